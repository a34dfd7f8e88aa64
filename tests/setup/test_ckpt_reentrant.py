"""--ckpt-reentrant: torch's reentrant checkpoint (CheckpointFunction), what it changes (LLM.int8 keeps no layer
inputs: its forward runs under no_grad), what it is refused with, and the frameworks that default to it (axolotl's
normalize_config, LLaMA-Factory's use_reentrant_gc) read from their own code's rules."""

from __future__ import annotations

import pytest
import yaml

from llmem import estimate
from llmem.cli import main
from llmem.errors import LlmemError
from llmem.memory.activations.profile import activation_profile
from llmem.model.resolved import resolve
from llmem.planner.export import unexportable_options
from llmem.setup.sources import setup_from_file
from llmem.setup.training import user_setup

INT8 = dict(model="tiny-llama", precision="bf16-mixed", batch_size=2, seq_len=256, lora_rank=8, quant_base="int8")


def test_the_flag_implies_checkpointing():
    s = user_setup(model="tiny-llama", ckpt_reentrant=True)
    assert s.grad_ckpt and s.ckpt_reentrant


@pytest.mark.parametrize("flags, named", [
    (dict(ac_policy="op"), "--ac-policy op"),
    (dict(offload_activations=True), "--offload-activations"),
    (dict(compile=True), "--compile"),
])
def test_refused_with_what_only_the_non_reentrant_checkpoint_models(flags, named):
    with pytest.raises(LlmemError, match=f"--ckpt-reentrant with {named}"):
        user_setup(model="tiny-llama", ckpt_reentrant=True, **flags)


def test_refused_in_one_line_on_the_command_line(capsys):
    assert main(["estimate", "tiny-llama", "--ckpt-reentrant", "--offload-activations"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "--ckpt-reentrant" in err


def test_llm_int8_keeps_no_layer_inputs_under_it():
    # one kept input per block of int8 linears, by hand: tiny-llama (hidden 512, intermediate 1376, 4 layers),
    # 2 x 256 = 512 tokens, bf16-mixed with prepare_model_for_kbit_training's upcast (fp32 norms): q/k/v's shared
    # input and gate/up's are the norms' fp32 outputs, o_proj's the attention output in bf16 (autocast), down_proj's
    # fp32 (Linear8bitLt returns its input's dtype, so the MLP's product is fp32)
    t = 512
    per_layer = t * 512 * 4 + t * 512 * 2 + t * 512 * 4 + t * 1376 * 4
    plain = activation_profile(resolve(user_setup(grad_ckpt=True, **INT8)))
    reentrant = activation_profile(resolve(user_setup(ckpt_reentrant=True, **INT8)))
    assert sum(plain.int8_kept) == per_layer and reentrant.int8_kept == ()
    # the step's peak is in backward, when every layer's kept inputs are live without the reentrant checkpoint
    a = estimate(user_setup(grad_ckpt=True, **INT8))
    b = estimate(user_setup(ckpt_reentrant=True, **INT8))
    assert a.peak_phase == b.peak_phase == "backward"
    assert a.peak_allocated_bytes - b.peak_allocated_bytes == 4 * per_layer


def test_the_trace_runs_the_reentrant_checkpoint_and_agrees():
    # the real step on fake tensors, torch's CheckpointFunction in it: LLM.int8's kept inputs gone (within the
    # allocator's rounding of the hand-worked bytes), and the estimate within 2 % on both counters
    from llmem.runtime.trace import trace

    plain = trace(user_setup(grad_ckpt=True, **INT8), iterations=2)
    reentrant = trace(user_setup(ckpt_reentrant=True, **INT8), iterations=2)
    per_layer = 512 * (512 * 4 + 512 * 2 + 512 * 4 + 1376 * 4)
    assert abs((plain.peak_allocated_bytes - reentrant.peak_allocated_bytes) - 4 * per_layer) < 0.01 * 4 * per_layer
    est = estimate(user_setup(ckpt_reentrant=True, **INT8))
    for counter in ("peak_allocated_bytes", "peak_reserved_bytes"):
        assert abs(getattr(est, counter) / getattr(reentrant, counter) - 1) < 0.02, counter


def test_other_steps_keep_what_they_kept():
    # full fine-tuning and QLoRA: the reentrant checkpoint saves the same layer input
    for flags in (dict(), dict(lora_rank=16, quant_base="nf4")):
        a = estimate(user_setup(model="tiny-llama", grad_ckpt=True, seq_len=256, **flags))
        b = estimate(user_setup(model="tiny-llama", ckpt_reentrant=True, seq_len=256, **flags))
        assert (a.peak_allocated_bytes, a.peak_reserved_bytes) == (b.peak_allocated_bytes, b.peak_reserved_bytes)


def _read(tmp_path, data: dict, name="run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return setup_from_file(str(path), model="tiny-llama")


AXOLOTL = {"base_model": "tiny-llama", "sequence_len": 256, "micro_batch_size": 1, "datasets": [{"path": "x"}],
           "adapter": "lora", "lora_r": 8, "lora_target_linear": True}


@pytest.mark.parametrize("extra, reentrant", [
    ({"gradient_checkpointing": True}, True),                                         # normalize_config's default
    ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}}, False),
    ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}}, True),
    ({"gradient_checkpointing": True, "rl": "dpo"}, False),       # the builder's {"use_reentrant": False}
    ({"gradient_checkpointing": True, "unfrozen_parameters": ["^lm_head.weight$"]}, False),
    ({"gradient_checkpointing": False}, False),
])
def test_axolotl_checkpoint_as_its_config_normalises_it(tmp_path, extra, reentrant):
    fs = _read(tmp_path, {**AXOLOTL, **extra})
    assert fs.setup.ckpt_reentrant is reentrant


LLAMAFACTORY = {"model_name_or_path": "tiny-llama", "stage": "sft", "do_train": True, "finetuning_type": "lora",
                "lora_rank": 8, "lora_target": "all", "cutoff_len": 256, "per_device_train_batch_size": 1,
                "dataset": "x", "template": "llama3", "bf16": True}


def test_llamafactory_defaults_to_the_reentrant_checkpoint(tmp_path):
    assert _read(tmp_path, LLAMAFACTORY).setup.ckpt_reentrant
    assert not _read(tmp_path, {**LLAMAFACTORY, "use_reentrant_gc": False}).setup.ckpt_reentrant
    assert not _read(tmp_path, {**LLAMAFACTORY, "disable_gradient_checkpointing": True}).setup.grad_ckpt


def test_llamafactory_turns_it_off_under_fsdp2_not_fsdp1(tmp_path):
    # prepare_model_for_training: FSDP_VERSION 2 sets use_reentrant_gc False; FSDP1 keeps it
    train = tmp_path / "train.yaml"
    train.write_text(yaml.safe_dump(LLAMAFACTORY))
    for version, reentrant in ((2, False), (1, True)):
        acc = tmp_path / f"fsdp{version}.yaml"
        acc.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP",
                                       "num_processes": 2, "mixed_precision": "bf16",
                                       "fsdp_config": {"fsdp_version": version,
                                                       "fsdp_sharding_strategy": "FULL_SHARD"}}))
        fs = setup_from_file([str(train), str(acc)], model="tiny-llama")
        assert fs.setup.ckpt_reentrant is reentrant, version
        if not reentrant:
            assert any("FSDP2" in u.note for u in fs.record.used if u.key.startswith("use_reentrant_gc"))


def test_hf_trainer_kwargs(tmp_path):
    base = {"model_name_or_path": "tiny-llama", "per_device_train_batch_size": 1, "max_length": 256,
            "gradient_checkpointing": True}
    assert _read(tmp_path, {**base, "gradient_checkpointing_kwargs": {"use_reentrant": True}}).setup.ckpt_reentrant
    assert not _read(tmp_path, base).setup.ckpt_reentrant          # transformers 5's default: non-reentrant


def test_exports_say_what_they_cannot_carry():
    s = user_setup(model="tiny-llama", ckpt_reentrant=True)
    assert "--ckpt-reentrant" in unexportable_options(s)
    assert "--ckpt-reentrant" not in unexportable_options(s, "trl")     # gradient_checkpointing_kwargs


def test_trl_export_carries_it_and_reads_back(tmp_path):
    from llmem.planner.export import write_export
    from llmem.planner.options import PlanOptions
    from llmem.planner.plan import plan

    setup = user_setup(model="tiny-llama", ckpt_reentrant=True, gpus=2, seq_len=256, gpu="A100-80GB",
                       objective="trl-sft")
    p = plan(setup, PlanOptions(batch_cap=2, methods=("ddp",)))
    path = tmp_path / "sft.yaml"
    write_export(p, "trl", str(path))
    assert yaml.safe_load(path.read_text())["gradient_checkpointing_kwargs"] == {"use_reentrant": True}
    back = setup_from_file([path, tmp_path / "sft.accelerate.yaml"]).setup
    assert back.ckpt_reentrant and back.grad_ckpt
