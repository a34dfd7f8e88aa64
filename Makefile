# Set-up on a fresh machine. Torch is pinned to the CPU build that lies on this disk; users on GPUs keep their own.
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
TORCH_PIN = torch==2.13.0

.PHONY: install demo test test-slow lint bench validate

$(BIN)/llmem: pyproject.toml setup.py llmem/memory/native_replay.c llmem/estimator/native_events.c
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q $(TORCH_PIN)
	echo "$(TORCH_PIN)" > $(VENV)/torch-pin.txt
	$(BIN)/pip install -q -c $(VENV)/torch-pin.txt -e '.[dev]'
	# DeepSpeed: its engine runs the ds-zero traces on fake tensors (and its own estimators are checked); no CUDA ops
	# are built
	DS_BUILD_OPS=0 $(BIN)/pip install -q --no-build-isolation -c $(VENV)/torch-pin.txt deepspeed
	# TRL for the trace of --objective dpo: its own DPOTrainer loss code and fused LM head, pinned as pyproject's
	# trl extra (llmem emulates that head's CUDA path, llmem/runtime/objectives.py)
	$(BIN)/pip install -q -c $(VENV)/torch-pin.txt 'trl>=1.16,<1.17'
	touch $(BIN)/llmem

install: $(BIN)/llmem

demo: install
	HF_HUB_OFFLINE=1 $(BIN)/llmem estimate meta-llama/Llama-3.1-8B --gpu A100-80GB --gpus 4 --method fsdp --seq-len 4096 --batch-size 1 --precision bf16-mixed --grad-ckpt
	HF_HUB_OFFLINE=1 $(BIN)/llmem plan meta-llama/Llama-3.1-8B --gpu A100-80GB --gpus 4 --seq-len 4096 --grad-ckpt

# Bytecode is written during the tests even where the environment sets PYTHONDONTWRITEBYTECODE: each test worker and
# each subprocess would otherwise compile llmem again, and pytest rewrite every test module's asserts (a plain
# `pytest --collect-only` took 29.8 s without the cache, 16.2 s with it)
test: install
	HF_HUB_OFFLINE=1 $(BIN)/ruff check llmem tests benchmarks tools
	$(BIN)/lint-imports
	$(BIN)/python -m compileall -q llmem
	PYTHONDONTWRITEBYTECODE= HF_HUB_OFFLINE=1 $(BIN)/pytest -q -n auto --maxprocesses 4 --dist worksteal

test-slow: install
	PYTHONDONTWRITEBYTECODE= HF_HUB_OFFLINE=1 $(BIN)/pytest -q -m slow -n auto --maxprocesses 4

lint: install
	$(BIN)/ruff check llmem tests benchmarks tools
	$(BIN)/lint-imports

bench: install
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/estimate_speed.py
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/plan_speed.py

validate: install
	HF_HUB_OFFLINE=1 $(BIN)/llmem validate --against trace --matrix ci --max-error 2
