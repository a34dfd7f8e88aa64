"""The time model of `llmem plan`: FLOPs, communication and step time of a layout at a micro-batch.

Time model (all functions pure; units in the names; every assumption is stated here and in `plan_notes`):

* FLOPs of one micro-step, per data-parallel rank (`step_flops`):
  - matmuls: 2 FLOPs per multiply-add, i.e. forward 2 * P * tokens, backward 4 * P * tokens for trainable weights
    (input and weight gradients). A frozen weight (LoRA base) costs 2 * P forward + 2 * P backward (its input
    gradient is still needed by the adapters below it), not 6 * P. P counts the weights that multiply activations:
    decoder-layer matrices (MoE experts scaled by experts_per_token / experts), the lm_head (even when tied) and
    other projections; embedding look-ups are free.
  - attention scores and weighted values: 2 matmuls of 2 * s * d FLOPs per token per layer forward (d = query heads
    x head_dim), i.e. 4 * L * s * d per token forward and 12 * L * s * d forward + backward. Causal halving: the
    SDPA flash / memory-efficient kernels skip fully-masked blocks, so half of that counts; eager attention computes
    the whole s x s matrix and is not halved.
  - gradient checkpointing recomputes the decoder layers' forward once in backward: + 2 * P_layers * tokens + the
    forward attention FLOPs, times the share of layers checkpointed (ceil(L / k) / L with --grad-ckpt-every k);
    under --ac-policy op only the matmuls whose outputs the policy does not save (no attention).
  - fused cross-entropy computes the same matmuls (the lm_head's gradients in forward): no change.
* memory-bound work, added to compute: a bitsandbytes base is dequantised (storage read, compute-dtype weight
  written) in forward, in backward and in the recompute, at the GPU's memory bandwidth (`gpu.memory_gbps`);
  activation offloading copies the layers' saved tensors to the host in forward and back in backward at
  PCIE_GBPS, each copy hidden behind its phase's compute where it is shorter.
* --objective grpo: each micro-step is charged its share of the generation batch's generation and scoring
  (llmem.planner.generation_time: batch x steps_per_generation rows generated at once every steps_per_generation
  micro-steps, amortised over them; prefill at FLOPs, decode at memory bandwidth, the reference's forward when
  beta > 0).
* time = FLOPs / (peak * MFU), MFU default 0.4 (`--mfu`). Peak is the GPU's dense bf16/fp16 tensor peak; fp32
  assumes TF32 matmuls (torch.set_float32_matmul_precision("high")) at half that peak on compute capability >= 8.0,
  and 1/8 of it on Volta/Turing, which have no TF32. Tensor parallelism splits a micro-batch's FLOPs evenly over tp.
* communication (`ring_allreduce_time_s`, `ring_allgather_time_s`): ring collectives, all-reduce moves
  2 (N-1)/N of the buffer per GPU, all-gather and reduce-scatter (N-1)/N of the full buffer, plus a fixed latency
  per collective (`COLLECTIVE_LATENCY_S`). Bandwidth per GPU: the GPU's NVLink/PCIe peer bandwidth
  (`gpu.link_gbps`) inside a node, `--inter-node-gbps` (default 25 GB/s per GPU, a 200 Gb/s NIC per GPU) for a
  group that spans nodes (the ring is as fast as its slowest hop).
  - DDP: all-reduce of the gradients (parameter dtype: fp32 under *-mixed) once per optimizer step (no_sync during
    accumulation); it overlaps with backward compute, except the last 25 MiB bucket.
  - FSDP: per micro-step, all-gather of the parameters in forward (compute dtype under *-mixed) and again in
    backward (fsdp reshards after forward; zero2 does not, so it has only the forward one), reduce-scatter of the
    gradients (fp32 under *-mixed, as the estimator assumes). Forward gathers overlap forward compute, backward
    gathers and reduce-scatters overlap backward compute; the root unit's and first layer's gathers and the root's
    reduce-scatter are exposed.
  - TP: per layer 2 all-reduces of the [b, s, h] activations forward, 2 backward, 2 more in the recompute under
    checkpointing, one for the vocab-parallel embedding forward and one for the lm_head input backward, plus the
    all-gather of the vocab-split logits; none overlaps (it is on the critical path). --sequence-parallel turns
    each all-reduce into an all-gather + a reduce-scatter (the same bytes, one more latency); --loss-parallel drops
    the logits' all-gather (the cross-entropy's two [tokens] all-reduces are left out). Async TP is not modelled.
  - fsdp+tp: FSDP over the dp group on the TP-local shards, plus TP within the node.
  - FSDP2's CPUOffloadPolicy (--offload-param): before each all-gather every unit's shard is copied from pinned
    host memory (in its stored dtype: fp32 under *-mixed), after each reduce-scatter the sharded gradients are
    copied back, both at PCIE_GBPS and on the collectives' streams, so each joins its collective's chain (hidden
    behind compute where the chain is shorter; the root unit's copy is exposed with its gather); the optimizer
    then steps every shard on the host at HOST_ADAMW_PARAMS_PER_S, after backward, hidden behind nothing.
  - --pp / --cp: the busiest stage's FLOPs, the stage-to-stage sends, the schedule's bubble and FSDP2 x PP's one
    gather and reduce-scatter per schedule step; the ring attention's K / V all-gathers and dK / dV rotations
    (llmem.planner.parallel_time, which cites torch's code for each).
  - not modelled: the optimizer step's own time on the GPU (memory-bound, small against compute at the batch
    sizes that fill a GPU), data loading, kernel-launch overhead.
* step time = accumulation_steps x micro-step; tokens/s = global tokens per step / step time.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmem.errors import LlmemError
from llmem.estimator.states import cpu_offload, fsdp_gathered_tensors
from llmem.memory.activations.profile import activation_profile, effective_attention
from llmem.memory.activations.selective import saved_matmuls
from llmem.memory.quant import allocated, is_quantised, quant_args, storage_bytes, torchao_dequantise_events
from llmem.model.anatomy import ModelAnatomy
from llmem.model.moe import moe_facts
from llmem.model.resolved import ResolvedSetup
from llmem.planner.generation_time import generation_time_s
from llmem.planner.parallel_time import (
    StageShare,
    busiest_stage,
    p2p_time_s,
    pipeline_step_s,
    ring_attention_time_s,
)
from llmem.setup.checkpointing import AC_POLICIES
from llmem.setup.expert_parallel import received_rows
from llmem.setup.gpus import GpuSpec
from llmem.setup.layout import Layout
from llmem.setup.methods import DDP_BUCKET_CAP_BYTES
from llmem.setup.pipeline import pipeline_schedule
from llmem.setup.precision import PRECISIONS
from llmem.setup.training import TrainingSetup

DEFAULT_MFU = 0.4
DEFAULT_INTER_NODE_GBPS = 25.0      # GB/s per GPU across nodes (one 200 Gb/s NIC per GPU)
COLLECTIVE_LATENCY_S = 10e-6        # fixed cost of one NCCL collective
# Host <-> device, the constants of every offload (optimizer, activations, FSDP2's CPUOffloadPolicy), with their sources:
PCIE_GBPS = 25.0                    # pinned host <-> GPU copies, one way: PCIe 4.0 x16 is 32 GB/s raw, ~25 achieved
CPU_ADAM_PARAMS_PER_S = 2e9         # --offload-optimizer: a multi-threaded CPU Adam (DeepSpeed's CPUAdam), assumed
# --offload-param: FSDP2 leaves the step to torch.optim on the host's sharded parameters. AdamW's default on CPU
# tensors is its for-loop implementation (no foreach kernels on the CPU), and torchrun starts each rank with
# OMP_NUM_THREADS=1: one core per rank. Measured with torch 2.13 on one AMD EPYC core, 40 M fp32 parameters:
# 0.09e9 parameters/s (foreach=True 0.07e9, fused=True 0.41e9).
HOST_ADAMW_PARAMS_PER_S = 0.1e9


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one micro-step of one data-parallel rank (before any tensor-parallel split)."""
    forward: float
    backward: float
    recompute: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute


def attention_flops_per_token_forward(anatomy: ModelAnatomy, seq_len: int, causal_skip: bool) -> float:
    """Scores (q k^T) and weighted values (p v): 2 x 2 s d FLOPs per token per layer, halved by causal kernels."""
    d = anatomy.num_heads * anatomy.head_dim
    flops = anatomy.num_layers * 4.0 * seq_len * d
    return flops / 2 if causal_skip else flops


def checkpointed_fraction(num_layers: int, grad_ckpt: bool, ckpt_every: int = 1) -> float:
    """Share of decoder layers recomputed in backward: those with index % ckpt_every == 0."""
    if not grad_ckpt or num_layers < 1:
        return 0.0
    return -(-num_layers // ckpt_every) / num_layers


def step_flops(anatomy: ModelAnatomy, tokens: int, seq_len: int, *, grad_ckpt: bool, causal_skip: bool,
               frozen_base: bool = False, adapter_params: int = 0, ckpt_every: int = 1,
               selective: bool = False) -> StepFlops:
    """FLOPs of forward, backward and checkpoint recompute for `tokens` tokens (see the module docstring).
    selective (--ac-policy op): torchtitan's op-level policy hands back the saved matmuls' outputs (every other
    aten.mm, llmem.memory.activations.selective.saved_matmuls) and SDPA's, so the recompute runs only the other
    matmuls and no attention."""
    layer_p, other_p = anatomy.matmul_params
    p = layer_p + other_p
    attn_fwd = attention_flops_per_token_forward(anatomy, seq_len, causal_skip)
    fwd = (2 * p + 2 * adapter_params + attn_fwd) * tokens
    base_bwd = 2 * p if frozen_base else 4 * p                 # frozen: input gradients only
    bwd = (base_bwd + 4 * adapter_params + 2 * attn_fwd) * tokens
    share = checkpointed_fraction(anatomy.num_layers, grad_ckpt, ckpt_every)
    rec = share * (2 * layer_p + 2 * adapter_params + attn_fwd) * tokens
    if selective:
        saved = {f"{m}.weight" for m in saved_matmuls(anatomy)}
        saved_p = anatomy.num_layers * sum(float(p.numel) for p in anatomy.params if p.name in saved)
        rec = share * 2 * (layer_p - saved_p) * tokens
    return StepFlops(fwd, bwd, rec)


def dequantised_bytes_per_pass(anatomy: ModelAnatomy, setup: TrainingSetup) -> int:
    """Device-memory traffic of dequantising a bitsandbytes base once (every quantised weight read in its storage
    and written in the compute dtype): memory-bound work the matmul FLOPs do not count. MatMul4Bit dequantises in
    forward and again in backward (and in the recompute under checkpointing); LLM.int8 dequantises in backward and
    quantises the input in forward (counted alike, an approximation); torchao's NF4Tensor, forward and backward,
    through eager temporaries each written and read once (llmem.memory.quant.torchao_dequantise_events)."""
    if not setup.quant_spec.quantised:
        return 0
    args = quant_args(setup, False)
    total = 0
    for p in anatomy.params:
        if is_quantised(p, setup.quant_base):
            weight = p.numel * setup.compute_bytes
            # torchao's eager get_original_weight writes and reads back its temporaries (int64 nibble planes, ...)
            temps = sum(allocated(torchao_dequantise_events(p.numel, setup.compute_bytes))) - weight \
                if not setup.quant_spec.bitsandbytes else 0
            total += storage_bytes(p, setup.quant_base, args) + weight + 2 * temps
    return total


def offloaded_activation_bytes(r: ResolvedSetup) -> int:
    """Bytes --offload-activations moves to the host in forward (and back in backward): the estimator's
    ActivationProfile.offloaded_bytes (checkpointed layers' inputs and the lm_head's input stay on the device)."""
    if not r.setup.offload_activations:
        return 0
    return activation_profile(r).offloaded_bytes


def peak_flops_per_s(gpu: GpuSpec, precision: str) -> float:
    """Dense matmul peak for `precision`: bf16/fp16 tensor peak; fp32 as TF32 (half) or 1/8 before Ampere."""
    peak = gpu.bf16_tflops * 1e12
    if not PRECISIONS[precision].low_precision:
        return peak / 2 if gpu.compute_capability >= (8, 0) else peak / 8
    return peak


def ring_allreduce_time_s(nbytes: float, n: int, bandwidth_gbps: float,
                          latency_s: float = COLLECTIVE_LATENCY_S) -> float:
    """Ring all-reduce of an `nbytes` buffer over n GPUs: 2 (n-1)/n * nbytes per GPU at bandwidth_gbps GB/s."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / (bandwidth_gbps * 1e9) + latency_s


def ring_allgather_time_s(full_nbytes: float, n: int, bandwidth_gbps: float,
                          latency_s: float = COLLECTIVE_LATENCY_S) -> float:
    """All-gather (or reduce-scatter) whose full, unsharded buffer is `full_nbytes`: (n-1)/n of it per GPU."""
    if n <= 1 or full_nbytes <= 0:
        return 0.0
    return (n - 1) / n * full_nbytes / (bandwidth_gbps * 1e9) + latency_s


def group_bandwidth_gbps(gpu: GpuSpec, spans_nodes: bool, inter_node_gbps: float) -> float:
    """Per-GPU bandwidth of a collective's group: NVLink/PCIe inside a node, the slower network across nodes."""
    return min(gpu.link_gbps, inter_node_gbps) if spans_nodes else gpu.link_gbps


@dataclass(frozen=True)
class CommSizes:
    """Bytes one GPU's collectives move per micro-step (full buffer sizes, before the (n-1)/n factors)."""
    ddp_grad_bytes: float = 0.0          # all-reduced once per optimizer step
    fsdp_gather_bytes: float = 0.0       # one all-gather of every unit (TP-local, unsharded)
    fsdp_reduce_bytes: float = 0.0       # one reduce-scatter of every trainable unit
    fsdp_root_gather_bytes: float = 0.0  # the root unit's gather (exposed at the start of forward)
    fsdp_layer_gather_bytes: float = 0.0
    fsdp_root_reduce_bytes: float = 0.0  # the root unit's reduce-scatter (exposed at the end of backward)
    fsdp_units: int = 0
    tp_allreduce_bytes: float = 0.0      # one activation all-reduce [b, s, h]
    tp_allreduces: int = 0
    tp_logits_gather_bytes: float = 0.0
    # --sequence-parallel: each activation all-reduce is an all-gather + a reduce-scatter (the same volume, two
    # collectives' latency)
    tp_sequence_parallel: bool = False


def quantised_gather_bytes(anatomy: ModelAnatomy, setup: TrainingSetup, layout: Layout) -> tuple[float, float, float]:
    """FSDP2's all-gather bytes over a quantised base (every unit, the root, one layer): its sharded storage in its
    own dtypes, the other parameters as FSDP2 gathers them (llmem.estimator.states.fsdp_gathered_tensors)."""
    per = {p.name: sum(fsdp_gathered_tensors(p, setup, layout)) for p in anatomy.params}
    return (float(sum(per.values())), float(sum(per[p.name] for p in anatomy.params if p.layer_index is None)),
            float(sum(per[p.name] for p in anatomy.params if p.layer_index == 0)))


def comm_sizes(anatomy: ModelAnatomy, setup: TrainingSetup, layout: Layout, micro_batch: int,
               trainable_fraction: float = 1.0, stage_params: int | None = None) -> CommSizes:
    """What `layout` communicates per micro-step at `micro_batch`; trainable_fraction scales gradient traffic
    (1 for full fine-tuning, adapters / base for LoRA); `stage_params`: under --pp, the busiest rank's parameters
    (its FSDP2 units; the whole model otherwise)."""
    pb = setup.param_bytes
    tp = layout.tp
    total = float(anatomy.total_params if stage_params is None else stage_params) / tp
    root = float(anatomy.root_params) / tp
    layer = float(anatomy.layer_params(0)) / tp
    sizes: dict = {}
    stage = layout.spec.zero_stage
    if stage is not None:
        # DeepSpeed's engine communicates the module's dtype. ZeRO-1/2: the gradients reduced to their partitions
        # and the updated partitions all-gathered after the step, an all-reduce's volume; ZeRO-3: FSDP's pattern
        pb = setup.compute_bytes
    if (layout.spec.gradient_buckets or stage in (1, 2)) and layout.dp > 1:
        sizes["ddp_grad_bytes"] = total * trainable_fraction * pb
    if (layout.shards_model_states or stage == 3) and layout.dp * layout.cp > 1:   # FSDP2 over dp_shard x cp
        gather_b = setup.gather_bytes if stage is None else pb
        reduce_b = setup.reduce_bytes if stage is None else pb
        gathered = (total * gather_b, root * gather_b, layer * gather_b)
        if setup.quant_spec.quantised:   # FSDP-QLoRA gathers the quantised storage, not compute-dtype weights
            gathered = quantised_gather_bytes(anatomy, setup, layout)
        sizes.update(fsdp_gather_bytes=gathered[0], fsdp_reduce_bytes=total * trainable_fraction * reduce_b,
                     fsdp_root_gather_bytes=gathered[1], fsdp_layer_gather_bytes=gathered[2],
                     fsdp_root_reduce_bytes=root * trainable_fraction * reduce_b,
                     fsdp_units=anatomy.num_layers + 1)
    if tp > 1:
        act = float(micro_batch) * setup.seq_len * anatomy.hidden_size * setup.compute_bytes
        per_layer = 4 + (2 if setup.grad_ckpt else 0)
        # --loss-parallel: the loss runs on the vocab shards (two [tokens] all-reduces, negligible): no gather
        sizes.update(tp_allreduce_bytes=act, tp_allreduces=per_layer * anatomy.num_layers + 2,
                     tp_logits_gather_bytes=0.0 if setup.loss_parallel else float(micro_batch) * setup.seq_len
                     * anatomy.vocab_size * setup.compute_bytes, tp_sequence_parallel=setup.sequence_parallel)
    return CommSizes(**sizes)


@dataclass(frozen=True)
class StepTime:
    """Time of one optimizer step (accumulation_steps micro-steps) on one GPU, seconds."""
    micro_batch_size: int
    accumulation_steps: int
    global_batch_size: int        # samples per optimizer step over all data-parallel ranks
    tokens_per_step: int
    compute_s: float              # all micro-steps' forward + backward + recompute (+ dequantisation, offload copies)
    dp_comm_s: float              # DDP/FSDP collectives per step (overlappable)
    dp_exposed_s: float           # the part of dp_comm_s not hidden behind compute, tails included
    tp_comm_s: float              # tensor-parallel collectives per step (never hidden)
    step_s: float
    tokens_per_s: float
    host_copy_s: float = 0.0      # --offload-param: host <-> device copies per step (in dp_comm_s, overlappable)
    host_step_s: float = 0.0      # --offload-param: the optimizer step on the host (in step_s, never hidden)
    generation_s: float = 0.0     # --objective grpo: generate and score per step, amortised (in step_s)
    pp_microbatches: int = 1      # --pp: micro-batches per schedule step (micro_batch_size samples each)
    bubble_s: float = 0.0         # --pp: the schedule's fill and drain per step (in step_s; parallel_time)
    p2p_s: float = 0.0            # --pp: the stage-to-stage activation / gradient waits per step (in step_s)
    cp_comm_s: float = 0.0        # --cp: the ring's K / V all-gathers and dK / dV rotations per step
    cp_exposed_s: float = 0.0     # the part of cp_comm_s not hidden behind the attention blocks (in step_s)
    ep_comm_s: float = 0.0        # --ep: the dispatch / combine all-to-alls per step (in step_s, never hidden)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def step_time(r: ResolvedSetup, micro_batch: int,
              accumulation_steps: int = 1, *, mfu: float = DEFAULT_MFU,
              inter_node_gbps: float = DEFAULT_INTER_NODE_GBPS, adapter_params: int = 0) -> StepTime:
    """The time model (module docstring) for `layout` at `micro_batch` x `accumulation_steps`.

    adapter_params > 0 models LoRA: the base is frozen, only the adapters get gradients and communicate them.
    """
    anatomy, setup, layout, gpu = r.base, r.setup, r.layout, r.gpu
    if micro_batch < 1 or accumulation_steps < 1:
        raise LlmemError("micro-batch and accumulation steps must be >= 1")
    if not 0 < mfu <= 1:
        raise LlmemError(f"--mfu must lie in (0, 1], got {mfu}")
    w = micro_step_compute(r, micro_batch, mfu, adapter_params)
    trainable_fraction = adapter_params / max(anatomy.total_params, 1) if adapter_params else 1.0
    c = comm_sizes(anatomy, setup, layout, micro_batch, trainable_fraction, w.stage.params if w.stage else None)
    dp_bw = group_bandwidth_gbps(gpu, layout.world_size > layout.gpus_per_node, inter_node_gbps)
    a = accumulation_steps
    copies = host_copies(r, adapter_params)
    dp_comm, exposed = data_parallel_comm_s(r, c, copies, w, a, dp_bw, inter_node_gbps)
    tp_comm = tensor_parallel_comm_s(c, layout.tp, gpu.link_gbps, a)     # tp stays inside a node
    ring = ring_attention_time_s(anatomy, micro_batch, setup.seq_len, layout.cp, setup.compute_bytes,
                                 attention_flops_per_token_forward(anatomy, setup.seq_len, w.causal_skip)
                                 / anatomy.num_layers * w.tokens / w.rate_flops_per_s,
                                 checkpointed_fraction(anatomy.num_layers, setup.grad_ckpt, setup.ckpt_every),
                                 group_bandwidth_gbps(gpu, layout.cp > layout.gpus_per_node, inter_node_gbps),
                                 COLLECTIVE_LATENCY_S)
    micro_compute_s = w.compute_s + ring.exposed_s
    m, p2p, bubble = pipeline_terms(r, micro_batch, micro_compute_s, w.stage, dp_bw)
    compute = a * m * (micro_compute_s - ring.exposed_s)
    ep_s = a * ep_alltoall_time_s(r, micro_batch, group_bandwidth_gbps(gpu, layout.ep > layout.gpus_per_node,
                                                                       inter_node_gbps))
    step = compute + a * m * (ring.exposed_s + p2p) + a * bubble + exposed + tp_comm + copies.step_s \
        + a * w.generation_s + ep_s
    global_batch = micro_batch * m * a * layout.dp
    tokens_per_step = global_batch * setup.seq_len
    copy_s = a * (copies.params_s * (2 if layout.spec.reshard_after_forward else 1) + copies.grads_s)
    return StepTime(micro_batch, a, global_batch, tokens_per_step, compute, dp_comm, exposed, tp_comm, step,
                    tokens_per_step / step, copy_s, copies.step_s, a * w.generation_s, m, a * bubble, a * m * p2p,
                    a * m * ring.comm_s, a * m * ring.exposed_s, ep_comm_s=ep_s)


@dataclass(frozen=True)
class MicroStepCompute:
    """One micro-step's work on the busiest rank, before any communication (module docstring), seconds."""
    tokens: int                   # the rank's tokens: micro_batch x seq_len / cp
    causal_skip: bool             # a fused attention kernel skips the masked blocks
    rate_flops_per_s: float       # peak x MFU x tp
    stage: StageShare | None      # --pp: the busiest rank's share
    forward_s: float
    backward_s: float             # backward and the recompute
    compute_s: float              # forward + backward + dequantisation + the activation copies not hidden
    generation_s: float           # --objective grpo: the micro-step's share of the generation batch's time


def micro_step_compute(r: ResolvedSetup, micro_batch: int, mfu: float, adapter_params: int) -> MicroStepCompute:
    """The FLOPs of one micro-step at peak x MFU, the memory-bound work added to them, and GRPO's generation."""
    anatomy, setup, layout, gpu = r.base, r.setup, r.layout, r.gpu
    # --cp: each rank runs seq_len / cp of every sample's tokens, its queries against all seq_len keys
    tokens = micro_batch * setup.seq_len // layout.cp
    causal_skip = not effective_attention(anatomy, setup).keeps_scores    # a fused kernel skips masked blocks
    flops = step_flops(anatomy, tokens, setup.seq_len, grad_ckpt=setup.grad_ckpt, causal_skip=causal_skip,
                       frozen_base=adapter_params > 0, adapter_params=adapter_params, ckpt_every=setup.ckpt_every,
                       selective=AC_POLICIES[setup.ac_policy].selective)
    rate = peak_flops_per_s(gpu, setup.precision) * mfu * layout.tp
    stage = pipeline_stage(r, adapter_params, causal_skip)     # --pp: the busiest rank's share (else None)
    share = stage.flops_share if stage else 1.0
    fwd_s = share * flops.forward / rate
    bwd_s = share * (flops.backward + flops.recompute) / rate
    # memory-bound: a quantised base is dequantised in forward, backward and the recompute
    passes = 2 + checkpointed_fraction(anatomy.num_layers, setup.grad_ckpt, setup.ckpt_every)
    dequant_s = share * passes * dequantised_bytes_per_pass(anatomy, setup) / (gpu.memory_gbps * 1e9)
    # activation offloading: copies to the host in forward, back in backward, each overlapping its phase's compute
    copy_s = offloaded_activation_bytes(r) / (PCIE_GBPS * 1e9)
    offload_s = max(0.0, copy_s - fwd_s) + max(0.0, copy_s - bwd_s)
    # GRPO: the generation batch generated (prefill at FLOPs, decode at memory bandwidth) and scored, amortised
    gen_s = generation_time_s(r, micro_batch, sum(anatomy.matmul_params), rate,
                              attention_flops_per_token_forward(anatomy, setup.seq_len, causal_skip), fwd_s)
    return MicroStepCompute(tokens, causal_skip, rate, stage, fwd_s, bwd_s, fwd_s + bwd_s + dequant_s + offload_s,
                            gen_s)


def data_parallel_comm_s(r: ResolvedSetup, c: CommSizes, copies: HostCopies, w: MicroStepCompute, a: int,
                         dp_bw: float, inter_node_gbps: float) -> tuple[float, float]:
    """(the data-parallel collectives per step, the part of them not hidden behind compute): DDP's all-reduce, or
    FSDP's all-gathers and reduce-scatters (with --offload-param's copies on their streams); 0 without either."""
    layout = r.layout
    if c.ddp_grad_bytes:
        ar = ring_allreduce_time_s(c.ddp_grad_bytes, layout.dp, dp_bw)
        tail = ring_allreduce_time_s(min(DDP_BUCKET_CAP_BYTES, c.ddp_grad_bytes), layout.dp, dp_bw)
        return ar, max(0.0, ar - w.backward_s) + tail   # once per step, behind the last micro-step's backward
    if not c.fsdp_units:
        return 0.0, 0.0
    lat = (c.fsdp_units - 1) * COLLECTIVE_LATENCY_S      # one latency is inside each ring_* call already
    # HSDP: all-gathers and reduce-scatters within a shard group (on NVLink when it fits in a node), then
    # FSDP2's foreach_reduce all-reduces each gradient shard across the replicas (all_reduce_group)
    shards = layout.dp if layout.spec.zero_stage is not None else layout.shard_degree
    shard_bw = dp_bw if layout.replicas == 1 else group_bandwidth_gbps(
        r.gpu, shards * layout.tp > layout.gpus_per_node, inter_node_gbps)
    replica_ar = ring_allreduce_time_s(c.fsdp_reduce_bytes / shards, layout.replicas, dp_bw) \
        if layout.replicas > 1 else 0.0
    ag = ring_allgather_time_s(c.fsdp_gather_bytes, shards, shard_bw) + lat + copies.params_s
    rs = ring_allgather_time_s(c.fsdp_reduce_bytes, shards, shard_bw) + lat + copies.grads_s + replica_ar
    if w.stage:   # FSDP2 x PP: the stage gathered once per schedule step, reduce-scattered once (parallel_time)
        return a * (ag + rs), a * (max(0.0, ag - w.forward_s) + max(0.0, rs - w.backward_s))
    ag_bwd = ag if layout.spec.reshard_after_forward or layout.spec.zero_stage == 3 else 0.0
    tail = (ring_allgather_time_s(c.fsdp_root_gather_bytes, shards, shard_bw)
            + ring_allgather_time_s(c.fsdp_layer_gather_bytes, shards, shard_bw)
            + ring_allgather_time_s(c.fsdp_root_reduce_bytes, shards, shard_bw) + copies.root_s)
    return a * (ag + ag_bwd + rs), a * (max(0.0, ag - w.forward_s) + max(0.0, ag_bwd + rs - w.backward_s) + tail)


def tensor_parallel_comm_s(c: CommSizes, tp: int, tp_bw: float, a: int) -> float:
    """The tensor-parallel collectives per step (never hidden): the activations' all-reduces and the logits'
    all-gather."""
    if not c.tp_allreduces:
        return 0.0
    # sequence parallel (Megatron-SP, torchtitan): an all-gather of [b, s, h] before each TP region and a
    # reduce-scatter after it replace the all-reduce: (n-1)/n each, 2 (n-1)/n together, as the all-reduce's ring
    one = 2 * ring_allgather_time_s(c.tp_allreduce_bytes, tp, tp_bw) if c.tp_sequence_parallel else \
        ring_allreduce_time_s(c.tp_allreduce_bytes, tp, tp_bw)
    return a * (c.tp_allreduces * one + ring_allgather_time_s(c.tp_logits_gather_bytes, tp, tp_bw))


def pipeline_terms(r: ResolvedSetup, micro_batch: int, micro_compute_s: float, stage: StageShare | None,
                   dp_bw: float) -> tuple[int, float, float]:
    """--pp: (micro-batches per schedule step, the stage-to-stage sends per micro-batch, the schedule's bubble):
    the micro-batches of one schedule step, each waiting on its neighbours, stretched by the bubble; (1, 0, 0)
    without pipeline parallelism."""
    if not stage:
        return 1, 0.0, 0.0
    setup, layout = r.setup, r.layout
    m = setup.microbatches
    p2p = p2p_time_s(micro_batch, setup.seq_len, r.base.hidden_size, setup.compute_bytes, stage.stages,
                     dp_bw, COLLECTIVE_LATENCY_S, layout.tp if setup.sequence_parallel else 1)
    busy = micro_compute_s + p2p
    bubble = pipeline_step_s(busy, m, pipeline_schedule(setup.pp_schedule).bubble_fraction(
        layout.pp, m, stage.stages)) - m * busy
    return m, p2p, bubble


def ep_alltoall_time_s(r: ResolvedSetup, micro_batch: int, bw_gbps: float) -> float:
    """--ep: torchtitan's AllToAllTokenDispatcher per MoE layer and micro-step, forward and backward: the dispatch
    and the combine all_to_all_single each move the rank's routed rows (tokens x top_k, hidden wide, in the compute
    dtype; the received side scaled by --ep-imbalance), (ep - 1) / ep of them to other ranks; blocking (the split
    sizes' device-to-host sync), so never hidden. 0 without --ep."""
    ep = r.layout.ep
    facts = moe_facts(r.base) if ep > 1 else None
    if facts is None:
        return 0.0
    layers = r.base.num_layers - facts.dense_layers
    rows = received_rows(micro_batch * r.setup.seq_len, facts.top_k, ep, r.setup.ep_imbalance)
    moved = rows * r.base.hidden_size * r.setup.compute_bytes * (ep - 1) / ep
    return layers * 4 * (moved / (bw_gbps * 1e9) + COLLECTIVE_LATENCY_S)


def pipeline_stage(r: ResolvedSetup, adapter_params: int, causal_skip: bool) -> StageShare | None:
    """--pp: the busiest rank's share of the forward FLOPs (per token: each decoder layer's matmuls and attention,
    the head's matmuls) and its parameters; None without pipeline parallelism."""
    if r.layout.pp <= 1:
        return None
    anatomy, setup = r.base, r.setup
    layer_p, other_p = anatomy.matmul_params
    layers = max(anatomy.num_layers, 1)
    attn = attention_flops_per_token_forward(anatomy, setup.seq_len, causal_skip)
    layer_cost = (2 * layer_p + 2 * adapter_params + attn) / layers
    virtual = setup.pp_virtual_stages or pipeline_schedule(setup.pp_schedule).virtual_stages
    return busiest_stage(anatomy, r.layout.pp, virtual, layer_cost, 2 * other_p)


@dataclass(frozen=True)
class HostCopies:
    """FSDP2 CPUOffloadPolicy's host side per micro-step (module docstring), seconds; zero without it."""
    params_s: float = 0.0         # every unit's shard to the device, once per all-gather pass
    grads_s: float = 0.0          # the sharded gradients to the host, once per backward
    root_s: float = 0.0           # the root unit's share of params_s (exposed with its gather)
    step_s: float = 0.0           # the optimizer step on the host, once per optimizer step


def host_copies(r: ResolvedSetup, adapter_params: int = 0) -> HostCopies:
    """The host <-> device copies and the host's optimizer step of --offload-param for this rank's shards: the
    parameters in their stored dtypes (trained ones in param_bytes, a frozen base in the compute dtype), the trained
    ones' gradients in param_bytes (foreach_reduce casts the reduce-scatter output to the parameter dtype)."""
    if not cpu_offload(r):
        return HostCopies()
    anatomy, setup = r.base, r.setup
    shards = _shard_count(r.layout)
    trained = adapter_params or anatomy.total_params
    frozen = anatomy.total_params if adapter_params else 0       # a frozen base under its adapters
    params_bytes = (trained * setup.param_bytes + frozen * setup.stored_bytes(False)) / shards
    bandwidth = PCIE_GBPS * 1e9
    root_share = anatomy.root_params / max(anatomy.total_params, 1)
    return HostCopies(params_bytes / bandwidth, trained * setup.param_bytes / shards / bandwidth,
                      root_share * params_bytes / bandwidth, trained / shards / HOST_ADAMW_PARAMS_PER_S)


def accumulation_for(global_batch: int | None, max_micro_batch: int, dp: int, multiple: int = 1) -> tuple[int, int]:
    """(micro-batch, accumulation steps) for a global batch of samples: the fewest accumulation steps with a
    micro-batch that fits, then the smallest micro-batch that still reaches the global batch (a multiple of
    `multiple`, the objective's: `max_micro_batch` is one)."""
    if max_micro_batch < 1:
        raise LlmemError("no micro-batch fits")
    if not global_batch:
        return max_micro_batch, 1
    steps = max(1, -(-global_batch // (max_micro_batch * dp)))
    micro = max(1, -(-global_batch // (steps * dp)))
    return -(-micro // multiple) * multiple, steps


def _shard_count(layout: Layout) -> int:
    return layout.shard_degree * layout.tp


def offload_step_extra_s(r: ResolvedSetup) -> float:
    """Time offloading adds per step, not overlapped (an upper bound): gradients to the host, the CPU update, the
    updated parameters back, at PCIE_GBPS and CPU_ADAM_PARAMS_PER_S, for the parameters the step trains (a frozen
    base's adapters only: the optimizer never sees the base)."""
    local = r.anatomy.trainable_params / _shard_count(r.layout)
    moved = local * (4 + r.setup.param_bytes)           # fp32 gradients down, parameters up
    return moved / (PCIE_GBPS * 1e9) + local / CPU_ADAM_PARAMS_PER_S

