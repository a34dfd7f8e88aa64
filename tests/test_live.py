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
    callback = LlmemCallback(after_steps=2, out=out)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(model.config.vocab_size),
                                   callbacks=[callback])
    trainer.train()
    return callback, model, out


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
