"""Distributed plumbing: one rank (rank 0) of the target world on a fake process group, and the methods applied
through PyTorch's own APIs (DDP, FSDP2 `fully_shard`, DTensor `parallelize_module`) as each method's row says.

On the fake process group collectives do nothing, but every buffer a method allocates (DDP buckets, FSDP2's
all-gather / reduce-scatter buffers, DTensor redistributions) is still a tensor. Each patch here restores what it
replaced on exit.

FSDP2's CPUOffloadPolicy (--offload-param) on fake tensors: host and device are one fake cpu device, so the sharded
parameters are made inside `region(HOST)` (the ledger counts no host tensor), and the two copies that the one
device turns into no-ops are made explicitly: FSDPParam.all_gather_inputs' host -> device copy of each shard
(`_HostShardedParam`, a subclass the FSDPParams are switched to) and foreach_reduce's device -> host copy of each
sharded gradient (`_gradients_to_host`, after the group's post-backward). Pinning a fake tensor (FSDPParam's
`pin_memory()`) is the fake mode's: llmem.runtime.ledger.TracingFakeMode returns it as it is.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from llmem.errors import LlmemError
from llmem.model.families import decoder_layers, tp_plan_of
from llmem.model.vision import under, vision_spec
from llmem.runtime.expert_parallel import efsdp_mesh_of, expert_placement, forward_prefetch
from llmem.runtime.ledger import HOST
from llmem.runtime.patches import patched
from llmem.setup.layout import Layout


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise LlmemError("a process group is already initialised in this process: llmem emulates rank 0 on its own"
                         " fake process group")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def dtensor_propagation_untracked() -> Iterator[None]:
    """DTensor's sharding propagation builds global-shape shadow tensors in `detect_fake_mode() or FakeTensorMode()`.
    Under our fake mode those would be counted as real allocations: give them their own fake mode instead."""
    from torch.distributed.tensor import _sharding_prop

    with patched(_sharding_prop, "detect_fake_mode", lambda *a, **k: None):
        yield


@contextlib.contextmanager
def device_mesh_outside_fake() -> Iterator[None]:
    """DeviceMesh bookkeeping (rank tensors) must run on real tensors, also when fully_shard slices a 2-D mesh
    inside the fake mode (FSDP2 over TP)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed import _mesh_layout, device_mesh

    DeviceMesh = device_mesh.DeviceMesh

    def outside(fn):
        def wrapper(*args, **kwargs):
            with unset_fake_temporarily():
                return fn(*args, **kwargs)
        return wrapper

    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(DeviceMesh, "__init__", outside(DeviceMesh.__init__)))
        if hasattr(DeviceMesh, "_concatenate"):
            stack.enter_context(patched(DeviceMesh, "_concatenate",
                                         staticmethod(outside(DeviceMesh._concatenate))))
        mesh_prop = DeviceMesh.__dict__.get("mesh")
        if isinstance(mesh_prop, property):
            stack.enter_context(patched(DeviceMesh, "mesh", property(outside(mesh_prop.fget))))
        layout = getattr(_mesh_layout, "_MeshLayout", None)
        if layout is not None and hasattr(layout, "remap_to_tensor"):
            stack.enter_context(patched(layout, "remap_to_tensor", outside(layout.remap_to_tensor)))
        # reshard_after_forward=N: fully_shard views the mesh's rank tensor into the post-forward mesh's
        from torch.distributed.fsdp._fully_shard import _fully_shard
        stack.enter_context(patched(_fully_shard, "_get_post_forward_mesh_info",
                                    outside(_fully_shard._get_post_forward_mesh_info)))
        yield


@contextlib.contextmanager
def ddp_on_fake_pg() -> Iterator[None]:
    """DDP's constructor checks and broadcasts module states across ranks (nothing to do for one emulated rank, and
    impossible on fake tensors)."""
    from torch.nn.parallel import distributed as pd

    noop = lambda *a, **k: None  # noqa: E731
    with patched(pd, "_verify_param_shape_across_processes", noop), patched(pd, "_sync_module_states", noop):
        yield


class _ReducerProxy:
    """DDP reducer whose `_rebuild_buckets` does nothing (it reads tensor data, which fake tensors lack).
    The buckets keep their first-iteration layout: the same total size (4 B x P for fp32 grads)."""

    def __init__(self, reducer) -> None:
        object.__setattr__(self, "_reducer", reducer)

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._reducer, name)

    def __setattr__(self, name, value):
        setattr(self._reducer, name, value)


def _completed_future_hook(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def layer_list(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder layers (llmem.model.families' rule)."""
    found = decoder_layers(model)
    if found is None:
        raise LlmemError(f"{type(model).__name__} has no list of decoder layers")
    return found[1]


def tp_plan(model: nn.Module, model_type: str, sequence_parallel: bool = False,
            loss_parallel: bool = False) -> dict[str, object]:
    """parallelize_module's plan: each decoder layer's column- and row-parallel modules from the family's row,
    the embedding row-parallel (vocab-split) and the lm_head column-parallel (vocab-split).

    Plain (Megatron) TP: the embedding's output and the lm_head's logits replicated (the logits all-gathered).
    --sequence-parallel, as torchtitan's parallelize_llama applies it (torchtitan/models/llama3/infra/
    parallelize.py; torch/distributed/tensor/parallel/style.py): the embedding's output Shard(1) (a reduce-scatter),
    the norms SequenceParallel (their input and output sharded on the sequence), each TP region's input gathered by
    PrepareModuleInput(Shard(1) -> Replicate()), o_proj / down_proj RowwiseParallel(output_layouts=Shard(1)) (a
    reduce-scatter), the final norm SequenceParallel and the lm_head's input Shard(1). Where torchtitan hands local
    tensors on (its rotary table is precomputed for the whole sequence), HF's model reads the sequence length off
    the embedding's output, so the residual stream stays a DTensor (use_local_output=False): the same local shards.
    --loss-parallel: the lm_head's logits Shard(-1) as a DTensor, for cross_entropy under loss_parallel()."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    family = tp_plan_of(model_type)
    layers = layer_list(model)
    prefix = next(n for n, m in model.named_modules() if m is layers)
    sp = sequence_parallel
    plan: dict[str, object] = {}
    for i in range(len(layers)):
        plan.update({f"{prefix}.{i}.{n}": ColwiseParallel() for n in family.colwise})
        plan.update({f"{prefix}.{i}.{n}": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
                     if sp else RowwiseParallel() for n in family.rowwise})
        if sp:
            plan.update({f"{prefix}.{i}.{n}": SequenceParallel() for n in family.sp_norms})
            for region, arg in family.sp_regions:
                plan[f"{prefix}.{i}.{region}"] = (
                    PrepareModuleInput(input_kwarg_layouts={arg: Shard(1)},
                                       desired_input_kwarg_layouts={arg: Replicate()}) if isinstance(arg, str) else
                    PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)))
    # a pipeline stage without the embedding or the head (llmem.runtime.pipeline.split_model: None / Identity)
    embed = next((n for n, m in model.named_modules() if m is model.get_input_embeddings()), None)
    if embed is not None:
        plan[embed] = (RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
                       if sp else RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    if sp:
        plan[final_norm_name(model, prefix)] = SequenceParallel()
    head = next((n for n, m in model.named_modules() if m is model.get_output_embeddings()
                 and not isinstance(m, nn.Identity)), None)
    if head is not None:
        plan[head] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                     output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                     use_local_output=not loss_parallel)
    return plan


def final_norm_name(model: nn.Module, layers_prefix: str) -> str:
    """The final norm: the decoder stack's `norm` next to its layer list (HF's LlamaModel.norm)."""
    stack = layers_prefix.rsplit(".", 1)[0]
    name = f"{stack}.norm" if stack != layers_prefix else "norm"
    if name not in dict(model.named_modules()):
        raise LlmemError(f"--sequence-parallel: {type(model).__name__} has no final norm at {name}")
    return name


def _divide_local_heads(model: nn.Module, tp: int) -> None:
    """Attention modules that view q/k/v with their configured head count need the per-rank count under TP."""
    for module in model.modules():
        for attr in ("num_heads", "num_key_value_heads"):
            value = module.__dict__.get(attr)
            if isinstance(value, int) and value % tp == 0 and hasattr(module, "head_dim"):
                setattr(module, attr, value // tp)


def apply_tensor_parallel(model: nn.Module, tp_mesh, tp: int, sequence_parallel: bool = False,
                          loss_parallel: bool = False) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    model_type = model.config.model_type
    plan = tp_plan(model, model_type, sequence_parallel, loss_parallel)
    tied = getattr(model.config, "tie_word_embeddings", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parallelize_module(model, tp_mesh, plan)
    if tp_plan_of(model_type).local_heads:
        _divide_local_heads(model, tp)
    if tied:
        # embed (rowwise: Shard(0) over vocab) and lm_head (colwise: Shard(0) over vocab) shard the same way
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        if out is not None and out.weight is not inp.weight and out.weight.placements == inp.weight.placements:
            out.weight = inp.weight


def apply_fsdp(model: nn.Module, mesh, setup, reshard: bool | int, region=None) -> None:
    """fully_shard a vision-language model's vision blocks (vision_units), each decoder layer, then the root; under *-mixed FSDP2's MixedPrecisionPolicy (low-precision
    parameters gathered, fp32 gradients reduced); under --offload-param its CPUOffloadPolicy (pinned, the default),
    on fake tensors only (`region`: the ledger's, for the host side). `reshard`: reshard_after_forward, an int N
    reshards each layer to N ranks after forward (its post-forward shards labelled gathered weights)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kw: dict = {"mesh": mesh, "reshard_after_forward": reshard}
    if setup.mixed:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, setup.compute_dtype),
                                               reduce_dtype=torch.float32)
    host = contextlib.nullcontext()
    if setup.offload_param:
        why = setup.quant_spec.host_offload_refusal(setup.method)
        if why is not None:
            raise LlmemError(why)
        if next(model.parameters()).is_meta:
            raise LlmemError("--offload-param under FSDP2 is traced, not measured: FSDP2's CPUOffloadPolicy needs "
                             "the model materialised on the host (use llmem trace, or the exported torchrun script)")
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
        host = region(HOST) if region is not None else host
    with host:           # the sharded parameters: FSDPParam._init_sharded_param's .cpu().pin_memory()
        efsdp = efsdp_mesh_of(model)     # --ep: the routed experts on their own mesh (llmem.runtime.expert_parallel)
        for unit in vision_units(model):   # a vision-language model's tower, as accelerate's auto-wrap shards it
            fully_shard(unit, **kw)
        for layer in layer_list(model):
            placement = expert_placement(layer, efsdp) if efsdp is not None else None
            fully_shard(layer, **kw, **({"shard_placement_fn": placement} if placement else {}))
        for module in own_units(model, setup):       # --shard-embeddings: torchtune's custom_sharded_layers
            fully_shard(module, **kw)
        # the root as users write it: fully_shard's default (None) keeps the root gathered from forward to backward
        fully_shard(model, **{**kw, "reshard_after_forward": None if reshard else False})
        if efsdp is not None:
            forward_prefetch(model, layer_list(model))
    if setup.offload_param and region is not None:
        emulate_host_copies(model, region)
    if not isinstance(reshard, bool) and region is not None:
        label_post_forward_shards(model, region)


def vision_units(model: nn.Module) -> list[nn.Module]:
    """A vision-language model's FSDP2 units in its vision encoder, in module order: the modules there whose class
    the model names in `_no_split_modules` (transformers gathers its sub-models' lists: Qwen2.5-VL's vision blocks,
    Gemma 3's SigLIP encoder layers and its SiglipVisionEmbeddings), as accelerate's fsdp2_prepare_model wraps them
    (fsdp2_prepare_auto_wrap_policy: transformer_auto_wrap_policy over `_no_split_modules`). The projector and the
    rest of the tower stay in the root unit. [] for a text-only model."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    spec = vision_spec(getattr(lm.config, "model_type", ""))
    if spec is None:
        return []
    classes = set(getattr(lm, "_no_split_modules", None) or ())
    return [m for name, m in lm.named_modules() if under(name, spec.vision) and type(m).__name__ in classes]


def own_units(model: nn.Module, setup) -> list[nn.Module]:
    """--shard-embeddings: the input embedding and the lm_head, each fully_shard as a unit of its own before the
    root (torchtune's shard_model with custom_sharded_layers ['tok_embeddings', 'output']); a tied lm_head refused."""
    if not setup.shard_embeddings:
        return []
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or head.weight is embed.weight:
        raise LlmemError("--shard-embeddings needs an untied lm_head module (torchtune's TiedLinear is none): drop "
                         "--shard-embeddings")
    return [embed, head]


def label_post_forward_shards(model: nn.Module, region) -> None:
    """reshard_after_forward=N: FSDPParamGroup._to_sharded_post_forward's clones (FSDPParam.to_sharded_post_forward:
    the rank's 1/N of each all-gather output, kept until backward's copy-out) are gathered weights."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        if group is None or not group._use_post_forward_mesh:
            continue
        to_post_forward = group._to_sharded_post_forward

        def labelled(to_post_forward=to_post_forward) -> None:
            with region("gathered_weights"):
                to_post_forward()

        group._to_sharded_post_forward = labelled


def _offloaded_groups(model: nn.Module) -> Iterator:
    """The FSDPParamGroups of `model`'s fully_shard modules that offload to the CPU."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None and all(p.offload_to_cpu for p in group.fsdp_params):
                yield group


def _host_sharded_param_class():
    """FSDPParam whose all-gather input of a sharded (host) parameter is first copied to the device, as
    FSDPParam.all_gather_inputs does (`sharded_param_data.to(self.device, non_blocking=True)`, then the cast to
    param_dtype): on the one fake device that copy would return the host tensor itself."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _to_dtype_if_needed
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState

    class _HostShardedParam(FSDPParam):
        @property
        def all_gather_inputs(self) -> list[torch.Tensor]:
            if self.sharded_state != ShardedState.SHARDED or hasattr(self._sharded_local_tensor,
                                                                      "fsdp_pre_all_gather"):
                return super().all_gather_inputs
            on_device = self._sharded_param_data.clone()      # the host -> device copy, on the copy-in stream
            return [_to_dtype_if_needed(on_device, self.param_dtype)]

    return _HostShardedParam


def _gradients_to_host(group, region) -> None:
    """After the group's post-backward, each sharded gradient (a view of the reduce-scatter output on the device)
    copied to the host, as foreach_reduce does under CPUOffloadPolicy (`new_sharded_grad.to("cpu")`): the device
    output then dies with its last view, as it does when foreach_reduce returns."""
    post_backward = group.post_backward

    def post_backward_to_host(*args, **kwargs):
        out = post_backward(*args, **kwargs)
        with region(HOST):
            for fsdp_param in group.fsdp_params:
                grad = fsdp_param.sharded_param.grad
                if grad is not None and not getattr(grad, "_llmem_on_host", False):
                    host = fsdp_param.to_sharded_dtensor(grad._local_tensor.clone())
                    host._llmem_on_host = True
                    fsdp_param.sharded_param.grad = host
        return out

    group.post_backward = post_backward_to_host


def emulate_host_copies(model: nn.Module, region) -> None:
    """The host <-> device copies of FSDP2's CPUOffloadPolicy on the one fake device (module docstring)."""
    cls = _host_sharded_param_class()
    for group in _offloaded_groups(model):
        for fsdp_param in group.fsdp_params:
            fsdp_param.__class__ = cls
        _gradients_to_host(group, region)


def device_mesh(layout: Layout, device_type: str):
    """The layout's device mesh (its method's dimensions: dp for FSDP2, tp for tensor parallelism), or None."""
    from torch.distributed.device_mesh import init_device_mesh

    dims = layout.mesh_shape
    if not dims:
        return None
    return init_device_mesh(device_type, tuple(n for _, n in dims), mesh_dim_names=tuple(d for d, _ in dims))


def tp_submesh(layout: Layout, mesh):
    """The mesh tensor parallelism runs on: the tp dimension of a larger mesh, or the whole one."""
    return mesh["tp"] if len(layout.mesh_shape) > 1 else mesh


def fsdp_submesh(layout: Layout, mesh):
    """The mesh fully_shard takes: its data-parallel dimensions (HSDP: dp_replicate x dp_shard, so FSDP2 shards
    over dp_shard and replicates over the other), or the whole mesh."""
    dp_dims = tuple(d for d, _ in layout.mesh_shape if d not in ("tp", "pp"))
    if layout.cp > 1:    # torchtitan's "fsdp" mesh: dp_shard and cp flattened into one dimension FSDP2 shards over
        return mesh[dp_dims]._flatten("dp_shard_cp")
    return mesh[dp_dims] if len(layout.mesh_shape) > 1 else mesh


def apply_method(model: nn.Module, layout: Layout, mesh, setup, region, fake_pg: bool) -> nn.Module:
    """Apply the layout's method as its row says: DDP wraps the model (its reducer's buckets allocated under
    `region("communication_buffers")`); tensor parallelism and FSDP2 shard it in place (TP first, then FSDP2 over
    the dp dimension). Returns the module the step calls."""
    spec = layout.spec
    if spec.gradient_buckets:
        from torch.nn.parallel import DistributedDataParallel as DDP

        dev = next(model.parameters()).device
        with region("communication_buffers"):
            ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
        if fake_pg:
            ddp.register_comm_hook(None, _completed_future_hook)
            ddp.reducer = _ReducerProxy(ddp.reducer)
        return ddp
    if spec.has_tp:
        apply_tensor_parallel(model, tp_submesh(layout, mesh), layout.tp, setup.sequence_parallel,
                              setup.loss_parallel)
    if spec.shards_model_states:
        # torchtitan under PP: reshard_after_forward False (fsdp.py get_fsdp_reshard_after_forward_policy);
        # --reshard-after-forward N: FSDP2's int, each layer resharded to N ranks after forward
        reshard = setup.reshard_after_forward or spec.reshard_after_forward and layout.pp == 1
        apply_fsdp(model, fsdp_submesh(layout, mesh), setup, reshard=reshard, region=region)
    return model
