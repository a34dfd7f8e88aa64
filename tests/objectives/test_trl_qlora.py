"""QLoRA under TRL's trainers: the registry rows against the installed trl's own __init__ code, TRL's bf16 cast of a
bitsandbytes model's adapters in the estimate and the trace against bytes worked by hand (tiny-llama: hidden 512,
intermediate 1376, 4 layers), the refusals that remain (llmem.setup.objectives._check_quantised_base)."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

from llmem import estimate, trace
from llmem.cli import main
from llmem.errors import LlmemError
from llmem.model.resolved import resolve
from llmem.setup.objectives import OBJECTIVES, casts_quantised_adapters
from llmem.setup.training import TrainingSetup

# LoRA r16 on all seven linears of a tiny-llama layer: q, k, v, o (512 -> 512) r x (512 + 512) each; gate, up
# (512 -> 1376) and down (1376 -> 512) r x (512 + 1376) each; 4 layers
ADAPTER_NUMEL = 4 * (4 * 16 * (512 + 512) + 3 * 16 * (512 + 1376))
assert ADAPTER_NUMEL == 624_640
ADAMW_STATES = 2                     # exp_avg and exp_avg_sq, each in its parameter's dtype (torch.optim.AdamW)

# TRL 1.16's cast (sft_trainer.py, dpo_trainer.py, kto_trainer.py, grpo_trainer.py, rloo_trainer.py,
# reward_trainer.py __init__)
TRL_CAST = re.compile(r"if _is_quantized_model:\s+for name, param in model\.named_parameters\(\):\s+"
                      r'if param\.requires_grad and "lora_magnitude_vector" not in name:\s+'
                      r"param\.data = param\.data\.to\(torch\.bfloat16\)")


def qlora(**kw) -> TrainingSetup:
    return TrainingSetup(**{"model": "tiny-llama", "gpu": "H100-80GB", "objective": "dpo", "batch_size": 2,
                            "seq_len": 128, "precision": "bf16-mixed", "lora_rank": 16, "lora_targets": "all-linear",
                            "quant_base": "nf4", **kw})


def trainer_init_source(name: str) -> str:
    spec = OBJECTIVES[name]
    return inspect.getsource(getattr(importlib.import_module(spec.trainer_module), spec.trainer).__init__)


@pytest.mark.parametrize("name", [n for n, o in OBJECTIVES.items() if o.runs_trainer])
def test_each_rows_cast_is_the_installed_trainers(name):
    """The rows that cast are the trainers whose __init__ has TRL's cast; ORPO / CPO run peft's kbit preparation
    and peft_module_casting_to_bf16 instead."""
    source = trainer_init_source(name)
    assert OBJECTIVES[name].casts_quantised_adapters == bool(TRL_CAST.search(source))
    assert OBJECTIVES[name].prepares_kbit == ("prepare_model_for_kbit_training(" in source
                                              and "peft_module_casting_to_bf16(" in source)


def test_the_cast_needs_a_bitsandbytes_base_and_adapters():
    """is_loaded_in_4bit / is_loaded_in_8bit are set by transformers' bitsandbytes quantizers only."""
    assert casts_quantised_adapters(qlora()) and casts_quantised_adapters(qlora(quant_base="int8"))
    assert casts_quantised_adapters(qlora(objective="trl-sft", precision="fp32"))
    assert not casts_quantised_adapters(qlora(quant_base="none"))
    assert not casts_quantised_adapters(qlora(objective="sft"))
    assert not casts_quantised_adapters(qlora(objective="orpo", quant_base="int8"))


@pytest.mark.parametrize(("fields", "element_bytes"), [
    ({}, 2),                                                  # DPOTrainer: bf16 adapters, bf16 AdamW states
    ({"objective": "kto", "seq_len": 64}, 2),
    ({"objective": "trl-sft", "precision": "fp32", "seq_len": 64}, 2),   # whatever the precision
    ({"objective": "sft", "seq_len": 64}, 4),                 # no TRL trainer: peft's fp32 adapters
    ({"objective": "orpo", "quant_base": "int8", "seq_len": 64}, 4),     # ORPOTrainer keeps them fp32
])
def test_optimizer_states_by_hand_in_estimate_and_trace(fields, element_bytes):
    """AdamW's two states per adapter element in the adapter's dtype: the estimate's and the trace's (which runs
    TRL's cast on its model) are both the hand-worked bytes."""
    setup = qlora(**fields)
    want = ADAPTER_NUMEL * ADAMW_STATES * element_bytes
    assert estimate(setup).components["optimizer_states"] == want
    assert trace(setup).components["optimizer_states"] == want


def test_the_traced_model_has_bf16_adapters_and_keeps_its_frozen_dtypes():
    """TRL's cast on the traced model: every trained parameter bf16, the frozen ones (the kbit upcast's fp32
    embeddings / norms / lm_head, the packed 4-bit weights) untouched."""
    from llmem.runtime.step import meta_model_stage

    for setup, trained in ((qlora(), "torch.bfloat16"), (qlora(objective="sft"), "torch.float32")):
        model, _, _ = meta_model_stage(setup, resolve(setup), True, 0)
        dtypes = {(p.requires_grad, str(p.dtype)) for p in model.parameters()}
        assert dtypes == {(True, trained), (False, "torch.float32"), (False, "torch.uint8")}


@pytest.mark.parametrize(("fields", "message"), [
    ({"objective": "orpo"}, "--qlora with --objective orpo in bf16 is not modelled"),
    ({"objective": "simpo", "precision": "bf16", "kbit_upcast": True}, "--objective simpo in bf16"),
    ({"objective": "orpo", "quant_base": "int8", "kbit_upcast": False}, "runs peft's prepare_model_for_kbit"),
    ({"quant_base": "torchao-nf4", "precision": "bf16", "adapter_dtype": "base"}, "use --qlora or --load-in-8bit"),
])
def test_what_is_still_refused(fields, message):
    with pytest.raises(LlmemError, match=re.escape(message)):
        qlora(**fields)


@pytest.mark.parametrize("fields", [{}, {"objective": "kto"}, {"quant_base": "int8"}, {"precision": "bf16"},
                                    {"objective": "orpo", "precision": "fp32"},
                                    {"objective": "orpo", "quant_base": "int8"}])
def test_qlora_under_the_preference_objectives_is_modelled(fields):
    assert qlora(**fields).quant_spec.quantised


def test_refusal_is_one_line_exit_2(capsys):
    assert main(["estimate", "tiny-llama", "--objective", "orpo", "--qlora", "--lora-rank", "8",
                 "--precision", "bf16-mixed"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "peft_module_casting_to_bf16" in err


def test_bf16_adapters_over_an_fp32_stream_keep_their_own_bf16_copy():
    """fp32 (no autocast): peft's bitsandbytes LoRA layer casts the fp32 input down to TRL's bf16 adapters
    (`_cast_input_dtype`), so o_proj's lora_A keeps a bf16 copy [t, hidden] and lora_B a bf16 [t, rank]; with peft's
    fp32 adapters (sft: no TRL cast) lora_A keeps the fp32 input itself and lora_B an fp32 [t, rank]. tiny-llama:
    2 x 256 tokens, hidden 512, rank 16."""
    from llmem.memory.activations.profile import activation_profile

    t, hidden, rank = 2 * 256, 512, 16

    def o_proj(objective: str) -> tuple[int, ...]:
        setup = qlora(objective=objective, precision="fp32", seq_len=256)
        return next(b.tensors for b in activation_profile(resolve(setup)).blocks if b.name == "o_proj")

    assert o_proj("trl-sft") == (t * hidden * 2, t * rank * 2)
    assert o_proj("sft") == (t * rank * 4,)
