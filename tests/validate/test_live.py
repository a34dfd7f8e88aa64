"""The check inside a real run (llmem.validate.live): a real transformers.Trainer run of a tiny Llama on the CPU,
its counters read by the callback, its set-up rebuilt from the live objects and compared with llmem's estimate."""

from __future__ import annotations

import json

import pytest
import torch

from llmem.errors import LlmemError
from llmem.model.anatomy import load_anatomy
from llmem.runtime.measure import measure
from llmem.validate.live import LlmemCallback, live_setup

transformers = pytest.importorskip("transformers")

BATCH, SEQ = 4, 256


def _tiny_llama():
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_attention_heads=4,
                                      num_key_value_heads=4, num_hidden_layers=2, vocab_size=4096,
                                      max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i):
        ids = torch.randint(0, self.vocab, (SEQ,))
        return {"input_ids": ids, "labels": ids.clone()}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """Two real optimizer steps of a LoRA fine-tune with Trainer on the CPU, checked after the second."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_tiny_llama(), LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    out = tmp_path_factory.mktemp("live") / "check.json"
    args = transformers.TrainingArguments(output_dir=str(out.parent / "run"), per_device_train_batch_size=BATCH,
                                          max_steps=2, use_cpu=True, report_to=[], logging_steps=1,
                                          save_strategy="no", optim="adamw_torch", disable_tqdm=True)
    callback, reporter = LlmemCallback(after_steps=2, out=out), _Reporter()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(model.config.vocab_size),
                                   callbacks=[reporter, callback])      # a reporter registered before llmem's
    trainer.train()
    callback.log_history, callback.reporter_logs = trainer.state.log_history, reporter.logs
    return callback, model, out


class _Reporter(transformers.TrainerCallback):
    """Stands for a reporting integration (W&B, TensorBoard, MLflow): what on_log hands it, kept."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def test_the_setup_is_rebuilt_from_the_live_objects(lora_run):
    callback, model, _ = lora_run
    s = callback.result.setup
    assert (s.batch_size, s.seq_len) == (BATCH, SEQ)               # the first batch's shape
    assert s.precision == "fp32" and s.method == "single" and s.attn == "sdpa" and not s.grad_ckpt
    assert s.optimizer == "adamw-forloop"    # torch AdamW(foreach=None) on CPU tensors runs the for-loop
    assert s.peft_config is not None and s.adapter_dtype == "fp32"
    anatomy = load_anatomy(s.model)
    base = sum(p.numel() for name, p in model.named_parameters() if "lora_" not in name)
    assert anatomy.total_params == base                      # the config written and read back: the same model


def test_the_live_counters_are_the_runs_own(lora_run):
    """The callback's CPU counters (live tensors per op from the first step to the second's end) against llmem
    measure on the CPU - llmem's own real step of the same set-up, counted by the same ledger: the Trainer's step
    differs in its loss and bookkeeping, so within 10 %; and at least the model states worked out by hand."""
    callback, model, _ = lora_run
    measured = callback.result.measured
    truth = measure(callback.result.setup, device="cpu")
    for counter in ("peak_allocated_bytes", "peak_reserved_bytes"):
        assert abs(measured[counter] - getattr(truth, counter)) <= 0.10 * getattr(truth, counter), counter
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert measured["peak_allocated_bytes"] >= weights + trained * 4 * 3      # + fp32 grads and AdamW's 2 states


def test_the_comparison_is_logged_and_written_as_a_validate_record(lora_run):
    callback, _, out = lora_run
    record = json.loads(out.read_text())["rows"][0]
    assert record["truth_engine"] == "live (cpu)"
    assert record["truth"] == callback.result.measured
    est = record["estimate"]["peak_allocated_bytes"]
    assert record["error_pct"]["peak_allocated_bytes"] == pytest.approx(
        100 * (est - record["truth"]["peak_allocated_bytes"]) / record["truth"]["peak_allocated_bytes"])
    assert callback.result.agrees == (abs(record["error_pct"]["peak_allocated_bytes"]) <= 10.0)
    assert "llmem check on cpu" in callback.result.message()


def test_the_metrics_reach_log_history_and_every_reporter(lora_run):
    """Trainer.log appends its copy of the logs to state.log_history before the callbacks' on_log, and calls them in
    turn, reporters first: the check's keys must reach both."""
    callback = lora_run[0]
    keys = set(callback.result.log_values())
    assert "llmem/allocated_error_pct" in keys
    assert any(keys <= set(entry) for entry in callback.log_history)
    assert any(keys <= set(logs) for logs in callback.reporter_logs)


def test_a_run_llmem_cannot_estimate_completes(tmp_path, caplog):
    """RMSprop is not an optimizer llmem models: the check says so in the log, the run trains on to its last step."""
    model = _tiny_llama()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1, max_steps=3,
                                          use_cpu=True, report_to=[], logging_steps=1, save_strategy="no",
                                          optim="rmsprop", disable_tqdm=True)
    callback = LlmemCallback(after_steps=1)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(model.config.vocab_size),
                                   callbacks=[callback])
    with caplog.at_level("WARNING", logger="llmem"):
        trainer.train()
    assert trainer.state.global_step == 3 and callback.result is None
    assert any("no estimate of this run" in r.message and "RMSprop" in r.message for r in caplog.records)
    assert any(entry.get("llmem/estimate_error") == 1.0 for entry in trainer.state.log_history)


def test_a_trl_config_names_its_objective():
    """A TRL trainer's config class names its trainer (DPOConfig -> DPOTrainer -> --objective dpo), and the settings
    TRL spells as llmem does are read off it; transformers' own TrainingArguments name none."""
    from llmem.validate.live import trl_fields

    trl = pytest.importorskip("trl")
    dpo = trl.DPOConfig(output_dir="unused", beta=0.25, loss_type=["sigmoid"], max_length=512, report_to=[],
                         use_cpu=True, bf16=False)
    fields = trl_fields(dpo)
    assert fields["objective"] == "dpo" and fields["beta"] == 0.25 and fields["max_length"] == 512
    grpo = trl_fields(trl.GRPOConfig(output_dir="unused", num_generations=4, max_completion_length=64,
                                     per_device_train_batch_size=4, report_to=[], use_cpu=True,
                                     bf16=False))
    assert (grpo["objective"], grpo["num_generations"], grpo["max_completion_length"]) == ("grpo", 4, 64)
    assert "gradient_accumulation_steps" not in fields     # DPO's accumulation: no generation batch to size
    batched = trl_fields(trl.GRPOConfig(output_dir="unused", num_generations=4, per_device_train_batch_size=2,
                                        gradient_accumulation_steps=4, report_to=[], use_cpu=True, bf16=False))
    assert (batched["gradient_accumulation_steps"], batched["steps_per_generation"]) == (4, 4)
    assert "generation_batch_size" not in batched          # derived by GRPOConfig: steps_per_generation says it
    assert trl_fields(transformers.TrainingArguments(output_dir="unused", report_to=[])) == {}


def test_an_optimizer_llmem_does_not_model_is_refused_in_one_line():
    model = _tiny_llama()
    with pytest.raises(LlmemError, match="RMSprop is not one llmem models"):
        live_setup(model, torch.optim.RMSprop(model.parameters()), batch_size=1, seq_len=8)


@pytest.mark.parametrize("device,total,entry", [
    ("NVIDIA A100-SXM4-40GB", 42_298_834_944, "A100-40GB"),   # the driver totals torch reports
    ("NVIDIA A100-SXM4-80GB", 84_986_691_584, "A100-80GB"),
    ("NVIDIA A100 80GB PCIe", 85_096_693_760, "A100-80GB"),
    ("NVIDIA H100 80GB HBM3", 85_520_809_984, "H100-80GB"),
    ("NVIDIA H200", 150_754_820_096, "H200"),
    ("Tesla T4", 15_835_660_288, "T4"),
    ("NVIDIA GeForce GTX 1080", 8_500_000_000, None),
])
def test_the_live_gpu_is_the_catalog_entry_of_its_name_and_memory(device, total, entry):
    from llmem.setup.gpus import catalog_gpu_for

    assert catalog_gpu_for(device, total) == entry


@pytest.mark.parametrize("fsdp, method", [("full_shard auto_wrap", "fsdp"), ("shard_grad_op auto_wrap", "zero2")])
def test_the_trainers_fsdp_is_read_off_its_arguments(fsdp, method):
    """TrainingArguments' __post_init__ turns fsdp="full_shard" / "shard_grad_op" into fsdp_config's
    reshard_after_forward True / False: FSDP2's fsdp and zero2."""
    from llmem.validate.live import trainer_layout

    args = transformers.TrainingArguments(output_dir="unused", report_to=[], use_cpu=True, fsdp=fsdp)
    assert trainer_layout(args) == {"method": method, "gpus": 1}


def test_the_trainers_deepspeed_stage_and_world_size():
    """The ZeRO stage of the config the Trainer holds (hf_deepspeed_config.config), over its world size; one plain
    process names no layout (the set-up's defaults stand)."""
    from types import SimpleNamespace

    from llmem.validate.live import trainer_layout

    zero3 = SimpleNamespace(config={"zero_optimization": {"stage": 3}})
    args = SimpleNamespace(world_size=8, deepspeed="ds.json", hf_deepspeed_config=zero3, fsdp=None)
    assert trainer_layout(args) == {"method": "ds-zero3", "gpus": 8}
    assert trainer_layout(SimpleNamespace(world_size=4, deepspeed=None, fsdp=None)) == {"method": "ddp", "gpus": 4}
    plain = transformers.TrainingArguments(output_dir="unused", report_to=[], use_cpu=True)
    assert trainer_layout(plain) == {}
