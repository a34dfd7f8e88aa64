"""Sharding geometry: which dimension of a parameter tensor parallelism splits, the shape rank 0 holds under a
layout, and the size of an FSDP2 unit as it is all-gathered.

- DTensor tensor parallelism (ColwiseParallel / RowwiseParallel) splits with torch.chunk: rank 0 takes the
  ceiling, so its shard is the largest.
- FSDP2 `fully_shard` shards dim 0 of each (TP-local) parameter, padded to a multiple of the shard count
  (FSDPParam's padded sharded size); its all-gather output is the padded unsharded size.
"""

from __future__ import annotations

from math import prod

from llmem.model.anatomy import ParamInfo
from llmem.setup.layout import Layout

# Module names whose weights tensor parallelism splits by output (column) or by input (row) features.
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1", "c_attn", "c_fc", "query_key_value",
           "dense_h_to_4h", "qkv_proj", "gate_up_proj", "w1", "w3", "q_attn")
ROWWISE = ("o_proj", "down_proj", "out_proj", "fc2", "c_proj", "dense", "dense_4h_to_h", "w2")
MATMUL_KINDS = ("Linear", "Conv1D")
VOCAB_PARALLEL_MIN_ROWS = 8192   # an embedding this tall is split by vocabulary (RowwiseParallel on nn.Embedding)


def linear_layer_class(class_name: str) -> bool:
    """Whether a module of this class is a linear layer that all-linear LoRA adapts: LLaMA-Factory's
    find_all_linear_modules rule (a class whose name holds "Linear": nn.Linear, a quantised base's Linear4bit /
    Linear8bitLt), or transformers' Conv1D; not an nn.Linear subclass of a model's own such as Llama 4's
    Llama4Router, which returns the routing scores and logits (peft's LoRA layer around it fails on the tuple)."""
    return "Linear" in class_name or class_name == "Conv1D"


def is_embedding(p: ParamInfo) -> bool:
    return p.module_kind.endswith("Embedding")


def unwrapped_module(name: str) -> str:
    """The module path of a parameter `name` with peft's ModulesToSaveWrapper left out: lm_head.original_module.weight
    and lm_head.modules_to_save.default.weight both -> lm_head (the module the base model names)."""
    parts = name.split(".")[:-1]
    if "original_module" in parts:
        parts.remove("original_module")
    elif "modules_to_save" in parts:
        at = parts.index("modules_to_save")
        del parts[at:at + 2]
    return ".".join(parts)


def is_saved_copy(p: ParamInfo) -> bool:
    """A trained copy peft's ModulesToSaveWrapper makes of a whole module (modules_to_save):
    <module>.modules_to_save.<adapter>.*, beside the frozen <module>.original_module.*."""
    return ".modules_to_save." in f".{p.name}"


def is_wrapped_original(p: ParamInfo) -> bool:
    """The frozen original of a module peft's ModulesToSaveWrapper wraps: it runs only with the adapters disabled
    (the wrapper's forward runs the trained copy otherwise)."""
    return ".original_module." in f".{p.name}"


def is_lm_head(p: ParamInfo) -> bool:
    """The lm_head weight, or the embedding tied to it."""
    return p.name.startswith("lm_head") or (p.tied_to or "").startswith("lm_head")


def tp_split_dim(p: ParamInfo) -> int | None:
    """Which dimension of this parameter tensor parallelism shards (None: replicated)."""
    parts = p.name.split(".")
    module, leaf = (parts[-2] if len(parts) > 1 else ""), parts[-1]
    conv1d = p.module_kind == "Conv1D"  # GPT-2's Conv1D stores weight as [in, out]
    if is_embedding(p) and p.layer_index is None and p.shape[0] > VOCAB_PARALLEL_MIN_ROWS:
        return 0                         # vocab-parallel embedding (RowwiseParallel on nn.Embedding)
    if module == "lm_head":
        return 0                         # ColwiseParallel: vocab split
    if module in COLWISE:
        return (1 if conv1d else 0) if leaf == "weight" else 0
    if module in ROWWISE and leaf == "weight":
        return 0 if conv1d else 1
    return None


def is_routed_expert(p: ParamInfo) -> bool:
    """A routed experts module's 3-D weight (or 2-D bias) with the experts on dim 0: transformers'
    `@use_experts_implementation` classes (Qwen3MoeExperts, GptOssExperts, DeepseekV3Experts, MixtralExperts)."""
    return p.module_kind.endswith("Experts")


def param_shard_degree(p: ParamInfo, layout: Layout) -> int:
    """FSDP2's shard count of `p`: efsdp for a routed expert under --ep (torchtitan's per-parameter mesh), else the
    layout's shard degree."""
    return layout.expert_shard_degree if layout.ep > 1 and is_routed_expert(p) else layout.shard_degree


def tp_local_shape(p: ParamInfo, layout: Layout) -> tuple[int, ...]:
    """Shape after tensor parallelism only (what FSDP all-gathers back per GPU): torch.chunk, rank 0 the ceiling;
    under --ep a routed expert weight's experts / ep local experts (torchtitan's Shard(0) over ep)."""
    shape = list(p.shape)
    if layout.ep > 1 and is_routed_expert(p):
        shape[0] //= layout.ep
    if layout.tp > 1:
        dim = tp_split_dim(p)
        if dim is not None and dim < len(shape):
            shape[dim] = -(-shape[dim] // layout.tp)
    return tuple(shape)


def tp_local_numel(p: ParamInfo, layout: Layout) -> int:
    return prod(tp_local_shape(p, layout))


def local_shape(p: ParamInfo, layout: Layout) -> tuple[int, ...]:
    """Shape of `p` held by rank 0: the TP chunk, then FSDP2's dim-0 shard (dim 0 padded to a multiple of
    the shard degree: dp, or dp_shard under HSDP)."""
    shape = list(tp_local_shape(p, layout))
    shards = param_shard_degree(p, layout)
    if shards > 1 and shape:
        shape[0] = -(-shape[0] // shards)
    return tuple(shape)


def local_numel(p: ParamInfo, layout: Layout) -> int:
    return prod(local_shape(p, layout))


def fsdp_unit_numel(unit: list[ParamInfo], layout: Layout) -> int:
    """Unsharded size of an FSDP unit as all-gathered: each TP-local parameter padded to a multiple of the
    shard degree."""
    total = 0
    for p in unit:
        shape = tp_local_shape(p, layout) or (1,)
        shards = param_shard_degree(p, layout)
        total += -(-shape[0] // shards) * shards * prod(shape[1:])
    return total


def foreach_groups(trainable: list[ParamInfo], layout: Layout) -> list[list[ParamInfo]]:
    """Parameter groups as a tensor-parallel run must form them for foreach kernels (one kind of tensor each): the
    TP-sharded DTensors and the TP-replicated tensors (norms, row-parallel biases); under --ep the DTensors on the dp
    mesh and the routed experts' on the efsdp mesh."""
    if layout.ep > 1:
        dense = [p for p in trainable if not is_routed_expert(p)]
        return [g for g in (dense, [p for p in trainable if is_routed_expert(p)]) if g]
    if layout.tp == 1:
        return [trainable]
    split = [p for p in trainable if tp_split_dim(p) is not None]
    replicated = [p for p in trainable if tp_split_dim(p) is None]
    return [g for g in (split, replicated) if g]
