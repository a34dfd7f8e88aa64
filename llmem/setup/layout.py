"""GPU layouts: how a method arranges the world of GPUs (dp x tp, nodes), checked once, and the layouts worth
planning on a number of GPUs."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from llmem.errors import LlmemError
from llmem.setup.methods import METHODS, TP_ALL, TP_INNER, TP_NONE, MethodSpec, canonical_method

DEFAULT_GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Layout:
    """How the world of GPUs is arranged for one method."""
    method: str
    dp: int            # data-parallel degree (replicas for ddp, shards for fsdp/zero2)
    tp: int            # tensor-parallel degree
    gpus_per_node: int

    @property
    def spec(self) -> MethodSpec:
        return METHODS[self.method]

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    @property
    def nodes(self) -> int:
        return -(-self.world_size // self.gpus_per_node)

    @property
    def shards_model_states(self) -> bool:
        return self.spec.shards_model_states

    @property
    def shard_degree(self) -> int:
        """How many ways FSDP2 shards dim 0 of each parameter: dp under a sharding method, else 1."""
        return self.dp if self.shards_model_states else 1

    @property
    def label(self) -> str:
        spec = self.spec
        if spec.tensor_parallel == TP_NONE and self.dp == 1:
            return self.method
        return spec.label_format.format(name=self.method, dp=self.dp, tp=self.tp)


def gpus_per_node(gpus: int, per_node: int | None) -> int:
    """The node size a set-up runs with: --gpus-per-node, else min(gpus, 8)."""
    return min(per_node or min(gpus, DEFAULT_GPUS_PER_NODE), gpus)


def check_world(gpus: int, per_node: int | None) -> int:
    """The world must be a whole number of nodes: the node size it runs with (LlmemError otherwise)."""
    if gpus < 1:
        raise LlmemError(f"--gpus must be >= 1, got {gpus}")
    node = per_node or min(gpus, DEFAULT_GPUS_PER_NODE)
    if node < 1:
        raise LlmemError(f"--gpus-per-node must be >= 1, got {node}")
    if gpus > node and gpus % node:
        raise LlmemError(f"--gpus {gpus} is not a whole number of nodes of {node} GPUs")
    return min(node, gpus)


def resolve_layout(method: str, gpus: int, tp: int | None, per_node: int | None,
                   num_heads: int, num_kv_heads: int) -> Layout:
    """Check that `method` can run on `gpus` GPUs with tensor-parallel degree `tp` and return the layout.
    num_heads = num_kv_heads = 0 skips the head-divisibility check (the paper's 1D TP splits weights, not heads)."""
    method = canonical_method(method)
    spec = METHODS[method]
    node = check_world(gpus, per_node)

    if spec.one_gpu:
        if gpus != 1:
            raise LlmemError(f"method {method!r} runs on one GPU, got --gpus {gpus}: use ddp, fsdp, tp or fsdp+tp")
        if tp not in (None, 1):
            raise LlmemError(f"method {method!r} has no tensor parallelism: drop --tp or use --method tp")
        return Layout(method, 1, 1, 1)
    if spec.tensor_parallel == TP_NONE:
        if tp not in (None, 1):
            raise LlmemError(f"method {method!r} has no tensor parallelism: use --method fsdp+tp for --tp {tp}")
        return Layout(method, gpus, 1, node)
    if spec.tensor_parallel == TP_ALL:
        tp_degree = tp or gpus
        if tp_degree != gpus:
            raise LlmemError(f"method {method!r} uses every GPU for tensor parallelism (--tp {tp_degree} != --gpus "
                             f"{gpus}); use --method fsdp+tp to combine data and tensor parallelism")
        layout = Layout(method, 1, tp_degree, node)
    else:  # TP_INNER
        tp_degree = tp or min(2, gpus)
        if tp_degree < 1 or gpus % tp_degree:
            raise LlmemError(f"--tp {tp_degree} does not divide --gpus {gpus}: choose a tp that divides the GPU count")
        if gpus // tp_degree < 2:
            raise LlmemError(f"{method} with --tp {tp_degree} on {gpus} GPUs leaves one data-parallel rank:"
                             " use --method tp, or a smaller --tp")
        layout = Layout(method, gpus // tp_degree, tp_degree, node)
    if layout.tp > 1:
        if layout.tp > node or node % layout.tp:
            raise LlmemError(f"--tp {layout.tp} does not fit inside a node of {node} GPUs:"
                             " tensor parallelism must stay on NVLink; choose a tp that divides --gpus-per-node")
        if num_heads % layout.tp or num_kv_heads % layout.tp:
            raise LlmemError(f"--tp {layout.tp} does not divide the model's attention heads ({num_heads} query, "
                             f"{num_kv_heads} key/value): choose a tp that divides both")
    return layout


def candidate_layouts(gpus: int, per_node: int | None, num_heads: int, num_kv_heads: int,
                      methods: Iterable[str] | None = None, tp: int | None = None) -> list[Layout]:
    """Every layout worth planning on `gpus` GPUs, in registry order (the paper's tie order); invalid ones skipped.

    A one-GPU method only on one GPU; DeepSpeed's only when `methods` names them; the others on more: no tp once; tp over all GPUs when they fit in one node;
    an inner tp for each tp in the divisors of the node size (> 1) with dp = gpus / tp >= 2. `methods` / `tp`
    restrict the list. num_heads = num_kv_heads = 0 skips the head-divisibility check.
    """
    node = check_world(gpus, per_node)    # an invalid world (not a whole number of nodes) is the user's error
    wanted = {canonical_method(m) for m in methods} if methods else None
    specs: list[tuple[str, int | None]] = []
    for spec in METHODS.values():
        if spec.one_gpu != (gpus == 1):
            continue
        if spec.zero_stage is not None and (wanted is None or spec.name not in wanted):
            continue                      # DeepSpeed's engine: searched when asked for (--method ds-zero*)
        if spec.tensor_parallel == TP_NONE:
            specs.append((spec.name, None))
        elif spec.tensor_parallel == TP_ALL:
            if gpus <= node:
                specs.append((spec.name, gpus))
        elif spec.tensor_parallel == TP_INNER:
            specs += [(spec.name, t) for t in range(2, node + 1)
                      if node % t == 0 and gpus % t == 0 and gpus // t >= 2]
    layouts = []
    for method, t in specs:
        if wanted is not None and method not in wanted:
            continue
        has_tp = METHODS[method].has_tp
        if tp is not None and has_tp and t != tp:
            continue
        if tp not in (None, 1) and not has_tp:
            continue
        try:
            layouts.append(resolve_layout(method, gpus, t, per_node, num_heads, num_kv_heads))
        except LlmemError:
            continue
    return layouts
