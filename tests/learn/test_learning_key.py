"""The learned activations' cache key against what the learning run reads: every TrainingSetup field is read by the
key, reset by the learning run, or declared as changing nothing a decoder layer keeps; and a file learned under a
TRL trainer's step is not read for the plain step (it was, before LEARN_FORMAT 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields

import pytest

from llmem import estimate
from llmem.learn.shallow_copy import LEARNING_RESETS
from llmem.memory.activations.learned import KEYED_FIELDS, LAYER_FREE_FIELDS, learning_key
from llmem.model.resolved import resolve
from llmem.setup.sections import DeepSpeedConfig, JobConfig, ParallelismConfig
from llmem.setup.training import FLAT_ORDER, TrainingSetup


def test_every_field_is_keyed_reset_or_layer_free():
    reset = set(LEARNING_RESETS) | {f.name for f in fields(ParallelismConfig)} \
        | {f.name for f in fields(DeepSpeedConfig)} | {f.name for f in fields(JobConfig)} | {"batch_size", "seq_len"}
    unclassified = set(FLAT_ORDER) - set(KEYED_FIELDS) - set(LAYER_FREE_FIELDS) - reset
    assert not unclassified, f"classify for the learned activations' key: {sorted(unclassified)}"
    assert not set(LAYER_FREE_FIELDS) & set(KEYED_FIELDS)


@pytest.mark.parametrize("lora, changes", [
    (8, {"objective": "dpo"}), (8, {"objective": "trl-sft"}), (8, {"liger": "rms_norm"}),
    (0, {"float8": "tensorwise"}), (8, {"lora_dropout": 0.1}), (8, {"packing": True}),
])
def test_a_keyed_field_changes_the_key(lora, changes):
    base = dict(model="tiny-llama", precision="bf16", batch_size=2, seq_len=128, lora_rank=lora)
    assert learning_key(resolve(TrainingSetup(**base))) != learning_key(resolve(TrainingSetup(**base, **changes)))


def test_a_compiled_nf4_base_is_learned_under_its_own_key(monkeypatch):
    """--compile over torchao's NF4 base: the dequantisation is ops of the compiled layer's graph, learned with it
    (a key of its own: the unquantised compiled layer's file would miss them); eager, the schedule lays the
    dequantisation out itself and the base is not learned (bitsandbytes' base under --compile is refused)."""
    from llmem.memory.activations.learned import learning_need

    monkeypatch.setenv("LLMEM_LEARN", "always")
    base = dict(model="tiny-llama", precision="bf16", batch_size=2, seq_len=128, lora_rank=8, adapter_dtype="base")
    nf4 = resolve(TrainingSetup(**base, quant_base="torchao-nf4", compile=True))
    assert learning_need(nf4) == (True, "")
    assert learning_key(nf4) != learning_key(resolve(TrainingSetup(**base, compile=True)))
    for quant in ("torchao-nf4", "nf4"):
        need, why = learning_need(resolve(TrainingSetup(**base, quant_base=quant)))
        assert not need and why.startswith("a quantised base")


def test_a_generation_objective_learns_the_plain_step():
    base = dict(model="tiny-llama", precision="bf16", batch_size=2, seq_len=128)
    grpo = TrainingSetup(**base, objective="grpo", num_generations=2, max_completion_length=64)
    assert learning_key(resolve(grpo)) == learning_key(resolve(TrainingSetup(**base)))


def _estimate(cache, *flags) -> tuple[int, int]:
    run = subprocess.run([sys.executable, "-m", "llmem.cli", "estimate", "tiny-llama", "--precision", "bf16-mixed",
                          "--batch-size", "2", "--seq-len", "128", "--json", *flags], capture_output=True, text=True,
                         check=True, env={"HF_HUB_OFFLINE": "1", "LLMEM_LEARN": "always", "LLMEM_CACHE_DIR": str(cache),
                                          "PATH": ""})
    out = json.loads(run.stdout)
    return out["peak_allocated_bytes"], out["peak_reserved_bytes"]


@pytest.mark.slow     # three processes that each learn a step: 40 s on 2 cores
def test_a_trainer_learned_file_is_not_read_for_the_plain_step(tmp_path):
    """DPOTrainer's step in the learning copy (its collator, dropout off) learns other blocks than the plain step;
    both were one cache file before: a plain estimate after a DPO one read the DPO file (977 -> 1,015 MB reserved
    on this set-up)."""
    shared, fresh = tmp_path / "shared", tmp_path / "fresh"
    _estimate(shared, "--objective", "dpo")
    assert _estimate(shared) == _estimate(fresh)


@pytest.mark.parametrize("method, gpus, save_kind", [("fsdp", 2, "sharded"), ("ds-zero3", 2, "gather-16bit")])
def test_a_save_kind_of_a_sharded_method_learns_on_one_gpu(tmp_path, monkeypatch, method, gpus, save_kind):
    """The learning copy runs the step on one GPU, the job's section at its defaults: an FSDP2 or ZeRO-3 save kind
    (read from an axolotl / LLaMA-Factory file) refused the copy's set-up ("--save-kind sharded does not apply to
    --method single") and so the whole estimate. The step is the same whatever the save kind."""
    monkeypatch.setenv("LLMEM_LEARN", "always")
    monkeypatch.setenv("LLMEM_CACHE_DIR", str(tmp_path))
    base = dict(model="tiny-llama", precision="bf16-mixed", batch_size=2, seq_len=128, method=method, gpus=gpus)
    saved = estimate(TrainingSetup(**base, save_kind=save_kind))
    plain = estimate(TrainingSetup(**base))
    assert (saved.peak_allocated_bytes, saved.peak_reserved_bytes) == (plain.peak_allocated_bytes,
                                                                       plain.peak_reserved_bytes)
    assert [p.kind for p in saved.job_phases if p.name == "save"] == [save_kind]
