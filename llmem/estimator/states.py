"""Model states per GPU: weights, gradients, optimizer states and step temporaries, and the method's buffers.

LLMem's model-state terms (paper §3-4) generalised to PyTorch-native training: the states follow the method's real
sharding (FSDP2 pads dim 0 to the data-parallel degree; DTensor tensor parallelism splits column/row-parallel
weights, rank 0 taking the larger chunk; llmem.model.sharding), the optimizer's states and step temporaries come
from its registry row (llmem.setup.optimizers), and the buffers are DDP's gradient buckets, FSDP2's gathered and
reduce-scatter units, and autocast's cached low-precision weight copies. None of it depends on the micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmem.errors import LlmemError
from llmem.memory.quant import check_quantisable, gathered_tensors, is_quantised, quant_args, storage_bytes
from llmem.model.anatomy import ParamInfo
from llmem.model.peft import buffer_bytes, element_bytes
from llmem.model.resolved import ResolvedSetup
from llmem.model.sharding import (
    MATMUL_KINDS,
    foreach_groups,
    fsdp_unit_numel,
    is_embedding,
    is_lm_head,
    local_numel,
    local_shape,
    tp_local_numel,
    tp_split_dim,
)
from llmem.setup.deepspeed import (
    bucket_buffers,
    param_partition_numel,
    partition_gradient_numels,
    partition_norm_numels,
    partition_numel,
    sub_group_numels,
    zero_config,
)
from llmem.setup.float8 import FP8, gathered_in_float8
from llmem.setup.layout import Layout
from llmem.setup.optimizers import OPTIMIZERS, OptimizerSpec, step_peak_bytes
from llmem.setup.precision import F32
from llmem.setup.training import TrainingSetup


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


def param_storage_bytes(p: ParamInfo, setup: TrainingSetup, local: int, layout: Layout | None = None) -> int:
    """Bytes a parameter is stored in on this GPU (`local` elements of it): the quantised layout of a quantised
    base weight (llmem.memory.quant: FSDP2's shard of its sharded tensors, the quantisation state replicated), else
    the set-up's dtype for trained / frozen parameters."""
    if is_quantised(p, setup.quant_base):
        shards = fsdp_shards(layout)
        check_quantisable(p, setup.quant_base, shards)
        return storage_bytes(p, setup.quant_base, quant_args(setup, shards > 1), shards)
    return local * element_bytes(p, setup)


def cpu_offload(r: ResolvedSetup) -> bool:
    """FSDP2's CPUOffloadPolicy (TrainingSetup.fsdp_cpu_offload)."""
    return r.setup.fsdp_cpu_offload


def steps_on_host(r: ResolvedSetup) -> bool:
    """The optimizer's states and update are on the host (TrainingSetup.steps_on_host)."""
    return r.setup.steps_on_host


def fsdp_shards(layout: Layout | None) -> int:
    """How many ranks FSDP2 shards a parameter over (1: not sharded)."""
    return layout.shard_degree if layout is not None else 1


def fsdp_gathered_tensors(p: ParamInfo, setup: TrainingSetup, layout: Layout) -> tuple[int, ...]:
    """Bytes of FSDP2's all-gather outputs for one parameter (FSDPParam.alloc_all_gather_outputs): a quantised
    weight's sharded tensors in their storage dtypes (llmem.memory.quant.gathered_tensors); any other parameter
    padded to a multiple of the shard degree, in MixedPrecisionPolicy's param_dtype under *-mixed, else in its own dtype (a kbit
    upcast's fp32 norms and embeddings stay fp32)."""
    if is_quantised(p, setup.quant_base):
        return gathered_tensors(p.shape, setup.quant_base, quant_args(setup, True), layout.shard_degree,
                                p.module_kind == "Conv1D")
    per = setup.gather_bytes if setup.mixed else element_bytes(p, setup)
    if gathered_in_float8(setup, p):     # torchao's float8 all-gather (llmem.setup.float8)
        per = FP8
    return (fsdp_unit_numel([p], layout) * per,)


def by_bytes(params: list[ParamInfo], pb: dict[str, int]) -> list[tuple[int, list[ParamInfo]]]:
    """`params` split by bytes per element (in order of first appearance): one group when all share a dtype."""
    groups: dict[int, list[ParamInfo]] = {}
    for p in params:
        groups.setdefault(pb[p.name], []).append(p)
    return list(groups.items())


# torch.optim on CPU tensors: no foreach kernels there (_default_to_fused_or_foreach), so a foreach row steps its
# for-loop implementation on the host
HOST_IMPLEMENTATION = {"adamw": "adamw-forloop"}


def per_parameter_temporaries(r: ResolvedSetup, trainable: list[ParamInfo], spec: OptimizerSpec | None = None
                              ) -> int:
    """The step's temporaries when it runs one parameter at a time (an optimizer per parameter, or torch's for-loop
    implementation): those of the largest single parameter (`spec`: the optimizer row, the set-up's by default)."""
    setup, layout, spec = r.setup, r.layout, spec or r.optimizer
    return max((step_peak_bytes(spec.part(p).step_events([local_shape(p, layout)], element_bytes(p, setup),
                                                         layout.shard_degree)) for p in trainable), default=0)


def _optimizer_bytes(r: ResolvedSetup, trainable: list[ParamInfo]) -> tuple[int, int, int]:
    """(device states, step temporaries, states outside the allocator) of the trained parameters."""
    setup, layout, spec = r.setup, r.layout, r.optimizer
    if steps_on_host(r):
        return 0, 0, 0                 # states and the update live on the CPU (ZeRO-Offload / FSDP)
    kinds = param_kinds(trainable)
    by_kind = {p.kind: (element_bytes(p, setup), local_shape(p, layout)) for p, _ in kinds}
    pb = {p.name: by_kind[p.kind][0] for p in trainable}        # peft's fp32 adapters on a bf16 base: 4
    shards = layout.shard_degree                                 # FSDP2's DTensor shards of dim 0
    shapes = {p.name: by_kind[p.kind][1] for p in trainable}
    states = sum(n * sum(spec.part(p).states(*by_kind[p.kind][::-1])) for p, n in kinds)
    states += spec.shared_state_bytes([shapes[p.name] for p in trainable], setup.optimizer_in_backward)
    outside = sum(n * spec.outside_allocator_bytes(by_kind[p.kind][1]) for p, n in kinds) if spec.paged else 0
    if setup.optimizer_in_backward:
        # one optimizer per parameter: the step's temporaries are those of the largest single parameter
        temporaries = per_parameter_temporaries(r, trainable)
    else:
        # per parameter group (fused AdamW, SGD and bitsandbytes' fused 8-bit kernels: none); a composite's parts
        # step one after the other
        # (foreach kernels group their tensors by dtype too: torch's _group_tensors_by_device_and_dtype)
        temporaries = max((step_peak_bytes(part.step_events([shapes[p.name] for p in ps], n, shards))
                           for g in foreach_groups(trainable, layout) for n, dg in by_bytes(g, pb)
                           for part, ps in spec.split(dg)), default=0)
    return states, temporaries, outside


def _autocast_copies(r: ResolvedSetup) -> tuple[int, int]:
    """(weight, bias) bytes of autocast's low-precision copies: autocast casts every weight a matmul uses (cached
    when it requires grad, cast again per use when frozen) and linear keeps the cast for the input gradient."""
    setup, regime = r.setup, r.regime
    if not regime.autocast:
        return 0, 0
    weights = biases = 0
    for p, count in param_kinds(r.anatomy.params):
        if not (p.module_kind in MATMUL_KINDS or is_lm_head(p)):
            continue
        if element_bytes(p, setup) == regime.mm or is_quantised(p, setup.quant_base):
            continue                 # a weight stored in the compute dtype (or quantised) needs no cast
        n = count * tp_local_numel(p, r.layout) * regime.mm
        if p.name.endswith("bias"):
            biases += n
        else:
            weights += n
    return weights, biases


def param_kinds(params) -> list[tuple[ParamInfo, int]]:
    """`params` by kind (ParamInfo.kind: what the per-parameter facts read, the decoder layer aside), each as its
    first parameter and how many share it, in order: a sum of a per-parameter fact is a sum over kinds."""
    counts: dict[tuple, list] = {}
    for p in params:
        seen = counts.get(p.kind)
        if seen is None:
            counts[p.kind] = [p, 1]
        else:
            seen[1] += 1
    return [(p, n) for p, n in counts.values()]


def zero_model_states(r: ResolvedSetup) -> ModelStates:
    """Model states of DeepSpeed's engine (llmem.estimator.deepspeed lays them out), in ModelStates' fields: weights
    the module in its bf16 / fp16 (stage 3: this rank's partitions and the persistent parameters whole) and the
    fp32 master partition; gradients the partition's gradients (held from the end of backward to the step; stage 3's
    buffer always); optimizer_states the optimizer's over the fp32 partition; optimizer_temporaries the step's
    largest moment (flattened and fp32 gradients, the fp64 norm, the optimizer's temporaries); ddp_buckets the IPG
    buffers; layer_grads the reduction's flattened copy of a bucket; fsdp_layer_gathered stage 3's gathered
    parameters (all of them when DeepSpeed's reuse distance keeps every layer gathered, else one layer)."""
    zero = zero_config(r.setup, r.method.zero_stage, r.anatomy.hidden_size)
    params, dp, mb = r.anatomy.params, r.layout.dp, r.setup.compute_bytes
    trainable = [p for p in params if p.trainable]
    numels = [p.numel for p in trainable]
    part = partition_numel(numels, zero.stage, dp)
    pieces = partition_gradient_numels(numels, zero.stage, dp)     # the gradients rank 0's step reads
    offload = zero.offload_optimizer
    master = 0 if offload else part * F32
    if zero.stage == 3:
        persistent = sum(p.numel for p in params if p.numel <= zero.param_persistence_threshold)
        on_device = 0 if zero.offload_param else sum(param_partition_numel(p.numel, dp) for p in params)
        weights = (on_device + persistent) * mb + master
        groups = sub_group_numels(pieces, zero.sub_group_size)
        grads = 0 if offload else part * mb
        layer = max((sum(p.numel for p in params if p.layer_index == i) for i in range(r.anatomy.num_layers)),
                    default=0)
        total = sum(p.numel for p in params if p.numel > zero.param_persistence_threshold)
        gathered = (total if 2 * total < zero.max_reuse_distance else layer) * mb
    else:
        weights = (sum(p.numel for p in params if not p.trainable) + part * dp) * mb + master
        groups = [part]
        grads = sum(pieces) * mb
        gathered = 0
    states = 0 if offload else sum(sum(r.optimizer.states((g,), F32)) for g in groups)
    biggest = max(groups, default=0)
    step = 0 if offload else max(biggest * (mb + F32) + (grads if zero.stage < 3 else 0),
                                 biggest * F32 + step_peak_bytes(r.optimizer.step_events([(biggest,)], F32, 1)),
                                 8 * max(partition_norm_numels(numels, zero.stage, dp), default=0))
    buckets = bucket_buffers(zero) * zero.reduce_bucket_size * mb
    flattened = min(sum(numels), zero.reduce_bucket_size) * mb
    weights += sum(b.numel for b in r.anatomy.buffers) * mb    # an adapter's buffers, cast with the module, whole
    return ModelStates(weights, grads, states, step, buckets, 0, 0, 0, flattened, 0, 0, gathered, 0, 0, 0)


def check_cpu_offload(r: ResolvedSetup) -> None:
    """FSDP2's CPUOffloadPolicy is modelled over plain parameters and the quantised storage it offloads as one
    (QuantBaseSpec.host_offload: bitsandbytes' NF4 packed in the compute dtype, FSDP-QLoRA)."""
    why = r.setup.quant_spec.host_offload_refusal(r.layout.method) if cpu_offload(r) else None
    if why is not None:
        raise LlmemError(why)


def offload_resident_bytes(r: ResolvedSetup) -> int:
    """What CPUOffloadPolicy leaves on the GPU of the model's storage: a quantised weight's replicated quantisation
    state (bitsandbytes' absmax and constants: attributes of Params4bit, not FSDP2's sharded parameters)."""
    setup, args = r.setup, quant_args(r.setup, True)
    return sum(storage_bytes(p, setup.quant_base, args, fsdp_shards(r.layout), offloaded=True)
               for p in r.anatomy.params if is_quantised(p, setup.quant_base))


def cpu_offloaded_states(ms: ModelStates, resident_bytes: int = 0) -> ModelStates:
    """Model states under CPUOffloadPolicy: the sharded parameters and gradients (FSDPParam._init_sharded_param
    pins them on the host; foreach_reduce copies each sharded gradient there) and the optimizer leave the device
    (`resident_bytes` of the weights stay: offload_resident_bytes); the gathered units and their reduce-scatter
    buffers stay."""
    return replace(ms, weights=resident_bytes, gradients=0, optimizer_states=0, optimizer_temporaries=0,
                   layer_grads=0, head_grads=0, embed_grads=0, optimizer_states_outside_allocator=0)


def model_states(r: ResolvedSetup) -> ModelStates:
    if r.method.zero_stage is not None:
        return zero_model_states(r)
    check_cpu_offload(r)
    setup, layout, params = r.setup, r.layout, r.anatomy.params
    trainable = [p for p in params if p.trainable]
    kinds = param_kinds(params)        # the parameters by kind (identical layers' alike), with their counts
    local = {p.kind: local_numel(p, layout) for p, _ in kinds}
    pb = {p.kind: element_bytes(p, setup) for p, _ in kinds if p.trainable}   # a gradient in its parameter's dtype
    weights = sum(n * param_storage_bytes(p, setup, local[p.kind], layout) for p, n in kinds) \
        + sum(buffer_bytes(b, setup) for b in r.anatomy.buffers)      # an adapter's buffers: whole on every rank
    grads = sum(n * local[p.kind] * pb[p.kind] for p, n in kinds if p.trainable)
    opt_states, opt_temp, opt_outside = _optimizer_bytes(r, trainable)
    ddp_buckets = grads if r.method.gradient_buckets else 0   # gradient_as_bucket_view=False: a second copy
    ac_w, ac_b = _autocast_copies(r)

    head = [p for p in trainable if p.layer_index is None and not is_embedding(p)]
    embed = [p for p in trainable if p.layer_index is None and is_embedding(p)]
    layer0 = [p for p in trainable if p.layer_index == 0]
    head_grads = sum(local[p.kind] * pb[p.kind] for p in head)
    embed_grads = sum(local[p.kind] * pb[p.kind] for p in embed)
    layer_grads = sum(local[p.kind] * pb[p.kind] for p in layer0)

    root_gathered = layer_gathered = layer_reduce = root_reduce = 0
    if layout.shards_model_states:
        reduce_bytes = setup.reduce_bytes
        root = [p for p in params if p.layer_index is None]
        # --shard-embeddings: the embedding is its own unit, gathered around its forward and backward only (the
        # lm_head's unit is gathered over the loss, the moments' peak: counted with the root's)
        gathered_root = [p for p in root if not (setup.shard_embeddings and is_embedding(p) and p.tied_to is None)]
        layer0_all = [p for p in params if p.layer_index == 0]
        layer_gathered = sum(sum(fsdp_gathered_tensors(p, setup, layout)) for p in layer0_all)
        root_gathered = sum(sum(fsdp_gathered_tensors(p, setup, layout)) for p in gathered_root)
        layer_reduce = fsdp_unit_numel(layer0, layout) * reduce_bytes
        root_reduce = fsdp_unit_numel([p for p in root if p.trainable], layout) * reduce_bytes
    tp_excess = 0
    if layout.tp > 1:
        for p in embed:
            if tp_split_dim(p) == 0:
                tp_excess += (p.numel // layout.shard_degree - tp_local_numel(p, layout)) * pb[p.kind]
    states = ModelStates(weights, grads, opt_states, opt_temp, ddp_buckets, ac_w, ac_b, head_grads, layer_grads,
                         embed_grads, root_gathered, layer_gathered, layer_reduce, root_reduce, max(tp_excess, 0),
                         opt_outside)
    return cpu_offloaded_states(states, offload_resident_bytes(r)) if cpu_offload(r) else states


def zero_host_bytes(r: ResolvedSetup) -> int:
    """CPU RAM per GPU of DeepSpeed's offload (pinned by default): under offload_optimizer the fp32 master
    partition, its fp32 gradient, the optimizer's states and the bf16 staging copy (stage_1_and_2.py
    param_buffer_of_bit16_for_cpu_offload_groups; stage 3 the same per sub-group); under offload_param the bf16
    partitions as well."""
    zero = zero_config(r.setup, r.method.zero_stage, r.anatomy.hidden_size)
    dp, mb = r.layout.dp, r.setup.compute_bytes
    part = partition_numel([p.numel for p in r.anatomy.params if p.trainable], zero.stage, dp)
    host = 0
    if zero.offload_optimizer:
        host += part * (F32 + F32 + mb) + sum(r.optimizer.states((part,), F32))
    if zero.offload_param:
        host += sum(param_partition_numel(p.numel, dp) for p in r.anatomy.params) * mb
    return host


def offloaded_optimizer_host_bytes(r: ResolvedSetup) -> int:
    """CPU RAM per GPU when the optimizer runs on the host (ZeRO-Offload, FSDP CPU offload): its states for this
    GPU's share of the trained parameters and an fp32 master copy of that share, all in fp32 (attention does not
    enter the model states, so any set-up attention stands in fp32)."""
    if r.method.zero_stage is not None:
        return zero_host_bytes(r)
    if cpu_offload(r):
        return cpu_offload_host_bytes(r).total
    fp32 = replace(r.setup, precision="fp32", attn="sdpa", offload_optimizer=False)
    states = model_states(ResolvedSetup(fp32, r.anatomy, r.base, r.gpu, r.layout))
    return states.optimizer_states + states.gradients   # fp32 gradients: one fp32 copy of the trained share


@dataclass(frozen=True)
class HostBytes:
    """Host RAM per GPU under FSDP2's CPUOffloadPolicy: what the device would otherwise hold of the model states."""
    pinned: int            # the sharded parameters and gradients (CPUOffloadPolicy(pin_memory=True))
    optimizer: int         # the optimizer's states and its step's largest temporaries (pageable)

    @property
    def total(self) -> int:
        return self.pinned + self.optimizer


def cpu_offload_host_bytes(r: ResolvedSetup) -> HostBytes:
    """CPUOffloadPolicy's host side: this rank's padded shards of every parameter in its stored dtype (fp32 masters
    under *-mixed), their sharded gradients (foreach_reduce's output cast to the parameter dtype, copied to pinned
    memory) and the optimizer stepping them there: its states as on the device, its temporaries one parameter's
    (HOST_IMPLEMENTATION: torch.optim's for-loop implementation, its default for CPU tensors)."""
    on_device = ResolvedSetup(replace(r.setup, offload_param=False, offload_optimizer=False), r.anatomy, r.base,
                              r.gpu, r.layout)
    ms = model_states(on_device)
    host = OPTIMIZERS[HOST_IMPLEMENTATION.get(r.optimizer.name, r.optimizer.name)]
    step = per_parameter_temporaries(on_device, [p for p in r.anatomy.params if p.trainable], host)
    return HostBytes(ms.weights - offload_resident_bytes(r) + ms.gradients, ms.optimizer_states + step)
