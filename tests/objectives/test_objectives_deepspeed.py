"""TRL's preference trainers under DeepSpeed's engine (--method ds-zero1/2/3): the policy through
deepspeed.initialize, the reference through TRL's prepare_deepspeed (trl/models/utils.py): ZeRO off for it under
stages 1-2 (the whole copy on every rank, cast to bf16 by its engine), partitioned under stage 3 (ceil(numel / dp)
elements per parameter, partition_parameters.py _aligned_size // world size). Sizes worked by hand for tiny-llama
(hidden 512, intermediate 1376, vocab 32000, 4 layers, untied, 45,421,056 parameters); and the refusals."""

from __future__ import annotations

import re
from math import ceil

import pytest

from llmem.cli import main
from llmem.errors import LlmemError
from llmem.estimator.engine import estimate
from llmem.model.resolved import resolve
from llmem.setup.training import TrainingSetup

VOCAB, HIDDEN, FFN, LAYERS = 32000, 512, 1376, 4
# one decoder layer's parameters: q, k, v, o [512, 512], gate, up, down [1376 x 512], two RMSNorms [512]
LAYER_NUMELS = [HIDDEN * HIDDEN] * 4 + [HIDDEN * FFN] * 3 + [HIDDEN] * 2
NUMELS = [VOCAB * HIDDEN, VOCAB * HIDDEN, HIDDEN] + LAYER_NUMELS * LAYERS   # embed, lm_head, final norm, layers
PARAMS = sum(NUMELS)                                                        # 45,421,056
BF16, FP32 = 2, 4


def _setup(objective: str = "dpo", method: str = "ds-zero2", gpus: int = 2, **kw) -> TrainingSetup:
    return TrainingSetup(**{"model": "tiny-llama", "gpu": "H100-80GB", "objective": objective, "method": method,
                            "gpus": gpus, "precision": "bf16-mixed", "optimizer": "sgd", "batch_size": 1,
                            "seq_len": 64, **kw})


def test_tiny_llama_parameter_count():
    assert PARAMS == 45_421_056 == resolve(_setup()).anatomy.total_params


@pytest.mark.parametrize("method", ["ds-zero1", "ds-zero2"])
def test_reference_is_a_whole_bf16_copy_under_stages_1_2(method):
    """prepare_deepspeed sets the reference's stage to 0: its engine casts it to bf16 (from the policy's fp32 or
    --ref-dtype compute alike), whole on each rank. The policy: its bf16 flat buffer (45,421,056 is a multiple of
    2 x dp: no alignment padding) and its fp32 master partition (half of it on each of 2 ranks)."""
    policy = PARAMS * BF16 + PARAMS // 2 * FP32
    for ref_dtype in ("policy", "compute"):
        weights = estimate(_setup(method=method, ref_dtype=ref_dtype)).components["weights"]
        assert weights == policy + PARAMS * BF16


def test_reference_is_partitioned_under_stage_3():
    """ZeRO-3 on 3 ranks (no dim divides evenly): each reference parameter keeps ceil(numel / 3) elements in bf16,
    the RMSNorms (512 <= param_persistence_threshold 1e5) whole as well once gathered. ORPO keeps no reference:
    the difference is the copy's."""
    partition = sum(ceil(n / 3) for n in NUMELS)
    persistent = sum(n for n in NUMELS if n <= 100_000)
    assert partition == 2 * 5_461_334 + ceil(512 / 3) + LAYERS * (4 * 87_382 + 3 * 234_838 + 2 * 171)
    dpo = estimate(_setup(method="ds-zero3", gpus=3)).components["weights"]
    orpo = estimate(_setup("orpo", method="ds-zero3", gpus=3)).components["weights"]
    assert dpo - orpo == (partition + persistent) * BF16


def test_lora_reference_is_the_policy():
    """Under peft the reference is the policy with its adapters off: no copy, no engine of its own."""
    dpo = estimate(_setup(lora_rank=16)).components["weights"]
    sft = estimate(_setup("sft", lora_rank=16)).components["weights"]
    assert dpo == sft


def test_estimate_says_how_the_reference_is_held():
    notes = " ".join(estimate(_setup(method="ds-zero3")).notes)
    assert "prepare_deepspeed engine at ZeRO stage 3" in notes and "partitioned" in notes
    notes = " ".join(estimate(_setup()).notes)
    assert "ZeRO off for it (stage 2 -> 0)" in notes


@pytest.mark.parametrize(("objective", "fields", "message"), [
    ("grpo", {"seq_len": 16, "num_generations": 2, "max_completion_length": 8, "batch_size": 2, "use_vllm": True},
     "weight sync to vLLM"),
    ("dpo", {"method": "ds-zero3", "precompute_ref_log_probs": True}, "precompute engine"),
    ("kto", {"method": "ds-zero3", "offload_param": True, "batch_size": 2}, "offload_param"),
])
def test_refusals(objective, fields, message):
    with pytest.raises(LlmemError, match=re.escape(message)):
        estimate(_setup(objective, **fields))


def test_refusal_is_one_line_exit_2(capsys):
    assert main(["estimate", "tiny-llama", "--objective", "grpo", "--method", "ds-zero2", "--gpus", "2",
                 "--seq-len", "16", "--max-completion-length", "8", "--num-generations", "2", "--use-vllm"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "under DeepSpeed (--method ds-zero2)" in err


@pytest.mark.slow
@pytest.mark.parametrize("setup", [_setup(), _setup(lora_rank=16, optimizer="adamw"), _setup(method="ds-zero3"),
                                   _setup("kto", method="ds-zero1", batch_size=2, reduce_bucket_size="auto"),
                                   _setup("orpo", method="ds-zero3")],
                         ids=["dpo-zero2", "dpo-lora", "dpo-zero3", "kto-zero1", "orpo-zero3"])
def test_trace_agrees(setup):
    """DeepSpeed's engine and TRL's own loss and prepare_deepspeed on fake tensors, against the estimate."""
    from llmem.validate.compare import compare_one

    err = compare_one(setup, "trace").to_dict()["error_pct"]
    assert abs(err["peak_allocated_bytes"]) < 2 and abs(err["peak_reserved_bytes"]) < 2


@pytest.mark.slow
def test_traced_reference_is_a_bf16_copy():
    """The trace's weights (TRL's prepare_deepspeed run): DPO's are SFT's plus the bf16 copy (its parameters and
    its two fp32 rotary inv_freq buffers, [hidden / heads / 2] = 32 elements each: the model's and its rotary's)."""
    from llmem.runtime.trace import trace

    dpo = trace(_setup()).components["weights"]
    sft = trace(_setup("sft")).components["weights"]
    assert PARAMS * BF16 <= dpo - sft <= PARAMS * BF16 + 4096
