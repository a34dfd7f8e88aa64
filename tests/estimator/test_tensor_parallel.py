"""Tensor parallelism as torchtitan applies it (--sequence-parallel, --loss-parallel): the bytes worked out by hand
from tiny-llama's shapes (hidden 512, intermediate 1376, 8 heads, vocab 32000, 4 layers) and torch's code
(torch/distributed/tensor/parallel/style.py, loss.py), the refusals, the time model and the planner's layouts.

The same figures were read off `llmem trace` (the real step on fake tensors): the SP norm's fp32 input 524288 B,
rsqrt 1024 B and bf16 normalised tensor 262144 B per layer; the gathered q/k/v input 524288 B; loss_parallel()'s
backward peak four fp32 [512, 16000] shards (131072000 B)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmem.errors import LlmemError
from llmem.memory.activations.profile import activation_profile
from llmem.model.resolved import resolve
from llmem.planner.timing import COLLECTIVE_LATENCY_S, comm_sizes, step_time
from llmem.setup.layout import resolve_layout
from llmem.setup.training import TrainingSetup

T, H, V = 2 * 256, 512, 32000         # tokens (batch 2 x seq 256), hidden, vocab


def _tp(**kw) -> TrainingSetup:
    base = {"model": "tiny-llama", "method": "tp", "gpus": 2, "precision": "bf16", "optimizer": "sgd",
            "batch_size": 2, "seq_len": 256, "gpu": "H100-80GB"}
    return TrainingSetup(**{**base, **kw})


def _profile(**kw):
    return activation_profile(resolve(_tp(**kw)))


def test_loss_parallel_keeps_the_logits_vocab_sharded():
    # plain TP: three fp32 [tokens, vocab] tensors at the loss backward (the logits all-gathered)
    assert _profile().loss_peak == 3 * 4 * T * V
    # loss_parallel(): four fp32 [tokens, vocab / 2] shards (log-softmax, zeros_like, exp, their sum)
    assert _profile(loss_parallel=True).loss_peak == 4 * 4 * T * (V // 2) == 131_072_000
    # an odd vocab: torch.chunk gives rank 0 the ceiling
    lp = activation_profile(resolve(_tp(loss_parallel=True, gpus=4)))
    assert lp.loss_peak == 4 * 4 * T * 8000


def test_sequence_parallel_shards_the_residual_stream_and_the_norms():
    plain, sp = _profile(grad_ckpt=True), _profile(grad_ckpt=True, sequence_parallel=True)
    # a checkpointed layer keeps its input: [2, 256 / 2, 512] bf16 under SP, [2, 256, 512] without
    assert plain.ckpt_input_bytes == 2 * 256 * H * 2
    assert sp.ckpt_input_bytes == 2 * 128 * H * 2 == 262_144
    norm = sp.blocks[0]
    # HF's RMSNorm on the sequence shard (256 tokens): fp32 input copy, fp32 rsqrt [t], bf16 normalised
    assert norm.tensors == (256 * H * 4, 256 * 4, 256 * H * 2)
    assert plain.blocks[0].tensors == (T * H * 4, T * 4, T * H * 2)
    # q/k/v keep the all-gathered [512, 512] bf16 input; the gather's two buffers are forward temporaries
    qkv = sp.blocks[1]
    assert qkv.tensors == (T * H * 2,)
    assert [n for n, _, _ in qkv.temps] == [T * H * 2] * 2
    # the final norm on the shard, the lm_head's gathered input
    assert sp.head_tensors == (256 * H * 4, 256 * 4, 256 * H * 2, T * H * 2)


def test_sequence_parallel_rounds_the_shard_up():
    # seq 255 over 2: torch.chunk gives rank 0 128 positions
    sp = activation_profile(resolve(_tp(seq_len=255, grad_ckpt=True, sequence_parallel=True)))
    assert sp.ckpt_input_bytes == 2 * 128 * H * 2


def test_the_estimate_shrinks_by_the_sharded_parts():
    from llmem.estimator.engine import estimate

    plain = estimate(_tp()).peak_allocated_bytes
    lp = estimate(_tp(loss_parallel=True)).peak_allocated_bytes
    # the peak is the loss backward: 3 full fp32 logits tensors + the cast gradient -> 4 fp32 shards
    assert plain - lp > (3 * 4 * T * V - 4 * 4 * T * V // 2) * 0.9


@pytest.mark.parametrize("kw, words", [
    ({"method": "fsdp", "sequence_parallel": True}, "--sequence-parallel applies to tensor parallelism"),
    ({"method": "ddp", "loss_parallel": True}, "--loss-parallel applies to tensor parallelism"),
    ({"loss_parallel": True, "fused_ce": True}, "--fused-ce with --loss-parallel"),
    ({"sequence_parallel": True, "offload_activations": True}, "--offload-activations with --sequence-parallel"),
    ({"model": "google/gemma-2-2b", "loss_parallel": True}, "--loss-parallel is not modelled for gemma2"),
    ({"model": "google/gemma-2-2b", "sequence_parallel": True}, "--sequence-parallel is not modelled for gemma2"),
    ({"model": "facebook/opt-125m", "sequence_parallel": True}, "--sequence-parallel is not modelled for opt"),
])
def test_refusals(kw, words):
    with pytest.raises(LlmemError, match=words.replace("+", r"\+")):
        resolve(_tp(**kw))


def test_time_model_sequence_and_loss_parallel():
    r_plain = resolve(_tp(method="fsdp+tp", gpus=4, tp=2))
    r_both = resolve(replace(r_plain.setup, sequence_parallel=True, loss_parallel=True))
    plain = comm_sizes(r_plain.anatomy, r_plain.setup, r_plain.layout, 2)
    both = comm_sizes(r_both.anatomy, r_both.setup, r_both.layout, 2)
    assert plain.tp_logits_gather_bytes == 2 * 256 * V * 2 and both.tp_logits_gather_bytes == 0
    assert both.tp_allreduce_bytes == plain.tp_allreduce_bytes == 2 * 256 * H * 2
    # all-gather + reduce-scatter move what the all-reduce moved: one more collective's latency each, less the gather
    lp = resolve(replace(r_plain.setup, loss_parallel=True))
    t_lp, t_both = step_time(lp, 2).tp_comm_s, step_time(r_both, 2).tp_comm_s
    assert t_both - t_lp == pytest.approx(both.tp_allreduces * COLLECTIVE_LATENCY_S, rel=1e-6)


def test_the_plan_keeps_the_styles_on_tensor_parallel_layouts_only():
    base = _tp(method="fsdp", gpus=4, sequence_parallel=True, loss_parallel=True)
    fsdp = base.with_layout(resolve_layout("fsdp", 4, None, None, 8, 8), 1)
    two_d = base.with_layout(resolve_layout("fsdp+tp", 4, 2, None, 8, 8), 1)
    assert not fsdp.sequence_parallel and not fsdp.loss_parallel
    assert two_d.sequence_parallel and two_d.loss_parallel
    resolve(fsdp), resolve(two_d)     # both run


def test_trace_plan_applies_torchtitans_styles():
    """The trace's parallelize_module plan (no process group needed to build it)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    from llmem.runtime.build import meta_model_for
    from llmem.runtime.distributed import tp_plan

    model = meta_model_for(_tp())
    plan = tp_plan(model, "llama", sequence_parallel=True, loss_parallel=True)
    layer = "model.layers.1"
    assert isinstance(plan[f"{layer}.input_layernorm"], SequenceParallel)
    assert isinstance(plan["model.norm"], SequenceParallel)
    attn = plan[f"{layer}.self_attn"]
    assert isinstance(attn, PrepareModuleInput)
    assert attn.input_kwarg_layouts == {"hidden_states": Shard(1)}
    assert attn.desired_input_kwarg_layouts == {"hidden_states": Replicate()}
    assert isinstance(plan[f"{layer}.mlp"], PrepareModuleInput)
    o_proj = plan[f"{layer}.self_attn.o_proj"]
    assert isinstance(o_proj, RowwiseParallel) and o_proj.output_layouts == (Shard(1),)
    head = plan["lm_head"]
    assert isinstance(head, ColwiseParallel) and head.input_layouts == (Shard(1),)
    assert head.output_layouts == (Shard(-1),) and not head.use_local_output
    plain = tp_plan(model, "llama")
    assert plain["lm_head"].output_layouts == (Replicate(),) and "model.norm" not in plain
