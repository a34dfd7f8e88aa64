"""The fast analytic estimator: per-GPU peak memory of one fine-tuning step under PyTorch-native training.

LLMem's equations (paper.md §3-4) generalised to modern PyTorch:
- model states per GPU follow the method's real sharding (FSDP2 pads dim 0 to the data-parallel degree; DTensor
  tensor parallelism splits column/row-parallel weights, rank 0 taking the larger chunk);
- the optimizer step is a moment of its own: weights + gradients + states + the implementation's temporaries
  (AdamW foreach keeps sqrt(exp_avg_sq) for every parameter of a group at once; `optimizer_step_events`); with
  --optimizer-in-backward there is none: each parameter steps in backward and its gradient dies there;
- the forward/backward peak is evaluated at the moments it can occur: the end of forward, the loss backward, the
  backward of the top decoder layer and of the bottom one (memory is linear in the layer index between them);
- method buffers: DDP's gradient buckets; FSDP2's gathered root and current unit, the prefetched unit's
  all-gather output and the reduce-scatter input; autocast's cached low-precision weight copies;
- the counters: the same tensors, in the order the step allocates and frees them (llmem.schedule), replayed through
  the caching-allocator model (llmem.allocator) give max_memory_allocated (whole blocks) and max_memory_reserved
  (segments, per stream); device_used adds what is outside the allocator: the CUDA context, NCCL's buffers and
  the managed memory of paged 8-bit optimizer states (cudaMallocManaged).
The moments above explain the peak (`--json` "moments"); the replay gives the numbers.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, replace

from llmem.activations import (
    F32,
    ActivationProfile,
    activation_notes,
    activation_profile,
    block_owner,
    has_recipe,
    regime_for,
    virtual_tokens,
)
from llmem.anatomy import ModelAnatomy, ParamInfo, load_anatomy, peft_anatomy, read_peft_config, with_lora
from llmem.config import EIGHT_BIT_OPTIMIZERS, TrainingSetup, check_optimizer_method
from llmem.errors import LlmemError
from llmem.hardware import GpuSpec, outside_allocator_bytes, resolve_gpu
from llmem.methods import Layout, resolve_layout
from llmem.quant import is_quantised, storage_bytes
from llmem.result import COMPONENTS, MemoryResult

# Module names whose weights tensor parallelism splits by output (column) or by input (row) features.
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1", "c_attn", "c_fc", "query_key_value",
           "dense_h_to_4h", "qkv_proj", "gate_up_proj", "w1", "w3", "q_attn")
ROWWISE = ("o_proj", "down_proj", "out_proj", "fc2", "c_proj", "dense", "dense_4h_to_h", "w2")
MATMUL_KINDS = ("Linear", "Conv1D")


def tp_split_dim(p: ParamInfo) -> int | None:
    """Which dimension of this parameter tensor parallelism shards (None: replicated)."""
    parts = p.name.split(".")
    module, leaf = (parts[-2] if len(parts) > 1 else ""), parts[-1]
    conv1d = p.module_kind == "Conv1D"  # GPT-2's Conv1D stores weight as [in, out]
    if p.module_kind.endswith("Embedding") and p.layer_index is None and p.shape[0] > 8192:
        return 0                         # vocab-parallel embedding (RowwiseParallel on nn.Embedding)
    if module == "lm_head":
        return 0                         # ColwiseParallel: vocab split
    if module in COLWISE:
        return (1 if conv1d else 0) if leaf == "weight" else 0
    if module in ROWWISE and leaf == "weight":
        return 0 if conv1d else 1
    return None


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def local_shape(p: ParamInfo, layout: Layout) -> tuple[int, ...]:
    """Shape of `p` held by rank 0: TP chunk (torch.chunk: rank 0 gets the ceil), then FSDP2's dim-0 shard."""
    shape = list(p.shape)
    if layout.tp > 1:
        dim = tp_split_dim(p)
        if dim is not None and dim < len(shape):
            shape[dim] = -(-shape[dim] // layout.tp)
    if layout.shards_model_states and layout.dp > 1 and shape:
        shape[0] = -(-shape[0] // layout.dp)   # FSDP2 pads dim 0 to a multiple of the shard count
    return tuple(shape)


def local_numel(p: ParamInfo, layout: Layout) -> int:
    return _prod(local_shape(p, layout))


def tp_local_shape(p: ParamInfo, layout: Layout) -> tuple[int, ...]:
    """Shape after tensor parallelism only (what FSDP all-gathers back per GPU)."""
    return local_shape(p, Layout("tp", 1, layout.tp, layout.gpus_per_node))


def tp_local_numel(p: ParamInfo, layout: Layout) -> int:
    return _prod(tp_local_shape(p, layout))


@dataclass(frozen=True)
class ModelStates:
    """Bytes per GPU of the model states and the method's buffers."""
    weights: int
    gradients: int
    optimizer_states: int
    optimizer_temporaries: int
    ddp_buckets: int
    autocast_weight_copies: int      # all low-precision weight copies in autocast's cache (forward)
    autocast_bias_copies: int
    head_grads: int                  # gradients produced first in backward: lm_head, final norm
    layer_grads: int                 # gradients of one decoder layer
    embed_grads: int
    fsdp_root_gathered: int          # unsharded root parameters (embeddings, norm, lm_head), param dtype
    fsdp_layer_gathered: int         # one decoder layer unsharded, param dtype
    fsdp_layer_reduce: int           # reduce-scatter input of one layer (reduce dtype)
    fsdp_root_reduce: int
    tp_embed_grad_excess: int        # vocab-parallel embedding's gradient comes back replicated (full size)
    optimizer_states_outside_allocator: int = 0   # paged 8-bit states (cudaMallocManaged): in device_used only


def model_states(anatomy: ModelAnatomy, setup: TrainingSetup, layout: Layout) -> ModelStates:
    check_optimizer_method(setup, layout.method)
    pb = setup.param_bytes
    params = anatomy.params
    trainable = [p for p in params if p.trainable]
    local = {p.name: local_numel(p, layout) for p in params}
    weights = sum(param_storage_bytes(p, setup, local[p.name]) for p in params)
    grads = sum(local[p.name] for p in trainable) * pb
    local_shapes = {p.name: local_shape(p, layout) for p in trainable}
    opt_states = sum(sum(optimizer_state_bytes(local_shapes[p.name], setup)) for p in trainable)
    opt_states += optimizer_shared_state_bytes([local_shapes[p.name] for p in trainable], setup)
    opt_outside = sum(optimizer_outside_allocator_bytes(local_shapes[p.name], setup) for p in trainable) \
        if setup.optimizer == "paged-adamw-8bit" else 0
    if setup.offload_optimizer:
        opt_states = opt_temp = opt_outside = 0    # states and the update live on the CPU (ZeRO-Offload / FSDP)
    elif setup.optimizer_in_backward:
        # one optimizer per parameter: the step's temporaries are those of the largest single parameter
        opt_temp = max((_peak_of(optimizer_step_events([local_shapes[p.name]], setup)) for p in trainable),
                       default=0)
    else:
        # per parameter group (fused AdamW, SGD and bitsandbytes' fused 8-bit kernels: none)
        from llmem.schedule import optimizer_groups

        opt_temp = max((_peak_of(optimizer_step_events([local_shapes[p.name] for p in g], setup))
                        for g in optimizer_groups(trainable, layout)), default=0)
    ddp_buckets = grads if layout.method == "ddp" else 0   # gradient_as_bucket_view=False: a second copy

    regime = regime_for(setup, layout.method)
    # autocast casts every weight a matmul uses (cached when it requires grad, cast again per use when frozen) and
    # linear keeps the cast for the input gradient either way
    matmul = [p for p in params if p.module_kind in MATMUL_KINDS or p.name.startswith("lm_head")
              or p.tied_to is not None and p.tied_to.startswith("lm_head")]
    ac_w = ac_b = 0
    if regime.autocast:
        for p in matmul:
            if not p.trainable and (setup.stored_bytes(False) == regime.mm or is_quantised(p, setup.quant_base)):
                continue                 # a frozen weight stored in the compute dtype (or quantised) needs no cast
            n = tp_local_numel(p, layout) * regime.mm
            if p.name.endswith("bias"):
                ac_b += n
            else:
                ac_w += n

    head = [p for p in trainable if p.layer_index is None and not _is_embedding(p)]
    embed = [p for p in trainable if p.layer_index is None and _is_embedding(p)]
    layer0 = [p for p in trainable if p.layer_index == 0]
    head_grads = sum(local[p.name] for p in head) * pb
    embed_grads = sum(local[p.name] for p in embed) * pb
    layer_grads = sum(local[p.name] for p in layer0) * pb

    root_gathered = layer_gathered = layer_reduce = root_reduce = 0
    if layout.shards_model_states:
        gather_bytes, reduce_bytes = setup.gather_bytes, setup.reduce_bytes
        root = [p for p in params if p.layer_index is None]
        layer0_all = [p for p in params if p.layer_index == 0]
        layer_gathered = _fsdp_unit_numel(layer0_all, layout) * gather_bytes
        root_gathered = _fsdp_unit_numel(root, layout) * gather_bytes
        layer_reduce = _fsdp_unit_numel(layer0, layout) * reduce_bytes
        root_reduce = _fsdp_unit_numel([p for p in root if p.trainable], layout) * reduce_bytes
    tp_excess = 0
    if layout.tp > 1:
        for p in embed:
            if tp_split_dim(p) == 0:
                tp_excess += (p.numel // (layout.dp if layout.shards_model_states else 1)
                              - tp_local_numel(p, layout)) * pb
    return ModelStates(weights, grads, opt_states, opt_temp, ddp_buckets, ac_w, ac_b, head_grads, layer_grads,
                       embed_grads, root_gathered, layer_gathered, layer_reduce, root_reduce, max(tp_excess, 0),
                       opt_outside)


# ---------------------------------------------------------------------------------------------------------------
# Optimizer states and step temporaries (one place for each optimizer's formulas; the schedule replays them)

def optimizer_state_bytes(shape: tuple[int, ...], setup: TrainingSetup) -> list[int]:
    """Bytes of each device tensor (from the caching allocator) the optimizer keeps for one parameter of this
    (rank-local) shape, in the order the optimizer creates them. Step counters that live on the host (torch's
    non-fused, non-capturable optimizers; Adafactor always; bitsandbytes' python int) are not device memory."""
    pb = setup.param_bytes
    n = _prod(shape)
    opt = setup.optimizer
    if opt in ("adamw", "adamw-fused", "adamw-forloop"):
        return [n * pb, n * pb]                        # exp_avg, exp_avg_sq
    if opt == "sgd":
        return []
    if opt in ("sgd-momentum", "lion"):
        return [n * pb]                                # momentum_buffer / exp_avg
    if opt == "adafactor":
        # torch.optim.Adafactor._init_group: >= 2-D: row_var [..., m, 1] and col_var [..., 1, n] (grad dtype);
        # 1-D: a full variance
        if len(shape) >= 2:
            return [_prod(shape[:-1]) * pb, _prod(shape[:-2]) * shape[-1] * pb]
        return [n * pb]
    if opt in EIGHT_BIT_OPTIMIZERS:
        from llmem.optimizers import BNB_MIN_8BIT_SIZE, BNB_PAGED_MIN_NUMEL, bnb_blocks

        if n < BNB_MIN_8BIT_SIZE:
            return [n * F32, n * F32]                  # 32-bit state1, state2 (fp32 whatever the parameter dtype)
        paged = opt == "paged-adamw-8bit" and n >= BNB_PAGED_MIN_NUMEL
        states = [] if paged else [n, n]               # uint8 state1, state2 (paged: cudaMallocManaged)
        return states + [bnb_blocks(n) * F32, bnb_blocks(n) * F32]   # fp32 absmax1, absmax2
    raise LlmemError(f"unknown optimizer {opt!r}")


def optimizer_shared_state_bytes(shapes: list[tuple[int, ...]], setup: TrainingSetup) -> int:
    """Device tensors shared by all parameters: bitsandbytes' two 256-entry fp32 quantisation maps (made on the
    device at the first 8-bit parameter), once per optimizer (per parameter with --optimizer-in-backward)."""
    if setup.optimizer not in EIGHT_BIT_OPTIMIZERS:
        return 0
    from llmem.optimizers import BNB_MIN_8BIT_SIZE, BNB_QMAP_ENTRIES

    eight_bit = sum(1 for s in shapes if _prod(s) >= BNB_MIN_8BIT_SIZE)
    copies = eight_bit if setup.optimizer_in_backward else min(eight_bit, 1)
    return copies * 2 * BNB_QMAP_ENTRIES * F32


def optimizer_outside_allocator_bytes(shape: tuple[int, ...], setup: TrainingSetup) -> int:
    """PagedAdamW8bit: state1/state2 of >= 1e5 elements are cudaMallocManaged (bnb F.get_paged). PyTorch's counters
    never see them; while resident (the update prefetches them to the GPU every step) they take device memory."""
    from llmem.optimizers import BNB_MIN_8BIT_SIZE, BNB_PAGED_MIN_NUMEL

    n = _prod(shape)
    if setup.optimizer == "paged-adamw-8bit" and n >= max(BNB_MIN_8BIT_SIZE, BNB_PAGED_MIN_NUMEL):
        return 2 * n
    return 0


def optimizer_step_events(shapes: list[tuple[int, ...]], setup: TrainingSetup) -> list[tuple[int, int, int]]:
    """Temporaries of one optimizer step over one parameter group (rank-local shapes, in order), as
    (+1 / -1, tag, bytes) allocation / free events (the schedule replays them; the estimate takes their peak).
    Fused AdamW, SGD and bitsandbytes' fused 8-bit kernels update in place: none."""
    pb = setup.param_bytes
    ev: list[tuple[int, int, int]] = []
    if setup.optimizer == "adamw-forloop":
        # _single_tensor_adamw: exp_avg_sq.sqrt() / bias_correction2_sqrt: two temporaries of each parameter
        for i, s in enumerate(shapes):
            ev += [(1, 2 * i, _prod(s) * pb), (1, 2 * i + 1, _prod(s) * pb),
                   (-1, 2 * i, _prod(s) * pb), (-1, 2 * i + 1, _prod(s) * pb)]
        return ev
    if setup.optimizer in ("lion", "adamw"):
        # llmem.optimizers.Lion: updates = torch._foreach_mul(exp_avgs, beta1); foreach AdamW:
        # torch._foreach_sqrt(exp_avg_sqs): one copy of every state of the group, then freed
        for i, s in enumerate(shapes):
            ev.append((1, i, _prod(s) * pb))
        ev += [(-1, i, _prod(s) * pb) for i, s in enumerate(shapes)]
        return ev
    if setup.optimizer != "adafactor":
        return ev
    # torch.optim._adafactor._single_tensor_adafactor (the CUDA default, foreach=None). Locals live until the loop
    # rebinds them: row_mean, col_mean (>= 2-D), grad_squared (1-D), var_estimate / update (the parameter's size;
    # the previous parameter's update is freed only when `update` is rebound, after the new var_estimate exists).
    # param.norm / update.norm are 0-dim reads (.item()); row_var.mean(dim=-2, keepdim=True) is a [.., 1, 1] temp.
    live: dict[str, tuple[int, int]] = {}     # local name -> (tag, bytes)
    tag = 0

    def bind(name: str, size: int) -> None:
        nonlocal tag
        ev.append((1, tag, size))
        old = live.get(name)
        live[name] = (tag, size)
        tag += 1
        if old is not None and not any(v[0] == old[0] for v in live.values()):
            ev.append((-1, old[0], old[1]))

    def rebind(name: str, other: str) -> None:
        old = live.get(name)
        live[name] = live[other]
        if old is not None and not any(v[0] == old[0] for v in live.values()):
            ev.append((-1, old[0], old[1]))

    for s in shapes:
        n = _prod(s)
        if len(s) >= 2:
            bind("row_mean", _prod(s[:-1]) * pb)
            bind("col_mean", _prod(s[:-2]) * s[-1] * pb)
            bind("var_estimate", n * pb)
            bind("row_var_mean", _prod(s[:-2]) * pb)
            _, size = live.pop("row_var_mean")
            ev.append((-1, tag - 1, size))
        else:
            bind("grad_squared", n * pb)
            bind("var_estimate", n * pb)
        rebind("update", "var_estimate")
    freed: set[int] = set()
    for t, size in live.values():
        if t not in freed:
            freed.add(t)
            ev.append((-1, t, size))
    return ev


def offloaded_optimizer_host_bytes(anatomy: ModelAnatomy, setup: TrainingSetup, layout: Layout) -> int:
    """CPU RAM per GPU when the optimizer runs on the host (ZeRO-Offload, FSDP CPU offload): its states for this
    GPU's share of the trained parameters and an fp32 master copy of that share, all in fp32 (`anatomy`: the
    trained anatomy; attention does not enter the model states, so any set-up attention stands in fp32)."""
    fp32 = replace(setup, precision="fp32", attn="sdpa", offload_optimizer=False)
    states = model_states(anatomy, fp32, layout)
    return states.optimizer_states + states.gradients   # fp32 gradients: one fp32 copy of the trained share


def optimizer_notes(setup: TrainingSetup, engine: str) -> list[str]:
    """What the result says about the optimizer; engine "estimate", or "trace" / "measure" (the real step)."""
    notes = []
    if setup.optimizer in EIGHT_BIT_OPTIMIZERS:
        how = ("bitsandbytes' state layout, modelled analytically (its CUDA kernels cannot run on fake tensors: "
               "the trace uses an emulation with the same state tensors)" if engine == "estimate" else
               "bitsandbytes' CUDA kernels cannot run on fake tensors (nor is bitsandbytes a dependency): an llmem "
               "emulation allocates exactly bnb's state tensors and updates in place (fused kernel: no temporaries)")
        notes.append(f"{setup.optimizer}: {how}; blockwise uint8 state1/state2 + fp32 absmax per 256 elements, "
                     "fp32 states for parameters under 4096 elements, two shared 256-entry fp32 quantisation maps")
    if setup.optimizer == "paged-adamw-8bit":
        notes.append("paged-adamw-8bit: states of >= 1e5 elements are CUDA managed memory (cudaMallocManaged): "
                     "not in peak_allocated/peak_reserved (PyTorch's counters never see them) but in device_used "
                     "(component managed_memory), assumed resident on the GPU as the update prefetches them")
    if setup.optimizer == "adafactor":
        notes.append("adafactor: torch.optim.Adafactor's default for-loop implementation (torch does not default "
                     "it to foreach on CUDA); factored row/col second moments for >= 2-D parameters")
    if setup.optimizer == "lion":
        notes.append("lion: llmem.optimizers.Lion (the lion-pytorch update with foreach kernels)")
    if setup.optimizer_in_backward:
        notes.append("optimizer in backward: one optimizer per parameter stepped in its post-accumulate-grad hook; "
                     "its gradient is freed right after, states are created at the first backward")
    return notes


def _peak_of(events: list[tuple[int, int, int]]) -> int:
    held = peak = 0
    for sign, _tag, size in events:
        held += sign * size
        peak = max(peak, held)
    return peak


def param_storage_bytes(p: ParamInfo, setup: TrainingSetup, local: int) -> int:
    """Bytes a parameter is stored in on this GPU (`local` elements of it): bitsandbytes' layout for a quantised
    base weight (llmem.quant), else the set-up's dtype for trained / frozen parameters."""
    if is_quantised(p, setup.quant_base):
        return storage_bytes(p, setup.quant_base, setup.double_quant)
    return local * setup.stored_bytes(p.trainable)


def _is_embedding(p: ParamInfo) -> bool:
    return p.module_kind.endswith("Embedding")


def _fsdp_unit_numel(unit: list[ParamInfo], layout: Layout) -> int:
    """Unsharded size of an FSDP unit as all-gathered: each TP-local parameter padded to a multiple of dp."""
    total = 0
    for p in unit:
        shape = tp_local_shape(p, layout) or (1,)
        total += -(-shape[0] // layout.dp) * layout.dp * _prod(shape[1:])
    return total


# ---------------------------------------------------------------------------------------------------------------
# The step's peak

@dataclass(frozen=True)
class Moment:
    phase: str
    components: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.components.values())


@dataclass(frozen=True)
class LayerCosts:
    """Per-block bytes of one decoder layer, in forward order."""
    saved: tuple[int, ...]          # activations kept for backward (autocast weight copies excluded)
    copies: tuple[int, ...]         # autocast low-precision weight copies the block's linears keep
    grads_live: tuple[int, ...]     # gradient bytes the block's backward creates (unsharded under FSDP)
    transient: tuple[int, ...]


def layer_costs(anatomy: ModelAnatomy, setup: TrainingSetup, layout: Layout, act: ActivationProfile,
                regime) -> LayerCosts:
    """Assign layer 0's parameters to the activation recipe's blocks and price each block."""
    layer0 = [p for p in anatomy.params if p.layer_index == 0 and p.trainable]
    owner = {p.name: block_owner(act.blocks, p.name) for p in layer0}
    n = len(act.blocks)
    grads = [0] * n
    copies = [0] * n
    fsdp = layout.shards_model_states
    gather_bytes = setup.gather_bytes
    for p in layer0:
        i = owner[p.name]
        if fsdp:
            grads[i] += _fsdp_unit_numel([p], layout) * gather_bytes
        else:
            grads[i] += local_numel(p, layout) * setup.param_bytes
        if regime.autocast and p.module_kind in MATMUL_KINDS and not p.name.endswith("bias"):
            copies[i] += tp_local_numel(p, layout) * regime.mm
    transient = [b.transient + (copies[i] if regime.autocast else 0) for i, b in enumerate(act.blocks)]
    return LayerCosts(tuple(b.saved for b in act.blocks), tuple(copies), tuple(grads), tuple(transient))


def _walk_layer_backward(base: int, costs: LayerCosts, keep_copies: bool) -> int:
    """Backward through one layer's blocks in reverse; the peak inside the layer.

    `base` already holds everything outside this layer. Each block's backward allocates its weight gradients and
    a transient, then frees what the block kept for backward.
    """
    held = base + sum(costs.saved) + (sum(costs.copies) if keep_copies else 0)
    peak = held
    for i in reversed(range(len(costs.saved))):
        peak = max(peak, held + costs.grads_live[i] + costs.transient[i])
        held += costs.grads_live[i] - costs.saved[i] - (costs.copies[i] if keep_copies else 0)
    return peak


def step_moments(anatomy: ModelAnatomy, setup: TrainingSetup, layout: Layout, gpu: GpuSpec,
                 act: ActivationProfile | None = None, states: ModelStates | None = None) -> list[Moment]:
    """Memory at each moment where the step's peak can occur (second iteration: optimizer states exist).

    Forward end and loss backward are whole-model sums; the backward of the top and the bottom decoder layer is
    walked block by block (memory is linear in the layer index between them); then the embedding's backward and
    the optimizer step. `states`: the model states when the caller has them (they do not depend on the batch).
    """
    ms = states or model_states(anatomy, setup, layout)
    act = act or activation_profile(anatomy, setup, layout.method, layout.tp)
    regime = regime_for(setup, layout.method)
    costs = layer_costs(anatomy, setup, layout, act, regime)
    tokens_vocab = setup.batch_size * (setup.seq_len + virtual_tokens(anatomy)) * anatomy.vocab_size
    layers = anatomy.num_layers
    fsdp = layout.shards_model_states
    reshard = layout.method != "zero2"
    static = {
        "weights": ms.weights,
        "optimizer_states": ms.optimizer_states,
        "communication_buffers": ms.ddp_buckets,
        "cuda_workspaces": gpu.cublas_workspace_bytes,
    }
    layer_copies = sum(costs.copies)
    head_copy = ms.autocast_weight_copies - layers * layer_copies     # lm_head (and anything outside layers)
    root_gathered = ms.fsdp_root_gathered if fsdp else 0
    layer_gathered = ms.fsdp_layer_gathered if fsdp else 0
    all_layers_gathered = layers * layer_gathered if fsdp and not reshard else 0
    # layers that keep everything (not checkpointed) also keep their autocast weight copies
    full_layers = 0 if act.offload else layers - act.checkpointed_layers()   # offloaded: copies on the host
    outside = act.embed_saved + act.shared_saved if not act.offload else 0     # on the device during backward
    top_ckpt = act.checkpointed(layers - 1)
    gather_bytes = setup.gather_bytes
    # gradients alive during backward for the root parameters (lm_head, final norm; embedding when tied)
    head_params = [p for p in anatomy.params if p.layer_index is None and p.trainable
                   and (not _is_embedding(p) or p.tied_to is not None)]
    embed_params = [p for p in anatomy.params if p.layer_index is None and p.trainable and _is_embedding(p)
                    and p.tied_to is None]
    if fsdp:
        head_live = _fsdp_unit_numel(head_params, layout) * gather_bytes
        embed_live = _fsdp_unit_numel(embed_params, layout) * gather_bytes
    else:
        head_live = ms.head_grads + (ms.embed_grads if anatomy.tie_word_embeddings else 0)
        embed_live = ms.embed_grads - (ms.embed_grads if anatomy.tie_word_embeddings else 0)
    layer_final_grads = ms.layer_grads
    in_backward_head = 0
    if setup.optimizer_in_backward:
        # each hook steps its parameter and frees the gradient: no gradient outlives its own step. The head's
        # step (its gradient and the step's temporaries) is a moment of its own; later moments hold no head or
        # layer gradients, the embedding's moment its own gradient and step
        if anatomy.tie_word_embeddings:
            head_live = ms.embed_grads    # the tied weight's one hook waits for its embedding gradient
        else:
            in_backward_head = head_live + ms.optimizer_temporaries
            head_live = 0
            embed_live += ms.optimizer_temporaries
        layer_final_grads = 0

    moments: list[Moment] = []
    # 1. end of forward, inside the loss: logits, their fp32 upcast and the log-softmax output; autocast's cache
    fwd_loss = tokens_vocab * regime.mm + (tokens_vocab * F32 if regime.mm != F32 else 0) + tokens_vocab * F32
    if act.fused_ce is not None:     # chunked: the hidden states, the weight cast, the kept grads, one chunk
        fwd_loss = act.fused_ce.forward_peak_bytes
        head_copy = 0                # the loss's weight cast is freed at its end (counted in fwd_loss)
    gathered_fwd = root_gathered + all_layers_gathered
    saved_layers = act.device_layers_saved() + act.device_outside_saved
    moments.append(Moment("forward", {
        **static,
        "gathered_weights": gathered_fwd + ms.autocast_weight_copies + ms.autocast_bias_copies,
        "activations": saved_layers + act.mask_bytes,
        "logits_and_loss": fwd_loss,
    }))
    # 2. loss backward: three fp32 [tokens, vocab] tensors; the graph still holds the weight copies it saved
    kept_copies = head_copy + full_layers * layer_copies
    moments.append(Moment("backward", {
        **static,
        "gathered_weights": gathered_fwd + kept_copies,
        "activations": saved_layers,
        "logits_and_loss": act.loss_peak,
    }))
    if in_backward_head:   # the lm_head's hook: its gradient and step, the graph below still alive
        moments.append(Moment("backward", {
            **static,
            "gathered_weights": gathered_fwd + kept_copies - head_copy,
            "activations": saved_layers - act.head_saved,
            "gradients": in_backward_head,
        }))
    # 3. top decoder layer: head gradients exist; the layers below still hold their activations
    others = outside + act.device_layers_saved(layers - 1)
    other_copies = max(full_layers - (0 if top_ckpt else 1), 0) * layer_copies
    gathered_top = root_gathered + (all_layers_gathered or layer_gathered)
    prefetch = layer_gathered if fsdp and reshard and layers > 1 else 0
    base_top = sum(static.values()) + gathered_top + other_copies + head_live + others + prefetch
    top_peak = _walk_layer_backward(base_top, costs, keep_copies=regime.autocast)
    moments.append(_lump("backward", static, top_peak, {
        "gathered_weights": gathered_top + other_copies, "gradients": head_live,
        "communication_buffers": static["communication_buffers"] + prefetch}))
    # 4. bottom decoder layer: every other layer's final gradients exist
    below_grads = (layers - 1) * layer_final_grads
    rs_prev = ms.fsdp_layer_reduce if fsdp and layers > 1 else 0
    base_bottom = sum(static.values()) + root_gathered + (all_layers_gathered or layer_gathered) + head_live \
        + below_grads + outside + rs_prev
    bottom_peak = _walk_layer_backward(base_bottom, costs, keep_copies=regime.autocast)
    moments.append(_lump("backward", static, bottom_peak, {
        "gathered_weights": root_gathered + (all_layers_gathered or layer_gathered),
        "gradients": head_live + below_grads, "communication_buffers": static["communication_buffers"] + rs_prev}))
    # 5. embedding backward: all layer gradients final; the last layer's reduce-scatter may still be in flight
    all_layer_grads = layers * layer_final_grads
    tied_extra = 0
    if anatomy.tie_word_embeddings:
        # AccumulateGrad adds the embedding's gradient to the lm_head's one out of place: old + new + sum
        tied = [p for p in anatomy.params if _is_embedding(p) and p.tied_to is not None]
        tied_extra = 2 * (_fsdp_unit_numel(tied, layout) * gather_bytes if fsdp
                          else sum(local_numel(p, layout) for p in tied) * setup.param_bytes)
    embed_transient = tied_extra or embed_live
    moments.append(Moment("backward", {
        **static,
        "gathered_weights": root_gathered + all_layers_gathered,
        "gradients": all_layer_grads + head_live + embed_transient + ms.tp_embed_grad_excess,
        "activations": outside,
        "communication_buffers": static["communication_buffers"] + rs_prev,
    }))
    if fsdp:
        # the root's post-backward: its unsharded gradients, their reduce-scatter input and the sharded output
        # (FSDPParamGroup.post_backward reshards the root's parameters before the reduce)
        moments.append(Moment("backward", {
            **static,
            "gathered_weights": all_layers_gathered,
            "gradients": all_layer_grads + head_live + embed_live + ms.gradients - layers * layer_final_grads,
            "communication_buffers": static["communication_buffers"] + ms.fsdp_root_reduce,
        }))
    # 6. optimizer step: every gradient, the states and the implementation's temporaries
    if not setup.optimizer_in_backward:   # in backward: the step already happened, parameter by parameter
        moments.append(Moment("optimizer_step", {
            **static,
            "gradients": ms.gradients + ms.tp_embed_grad_excess,
            "optimizer_temporaries": ms.optimizer_temporaries,
        }))
    return moments


def _lump(phase: str, static: dict[str, int], total: int, known: dict[str, int]) -> Moment:
    """A moment whose total comes from a walk: the known parts by name, the rest is activations."""
    comps = {**static, **known}
    comps["activations"] = total - sum(comps.values())
    return Moment(phase, comps)


# ---------------------------------------------------------------------------------------------------------------

def estimate(setup: TrainingSetup, anatomy: ModelAnatomy | None = None, gpu: GpuSpec | None = None,
             *, draft: bool = False) -> MemoryResult:
    """Per-GPU peak memory of one training step: the three PyTorch counters and their breakdown.

    The step's tensors (from the moments' recipes) are laid out as an allocation schedule and replayed through the
    caching-allocator model, which gives max_memory_allocated (whole blocks) and max_memory_reserved (segments);
    the CUDA context and NCCL's buffers are added for device_used. `draft` extrapolates from shallower replays
    (4 and 8 layers): a few times faster, reserved less exact; searches use it and confirm with the full one.
    """
    anatomy = trained_anatomy(anatomy or load_anatomy(setup.model, setup.trust_remote_code), setup)
    gpu = gpu or resolve_gpu(setup.gpu, setup.gpu_memory, setup.cuda_context)
    layout = resolve_layout(setup.method, setup.gpus, setup.tp, setup.gpus_per_node,
                            anatomy.num_heads, anatomy.num_kv_heads)
    check_optimizer_method(setup, layout.method)   # before the activation recipes (peft / fused CE with TP)
    act = activation_profile(anatomy, setup, layout.method, layout.tp)
    ms = model_states(anatomy, setup, layout)
    moments = step_moments(anatomy, setup, layout, gpu, act, states=ms)
    rep = replayed_step(anatomy, setup, layout, act, gpu, DRAFT_FROM if draft else EXTRAPOLATE_FROM)
    context = outside_allocator_bytes(gpu, layout.world_size)
    components = dict.fromkeys(COMPONENTS, 0)
    components.update(rep.components)
    components["block_rounding"] = rep.peak_allocated_bytes - sum(rep.components.values())
    components["allocator_overhead"] = rep.peak_reserved_bytes - rep.peak_allocated_bytes
    components["cuda_context"] = context
    components["managed_memory"] = ms.optimizer_states_outside_allocator
    notes = optimizer_notes(setup, "estimate")
    if setup.offload_optimizer:
        notes.append(f"optimizer states offloaded: the CPU needs about "
                     f"{offloaded_optimizer_host_bytes(anatomy, setup, layout) / 1024**3:.1f} GiB of RAM per GPU for "
                     "them and the fp32 master copy of the trained parameters")
    notes += quant_notes(setup, anatomy)
    if not has_recipe(anatomy):
        notes.append(f"no activation recipe for model_type {anatomy.model_type!r}: the Llama recipe is used, so "
                     "activations are approximate (llmem trace gives the exact step)")
    notes.extend(activation_notes(setup))
    if act.offload:
        notes.append(f"activations offloaded: about {act.offloaded_bytes / 1024**3:.2f} GiB of pinned host memory per GPU")
    if anatomy.peft is not None:
        notes.extend(anatomy.peft.notes)
        if anatomy.peft.use_dora and setup.quant_base != "none":
            notes.append("DoRA on a quantised base: its weight norms are modelled as for an unquantised one (the "
                         "dequantised weight each forward), not checked against the trace")
    if not anatomy.supports_sdpa and setup.attn == "sdpa":
        notes.append(f"{anatomy.architecture} has no SDPA implementation in transformers: eager attention assumed")
    return MemoryResult(
        engine="llmem",
        peak_allocated_bytes=rep.peak_allocated_bytes,
        peak_reserved_bytes=rep.peak_reserved_bytes,
        device_used_bytes=rep.peak_reserved_bytes + context + ms.optimizer_states_outside_allocator,
        gpu_memory_bytes=gpu.memory_bytes,
        components=components,
        setup=resolved_setup(setup, anatomy, layout, gpu),
        peak_phase=rep.peak_phase,
        notes=notes,
        moments=[{"phase": m.phase, "allocated_bytes": m.total, "components": dict(m.components)} for m in moments],
    )


def quant_notes(setup: TrainingSetup, anatomy: ModelAnatomy) -> list[str]:
    """What the estimate says about a bitsandbytes-quantised base (its kernels are modelled, never run)."""
    if setup.quant_base == "none":
        return []
    quantised = [p for p in anatomy.params if is_quantised(p, setup.quant_base)]
    stored = sum(storage_bytes(p, setup.quant_base, setup.double_quant) for p in quantised)
    numel = sum(p.numel for p in quantised)
    kind = ("NF4 4-bit" + (", double-quantised constants" if setup.double_quant else ", fp32 absmax")
            if setup.quant_base == "nf4" else "LLM.int8")
    upcast = sum(p.numel for p in anatomy.params if not p.trainable and not is_quantised(p, setup.quant_base))
    notes = [f"bitsandbytes {kind} base: {numel / 1e9:.2f} B parameters in {stored / 1024**3:.2f} GiB "
             f"({8 * stored / max(numel, 1):.3f} bits each); bitsandbytes' kernels are modelled, not run "
             "(dequantisation transients in forward and backward included)",
             f"QLoRA recipe (peft's prepare_model_for_kbit_training): the {upcast / 1e9:.2f} B unquantised frozen "
             "parameters (embeddings, norms, lm_head) are fp32, and so is the residual stream"]
    if anatomy.family != "llama" and setup.mixed:
        notes.append(f"activations behind bitsandbytes' fp32-returning linears are modelled for the Llama family; "
                     f"for {anatomy.model_type!r} they are approximate (llmem trace gives the step)")
    return notes


def trained_anatomy(anatomy: ModelAnatomy, setup: TrainingSetup) -> ModelAnatomy:
    """Full fine-tuning trains every parameter; LoRA freezes them and adds adapters; --peft-config: the model peft
    builds from the config on the meta device (cached per model and config text)."""
    if setup.peft_config:
        return peft_anatomy(setup.model, setup.trust_remote_code, read_peft_config(setup.peft_config)[0])
    if setup.lora_rank:
        return with_lora(anatomy, setup.lora_rank, setup.lora_targets, setup.lora_dropout)
    return anatomy


@dataclass(frozen=True)
class PreparedStates:
    """What a search over batch sizes or sequence lengths can compute once: the trained anatomy, the layout and
    the model states (none of them depends on the micro-batch's shape)."""
    anatomy: ModelAnatomy
    layout: Layout
    states: ModelStates


def prepare_states(setup: TrainingSetup, anatomy: ModelAnatomy) -> PreparedStates:
    trained = trained_anatomy(anatomy, setup)
    layout = resolve_layout(setup.method, setup.gpus, setup.tp, setup.gpus_per_node,
                            trained.num_heads, trained.num_kv_heads)
    return PreparedStates(trained, layout, model_states(trained, setup, layout))


def quick_peak_allocated(setup: TrainingSetup, anatomy: ModelAnatomy, gpu: GpuSpec,
                         prepared: PreparedStates | None = None) -> int:
    """Tensor bytes at the step's largest moment, without the allocator replay (about 1 ms): for searches.
    `prepared`: prepare_states(setup, anatomy) for the same set-up up to batch size and sequence length."""
    prepared = prepared or prepare_states(setup, anatomy)
    return max(m.total for m in step_moments(prepared.anatomy, setup, prepared.layout, gpu,
                                             states=prepared.states))


EXACT_LAYERS = 40                 # models up to this depth are replayed whole
EXTRAPOLATE_FROM = (16, 24)       # deeper ones from these two depths, extrapolated (benchmarks/estimate_speed.md)
DRAFT_FROM = (4, 8)               # the planner's search estimates


def replayed_step(anatomy: ModelAnatomy, setup: TrainingSetup, layout: Layout, act: ActivationProfile,
                  gpu: GpuSpec, depths: tuple[int, int] = EXTRAPOLATE_FROM):
    """The step's allocation schedule through the allocator model (extrapolated in depth for deep models)."""
    from llmem.schedule import build_schedule, extrapolate, replay

    regime = regime_for(setup, layout.method)

    def run(layers: int | None):
        schedule = build_schedule(anatomy, setup, layout, act, regime, gpu.cublas_workspace_bytes, layers=layers)
        return replay(schedule, expandable_segments=setup.expandable_segments)

    small, large = depths
    if act.grad_ckpt and act.ckpt_every > 1:
        # every k-th layer checkpointed: replay depths congruent to the model's depth mod k, so the number of
        # checkpointed layers (ceil(depth / k)) and the top layer's kind grow linearly between them
        k, n = act.ckpt_every, anatomy.num_layers
        small, large = small + (n - small) % k, large + (n - large) % k
        large = large if large > small else small + k
    # tens of thousands of short-lived tuples: the cyclic garbage collector only adds pauses here
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        if anatomy.num_layers <= max(large, EXACT_LAYERS if depths == EXTRAPOLATE_FROM else large):
            return run(None)
        return extrapolate(run(small), run(large), small, large, anatomy.num_layers)
    finally:
        if was_enabled:
            gc.enable()


def resolved_setup(setup: TrainingSetup, anatomy: ModelAnatomy, layout: Layout, gpu: GpuSpec) -> dict:
    out = setup.to_dict()
    out.update({
        "model": anatomy.name, "model_type": anatomy.model_type, "total_params": anatomy.total_params,
        "trainable_params": anatomy.trainable_params, "method": layout.method, "dp": layout.dp, "tp": layout.tp,
        "gpus": layout.world_size, "gpus_per_node": layout.gpus_per_node, "nodes": layout.nodes,
        "gpu": gpu.name, "gpu_memory_bytes": gpu.memory_bytes, "cuda_context_bytes": gpu.cuda_context_bytes,
        "attn": setup.attn if anatomy.supports_sdpa else "eager",
    })
    return out
