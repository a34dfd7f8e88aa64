"""TRL's trainers under FSDP2 (--method fsdp / zero2), as accelerate's plugin and trl's prepare_fsdp run them: the
reference copy one fully_shard unit of its own, the policy's units gathered in its no_grad forwards and in every
forward of generate; sizes worked by hand for tiny-llama (hidden 512, vocab 32000, 4 layers, 45,421,056
parameters, every dim 0 even: no FSDP2 padding on 2 ranks), and the refusals."""

from __future__ import annotations

import re

import pytest
from schedules import built_schedule as _schedule

from llmem.errors import LlmemError
from llmem.estimator.events import ALL_GATHER
from llmem.estimator.objectives import REF_ALL_GATHER
from llmem.estimator.schedule import StepSchedule
from llmem.model.resolved import resolve
from llmem.setup.training import TrainingSetup

PARAMS = 2 * 32000 * 512 + 4 * (4 * 512 * 512 + 3 * 512 * 1376 + 2 * 512) + 512     # 45,421,056
LAYER = 4 * 512 * 512 + 3 * 512 * 1376 + 2 * 512


def _setup(objective: str = "dpo", method: str = "fsdp", **kw) -> TrainingSetup:
    return TrainingSetup(**{"model": "tiny-llama", "gpu": "H100-80GB", "objective": objective, "method": method,
                            "gpus": 2, "precision": "bf16-mixed", "optimizer": "sgd", "batch_size": 2,
                            "seq_len": 128, **kw})


def _allocs(s: StepSchedule, stream: int, phase: str | None = None) -> list[int]:
    """Sizes allocated on `stream` (within `phase`, e.g. "it0:generation", when given)."""
    starts = [*s.sch.phase_starts, (len(s.sch.events), "")]
    spans = [(a, b) for (a, p), (b, _) in zip(starts, starts[1:], strict=False) if phase is None or p == phase]
    return [size for a, b in spans for sign, _k, size, st, _c in s.sch.events[a:b] if sign > 0 and st == stream]


def test_reference_copy_is_one_unit_gathered_per_forward():
    """prepare_fsdp: fully_shard(ref_model) once. Its fp32 shards (PARAMS / 2 x 4 B) cast to bf16 for the copy-in
    (PARAMS / 2 x 2 B), the whole copy gathered in bf16 (PARAMS x 2 B), on the reference root's own stream; FULL_SHARD
    reshards after each forward (gathered again in the second iteration), zero2 keeps it (gathered once)."""
    assert resolve(_setup()).anatomy.total_params == PARAMS == 45_421_056
    assert _allocs(_schedule(_setup()), REF_ALL_GATHER) == [PARAMS, 2 * PARAMS] * 2
    assert _allocs(_schedule(_setup(method="zero2")), REF_ALL_GATHER) == [PARAMS, 2 * PARAMS]


def test_reference_copy_weights_are_its_shard():
    """The copy's weights on this rank: half of every parameter in fp32 (the policy's dtype under bf16-mixed)."""
    def setup_bytes(setup):
        s = _schedule(setup)
        end = next(i for i, p in s.sch.phase_starts if p == "it0:forward")
        return sum(sign * n for sign, _k, n, _st, _c in s.sch.events[:end])

    copy, precomputed = setup_bytes(_setup()), setup_bytes(_setup(precompute_ref_log_probs=True))
    assert copy - precomputed == PARAMS // 2 * 4 - 2 * (2 * 4)      # less the batch's two [2] fp32 log-probs


def test_adapters_off_reference_gathers_the_policys_layers():
    """LoRA: the reference is the policy with its adapters disabled, a forward through the policy's own units: each
    of the 4 layers all-gathered again after the policy's forward resharded it (the root stays gathered); no copy."""
    s = _schedule(_setup(lora_rank=16))
    outputs = [n for n in _allocs(s, ALL_GATHER, "it0:forward") if n >= LAYER * 2]
    assert len(outputs) == 2 * 4 + 1                 # the policy's forward and the reference's: 4 layers each; root
    assert not _allocs(s, REF_ALL_GATHER)


def test_generate_gathers_every_layer_per_forward():
    """GRPO, 8 prompt + 8 completion tokens: generate runs 8 forwards (the prefill, 7 decodes), each gathering the
    4 layers in bf16 and resharding them; the root (embedding, lm_head, norm) is
    gathered at the first and kept. Under zero2 (reshard_after_forward False) every layer is gathered once."""
    kw = dict(seq_len=16, num_generations=4, max_completion_length=8, beta=0.04)
    root = PARAMS - 4 * LAYER
    fsdp = _allocs(_schedule(_setup("grpo", **kw)), ALL_GATHER, "it0:generation")
    # each unit: the bf16 copy-in of its fp32 shard (half the unit x 2 B), then the gathered output
    assert fsdp == [root, root * 2] + [LAYER, LAYER * 2] * (8 * 4)
    zero2 = _allocs(_schedule(_setup("grpo", "zero2", **kw)), ALL_GATHER, "it0:generation")
    assert zero2 == [root, root * 2] + [LAYER, LAYER * 2] * 4


@pytest.mark.parametrize(("objective", "fields", "message"), [
    ("dpo", {"method": "ds-zero3", "precompute_ref_log_probs": True}, "under DeepSpeed (--method ds-zero3)"),
    ("dpo", {"method": "ds-zero3", "offload_param": True}, "prepare_deepspeed keeps offload_param"),
    ("kto", {"method": "tp"}, "--method single or ddp or fsdp or zero2"),
    ("dpo", {"offload_param": True}, "--offload-param with --objective dpo"),
    ("kto", {"gpus": 4, "pp": 2}, "--pp with --objective kto"),
    ("grpo", {"seq_len": 16, "num_generations": 4, "max_completion_length": 8, "lora_rank": 8},
     "the real step fails"),
    ("grpo", {"seq_len": 16, "num_generations": 4, "max_completion_length": 8, "use_vllm": True,
              "vllm_mode": "server", "lora_rank": 8}, "peft's merge_adapter inside vLLM's packed broadcast"),
])
def test_refusals(objective, fields, message):
    with pytest.raises(LlmemError, match=re.escape(message)):
        _setup(objective, **fields)


def test_full_logits_are_cast_to_fp32_under_fsdp2_mixed():
    """ORPO's loss on the model's logits: accelerate's convert_outputs_to_fp32 wraps the forward under FSDP2's
    MixedPrecisionPolicy too, so the [4, 128, 32000] bf16 logits get an fp32 copy (4 B each); pure bf16 has none."""
    def forward_sizes(precision):
        s = _schedule(_setup("orpo", "zero2", precision=precision))
        a = next(i for i, p in s.sch.phase_starts if p == "it0:forward")
        b = next(i for i, p in s.sch.phase_starts if p == "it0:backward")
        return [n for sign, _k, n, _st, _c in s.sch.events[a:b] if sign > 0]

    logits = 4 * 128 * 32000
    mixed, pure = forward_sizes("bf16-mixed"), forward_sizes("bf16")
    assert logits * 2 in mixed and logits * 4 in mixed
    assert logits * 2 in pure and logits * 4 not in pure
