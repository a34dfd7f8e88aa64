"""Distributed methods: one row per method, registered by name (the only place a method's behaviour is written).

A method decides how model states are split across GPUs:
- single: one GPU, everything replicated (nothing to split).
- ddp: DistributedDataParallel; the paper's CDP. Every GPU holds the whole model plus gradient buckets.
- fsdp: FSDP2 `fully_shard` per decoder layer and the root, resharding after forward; the paper's ADP, ZeRO-3.
- zero2: FSDP2 without resharding after forward (parameters stay gathered from forward to backward).
- tp: Megatron-style tensor parallelism (column/row split of attention and MLP) over all GPUs.
- fsdp+tp: FSDP2 over the dp dimension of a 2-D mesh whose tp dimension holds the tensor-parallel layers.
- ds-zero1 / ds-zero2 / ds-zero3: DeepSpeed's engine with ZeRO stage 1 / 2 / 3 as DeepSpeed runs it (its flat
  buffers, buckets and stage-3 parameter coordinator: llmem.setup.deepspeed, llmem.estimator.deepspeed), not
  FSDP2's equivalent.

Everything else reads these rows: the layout rules (llmem.setup.layout), the support check (llmem.setup.support),
the estimator's sharding and buffers, the trace's method application (llmem.runtime.distributed), the time model,
the paper's method names and the launch-config exports.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmem.errors import LlmemError

# DistributedDataParallel's bucket_cap_mb=25 (torch/nn/parallel/distributed.py): the buckets the reducer rebuilds
# after the first backward, which the time model's last all-reduce reads (the memory's buckets:
# llmem.estimator.ddp_buckets)
DDP_BUCKET_CAP_BYTES = 25 * 1024**2

# MethodSpec.tensor_parallel
TP_NONE = "none"     # no tensor parallelism
TP_ALL = "all"       # every GPU is one tensor-parallel group (dp = 1)
TP_INNER = "inner"   # the tp dimension of a (dp, tp) mesh inside a node


@dataclass(frozen=True, kw_only=True)
class MethodSpec:
    name: str
    aliases: tuple[str, ...] = ()
    shards_model_states: bool       # FSDP2: parameters, gradients and optimizer states split over the dp ranks
    reshard_after_forward: bool     # FSDP2 frees a decoder layer's unsharded parameters after its forward
    tensor_parallel: str            # TP_NONE, TP_ALL or TP_INNER
    gradient_buckets: bool          # DDP's reducer keeps a bucket copy of every gradient
    autocast_under_mixed: bool      # *-mixed runs torch.autocast (FSDP2 casts through MixedPrecisionPolicy instead)
    steps_in_backward: bool         # gradients are final when AccumulateGrad runs (post-accumulate-grad hooks)
    paper_name: str                 # LLMem's CDP / ADP / TP / DP+TP
    paper_order: int                # Algorithm 1's tie order: CDP > ADP > TP > DP+TP (zero2 an ADP after fsdp)
    deepspeed_stage: int | None     # the ZeRO stage its DeepSpeed export uses (None: no DeepSpeed equivalent)
    torch_recipe: str               # what a PyTorch-native script builds, for the torchrun export ({dp}, {tp})
    label_format: str               # how tables name a layout of it ({name}, {dp}, {tp})
    one_gpu: bool = False           # runs on exactly one GPU
    zero_stage: int | None = None   # DeepSpeed's engine runs it with this ZeRO stage (None: PyTorch-native)

    @property
    def plain_tensors(self) -> bool:
        """Parameters stay plain tensors (no DTensor): what bitsandbytes' kernels and torch's Adafactor need."""
        return not self.shards_model_states and self.tensor_parallel == TP_NONE and self.zero_stage is None

    @property
    def has_tp(self) -> bool:
        return self.tensor_parallel != TP_NONE


def _deepspeed(stage: int) -> MethodSpec:
    """DeepSpeed's engine (deepspeed.initialize) with ZeRO stage `stage`: bf16/fp16 run without autocast (the engine
    casts the module), its ZeRO optimizer partitions the states itself (no FSDP2 sharding, no DDP reducer)."""
    return MethodSpec(
        name=f"ds-zero{stage}", aliases=(f"deepspeed-zero{stage}", f"ds{stage}"),
        shards_model_states=False, reshard_after_forward=False, tensor_parallel=TP_NONE, gradient_buckets=False,
        autocast_under_mixed=False, steps_in_backward=False,
        paper_name="ADP" if stage == 3 else "CDP", paper_order=5 + stage, deepspeed_stage=stage,
        torch_recipe=f"deepspeed.initialize(model, config={{'zero_optimization': {{'stage': {stage}}}, ...}})",
        label_format="{name} ({dp})", zero_stage=stage)


METHODS: dict[str, MethodSpec] = {m.name: m for m in (
    MethodSpec(
        name="single", one_gpu=True,
        shards_model_states=False, reshard_after_forward=False, tensor_parallel=TP_NONE, gradient_buckets=False,
        autocast_under_mixed=True, steps_in_backward=True,
        paper_name="CDP", paper_order=0, deepspeed_stage=0,
        torch_recipe="one process, no process group", label_format="{name}"),
    MethodSpec(
        name="ddp", aliases=("cdp", "dp"),
        shards_model_states=False, reshard_after_forward=False, tensor_parallel=TP_NONE, gradient_buckets=True,
        autocast_under_mixed=True, steps_in_backward=False,
        paper_name="CDP", paper_order=0, deepspeed_stage=0,
        torch_recipe="DistributedDataParallel(model)", label_format="{name} ({dp})"),
    MethodSpec(
        name="fsdp", aliases=("zero3", "adp", "fsdp2"),
        shards_model_states=True, reshard_after_forward=True, tensor_parallel=TP_NONE, gradient_buckets=False,
        autocast_under_mixed=False, steps_in_backward=False,
        paper_name="ADP", paper_order=1, deepspeed_stage=3,
        torch_recipe="fully_shard(layer) for each decoder layer, then fully_shard(model) (reshard_after_forward=True)",
        label_format="{name} ({dp})"),
    MethodSpec(
        name="zero2", aliases=("fsdp-no-reshard", "shard-grad-op"),
        shards_model_states=True, reshard_after_forward=False, tensor_parallel=TP_NONE, gradient_buckets=False,
        autocast_under_mixed=False, steps_in_backward=False,
        paper_name="ADP", paper_order=2, deepspeed_stage=2,
        torch_recipe="fully_shard(..., reshard_after_forward=False) per decoder layer and the root",
        label_format="{name} ({dp})"),
    MethodSpec(
        name="tp",
        shards_model_states=False, reshard_after_forward=False, tensor_parallel=TP_ALL, gradient_buckets=False,
        autocast_under_mixed=True, steps_in_backward=False,
        paper_name="TP", paper_order=3, deepspeed_stage=0,
        torch_recipe="init_device_mesh('cuda', ({tp},)) and parallelize_module with the model's tp_plan",
        label_format="{name} ({tp})"),
    MethodSpec(
        name="fsdp+tp", aliases=("dp+tp", "fsdp-tp", "2d"),
        shards_model_states=True, reshard_after_forward=True, tensor_parallel=TP_INNER, gradient_buckets=False,
        autocast_under_mixed=False, steps_in_backward=False,
        paper_name="DP+TP", paper_order=4, deepspeed_stage=None,
        torch_recipe="init_device_mesh('cuda', ({dp}, {tp}), mesh_dim_names=('dp', 'tp')): parallelize_module on "
                     "mesh['tp'], then fully_shard on mesh['dp']",
        label_format="{name} ({dp}dp x {tp}tp)"),
    *(_deepspeed(stage) for stage in (1, 2, 3)),
)}
METHOD_ALIASES: dict[str, str] = {alias: m.name for m in METHODS.values() for alias in m.aliases}


def canonical_method(name: str) -> str:
    key = name.strip().lower()
    key = METHOD_ALIASES.get(key, key)
    if key not in METHODS:
        raise LlmemError(f"unknown method {name!r}: choose one of {', '.join(METHODS)} "
                         f"(aliases: {', '.join(sorted(METHOD_ALIASES))})")
    return key


def method_spec(name: str) -> MethodSpec:
    return METHODS[canonical_method(name)]
