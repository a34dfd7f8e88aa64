"""The time model's pipeline- and context-parallel terms (llmem.planner.timing calls them; pure functions).

Pipeline parallelism (torch.distributed.pipelining under torchtitan, llmem.setup.pipeline):
* the busiest rank sets the pace: its stages' share of the model's forward FLOPs (decoder layers as torchtitan
  splits them, `stage_splits`; the norm + lm_head matmuls on the last stage, the embedding's look-up free);
* each micro-batch waits for its input activation (forward) and its output gradient (backward) from the
  neighbouring stage: torch's schedules post the recv and wait on it before the stage's forward_one_chunk /
  backward_one_chunk (schedules.py `_wait_batch_p2p`), so both sends are on the critical path, [micro, seq, hidden]
  in the compute dtype each, once per stage the rank holds;
* the schedule's bubble (its registry row's `bubble_fraction`: (pp - 1) / (m + pp - 1) of the step for GPipe and
  1F1B) stretches the m busy micro-batch slots: step = busy / (1 - bubble);
* FSDP2 x PP does not reshard or reduce-scatter between micro-batches (torch's PipelineStage runs every backward
  but the last without gradient sync, reshard_after_backward False; torchtitan sets reshard_after_forward False
  under PP): one all-gather of the stage's parameters per schedule step, hidden behind the first micro-batch's
  forward, and one reduce-scatter, behind the last micro-batch's backward.

Context parallelism (torch's ring attention, torch/distributed/tensor/experimental/_context_parallel/
_attention.py, rotate method all-gather, the default): per decoder layer,
* forward: `_AllGatherRotater` all-gathers the rank's K and V once (all_gather_single at i = 0, waited at i = 1),
  so the gather overlaps only the rank's local block (1/cp of its attention FLOPs); again in the recompute under
  checkpointing;
* backward: the same all-gather of K / V (kv_rotater, overlapping the local block's backward), and the dK / dV
  accumulators (fp32: _cp_options.convert_to_f32) rotated to the next rank after every one of the cp blocks
  (dkv_rotater, all-to-all method: permute_tensor), each waited at the next block: cp - 1 of them overlap a block's
  backward (1/cp of the rank's attention backward), the last is exposed;
* on the cp group's links (torchtitan's mesh: cp inside tp, so on NVLink while cp fits in a node).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmem.model.anatomy import ModelAnatomy
from llmem.setup.pipeline import rank_stages, stage_splits

CP_ACCUMULATOR_BYTES = 4            # _cp_options.convert_to_f32: dK / dV accumulated and rotated in fp32


@dataclass(frozen=True)
class StageShare:
    """What the busiest pipeline rank runs: its share of the model's forward FLOPs and its parameters."""
    flops_share: float
    params: int
    stages: int                     # stages the rank holds (virtual stages of a looped schedule)


def _stage_params(anatomy: ModelAnatomy) -> tuple[list[int], int, int]:
    """(parameters per decoder layer, the embedding's (first stage), the rest outside the layers (last stage))."""
    per_layer = [anatomy.layer_params(i) for i in range(anatomy.num_layers)]
    embedding = sum(p.numel for p in anatomy.params if p.layer_index is None and p.module_kind.endswith("Embedding"))
    return per_layer, embedding, anatomy.root_params - embedding


def busiest_stage(anatomy: ModelAnatomy, pp: int, virtual: int, layer_cost: float, head_cost: float) -> StageShare:
    """The rank with the largest share of forward FLOPs (`layer_cost` per decoder layer, `head_cost` for norm +
    lm_head, per token) under torchtitan's split of pp x virtual stages, rank r holding stages r, r + pp, ..."""
    splits = stage_splits(anatomy.num_layers, pp * virtual)
    per_layer, embedding, head = _stage_params(anatomy)
    whole = anatomy.num_layers * layer_cost + head_cost
    best: StageShare | None = None
    for rank in range(pp):
        cost, params = 0.0, 0
        for s in rank_stages(rank, pp, virtual):
            split = splits[s]
            cost += len(split.layers) * layer_cost + (head_cost if split.head else 0.0)
            params += sum(per_layer[i] for i in split.layers) + (embedding if split.embedding else 0) \
                + (head if split.head else 0)
        share = StageShare(cost / whole if whole else 1.0 / pp, params, virtual)
        if best is None or share.flops_share > best.flops_share:
            best = share
    return best


def p2p_time_s(micro_batch: int, seq_len: int, hidden: int, compute_bytes: int, stages: int,
               bandwidth_gbps: float, latency_s: float, seq_shards: int = 1) -> float:
    """One micro-batch's waits on its neighbours: the activation received in forward and its gradient in
    backward ([micro, seq, hidden] in the compute dtype each), per stage the rank holds; `seq_shards`: tp under
    --sequence-parallel, where each stage sends its local [micro, seq / tp, hidden] shard of the residual stream
    (torchtitan's use_local_output, as llmem.estimator.pipeline's StageSchedule.boundary_bytes)."""
    nbytes = float(micro_batch) * seq_len / seq_shards * hidden * compute_bytes
    return 2 * stages * (nbytes / (bandwidth_gbps * 1e9) + latency_s)


def pipeline_step_s(busy_micro_s: float, microbatches: int, bubble: float) -> float:
    """The schedule's step: m busy micro-batch slots stretched by the idle share `bubble` of the step."""
    return microbatches * busy_micro_s / (1.0 - bubble)


@dataclass(frozen=True)
class RingTime:
    """Context parallelism's ring per micro-step, seconds (module docstring)."""
    comm_s: float                   # every K / V all-gather and dK / dV rotation
    exposed_s: float                # the part not hidden behind the attention blocks


def ring_attention_time_s(anatomy: ModelAnatomy, micro_batch: int, seq_len: int, cp: int, compute_bytes: int,
                          attn_fwd_layer_s: float, recomputed_share: float, bandwidth_gbps: float,
                          latency_s: float) -> RingTime:
    """The ring's communication over the cp group for one micro-step of `micro_batch` samples of `seq_len` tokens
    (the whole sequence; each rank holds seq_len / cp); `attn_fwd_layer_s`: one layer's attention forward on this
    rank (its backward twice that); `recomputed_share`: the share of layers checkpointed (their forward, with its
    gather, runs again in backward)."""
    if cp <= 1:
        return RingTime(0.0, 0.0)
    bandwidth = bandwidth_gbps * 1e9
    kv_full = 2.0 * micro_batch * seq_len * anatomy.num_kv_heads * anatomy.head_dim * compute_bytes
    gather_s = (cp - 1) / cp * kv_full / bandwidth + latency_s
    dkv_bytes = 2.0 * micro_batch * (seq_len // cp) * anatomy.num_kv_heads * anatomy.head_dim * CP_ACCUMULATOR_BYTES
    rotate_s = dkv_bytes / bandwidth + latency_s
    local_fwd_s, block_bwd_s = attn_fwd_layer_s / cp, 2 * attn_fwd_layer_s / cp
    fwd_exposed = max(0.0, gather_s - local_fwd_s)
    per_layer_comm = (2 + recomputed_share) * gather_s + cp * rotate_s
    per_layer_exposed = ((1 + recomputed_share) * fwd_exposed + max(0.0, gather_s - block_bwd_s)
                         + (cp - 1) * max(0.0, rotate_s - block_bwd_s) + rotate_s)
    return RingTime(anatomy.num_layers * per_layer_comm, anatomy.num_layers * per_layer_exposed)
