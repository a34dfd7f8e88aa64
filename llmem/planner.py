"""`llmem plan`: the largest batch per distributed method, a step-time model, and a recommendation.

For a model, a GPU type and count, a sequence length and the training options, the planner

1. lists the candidate layouts (`candidate_layouts`): single (one GPU only), ddp, fsdp, zero2, tp over all GPUs
   (only inside one node) and fsdp+tp for every tp dividing the node size with dp >= 2;
2. finds each candidate's largest micro-batch that fits (`max_batch_size`: exponential probe 1, 2, 4, ... then
   bisection over the memory engine, which is monotone in the batch size), with the user's headroom;
3. ranks the candidates, either by the time model below (`--ranking time`, default) or by LLMem's Algorithm 1
   (`--ranking paper`, paper.md §5: eval = bs * gpu_n * 1.5 for CDP/ddp, bs * gpu_n for ADP/fsdp, bs for TP,
   bs * dp_n for DP+TP; argmax, ties to the earlier of CDP > ADP > TP > DP+TP; CPU offloading when nothing fits);
4. when nothing fits, says what would, each with its largest batch, memory, tokens/s and its time per token
   against the set-up as given (`time_cost_pct`): memory savers that keep full fine-tuning (fused cross-entropy,
   8-bit AdamW, the optimizer step in backward, checkpointing every 2nd / every layer, activation offloading, the
   cheap ones together), a shorter sequence, the LoRA (r16, all linear layers) and QLoRA (the same over a 4-bit
   NF4 base) settings that fit (each tried plain, with fused CE, with checkpointing, with both), optimizer
   offloading, or more GPUs of the same type;
5. writes a table or JSON, a memory-vs-batch plot, and a launch config for the recommended plan (accelerate YAML,
   torchrun script, DeepSpeed JSON).

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
    forward attention FLOPs, times the share of layers checkpointed (ceil(L / k) / L with --grad-ckpt-every k).
  - fused cross-entropy computes the same matmuls (the lm_head's gradients in forward): no change.
* memory-bound work, added to compute: a bitsandbytes base is dequantised (storage read, compute-dtype weight
  written) in forward, in backward and in the recompute, at the GPU's memory bandwidth (`gpu.memory_gbps`);
  activation offloading copies the layers' saved tensors to the host in forward and back in backward at
  PCIE_GBPS, each copy hidden behind its phase's compute where it is shorter.
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
    all-gather of the vocab-split logits; none overlaps (it is on the critical path).
  - fsdp+tp: FSDP over the dp group on the TP-local shards, plus TP within the node.
  - not modelled: the optimizer step's own time (memory-bound, small against compute at the batch sizes that fill a
    GPU), data loading, pipeline bubbles (no pipeline parallelism here), kernel-launch overhead.
* step time = accumulation_steps x micro-step; tokens/s = global tokens per step / step time.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from llmem.anatomy import ModelAnatomy, load_anatomy
from llmem.config import EIGHT_BIT_OPTIMIZERS, TrainingSetup
from llmem.errors import LlmemError
from llmem.hardware import GpuSpec, resolve_gpu
from llmem.methods import Layout, canonical_method, resolve_layout
from llmem.result import MemoryResult
from llmem.units import MIB, format_bytes, parse_bytes, parse_fraction

# ---------------------------------------------------------------------------------------------------- constants
BATCH_CAP = 4096                    # the batch search stops here
DEFAULT_MFU = 0.4
DEFAULT_INTER_NODE_GBPS = 25.0      # GB/s per GPU across nodes (one 200 Gb/s NIC per GPU)
COLLECTIVE_LATENCY_S = 10e-6        # fixed cost of one NCCL collective
DDP_BUCKET_BYTES = 25 * MIB         # DDP's bucket_cap_mb default: the last bucket's all-reduce is exposed
PCIE_GBPS = 25.0                    # host <-> GPU copies: optimizer / activation offloading (PCIe 4.0 x16, one way)
CPU_ADAM_PARAMS_PER_S = 2e9         # a multi-threaded CPU Adam (DeepSpeed's CPUAdam class of speed), assumed
LORA_RANK = 16
LORA_TARGETS = "all-linear"
MAX_SUGGESTED_GPUS = 64
SUGGESTION_LAYOUTS = 2              # each what-if is searched on the two closest layouts that can run it
MATMUL_KINDS = ("Linear", "Conv1D")
ENGINES = ("llmem", "paper")
RANKINGS = ("time", "paper")
EXPORT_KINDS = ("accelerate", "torchrun", "deepspeed")
CPU_OFFLOADING = "cpu-offloading"
# Algorithm 1's weight per method, and its tie order (CDP > ADP > TP > DP+TP; zero2 is an ADP after fsdp)
_PAPER_ORDER = {"single": 0, "ddp": 0, "fsdp": 1, "zero2": 2, "tp": 3, "fsdp+tp": 4}

MemoryFn = Callable[[TrainingSetup], MemoryResult]


# ================================================================================================ batch search

def max_batch_size(fits: Callable[[int], bool], cap: int = BATCH_CAP) -> int:
    """Largest b in [1, cap] with fits(b), 0 if fits(1) is false; fits must be monotone (true then false).

    Exponential probe 1, 2, 4, ... until the first failure (or the cap), then bisection between the last success
    and the first failure: about 2 log2(b) calls.
    """
    if cap < 1 or not fits(1):
        return 0
    lo = 1
    hi = 2
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    if hi > cap:
        if lo == cap or fits(cap):
            return cap
        hi = cap
    return bisect_max(fits, lo, hi)


def bisect_max(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest fitting value between lo (fits) and hi (does not fit)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def refine_max(fits: Callable[[int], bool], guess: int, cap: int = BATCH_CAP) -> int:
    """The largest b in [1, cap] with fits(b) (monotone), starting from a guess from a cheaper model: probe away
    from the guess in doubling steps until the answer is bracketed, then bisect (O(log |error|) calls)."""
    guess = min(max(guess, 1), cap)
    if fits(guess):
        lo, step = guess, 1
        while lo + step <= cap and fits(lo + step):
            lo, step = lo + step, step * 2
        hi = min(lo + step, cap + 1)
    else:
        hi, step = guess, 1
        while hi - step >= 1 and not fits(hi - step):
            hi, step = hi - step, step * 2
        lo = hi - step
        if lo < 1:
            if not fits(1):
                return 0
            lo = 1
    return bisect_max(fits, lo, hi)


def calibrated_max(used: Callable[[int], int], quick: Callable[[int], int], limit: int, cap: int) -> int:
    """Largest x in [1, cap] with used(x) <= limit (0 if none), with few calls of the costly `used`: search the
    cheap `quick` scaled by used/quick measured at x = 1 and again near that answer, then refine on `used`."""
    used = functools.cache(used)
    if used(1) > limit:
        return 0

    def guess_at(x: int) -> int:
        ratio = used(x) / max(quick(x), 1)
        return max_batch_size(lambda b: quick(b) * ratio <= limit, cap)

    guess = guess_at(1)
    if guess > 1:
        guess = max(1, guess_at(guess))        # the ratio drifts with x: measure it near the answer
    return refine_max(lambda x: used(x) <= limit, guess, cap)


# ================================================================================================ candidates

def candidate_layouts(gpus: int, gpus_per_node: int | None, num_heads: int, num_kv_heads: int,
                      methods: Iterable[str] | None = None, tp: int | None = None) -> list[Layout]:
    """Every layout worth planning on `gpus` GPUs, in the paper's tie order; invalid ones silently skipped.

    single only on one GPU; ddp, fsdp, zero2; tp over all GPUs when they fit in one node; fsdp+tp for each tp in
    the divisors of the node size (> 1) with dp = gpus / tp >= 2. `methods` / `tp` restrict the list.
    Pass num_heads = num_kv_heads = 0 to skip the head-divisibility check (the paper's 1D TP splits weights'
    last dimension, not heads).
    """
    # the world itself must be valid (e.g. a whole number of nodes): let that error reach the user
    resolve_layout("single" if gpus == 1 else "ddp", gpus, None, gpus_per_node, num_heads, num_kv_heads)
    per_node = min(gpus_per_node or min(gpus, 8), gpus)
    wanted = {canonical_method(m) for m in methods} if methods else None
    specs: list[tuple[str, int | None]] = []
    if gpus == 1:
        specs.append(("single", None))
    else:
        specs += [("ddp", None), ("fsdp", None), ("zero2", None)]
        if gpus <= per_node:
            specs.append(("tp", gpus))
        for t in range(2, per_node + 1):
            if per_node % t == 0 and gpus % t == 0 and gpus // t >= 2:
                specs.append(("fsdp+tp", t))
    layouts = []
    for method, t in specs:
        if wanted is not None and method not in wanted:
            continue
        if tp is not None and method in ("tp", "fsdp+tp") and t != tp:
            continue
        if tp not in (None, 1) and method not in ("tp", "fsdp+tp"):
            continue
        try:
            layouts.append(resolve_layout(method, gpus, t, gpus_per_node, num_heads, num_kv_heads))
        except LlmemError:
            continue
    return layouts


def setup_for(base: TrainingSetup, layout: Layout, batch_size: int) -> TrainingSetup:
    """`base` run with `layout` at micro-batch `batch_size`."""
    return replace(base, method=layout.method, gpus=layout.world_size,
                   tp=layout.tp if layout.method in ("tp", "fsdp+tp") else None, batch_size=batch_size)


# ================================================================================================ FLOPs

@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one micro-step of one data-parallel rank (before any tensor-parallel split)."""
    forward: float
    backward: float
    recompute: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute


def matmul_params(anatomy: ModelAnatomy) -> tuple[float, float]:
    """(decoder-layer, other) weights that multiply activations, per token; MoE experts scaled to the active ones."""
    cfg = anatomy.config or {}
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    active = cfg.get("num_experts_per_tok") or 0
    expert_share = active / experts if experts and active else 1.0
    layer = other = 0.0
    for p in anatomy.params:
        if len(p.shape) < 2 or p.module_kind.endswith("Embedding"):
            continue
        n = float(p.numel)
        if ".experts." in p.name or "Experts" in p.module_kind:
            n *= expert_share
        if p.layer_index is not None:
            layer += n
        elif not p.name.startswith("lm_head"):
            other += n
    other += anatomy.vocab_size * anatomy.hidden_size          # the lm_head matmul, tied or not
    return layer, other


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
               frozen_base: bool = False, adapter_params: int = 0, ckpt_every: int = 1) -> StepFlops:
    """FLOPs of forward, backward and checkpoint recompute for `tokens` tokens (see the module docstring)."""
    layer_p, other_p = matmul_params(anatomy)
    p = layer_p + other_p
    attn_fwd = attention_flops_per_token_forward(anatomy, seq_len, causal_skip)
    fwd = (2 * p + 2 * adapter_params + attn_fwd) * tokens
    base_bwd = 2 * p if frozen_base else 4 * p                 # frozen: input gradients only
    bwd = (base_bwd + 4 * adapter_params + 2 * attn_fwd) * tokens
    share = checkpointed_fraction(anatomy.num_layers, grad_ckpt, ckpt_every)
    rec = share * (2 * layer_p + 2 * adapter_params + attn_fwd) * tokens
    return StepFlops(fwd, bwd, rec)


def dequantised_bytes_per_pass(anatomy: ModelAnatomy, setup: TrainingSetup) -> int:
    """Device-memory traffic of dequantising a bitsandbytes base once (every quantised weight read in its storage
    and written in the compute dtype): memory-bound work the matmul FLOPs do not count. MatMul4Bit dequantises in
    forward and again in backward (and in the recompute under checkpointing); LLM.int8 dequantises in backward and
    quantises the input in forward (counted alike, an approximation)."""
    from llmem.quant import is_quantised, storage_bytes

    if setup.quant_base == "none":
        return 0
    return sum(storage_bytes(p, setup.quant_base, setup.double_quant) + p.numel * setup.compute_bytes
               for p in anatomy.params if is_quantised(p, setup.quant_base))


def offloaded_activation_bytes(anatomy: ModelAnatomy, setup: TrainingSetup, layout: Layout) -> int:
    """Bytes --offload-activations moves to the host in forward (and back in backward): the estimator's
    ActivationProfile.offloaded_bytes (checkpointed layers' inputs and the lm_head's input stay on the device)."""
    from llmem.activations import activation_profile
    from llmem.estimator import trained_anatomy

    if not setup.offload_activations:
        return 0
    return activation_profile(trained_anatomy(anatomy, setup), setup, layout.method, layout.tp).offloaded_bytes


def peak_flops_per_s(gpu: GpuSpec, precision: str) -> float:
    """Dense matmul peak for `precision`: bf16/fp16 tensor peak; fp32 as TF32 (half) or 1/8 before Ampere."""
    peak = gpu.bf16_tflops * 1e12
    if precision == "fp32":
        return peak / 2 if gpu.compute_capability >= (8, 0) else peak / 8
    return peak


# ================================================================================================ communication

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


def comm_sizes(anatomy: ModelAnatomy, setup: TrainingSetup, layout: Layout, micro_batch: int,
               trainable_fraction: float = 1.0) -> CommSizes:
    """What `layout` communicates per micro-step at `micro_batch`; trainable_fraction scales gradient traffic
    (1 for full fine-tuning, adapters / base for LoRA)."""
    pb = setup.param_bytes
    tp = layout.tp
    total = float(anatomy.total_params) / tp
    root = float(anatomy.root_params) / tp
    layer = float(anatomy.layer_params(0)) / tp
    sizes: dict = {}
    if layout.method == "ddp" and layout.dp > 1:
        sizes["ddp_grad_bytes"] = total * trainable_fraction * pb
    if layout.shards_model_states and layout.dp > 1:
        gather_b = setup.gather_bytes
        reduce_b = 4 if setup.mixed else pb
        sizes.update(fsdp_gather_bytes=total * gather_b, fsdp_reduce_bytes=total * trainable_fraction * reduce_b,
                     fsdp_root_gather_bytes=root * gather_b, fsdp_layer_gather_bytes=layer * gather_b,
                     fsdp_root_reduce_bytes=root * trainable_fraction * reduce_b,
                     fsdp_units=anatomy.num_layers + 1)
    if tp > 1:
        act = float(micro_batch) * setup.seq_len * anatomy.hidden_size * setup.compute_bytes
        per_layer = 4 + (2 if setup.grad_ckpt else 0)
        sizes.update(tp_allreduce_bytes=act, tp_allreduces=per_layer * anatomy.num_layers + 2,
                     tp_logits_gather_bytes=float(micro_batch) * setup.seq_len * anatomy.vocab_size
                     * setup.compute_bytes)
    return CommSizes(**sizes)


# ================================================================================================ step time

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

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def step_time(anatomy: ModelAnatomy, setup: TrainingSetup, layout: Layout, gpu: GpuSpec, micro_batch: int,
              accumulation_steps: int = 1, *, mfu: float = DEFAULT_MFU,
              inter_node_gbps: float = DEFAULT_INTER_NODE_GBPS, adapter_params: int = 0) -> StepTime:
    """The time model (module docstring) for `layout` at `micro_batch` x `accumulation_steps`.

    adapter_params > 0 models LoRA: the base is frozen, only the adapters get gradients and communicate them.
    """
    from llmem.activations import effective_attention

    if micro_batch < 1 or accumulation_steps < 1:
        raise LlmemError("micro-batch and accumulation steps must be >= 1")
    if not 0 < mfu <= 1:
        raise LlmemError(f"--mfu must lie in (0, 1], got {mfu}")
    tokens = micro_batch * setup.seq_len
    causal_skip = effective_attention(anatomy, setup) == "sdpa"
    flops = step_flops(anatomy, tokens, setup.seq_len, grad_ckpt=setup.grad_ckpt, causal_skip=causal_skip,
                       frozen_base=adapter_params > 0, adapter_params=adapter_params, ckpt_every=setup.ckpt_every)
    rate = peak_flops_per_s(gpu, setup.precision) * mfu * layout.tp
    fwd_s = flops.forward / rate
    bwd_s = (flops.backward + flops.recompute) / rate
    # memory-bound: a quantised base is dequantised in forward, backward and the recompute
    passes = 2 + checkpointed_fraction(anatomy.num_layers, setup.grad_ckpt, setup.ckpt_every)
    dequant_s = passes * dequantised_bytes_per_pass(anatomy, setup) / (gpu.memory_gbps * 1e9)
    # activation offloading: copies to the host in forward, back in backward, each overlapping its phase's compute
    copy_s = offloaded_activation_bytes(anatomy, setup, layout) / (PCIE_GBPS * 1e9)
    offload_s = max(0.0, copy_s - fwd_s) + max(0.0, copy_s - bwd_s)
    micro_compute_s = fwd_s + bwd_s + dequant_s + offload_s

    trainable_fraction = adapter_params / max(anatomy.total_params, 1) if adapter_params else 1.0
    c = comm_sizes(anatomy, setup, layout, micro_batch, trainable_fraction)
    spans = layout.world_size > layout.gpus_per_node
    dp_bw = group_bandwidth_gbps(gpu, spans, inter_node_gbps)
    tp_bw = gpu.link_gbps                       # tp stays inside a node
    a = accumulation_steps

    dp_comm = exposed = 0.0
    if c.ddp_grad_bytes:
        ar = ring_allreduce_time_s(c.ddp_grad_bytes, layout.dp, dp_bw)
        tail = ring_allreduce_time_s(min(DDP_BUCKET_BYTES, c.ddp_grad_bytes), layout.dp, dp_bw)
        dp_comm = ar
        exposed = max(0.0, ar - bwd_s) + tail   # once per step, behind the last micro-step's backward
    elif c.fsdp_units:
        lat = (c.fsdp_units - 1) * COLLECTIVE_LATENCY_S      # one latency is inside each ring_* call already
        ag = ring_allgather_time_s(c.fsdp_gather_bytes, layout.dp, dp_bw) + lat
        rs = ring_allgather_time_s(c.fsdp_reduce_bytes, layout.dp, dp_bw) + lat
        ag_bwd = ag if layout.method != "zero2" else 0.0
        tail = (ring_allgather_time_s(c.fsdp_root_gather_bytes, layout.dp, dp_bw)
                + ring_allgather_time_s(c.fsdp_layer_gather_bytes, layout.dp, dp_bw)
                + ring_allgather_time_s(c.fsdp_root_reduce_bytes, layout.dp, dp_bw))
        dp_comm = a * (ag + ag_bwd + rs)
        exposed = a * (max(0.0, ag - fwd_s) + max(0.0, ag_bwd + rs - bwd_s) + tail)
    tp_comm = 0.0
    if c.tp_allreduces:
        tp_comm = a * (c.tp_allreduces * ring_allreduce_time_s(c.tp_allreduce_bytes, layout.tp, tp_bw)
                       + ring_allgather_time_s(c.tp_logits_gather_bytes, layout.tp, tp_bw))
    compute = a * micro_compute_s
    step = compute + exposed + tp_comm
    global_batch = micro_batch * a * layout.dp
    tokens_per_step = global_batch * setup.seq_len
    return StepTime(micro_batch, a, global_batch, tokens_per_step, compute, dp_comm, exposed, tp_comm, step,
                    tokens_per_step / step)


def accumulation_for(global_batch: int | None, max_micro_batch: int, dp: int) -> tuple[int, int]:
    """(micro-batch, accumulation steps) for a global batch of samples: the fewest accumulation steps with a
    micro-batch that fits, then the smallest micro-batch that still reaches the global batch."""
    if max_micro_batch < 1:
        raise LlmemError("no micro-batch fits")
    if not global_batch:
        return max_micro_batch, 1
    steps = max(1, -(-global_batch // (max_micro_batch * dp)))
    micro = max(1, -(-global_batch // (steps * dp)))
    return micro, steps


# ================================================================================================ offload

def _shard_count(layout: Layout) -> int:
    return (layout.dp if layout.shards_model_states else 1) * layout.tp


def offload_cpu_ram_bytes(setup: TrainingSetup, anatomy: ModelAnatomy, layout: Layout) -> int:
    """CPU RAM per GPU for optimizer offloading (estimator.offloaded_optimizer_host_bytes of the trained model)."""
    from llmem.estimator import offloaded_optimizer_host_bytes, trained_anatomy

    s = setup_for(setup, layout, 1)
    return offloaded_optimizer_host_bytes(trained_anatomy(anatomy, s), s, layout)


def offload_step_extra_s(setup: TrainingSetup, anatomy: ModelAnatomy, layout: Layout) -> float:
    """Time offloading adds per step, not overlapped (an upper bound): gradients to the host, the CPU update, the
    updated parameters back, at PCIE_GBPS and CPU_ADAM_PARAMS_PER_S."""
    local = anatomy.trainable_params / _shard_count(layout)
    moved = local * (4 + setup.param_bytes)           # fp32 gradients down, parameters up
    return moved / (PCIE_GBPS * 1e9) + local / CPU_ADAM_PARAMS_PER_S


# ================================================================================================ the plan

@dataclass
class PlanOptions:
    engine: str = "llmem"                # llmem (estimator) or paper (LLMem's equations)
    ranking: str = "time"                # time (time model) or paper (Algorithm 1)
    headroom: float = 0.0                # fits when device_used <= (1 - headroom) * GPU memory
    mfu: float = DEFAULT_MFU
    inter_node_gbps: float = DEFAULT_INTER_NODE_GBPS
    global_batch: int | None = None      # samples per optimizer step (gradient accumulation)
    dataset_tokens: int | None = None
    m_base_bytes: int | None = None      # paper engine: memory in use before training
    batch_cap: int = BATCH_CAP
    methods: tuple[str, ...] | None = None
    tp: int | None = None

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise LlmemError(f"unknown engine {self.engine!r}: choose {' or '.join(ENGINES)}")
        if self.ranking not in RANKINGS:
            raise LlmemError(f"unknown ranking {self.ranking!r}: choose {' or '.join(RANKINGS)}")
        if not 0 <= self.headroom < 1:
            raise LlmemError(f"--headroom must lie in [0, 100%), got {self.headroom}")
        if not 0 < self.mfu <= 1:
            raise LlmemError(f"--mfu must lie in (0, 1], got {self.mfu}")
        if self.inter_node_gbps <= 0:
            raise LlmemError(f"--inter-node-gbps must be positive, got {self.inter_node_gbps}")
        if self.global_batch is not None and self.global_batch < 1:
            raise LlmemError(f"--global-batch must be >= 1, got {self.global_batch}")
        if self.dataset_tokens is not None and self.dataset_tokens < 1:
            raise LlmemError(f"--dataset-tokens must be >= 1, got {self.dataset_tokens}")
        if self.batch_cap < 1:
            raise LlmemError(f"--max-batch must be >= 1, got {self.batch_cap}")


@dataclass
class CandidatePlan:
    layout: Layout
    max_batch_size: int                  # 0: does not fit even at batch 1
    memory: MemoryResult                 # at max_batch_size (at batch 1 when nothing fits)
    limit_bytes: int
    time: StepTime | None = None         # at the micro-batch the plan would use
    eval: float | None = None            # Algorithm 1's eval (paper ranking)
    offload_optimizer: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.max_batch_size >= 1

    @property
    def method(self) -> str:
        return self.layout.method

    def to_dict(self) -> dict:
        t = self.time
        out = {
            "method": self.layout.method, "label": self.layout.label, "dp": self.layout.dp, "tp": self.layout.tp,
            "nodes": self.layout.nodes, "max_batch_size": self.max_batch_size,
            "batch_size_at_memory": max(self.max_batch_size, 1),
            "peak_reserved_bytes": self.memory.peak_reserved_bytes,
            "device_used_bytes": self.memory.device_used_bytes, "limit_bytes": self.limit_bytes,
            "micro_batch_size": t.micro_batch_size if t else None,
            "accumulation_steps": t.accumulation_steps if t else None,
            "global_batch_size": t.global_batch_size if t else None,
            "step_time_s": t.step_s if t else None, "tokens_per_s": t.tokens_per_s if t else None,
            "time": t.to_dict() if t else None, "fits": self.fits,
        }
        if self.eval is not None:
            out["eval"] = self.eval
        if self.offload_optimizer:
            out["offload_optimizer"] = True
        return out


@dataclass
class Plan:
    setup: TrainingSetup
    anatomy: ModelAnatomy
    gpu: GpuSpec
    options: PlanOptions
    candidates: list[CandidatePlan]
    recommended: CandidatePlan | None
    recommendation: str                  # a label, "cpu-offloading", or "" when nothing fits
    reason: str
    suggestions: list[dict]
    notes: list[str]
    memory_fn: MemoryFn = field(repr=False, default=None)
    dataset_time_s: float | None = None

    @property
    def limit_bytes(self) -> int:
        return limit_bytes(self.gpu, self.options.headroom)

    def to_dict(self) -> dict:
        rec: dict | None
        if self.recommended is not None:
            rec = {**self.recommended.to_dict(), "reason": self.reason}
            if self.dataset_time_s is not None:
                rec["dataset_time_s"] = self.dataset_time_s
        else:
            rec = {"method": self.recommendation or None, "reason": self.reason}
        setup = self.setup.to_dict()
        setup.update({
            "model": self.anatomy.name, "total_params": self.anatomy.total_params, "gpu": self.gpu.name,
            "gpu_memory_bytes": self.gpu.memory_bytes, "headroom": self.options.headroom,
            "limit_bytes": self.limit_bytes, "engine": self.options.engine, "ranking": self.options.ranking,
            "mfu": self.options.mfu, "inter_node_gbps": self.options.inter_node_gbps,
            "global_batch": self.options.global_batch, "dataset_tokens": self.options.dataset_tokens,
            "gpus_per_node": min(self.setup.gpus_per_node or min(self.setup.gpus, 8), self.setup.gpus),
        })
        setup.pop("method", None)
        setup.pop("batch_size", None)
        return {"methods": [c.to_dict() for c in self.candidates], "recommended": rec,
                "suggestions": self.suggestions, "setup": setup, "notes": self.notes}


def limit_bytes(gpu: GpuSpec, headroom: float) -> int:
    return int(gpu.memory_bytes * (1 - headroom))


def memory_function(engine: str, anatomy: ModelAnatomy, gpu: GpuSpec, m_base_bytes: int | None = None) -> MemoryFn:
    """TrainingSetup -> MemoryResult for `engine`, with the anatomy and GPU bound once."""
    if engine == "llmem":
        from llmem.estimator import PreparedStates, estimate, prepare_states, quick_peak_allocated

        def full(s: TrainingSetup) -> MemoryResult:
            return estimate(s, anatomy, gpu)

        # searches: a 1 ms tensor-sum bound and a draft estimate, confirmed with the full one at the answer; the
        # model states do not depend on the batch or the sequence, so the bound computes them once per set-up
        prepared: dict[TrainingSetup, PreparedStates] = {}

        def quick(s: TrainingSetup) -> int:
            key = replace(s, batch_size=1, seq_len=1)
            if key not in prepared:
                prepared[key] = prepare_states(s, anatomy)
            return quick_peak_allocated(s, anatomy, gpu, prepared[key])

        full.quick = quick   # type: ignore[attr-defined]
        full.draft = lambda s: estimate(s, anatomy, gpu, draft=True)  # type: ignore[attr-defined]
        return full
    if engine == "paper":
        from llmem.paper import paper_estimate

        return lambda s: paper_estimate(s, anatomy, gpu, m_base_bytes=m_base_bytes)
    raise LlmemError(f"unknown engine {engine!r}: choose {' or '.join(ENGINES)}")


def search_candidate(base: TrainingSetup, layout: Layout, mem: MemoryFn, limit: int,
                     cap: int = BATCH_CAP, quick: Callable[[TrainingSetup], int] | None = None) -> CandidatePlan:
    """Largest micro-batch of `layout` whose device-used memory stays within `limit`, and the memory there.

    With `quick` (tensor bytes at the largest moment, no allocator replay) the search runs on quick values scaled
    by the full estimate's device-used / quick ratio at batch 1, then the answer is checked and stepped with full
    estimates, so the result is the full estimator's own largest fitting batch.
    """
    cache: dict[int, MemoryResult] = {}

    def at(bs: int) -> MemoryResult:
        if bs not in cache:
            cache[bs] = mem(setup_for(base, layout, bs))
        return cache[bs]

    def fits(bs: int) -> bool:
        return at(bs).device_used_bytes <= limit

    quick = quick or getattr(mem, "quick", None)
    if quick is None:
        best = max_batch_size(fits, cap)
        return CandidatePlan(layout, best, at(max(best, 1)), limit)
    draft = getattr(mem, "draft", mem)
    # out of memory for sure: the draft's allocated peak is exact (linear in depth) and reserved >= allocated; its
    # reserved is not (fragmentation extrapolated from shallow replays), so the memory shown is a full estimate
    d1 = draft(setup_for(base, layout, 1))
    if d1.peak_allocated_bytes + (d1.device_used_bytes - d1.peak_reserved_bytes) > limit:
        return CandidatePlan(layout, 0, at(1), limit)
    best = calibrated_max(lambda bs: at(bs).device_used_bytes, lambda bs: quick(setup_for(base, layout, bs)),
                          limit, cap)
    return CandidatePlan(layout, best, at(max(best, 1)), limit)


def paper_eval(layout: Layout, batch: int) -> float:
    """Algorithm 1's eval for a layout at its max batch: CDP bs*gpu_n*1.5, ADP bs*gpu_n, TP bs, DP+TP bs*dp_n."""
    if layout.method in ("single", "ddp"):
        return batch * layout.world_size * 1.5
    if layout.method in ("fsdp", "zero2"):
        return float(batch * layout.world_size)
    if layout.method == "tp":
        return float(batch)
    return float(batch * layout.dp)


def frozen_base_trainable_params(setup: TrainingSetup, anatomy: ModelAnatomy) -> int:
    """Trainable parameters when the set-up freezes the base (LoRA and other adapters); 0 for full fine-tuning."""
    from llmem.estimator import trained_anatomy

    trained = trained_anatomy(anatomy, setup)
    return trained.trainable_params if trained.trainable_params < trained.total_params else 0


def _attach_time(c: CandidatePlan, anatomy: ModelAnatomy, setup: TrainingSetup, gpu: GpuSpec,
                 options: PlanOptions, adapter_params: int = 0) -> None:
    if not c.fits:
        return
    adapter_params = adapter_params or frozen_base_trainable_params(setup, anatomy)
    if setup.optimizer_in_backward:
        # each gradient is consumed by its update during backward: no accumulation, one micro-batch per step
        wanted = -(-options.global_batch // c.layout.dp) if options.global_batch else c.max_batch_size
        micro, steps = min(c.max_batch_size, wanted), 1
    else:
        micro, steps = accumulation_for(options.global_batch, c.max_batch_size, c.layout.dp)
    s = setup_for(setup, c.layout, micro)
    t = step_time(anatomy, s, c.layout, gpu, micro, steps, mfu=options.mfu,
                  inter_node_gbps=options.inter_node_gbps, adapter_params=adapter_params)
    if c.offload_optimizer:
        extra = offload_step_extra_s(s, anatomy, c.layout)
        t = replace(t, step_s=t.step_s + extra, tokens_per_s=t.tokens_per_step / (t.step_s + extra))
    c.time = t


def rank_by_time(candidates: list[CandidatePlan]) -> CandidatePlan | None:
    """The fitting candidate with the most tokens/s (earlier in the list on ties)."""
    best = None
    for c in candidates:
        if c.fits and c.time is not None and (best is None or c.time.tokens_per_s > best.time.tokens_per_s):
            best = c
    return best


def rank_by_paper(candidates: list[CandidatePlan]) -> CandidatePlan | None:
    """Algorithm 1: argmax eval, ties to CDP > ADP > TP > DP+TP; None (CPU offloading) when every eval is 0."""
    best = None
    for c in sorted(candidates, key=lambda c: _PAPER_ORDER[c.method]):
        if c.eval and (best is None or c.eval > best.eval):
            best = c
    return best


def plan(setup: TrainingSetup, options: PlanOptions | None = None, *, anatomy: ModelAnatomy | None = None,
         progress: Callable[[str, int, int], None] | None = None) -> Plan:
    """Plan `setup`'s model on setup.gpus GPUs of type setup.gpu (setup.method and batch_size are ignored)."""
    options = options or PlanOptions()
    anatomy = anatomy or load_anatomy(setup.model, setup.trust_remote_code)
    gpu = resolve_gpu(setup.gpu, setup.gpu_memory, setup.cuda_context)
    mem = memory_function(options.engine, anatomy, gpu, options.m_base_bytes)
    limit = limit_bytes(gpu, options.headroom)
    heads = (0, 0) if options.engine == "paper" else (anatomy.num_heads, anatomy.num_kv_heads)
    layouts = candidate_layouts(setup.gpus, setup.gpus_per_node, *heads, methods=options.methods, tp=options.tp)
    if not layouts:
        raise LlmemError(f"no layout of {setup.gpus} GPU(s) matches the requested method/tp for "
                         f"{anatomy.name}")
    notes = plan_notes(setup, gpu, options, anatomy)
    candidates: list[CandidatePlan] = []
    total_steps = len(layouts) + 1
    for i, layout in enumerate(layouts):
        if progress:
            progress(f"searching {layout.label}", i, total_steps)
        try:
            c = search_candidate(setup, layout, mem, limit, options.batch_cap)
        except LlmemError as exc:
            notes.append(f"{layout.label} skipped: {exc}")
            continue
        _attach_time(c, anatomy, setup, gpu, options)
        if options.ranking == "paper":
            c.eval = paper_eval(layout, c.max_batch_size)
        candidates.append(c)
    if not candidates:
        raise LlmemError("no candidate layout could be estimated: " + "; ".join(notes[-3:]))

    if options.ranking == "paper":
        best = rank_by_paper(candidates)
        if best is None:
            recommendation, reason = CPU_OFFLOADING, ("Algorithm 1: every method's eval is 0 (nothing fits at "
                                                      "batch 1), so CPU offloading (heterogeneous training)")
        else:
            recommendation = best.layout.label
            reason = (f"Algorithm 1: largest eval {best.eval:g} (max batch {best.max_batch_size}; eval = "
                      + _paper_formula(best.layout) + ")")
    else:
        best = rank_by_time(candidates)
        if best is None:
            recommendation, reason = "", "nothing fits at batch 1 on these GPUs; see the suggestions"
        else:
            recommendation = best.layout.label
            reason = (f"fastest by the time model: {best.time.tokens_per_s:,.0f} tokens/s at micro-batch "
                      f"{best.time.micro_batch_size} x {best.time.accumulation_steps} accumulation step(s)")
    suggestions: list[dict] = []
    if not any(c.fits for c in candidates):
        if progress:
            progress("looking for what would fit", len(layouts), total_steps)
        # what-ifs are tried on the two layouts that came closest to fitting (each try is a batch search), and on
        # the closest without tensor parallelism and the closest replicated one (fused CE, 8-bit optimizers and a
        # quantised base are modelled without TP / with single and ddp only)
        ranked = sorted(candidates, key=lambda c: c.memory.device_used_bytes)
        closest = [c.layout for c in ranked[:2]]
        for allowed in (("single", "ddp", "fsdp", "zero2"), ("single", "ddp")):
            extra = next((c.layout for c in ranked if c.method in allowed), None)
            if extra is not None and extra not in closest:
                closest.append(extra)
        suggestions = suggest(setup, anatomy, gpu, options, mem, closest or layouts)
    result = Plan(setup, anatomy, gpu, options, candidates, best, recommendation, reason, suggestions, notes, mem)
    if best is not None and best.time is not None and options.dataset_tokens:
        result.dataset_time_s = options.dataset_tokens / best.time.tokens_per_s
    if progress:
        progress("done", total_steps, total_steps)
    return result


def _paper_formula(layout: Layout) -> str:
    return {"single": "bs x gpu_n x 1.5 (CDP)", "ddp": "bs x gpu_n x 1.5 (CDP)", "fsdp": "bs x gpu_n (ADP)",
            "zero2": "bs x gpu_n (ADP)", "tp": "bs (TP)", "fsdp+tp": "bs x dp_n (DP+TP)"}[layout.method]


def plan_notes(setup: TrainingSetup, gpu: GpuSpec, options: PlanOptions, anatomy: ModelAnatomy) -> list[str]:
    notes = [
        f"fits: device-used memory <= {100 * (1 - options.headroom):g}% of {format_bytes(gpu.memory_bytes)} "
        f"= {format_bytes(limit_bytes(gpu, options.headroom))} (engine {options.engine})",
        f"time model: {gpu.name} peak {peak_flops_per_s(gpu, setup.precision) / 1e12:g} TFLOP/s for "
        f"{setup.precision} x MFU {options.mfu:g}; links {gpu.link_gbps:g} GB/s in a node, "
        f"{options.inter_node_gbps:g} GB/s per GPU across nodes; optimizer step, data loading not timed",
    ]
    if setup.precision == "fp32":
        notes.append("fp32 matmuls timed as TF32 (half the bf16 peak) on Ampere and newer, 1/8 of it before")
    if options.engine == "paper":
        notes.append("paper engine: LLMem's equations (fp16 mixed precision, Gemini chunks, gradient "
                     "checkpointing assumed); the time model still uses the setup given")
    if setup.batch_size != 1:
        notes.append("--batch-size is ignored by plan: the largest micro-batch is searched")
    if setup.optimizer_in_backward and options.global_batch:
        notes.append("--optimizer-in-backward cannot accumulate gradients: each step is one micro-batch per GPU, "
                     "so --global-batch is reached only when it fits in one micro-batch x data-parallel ranks")
    return notes


# ================================================================================================ suggestions

def _best_fitting(setup: TrainingSetup, layouts: list[Layout], mem: MemoryFn, limit: int, anatomy: ModelAnatomy,
                  gpu: GpuSpec, options: PlanOptions, adapter_params: int = 0, offload: bool = False,
                  max_layouts: int | None = None) -> tuple[CandidatePlan | None, list[CandidatePlan]]:
    """The fastest fitting plan over `layouts` (and every plan searched); with max_layouts, only the first that
    many layouts the set-up can run (a layout that refuses it, e.g. 8-bit AdamW under FSDP2, does not count)."""
    plans: list[CandidatePlan] = []
    for layout in layouts:
        if max_layouts is not None and len(plans) >= max_layouts:
            break
        try:
            c = search_candidate(setup, layout, mem, limit, options.batch_cap)
        except LlmemError:
            continue
        c.offload_optimizer = offload
        _attach_time(c, anatomy, setup, gpu, options, adapter_params)
        plans.append(c)
    return rank_by_time(plans), plans


def _suggestion(kind: str, text: str, c: CandidatePlan | None, **extra) -> dict:
    out = {"kind": kind, "text": text, "fits": bool(c and c.fits)}
    if c is not None:
        out.update({"method": c.layout.method, "label": c.layout.label, "dp": c.layout.dp, "tp": c.layout.tp,
                    "gpus": c.layout.world_size, "max_batch_size": c.max_batch_size,
                    "peak_reserved_bytes": c.memory.peak_reserved_bytes,
                    "device_used_bytes": c.memory.device_used_bytes,
                    "step_time_s": c.time.step_s if c.time else None,
                    "tokens_per_s": c.time.tokens_per_s if c.time else None})
    out.update(extra)
    return out


def _closest(plans: list[CandidatePlan]) -> CandidatePlan | None:
    return min(plans, key=lambda c: c.memory.device_used_bytes, default=None)


def _fewest_gpus(setup: TrainingSetup, anatomy: ModelAnatomy, gpu: GpuSpec, options: PlanOptions, mem: MemoryFn,
                 limit: int, methods: tuple[str, ...] | None = None) -> CandidatePlan | None:
    """The fastest fitting plan on the smallest power-of-two GPU count above setup.gpus (up to 64), or None."""
    heads = (0, 0) if options.engine == "paper" else (anatomy.num_heads, anatomy.num_kv_heads)
    n = 1
    while n < MAX_SUGGESTED_GPUS:
        n *= 2
        per = setup.gpus_per_node
        if n <= setup.gpus or (per and n > per and n % per):
            continue
        try:
            layouts = candidate_layouts(n, per, *heads, methods=methods or options.methods)
        except LlmemError:
            continue
        best, _ = _best_fitting(replace(setup, gpus=n), layouts, mem, limit, anatomy, gpu, options)
        if best is not None:
            return best
    return None


def describe_fit(c: CandidatePlan | None, plans: list[CandidatePlan], limit: int) -> str:
    if c is not None:
        t = f", {c.time.tokens_per_s:,.0f} tokens/s" if c.time else ""
        return (f"{c.layout.label} fits up to batch {c.max_batch_size} "
                f"({format_bytes(c.memory.device_used_bytes)} at that batch{t})")
    closest = _closest(plans)
    if closest is None:
        return "no layout could be estimated"
    return (f"still does not fit: best {closest.layout.label} needs "
            f"{format_bytes(closest.memory.device_used_bytes)} at batch 1 (limit {format_bytes(limit)})")


@dataclass(frozen=True)
class Saver:
    """One way to make the step smaller: the set-up fields it changes, the CLI flags that ask for it, its cost."""
    kind: str
    changes: tuple[tuple[str, object], ...]
    flags: str
    cost: str

    def apply(self, setup: TrainingSetup) -> TrainingSetup:
        return replace(setup, **dict(self.changes))


def full_finetune_savers(setup: TrainingSetup, methods: set[str]) -> list[Saver]:
    """Ways to keep full fine-tuning with less memory, cheapest in time first (those already on are skipped), then
    the cheap ones together (fused CE, 8-bit AdamW, checkpointing every layer)."""
    out: list[Saver] = []
    if not setup.fused_ce:
        out.append(Saver("fused_ce", (("fused_ce", True),), "--fused-ce",
                         "no [tokens, vocab] fp32 logits, same FLOPs"))
    eight_bit = setup.optimizer.startswith("adamw") and setup.optimizer not in EIGHT_BIT_OPTIMIZERS \
        and not setup.offload_optimizer and methods & {"single", "ddp"}
    if eight_bit:
        out.append(Saver("optimizer_8bit", (("optimizer", "adamw-8bit"),), "--optimizer adamw-8bit",
                         "bitsandbytes' 8-bit Adam states, 2 instead of 8 bytes per parameter"))
    if not setup.optimizer_in_backward and not setup.offload_optimizer and "single" in methods \
            and setup.optimizer not in EIGHT_BIT_OPTIMIZERS:
        out.append(Saver("optimizer_in_backward", (("optimizer_in_backward", True),), "--optimizer-in-backward",
                         "each gradient freed after its own update; no gradient accumulation"))
    if not setup.grad_ckpt:
        out.append(Saver("grad_ckpt_every_2", (("grad_ckpt", True), ("ckpt_every", 2)), "--grad-ckpt-every 2",
                         "recomputes half the decoder layers"))
    if not setup.grad_ckpt or setup.ckpt_every > 1:
        out.append(Saver("grad_ckpt", (("grad_ckpt", True), ("ckpt_every", 1)), "--grad-ckpt",
                         "recomputes every decoder layer's forward (about 1/3 more compute)"))
    if not setup.offload_activations:
        out.append(Saver("offload_activations", (("offload_activations", True),), "--offload-activations",
                         "saved activations to pinned host memory and back over PCIe"))
    cheap = [sv for sv in out if sv.kind in ("fused_ce", "optimizer_8bit", "grad_ckpt")]
    if len(cheap) > 1:
        changes = tuple(c for sv in cheap for c in sv.changes)
        out.append(Saver("combined", changes, " ".join(sv.flags for sv in cheap),
                         "; ".join(sv.cost for sv in cheap)))
    return out


def time_cost_pct(c: CandidatePlan | None, base: TrainingSetup, anatomy: ModelAnatomy, gpu: GpuSpec,
                  options: PlanOptions) -> float | None:
    """Time per token of a suggestion against the set-up as given, at the same layout and micro-batch (the
    given set-up's time is modelled even though it does not fit): + is slower, - faster."""
    if c is None or not c.fits or c.time is None:
        return None
    s = setup_for(base, c.layout, c.time.micro_batch_size)
    ref = step_time(anatomy, s, c.layout, gpu, c.time.micro_batch_size, c.time.accumulation_steps,
                    mfu=options.mfu, inter_node_gbps=options.inter_node_gbps,
                    adapter_params=frozen_base_trainable_params(s, anatomy))
    return 100.0 * (ref.tokens_per_s / c.time.tokens_per_s - 1.0)


def saver_suggestion(saver: Saver, setup: TrainingSetup, layouts: list[Layout], mem: MemoryFn, limit: int,
                     anatomy: ModelAnatomy, gpu: GpuSpec, options: PlanOptions, engine_note: str) -> dict:
    s = saver.apply(setup)
    best, plans = _best_fitting(s, layouts, mem, limit, anatomy, gpu, options, max_layouts=SUGGESTION_LAYOUTS)
    cost = time_cost_pct(best, setup, anatomy, gpu, options)
    when = f", time per token {cost:+.0f} %" if cost is not None else ""
    return _suggestion(saver.kind, f"{saver.flags} ({saver.cost}{when}): " + describe_fit(best, plans, limit)
                       + engine_note,
                       best or _closest(plans), flags=saver.flags, time_cost_pct=cost,
                       changes=dict(saver.changes))


@dataclass(frozen=True)
class AdapterMenu:
    """Adapters over a frozen base, tried with the activation savers that matter most for them."""
    kind: str
    title: str
    changes: tuple[tuple[str, object], ...]
    flags: str


# (field, value, flag) sets tried on top of each adapter menu, cheapest in time first
ADAPTER_VARIANTS: tuple[tuple[tuple[str, object, str], ...], ...] = (
    (),
    (("fused_ce", True, "--fused-ce"),),
    (("grad_ckpt", True, "--grad-ckpt"),),
    (("grad_ckpt", True, "--grad-ckpt"), ("fused_ce", True, "--fused-ce")),
)


def adapter_menus(setup: TrainingSetup) -> list[AdapterMenu]:
    """LoRA r16 on all linear layers over the base as given, and the same over a 4-bit NF4 base (QLoRA, mixed
    precision: bitsandbytes keeps fp32 adapters over a uint8 base, so pure bf16 becomes bf16-mixed). A set-up
    that already trains adapters gets the QLoRA menu on its own adapters; a quantised one gets neither."""
    if setup.quant_base != "none":
        return []
    lora = (("lora_rank", LORA_RANK), ("lora_targets", LORA_TARGETS))
    lora_flags = f"--lora-rank {LORA_RANK} --lora-targets {LORA_TARGETS}"
    menus = []
    if not setup.peft:
        menus.append(AdapterMenu("lora", f"LoRA r={LORA_RANK} on all linear layers", lora, lora_flags))
    else:
        lora, lora_flags = (), ""
    mixed = {"bf16": "bf16-mixed", "fp16": "fp16-mixed"}.get(setup.precision)
    precision = (("precision", mixed),) if mixed else ()
    flags = " ".join(f for f in ("--qlora", lora_flags, f"--precision {mixed}" if mixed else "") if f)
    title = "QLoRA (4-bit NF4 base, double quantisation)" + (f" with LoRA r={LORA_RANK} on all linear layers"
                                                             if lora else " with the given adapters")
    menus.append(AdapterMenu("qlora", title, (("quant_base", "nf4"),) + lora + precision, flags))
    return menus


def menu_suggestion(menu: AdapterMenu, setup: TrainingSetup, layouts: list[Layout], mem: MemoryFn, limit: int,
                    anatomy: ModelAnatomy, gpu: GpuSpec, options: PlanOptions, engine_note: str) -> dict:
    """Every variant of the menu that fits, with its largest batch and speed; the fastest is the suggestion."""
    base = replace(setup, **dict(menu.changes))
    settings: list[dict] = []
    fastest: tuple[CandidatePlan, str, tuple] | None = None
    closest: CandidatePlan | None = None
    tried: set[tuple] = set()
    for variant in ADAPTER_VARIANTS:
        changes = tuple((k, v) for k, v, _ in variant if getattr(base, k) != v)   # what the set-up lacks
        if changes in tried:
            continue
        tried.add(changes)
        flags = " ".join(f for k, v, f in variant if (k, v) in changes)
        s = replace(base, **dict(changes))
        best, plans = _best_fitting(s, layouts, mem, limit, anatomy, gpu, options, max_layouts=SUGGESTION_LAYOUTS)
        all_flags = " ".join(f for f in (menu.flags, flags) if f)
        pick = best or _closest(plans)
        if pick is not None and (closest is None
                                 or pick.memory.device_used_bytes < closest.memory.device_used_bytes):
            closest = pick
        settings.append({"flags": all_flags, "fits": best is not None,
                         "max_batch_size": best.max_batch_size if best else 0,
                         "label": pick.layout.label if pick else None,
                         "device_used_bytes": pick.memory.device_used_bytes if pick else None,
                         "tokens_per_s": best.time.tokens_per_s if best and best.time else None,
                         "time_cost_pct": time_cost_pct(best, setup, anatomy, gpu, options)})
        if best is not None and best.time is not None and (
                fastest is None or best.time.tokens_per_s > fastest[0].time.tokens_per_s):
            fastest = (best, all_flags, changes)
    trainable = frozen_base_trainable_params(base, anatomy)
    head = f"{menu.title} ({trainable:,} trainable parameters)"
    if fastest is None:
        text = f"{head}: no setting fits — " + describe_fit(None, [closest] if closest else [], limit)
        return _suggestion(menu.kind, text + engine_note, closest, flags=menu.flags, settings=settings,
                           adapter_params=trainable, changes=dict(menu.changes))
    best, flags, changes = fastest
    fitting = [x for x in settings if x["fits"]]
    others = "; ".join(f"{x['flags']}: batch {x['max_batch_size']}" for x in fitting if x["flags"] != flags)
    text = (f"{head}: {flags} — {describe_fit(best, [], limit)}"
            + (f"; also fits: {others}" if others else "") + engine_note)
    return _suggestion(menu.kind, text, best, flags=flags, settings=settings, adapter_params=trainable,
                       time_cost_pct=time_cost_pct(best, setup, anatomy, gpu, options),
                       changes={**dict(menu.changes), **dict(changes)})


def suggest(setup: TrainingSetup, anatomy: ModelAnatomy, gpu: GpuSpec, options: PlanOptions, mem: MemoryFn,
            layouts: list[Layout]) -> list[dict]:
    """What would fit when nothing does: memory savers that keep full fine-tuning (fused CE, 8-bit AdamW, the
    optimizer step in backward, checkpointing every 2nd / every layer, activation offloading, the cheap ones
    together), a shorter sequence, the LoRA and QLoRA settings that fit, optimizer offload, more GPUs."""
    limit = limit_bytes(gpu, options.headroom)
    out: list[dict] = []
    # the paper's equations model none of the savers: they are always priced by the llmem estimator
    engine_note = " (memory from the llmem estimator: the paper engine does not model it)" \
        if options.engine == "paper" else ""
    saver_mem: MemoryFn = mem if options.engine == "llmem" else memory_function("llmem", anatomy, gpu)

    def describe(c: CandidatePlan | None, plans: list[CandidatePlan]) -> str:
        return describe_fit(c, plans, limit)

    # 1. full fine-tuning kept: each memory saver alone, then the cheap ones together
    for saver in full_finetune_savers(setup, {lay.method for lay in layouts}):
        out.append(saver_suggestion(saver, setup, layouts, saver_mem, limit, anatomy, gpu, options, engine_note))
    # 2. the longest sequence that fits at batch 1 (searched on draft estimates)
    best_seq, best_c = 0, None
    draft = getattr(mem, "draft", mem)
    for layout in layouts:
        def fits_seq(n: int, layout=layout) -> bool:
            return draft(setup_for(replace(setup, seq_len=n), layout, 1)).device_used_bytes <= limit
        quick = getattr(mem, "quick", None)
        try:
            if quick is None:
                n = max_batch_size(fits_seq, setup.seq_len - 1) if setup.seq_len > 1 else 0
            else:
                def used(n: int, layout=layout) -> int:
                    return mem(setup_for(replace(setup, seq_len=n), layout, 1)).device_used_bytes

                def quick_used(n: int, layout=layout, quick=quick) -> int:
                    return quick(setup_for(replace(setup, seq_len=n), layout, 1))
                n = calibrated_max(used, quick_used, limit, setup.seq_len - 1) if setup.seq_len > 1 else 0
        except LlmemError:
            continue
        if n > best_seq:
            s = replace(setup, seq_len=n)
            best_seq = n
            best_c = search_candidate(s, layout, mem, limit, options.batch_cap)
            _attach_time(best_c, anatomy, s, gpu, options)
    if best_c is not None:
        out.append(_suggestion("seq_len", f"shorten the sequence: --seq-len {best_seq} is the longest that fits "
                               f"at batch 1 ({best_c.layout.label}, {format_bytes(best_c.memory.device_used_bytes)}"
                               f" at batch {best_c.max_batch_size})", best_c, seq_len=best_seq))
    else:
        out.append(_suggestion("seq_len", "a shorter sequence does not help: even --seq-len 1 does not fit at "
                               "batch 1", None, seq_len=0))
    # 3. adapters over a frozen base (LoRA), and over a 4-bit base (QLoRA): the settings that fit
    for menu in adapter_menus(setup):
        out.append(menu_suggestion(menu, setup, layouts, saver_mem, limit, anatomy, gpu, options, engine_note))
    # 4. optimizer states on the CPU
    best, plans = _best_fitting(replace(setup, offload_optimizer=True), layouts, saver_mem, limit, anatomy, gpu,
                                options, offload=True)
    pick = best or _closest(plans)
    ram = offload_cpu_ram_bytes(setup, anatomy, pick.layout) if pick else 0
    per_node = min(setup.gpus_per_node or min(setup.gpus, 8), setup.gpus)
    out.append(_suggestion("offload_optimizer", "offload the optimizer to the CPU (states and update, "
                           f"ZeRO-Offload style): {describe(best, plans)}; CPU RAM {format_bytes(ram)} per GPU "
                           f"({format_bytes(ram * per_node)} per node) for the states and an fp32 master copy"
                           + engine_note,
                           pick, cpu_ram_bytes_per_gpu=ram, cpu_ram_bytes_per_node=ram * per_node))
    # 5. more GPUs of the same type (then also with checkpointing)
    # the methods that came closest, on more GPUs ("single" has no multi-GPU form: from one GPU, try every method)
    methods = tuple(sorted({lay.method for lay in layouts} - {"single"})) or None
    found = _fewest_gpus(setup, anatomy, gpu, options, mem, limit, methods)
    if found is None and not setup.grad_ckpt and options.engine != "paper":
        found = _fewest_gpus(replace(setup, grad_ckpt=True), anatomy, gpu, options, mem, limit, methods)
        if found is not None:
            out.append(_suggestion("gpus", f"use {found.layout.world_size} {gpu.name} GPUs with --grad-ckpt: "
                                   + describe(found, []), found, grad_ckpt=True))
    elif found is not None:
        out.append(_suggestion("gpus", f"use {found.layout.world_size} {gpu.name} GPUs: "
                               + describe(found, []), found))
    if found is None:
        out.append(_suggestion("gpus", f"even {MAX_SUGGESTED_GPUS} {gpu.name} GPUs do not fit this set-up as it "
                               "is: combine the suggestions above", None))
    if options.ranking == "paper":
        out.append(_suggestion(CPU_OFFLOADING, "LLMem's Algorithm 1 recommends CPU offloading (heterogeneous "
                               "training) when no method fits at batch 1", None))
    return out


# ================================================================================================ outputs

def _fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s"
    hours, rem = divmod(seconds, 3600)
    return f"{int(hours)} h {int(rem // 60):02d} min" if hours else f"{seconds / 60:.1f} min"


def plan_table(p: Plan):
    from rich.table import Table

    s = p.setup
    title = (f"{p.anatomy.name} · {s.gpus}x {p.gpu.name} · seq {s.seq_len} · {s.precision} · {s.optimizer}"
             f"{' · grad-ckpt' if s.grad_ckpt else ''} · engine {p.options.engine} · ranking {p.options.ranking}")
    table = Table(title=title, title_justify="left")
    accum = p.options.global_batch is not None
    cols = ["method", "layout dp×tp", "max batch", "peak reserved", "device used"]
    if accum:
        cols += ["micro × accum"]
    cols += ["step time", "tokens/s"]
    if p.options.ranking == "paper":
        cols += ["eval"]
    cols += ["fits"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("method", "fits") else "right")
    for c in p.candidates:
        mark = "[bold green]★ [/]" if c is p.recommended else ""
        t = c.time
        row = [mark + c.layout.label, f"{c.layout.dp}×{c.layout.tp}", str(c.max_batch_size),
               format_bytes(c.memory.peak_reserved_bytes), format_bytes(c.memory.device_used_bytes)]
        if accum:
            row.append(f"{t.micro_batch_size} × {t.accumulation_steps}" if t else "-")
        row += [_fmt_time(t.step_s if t else None), f"{t.tokens_per_s:,.0f}" if t else "-"]
        if p.options.ranking == "paper":
            row.append(f"{c.eval:g}" if c.eval is not None else "-")
        row.append("[green]yes[/]" if c.fits else "[red]no[/] (batch 1)")
        table.add_row(*row)
    return table


def print_plan(p: Plan, console=None) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = console or Console()
    console.print(plan_table(p))
    if p.recommended is not None:
        line = f"[bold]recommended:[/] {p.recommendation} — {p.reason}"
        if p.dataset_time_s is not None:
            line += f"; {p.options.dataset_tokens:,} tokens in {_fmt_time(p.dataset_time_s)}"
        console.print(line)
    elif p.recommendation == CPU_OFFLOADING:
        console.print(f"[bold]recommended:[/] CPU offloading — {p.reason}")
    else:
        console.print(f"[bold red]nothing fits[/] — {p.reason}")
    for sug in p.suggestions:
        console.print(f"[cyan]suggestion ({sug['kind']}):[/] {escape(sug['text'])}")
    for note in p.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")


def plot_plan(p: Plan, path: str, points: int = 40) -> None:
    """Memory (device used) vs micro-batch per candidate, with the GPU's capacity and the headroom limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max([c.max_batch_size for c in p.candidates] + [4])
    top = min(max(int(top * 1.3) + 1, 8), p.options.batch_cap)
    xs = sorted({max(1, round(top ** (i / (points - 1)))) for i in range(points)})
    fig, ax = plt.subplots(figsize=(8, 5))
    for c in p.candidates:
        ys = [p.memory_fn(setup_for(p.setup, c.layout, b)).device_used_bytes / 2**30 for b in xs]
        ax.plot(xs, ys, marker=".", label=c.layout.label)
    ax.axhline(p.gpu.memory_bytes / 2**30, color="red", linestyle="--", label=f"{p.gpu.name} memory")
    if p.options.headroom:
        ax.axhline(p.limit_bytes / 2**30, color="orange", linestyle=":", label="limit with headroom")
    if top > 64:
        ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batch size per GPU")
    ax.set_ylabel("device used per GPU (GiB)")
    ax.set_title(f"{p.anatomy.name} on {p.setup.gpus}x {p.gpu.name}, seq {p.setup.seq_len}")
    ax.legend(fontsize="small")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ================================================================================================ exports

@dataclass(frozen=True)
class ExportPlan:
    """What an exported config describes: one layout, its batch and accumulation, and offloading."""
    model: str
    architecture: str
    layout: Layout
    micro_batch_size: int
    accumulation_steps: int
    seq_len: int
    precision: str
    grad_ckpt: bool
    offload_optimizer: bool


def unexportable_options(setup: TrainingSetup) -> list[str]:
    """The set-up's options that the exported launch configs (layout, batch, precision, checkpointing, optimizer
    offload) do not carry: exporting them would describe a different run than the one planned."""
    s = setup
    found = [flag for flag, on in (
        ("--lora-rank", bool(s.lora_rank)), ("--peft-config", bool(s.peft_config)),
        ("--qlora" if s.quant_base == "nf4" else "--load-in-8bit", s.quant_base != "none"),
        (f"--optimizer {s.optimizer}", not s.optimizer.startswith("adamw") or s.optimizer in EIGHT_BIT_OPTIMIZERS),
        ("--optimizer-in-backward", s.optimizer_in_backward), (f"--grad-ckpt-every {s.ckpt_every}", s.ckpt_every > 1),
        ("--fused-ce", s.fused_ce), ("--offload-activations", s.offload_activations), ("--packing", s.packing),
        (f"--attn {s.attn}", s.attn != "sdpa")) if on]
    return found


def export_plan(p: Plan) -> ExportPlan:
    """The recommended plan, or, when nothing fits, the optimizer-offload suggestion if it fits."""
    extra = unexportable_options(p.setup)
    if extra:
        raise LlmemError(f"--export writes the layout, batch, precision, checkpointing and optimizer offload of a "
                         f"full fine-tuning run with AdamW; it cannot express {', '.join(extra)}: plan without "
                         "--export, or export without these options")
    c = p.recommended
    offload = False
    if c is None:
        sug = next((s for s in p.suggestions if s["kind"] == "offload_optimizer" and s["fits"]), None)
        if sug is None:
            raise LlmemError("nothing fits, not even with the optimizer offloaded: there is no plan to export")
        layout = resolve_layout(sug["method"], sug["gpus"], sug["tp"] if sug["method"] in ("tp", "fsdp+tp")
                                else None, p.setup.gpus_per_node, 0, 0)
        micro, steps = accumulation_for(p.options.global_batch, sug["max_batch_size"], layout.dp)
        offload = True
    else:
        layout = c.layout
        micro, steps = c.time.micro_batch_size, c.time.accumulation_steps
    return ExportPlan(p.anatomy.name, p.anatomy.architecture, layout, micro, steps, p.setup.seq_len,
                      p.setup.precision, p.setup.grad_ckpt, offload)


def decoder_layer_class(anatomy: ModelAnatomy) -> str:
    """Class name of the model's decoder layer (FSDP's auto-wrap unit): HF `_no_split_modules`, else the class of
    the elements of the model's longest ModuleList built on the meta device."""
    import transformers

    cls = getattr(transformers, anatomy.architecture, None)
    names = getattr(cls, "_no_split_modules", None) if cls is not None else None
    if names:
        return names[0]
    import torch

    from llmem.anatomy import build_meta_model, resolve_config

    _, cfg = resolve_config(anatomy.name)
    model = build_meta_model(cfg)
    best, best_len = None, 0
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > best_len:
            best, best_len = module, len(module)
    if best is None:
        raise LlmemError(f"cannot find the decoder layers of {anatomy.name}")
    return type(best[0]).__name__


def _accelerate_mixed(precision: str) -> str:
    return {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}.get(precision, "no")


def export_accelerate(e: ExportPlan, layer_cls: str) -> str:
    """An `accelerate launch --config_file` YAML for the plan (FSDP2 with a ParallelismConfig for tp)."""
    import yaml

    lay = e.layout
    cfg: dict = {
        "compute_environment": "LOCAL_MACHINE", "debug": False, "downcast_bf16": "no", "machine_rank": 0,
        "main_training_function": "main", "mixed_precision": _accelerate_mixed(e.precision),
        "num_machines": lay.nodes, "num_processes": lay.world_size, "rdzv_backend": "static",
        "same_network": True, "use_cpu": False, "enable_cpu_affinity": False,
    }
    if lay.world_size == 1:
        cfg["distributed_type"] = "NO"
    elif lay.method == "ddp":
        cfg["distributed_type"] = "MULTI_GPU"
    else:
        cfg["distributed_type"] = "FSDP"
        cfg["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": lay.method != "zero2",
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": layer_cls,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_offload_params": e.offload_optimizer,
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_activation_checkpointing": e.grad_ckpt,
        }
        if lay.tp > 1:
            cfg["parallelism_config"] = {
                "parallelism_config_dp_replicate_size": 1,
                "parallelism_config_dp_shard_size": lay.dp if lay.method == "fsdp+tp" else 1,
                "parallelism_config_tp_size": lay.tp,
                "parallelism_config_cp_size": 1,
            }
    header = [
        f"# llmem plan for {e.model}: {lay.label} on {lay.world_size} GPU(s), {lay.nodes} node(s)",
        f"# per-GPU micro-batch {e.micro_batch_size}, gradient accumulation {e.accumulation_steps}, "
        f"seq {e.seq_len}, {e.precision}{', gradient checkpointing' if e.grad_ckpt else ''}",
    ]
    if e.offload_optimizer:
        header.append("# FSDP2 has no optimizer-only offload: fsdp_offload_params moves parameters, gradients and "
                      "optimizer states to the CPU")
    if lay.method == "ddp" and e.grad_ckpt:
        header.append("# enable gradient checkpointing in the script: model.gradient_checkpointing_enable()")
    if lay.nodes > 1:
        header.append("# set machine_rank, main_process_ip and main_process_port per node")
    return "\n".join(header) + "\n" + yaml.safe_dump(cfg, sort_keys=True)


def export_torchrun(e: ExportPlan) -> str:
    """A shell script launching a PyTorch-native training script with torchrun for the plan."""
    import shlex

    lay = e.layout
    per_node = lay.world_size // lay.nodes
    launcher = ["torchrun", "--nnodes", str(lay.nodes), "--nproc_per_node", str(per_node)]
    if lay.nodes == 1:
        launcher.append("--standalone")
    else:
        launcher += ["--node_rank", '"${NODE_RANK:?set NODE_RANK}"', "--rdzv_backend", "c10d",
                     "--rdzv_endpoint", '"${MASTER_ADDR:?set MASTER_ADDR}:${MASTER_PORT:-29500}"']
    script = ['"${TRAIN_SCRIPT:-train.py}"', "--model", shlex.quote(e.model), "--method", lay.method,
              "--dp", str(lay.dp), "--tp", str(lay.tp), "--micro-batch-size", str(e.micro_batch_size),
              "--gradient-accumulation-steps", str(e.accumulation_steps), "--seq-len", str(e.seq_len),
              "--precision", e.precision]
    if e.grad_ckpt:
        script.append("--grad-ckpt")
    if e.offload_optimizer:
        script.append("--offload-optimizer")
    lines = [
        "#!/usr/bin/env bash",
        f"# llmem plan for {e.model}: {lay.label} on {lay.world_size} GPU(s), {lay.nodes} node(s)",
        f"# the script should build: {_torch_recipe(lay)}",
        "set -euo pipefail",
        " ".join(launcher + script) + ' "$@"',
        "",
    ]
    return "\n".join(lines)


def _torch_recipe(lay: Layout) -> str:
    return {
        "single": "one process, no process group",
        "ddp": "DistributedDataParallel(model)",
        "fsdp": "fully_shard(layer) for each decoder layer, then fully_shard(model) (reshard_after_forward=True)",
        "zero2": "fully_shard(..., reshard_after_forward=False) per decoder layer and the root",
        "tp": f"init_device_mesh('cuda', ({lay.tp},)) and parallelize_module with the model's tp_plan",
        "fsdp+tp": f"init_device_mesh('cuda', ({lay.dp}, {lay.tp}), mesh_dim_names=('dp', 'tp')): "
                   "parallelize_module on mesh['tp'], then fully_shard on mesh['dp']",
    }[lay.method]


def export_deepspeed(e: ExportPlan) -> str:
    """A DeepSpeed JSON config: ZeRO-3 for fsdp, ZeRO-2 for zero2, ZeRO-0 for ddp, AutoTP for tp."""
    import json

    lay = e.layout
    if lay.method == "fsdp+tp":
        raise LlmemError("DeepSpeed's AutoTP works with ZeRO stages 0-2 only, not ZeRO-3 (fsdp+tp): export "
                         "accelerate or torchrun for this plan")
    stage = {"single": 0, "ddp": 0, "fsdp": 3, "zero2": 2, "tp": 0}[lay.method]
    zero: dict = {"stage": stage}
    if stage >= 2:
        zero.update({"overlap_comm": True, "contiguous_gradients": True})
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if e.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 0:
            zero["stage"] = 1            # DeepSpeed offloads the optimizer from ZeRO stage 1 on
    cfg: dict = {
        "train_micro_batch_size_per_gpu": e.micro_batch_size,
        "gradient_accumulation_steps": e.accumulation_steps,
        "train_batch_size": e.micro_batch_size * e.accumulation_steps * lay.dp,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "steps_per_print": 100,
        "wall_clock_breakdown": False,
    }
    if e.precision.startswith("bf16"):
        cfg["bf16"] = {"enabled": True}
    elif e.precision.startswith("fp16"):
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                       "hysteresis": 2, "min_loss_scale": 1}
    if lay.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": lay.tp}
    return json.dumps(cfg, indent=2) + "\n"


def write_export(p: Plan, kind: str, path: str) -> ExportPlan:
    e = export_plan(p)
    if kind == "accelerate":
        text = export_accelerate(e, decoder_layer_class(p.anatomy))
    elif kind == "torchrun":
        text = export_torchrun(e)
    elif kind == "deepspeed":
        text = export_deepspeed(e)
    else:
        raise LlmemError(f"unknown export {kind!r}: choose {', '.join(EXPORT_KINDS)}")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    if kind == "torchrun":
        import os

        os.chmod(path, 0o755)
    return e


# ================================================================================================ CLI

def _add(group, *flags: str, **kwargs) -> None:
    """Add an option unless the shared training options already define one of its flags."""
    taken = getattr(group, "_option_string_actions", {})
    if any(f in taken for f in flags):
        return
    group.add_argument(*flags, **kwargs)


def add_plan_options(parser: argparse.ArgumentParser, training_options: Callable) -> None:
    training_options(parser)
    g = parser.add_argument_group("plan")
    _add(g, "--engine", default="llmem", choices=ENGINES,
         help="memory engine: llmem (PyTorch-native estimator, default) or paper (LLMem's equations)")
    _add(g, "--m-base", default=None, help="paper engine: memory in use before training, e.g. 600MiB")
    _add(g, "--ranking", default="time", choices=RANKINGS,
         help="time (tokens/s from the time model, default) or paper (LLMem's Algorithm 1)")
    _add(g, "--headroom", default="0%", help="keep this share of GPU memory free, e.g. 5%% (default 0%%)")
    _add(g, "--mfu", type=float, default=DEFAULT_MFU, help=f"model FLOPs utilisation (default {DEFAULT_MFU})")
    _add(g, "--inter-node-gbps", type=float, default=DEFAULT_INTER_NODE_GBPS,
         help="network bandwidth per GPU across nodes in GB/s (default 25 = 200 Gb/s)")
    _add(g, "--global-batch", type=int, default=None,
         help="samples per optimizer step: gradient accumulation over the largest micro-batch that fits")
    _add(g, "--dataset-tokens", default=None, help="tokens in the dataset (e.g. 2e9, 500M, 1.5B): time to train it")
    _add(g, "--max-batch", type=int, default=BATCH_CAP, help=f"cap of the batch search (default {BATCH_CAP})")
    _add(g, "--plot", default=None, metavar="FILE.png", help="write memory vs batch size per method as a PNG")
    _add(g, "--export", nargs=2, default=None, metavar=("KIND", "PATH"),
         help="write a launch config for the recommended plan: accelerate (YAML), torchrun (shell), deepspeed (JSON)")


def parse_count(text: str | int | None) -> int | None:
    """'2e9', '500M', '1.5B', '3T', '1000000' -> an integer count."""
    if text is None:
        return None
    if isinstance(text, int):
        return text
    s = str(text).strip().replace("_", "").replace(",", "")
    mult = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(s[-1:].lower(), 1)
    if mult != 1:
        s = s[:-1]
    try:
        value = float(s) * mult
    except ValueError:
        raise LlmemError(f"cannot read count {text!r}: write e.g. 2e9, 500M or 1.5B") from None
    if value < 1:
        raise LlmemError(f"count {text!r} must be >= 1")
    return int(value)


def options_from_args(args: argparse.Namespace) -> PlanOptions:
    return PlanOptions(
        engine=getattr(args, "engine", "llmem"), ranking=getattr(args, "ranking", "time"),
        headroom=parse_fraction(getattr(args, "headroom", "0%")), mfu=getattr(args, "mfu", DEFAULT_MFU),
        inter_node_gbps=getattr(args, "inter_node_gbps", DEFAULT_INTER_NODE_GBPS),
        global_batch=getattr(args, "global_batch", None),
        dataset_tokens=parse_count(getattr(args, "dataset_tokens", None)),
        m_base_bytes=parse_bytes(args.m_base) if getattr(args, "m_base", None) else None,
        batch_cap=getattr(args, "max_batch", BATCH_CAP),
        methods=(args.method,) if getattr(args, "method", None) else None,
        tp=getattr(args, "tp", None),
    )


class _LazyProgress:
    """A rich progress bar that appears only once the plan has taken more than `delay_s`."""

    def __init__(self, enabled: bool, delay_s: float = 1.0) -> None:
        self.enabled, self.delay_s, self.start = enabled, delay_s, time.monotonic()
        self.bar = self.task = None

    def __call__(self, description: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            if time.monotonic() - self.start < self.delay_s:
                return
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), transient=True)
            self.bar.start()
            self.task = self.bar.add_task(description, total=total)
        self.bar.update(self.task, description=description, completed=done, total=total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def cli_plan(args: argparse.Namespace) -> int:
    from llmem import report
    from llmem.cli import setup_from_args

    options = options_from_args(args)
    setup = setup_from_args(args)
    export = getattr(args, "export", None)
    if export and export[0] not in EXPORT_KINDS:
        raise LlmemError(f"unknown export {export[0]!r}: choose {', '.join(EXPORT_KINDS)}")
    progress = _LazyProgress(enabled=not args.json)
    try:
        p = plan(setup, options, progress=progress)
    finally:
        progress.close()
    messages = []
    if getattr(args, "plot", None):
        plot_plan(p, args.plot)
        messages.append(f"wrote {args.plot}")
    export_error = None
    if export:
        try:
            e = write_export(p, export[0], export[1])
            messages.append(f"wrote {export[0]} config for {e.layout.label} to {export[1]}")
        except LlmemError as exc:
            export_error = exc
    if args.json:
        out = p.to_dict()
        if messages:
            out["written"] = messages
        report.print_json(out)
    else:
        from rich.console import Console

        console = Console()
        print_plan(p, console)
        for m in messages:
            console.print(m)
    if export_error is not None:
        raise LlmemError(f"--export {export[0]}: {export_error}")
    return 0
