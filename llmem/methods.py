"""Distributed methods and their GPU layouts (dp x tp, nodes).

A method decides how model states are split across GPUs:
- single: one GPU, everything replicated (nothing to split).
- ddp: DistributedDataParallel; the paper's CDP. Every GPU holds the whole model plus gradient buckets.
- fsdp: FSDP2 `fully_shard` per decoder layer and the root, resharding after forward; the paper's ADP, ZeRO-3.
- zero2: FSDP2 without resharding after forward (parameters stay gathered from forward to backward).
- tp: Megatron-style tensor parallelism (column/row split of attention and MLP) over all GPUs.
- fsdp+tp: FSDP2 over the dp dimension of a 2-D mesh whose tp dimension holds the tensor-parallel layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmem.errors import LlmemError

METHODS = ("single", "ddp", "fsdp", "zero2", "tp", "fsdp+tp")
METHOD_ALIASES = {
    "cdp": "ddp", "dp": "ddp",
    "zero3": "fsdp", "adp": "fsdp", "fsdp2": "fsdp",
    "fsdp-no-reshard": "zero2", "shard-grad-op": "zero2",
    "dp+tp": "fsdp+tp", "fsdp-tp": "fsdp+tp", "2d": "fsdp+tp",
}


def canonical_method(name: str) -> str:
    key = name.strip().lower()
    key = METHOD_ALIASES.get(key, key)
    if key not in METHODS:
        raise LlmemError(f"unknown method {name!r}: choose one of {', '.join(METHODS)} "
                         f"(aliases: {', '.join(sorted(METHOD_ALIASES))})")
    return key


@dataclass(frozen=True)
class Layout:
    """How the world of GPUs is arranged for one method."""
    method: str
    dp: int            # data-parallel degree (replicas for ddp, shards for fsdp/zero2)
    tp: int            # tensor-parallel degree
    gpus_per_node: int

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    @property
    def nodes(self) -> int:
        return -(-self.world_size // self.gpus_per_node)

    @property
    def shards_model_states(self) -> bool:
        return self.method in ("fsdp", "zero2", "fsdp+tp")

    @property
    def label(self) -> str:
        if self.method == "fsdp+tp":
            return f"fsdp+tp ({self.dp}dp x {self.tp}tp)"
        if self.method == "tp":
            return f"tp ({self.tp})"
        return f"{self.method} ({self.dp})" if self.dp > 1 else self.method


def resolve_layout(method: str, gpus: int, tp: int | None, gpus_per_node: int | None,
                   num_heads: int, num_kv_heads: int) -> Layout:
    """Check that `method` can run on `gpus` GPUs with tensor-parallel degree `tp` and return the layout."""
    method = canonical_method(method)
    if gpus < 1:
        raise LlmemError(f"--gpus must be >= 1, got {gpus}")
    per_node = gpus_per_node or min(gpus, 8)
    if per_node < 1:
        raise LlmemError(f"--gpus-per-node must be >= 1, got {per_node}")
    if gpus > per_node and gpus % per_node:
        raise LlmemError(f"--gpus {gpus} is not a whole number of nodes of {per_node} GPUs")
    per_node = min(per_node, gpus)

    if method == "single":
        if gpus != 1:
            raise LlmemError(f"method 'single' runs on one GPU, got --gpus {gpus}: use ddp, fsdp, tp or fsdp+tp")
        if tp not in (None, 1):
            raise LlmemError("method 'single' has no tensor parallelism: drop --tp or use --method tp")
        return Layout(method, 1, 1, 1)
    if method in ("ddp", "fsdp", "zero2"):
        if tp not in (None, 1):
            raise LlmemError(f"method {method!r} has no tensor parallelism: use --method fsdp+tp for --tp {tp}")
        return Layout(method, gpus, 1, per_node)
    if method == "tp":
        tp_degree = tp or gpus
        if tp_degree != gpus:
            raise LlmemError(f"method 'tp' uses every GPU for tensor parallelism (--tp {tp_degree} != --gpus {gpus});"
                             " use --method fsdp+tp to combine data and tensor parallelism")
        layout = Layout(method, 1, tp_degree, per_node)
    else:  # fsdp+tp
        tp_degree = tp or min(2, gpus)
        if tp_degree < 1 or gpus % tp_degree:
            raise LlmemError(f"--tp {tp_degree} does not divide --gpus {gpus}: choose a tp that divides the GPU count")
        if gpus // tp_degree < 2:
            raise LlmemError(f"fsdp+tp with --tp {tp_degree} on {gpus} GPUs leaves one data-parallel rank:"
                             " use --method tp, or a smaller --tp")
        layout = Layout(method, gpus // tp_degree, tp_degree, per_node)
    if layout.tp > 1:
        if layout.tp > per_node or per_node % layout.tp:
            raise LlmemError(f"--tp {layout.tp} does not fit inside a node of {per_node} GPUs:"
                             " tensor parallelism must stay on NVLink; choose a tp that divides --gpus-per-node")
        if num_heads % layout.tp or num_kv_heads % layout.tp:
            raise LlmemError(f"--tp {layout.tp} does not divide the model's attention heads ({num_heads} query, "
                             f"{num_kv_heads} key/value): choose a tp that divides both")
    return layout
