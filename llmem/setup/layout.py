"""GPU layouts: how a method arranges the world of GPUs (dp x tp, nodes), checked once, and the layouts worth
planning on a number of GPUs."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from llmem.errors import LlmemError
from llmem.setup.context_parallel import CP_METHODS
from llmem.setup.expert_parallel import EP_METHODS, check_ep_model, ep_mesh_refusal
from llmem.setup.methods import METHODS, TP_ALL, TP_INNER, TP_NONE, MethodSpec, canonical_method
from llmem.setup.pipeline import PP_METHODS, stage_splits

DEFAULT_GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Layout:
    """How the world of GPUs is arranged for one method."""
    method: str
    dp: int            # data-parallel degree (replicas for ddp, shards for fsdp/zero2)
    tp: int            # tensor-parallel degree
    gpus_per_node: int
    replicas: int = 1  # HSDP: the dp ranks as this many replicas of dp / replicas FSDP2 shards (1: plain FSDP)
    pp: int = 1        # pipeline-parallel degree: stages over ranks (torchtitan's mesh: pp outermost, across nodes)
    cp: int = 1        # context-parallel degree: each sample's tokens over cp ranks (torchtitan's mesh: dp_shard, cp)
    ep: int = 1        # expert-parallel degree: routed experts over ep of the FSDP2 ranks (torchtitan: efsdp x ep)

    @property
    def spec(self) -> MethodSpec:
        return METHODS[self.method]

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def nodes(self) -> int:
        return -(-self.world_size // self.gpus_per_node)

    @property
    def shards_model_states(self) -> bool:
        return self.spec.shards_model_states

    @property
    def shard_degree(self) -> int:
        """How many ways FSDP2 shards dim 0 of each parameter: dp under a sharding method (dp / replicas under
        HSDP), else 1."""
        # torchtitan folds cp into FSDP2's mesh (ParallelDims' "fsdp" = dp_shard x cp)
        return self.dp // self.replicas * self.cp if self.shards_model_states else 1

    @property
    def expert_shard_degree(self) -> int:
        """How many ways FSDP2 shards dim 0 of a routed expert weight: efsdp = dp_shard x cp / ep (torchtitan's
        ParallelDims; the weight is first Shard(0) over ep)."""
        return self.shard_degree // self.ep

    @property
    def mesh_shape(self) -> tuple[tuple[str, int], ...]:
        """The device mesh's (name, size) dimensions, outermost first, as torchtitan names them: dp (HSDP:
        dp_replicate x dp_shard) then tp; empty: no mesh."""
        spec, dims = self.spec, ()
        if spec.shards_model_states:
            dims = (("dp_replicate", self.replicas), ("dp_shard", self.shard_degree)) if self.replicas > 1 \
                else (("dp", self.dp),)
        pp = (("pp", self.pp),) if self.pp > 1 else ()    # torchtitan's ParallelDims: pp, dp_replicate, dp_shard, tp
        if self.cp > 1:                                   # ... dp_shard, cp, tp
            dims = (("dp_shard", self.dp), ("cp", self.cp))
        return pp + dims + ((("tp", self.tp),) if spec.has_tp else ())

    @property
    def label(self) -> str:
        if self.ep > 1:
            return f"{self.method} (dp {self.dp}, ep {self.ep})"
        if self.cp > 1:
            return f"{self.method} (dp {self.dp} x cp {self.cp})"
        if self.pp > 1:      # HSDP: dp as replicas x shards
            dp = f"{self.replicas}x{self.shard_degree}" if self.replicas > 1 else f"{self.dp}"
            degrees = ([f"dp {dp}"] if self.dp > 1 else []) + ([f"tp {self.tp}"] if self.tp > 1 else [])
            return f"{self.method} ({' x '.join(degrees + [f'pp {self.pp}'])})"
        spec = self.spec
        if spec.tensor_parallel == TP_NONE and self.dp == 1:
            return self.method
        if self.replicas == 1:
            return spec.label_format.format(name=self.method, dp=self.dp, tp=self.tp)
        dp = f"{self.replicas}x{self.shard_degree}"             # HSDP: replicas x shards
        return spec.label_format.format(name=self.method, dp=dp, tp=self.tp) + " hsdp"


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
                   num_heads: int, num_kv_heads: int, replicas: int = 1, pp: int = 1, cp: int = 1,
                   ep: int = 1) -> Layout:
    """Check that `method` can run on `gpus` GPUs with tensor-parallel degree `tp` (and, under HSDP, its dp ranks
    as `replicas` replicas; under pipeline parallelism, `pp` stages; under expert parallelism, the experts over `ep`
    of the FSDP2 ranks) and return the layout. num_heads = num_kv_heads = 0 skips the head-divisibility check (the
    paper's 1D TP splits weights, not heads)."""
    if cp > 1 and pp > 1:
        raise LlmemError("--pp with --cp is not modelled: drop one of them")
    if ep > 1:
        return _expert_parallel_layout(method, gpus, tp, per_node, replicas, pp, cp, ep)
    if cp > 1:
        return _context_parallel_layout(method, gpus, per_node, cp)
    if pp > 1:
        return _pipeline_layout(method, gpus, tp, per_node, replicas, pp, num_heads, num_kv_heads)
    layout = _resolve_layout(method, gpus, tp, per_node, num_heads, num_kv_heads)
    if replicas == 1:
        return layout
    if not layout.shards_model_states:
        raise LlmemError(f"--dp-replicate (HSDP) replicates FSDP2's shards: use --method fsdp, zero2 or fsdp+tp "
                         f"(got {layout.method})")
    if layout.dp % replicas:
        raise LlmemError(f"--dp-replicate {replicas} does not divide the {layout.dp} data-parallel ranks of "
                         f"{layout.label}: choose a divisor of {layout.dp}")
    return replace(layout, replicas=replicas)


def _context_parallel_layout(method: str, gpus: int, per_node: int | None, cp: int) -> Layout:
    """torchtitan's world = dp_shard x cp under FSDP2 (llmem.setup.context_parallel refuses the rest): cp divides
    the GPUs, at least one data-parallel rank left."""
    node = check_world(gpus, per_node)
    if gpus % cp:
        raise LlmemError(f"--cp {cp} does not divide --gpus {gpus}: --gpus is dp x cp, choose a cp that divides it")
    return Layout(canonical_method(method), gpus // cp, 1, node, cp=cp)


def _expert_parallel_layout(method: str, gpus: int, tp: int | None, per_node: int | None, replicas: int, pp: int,
                            cp: int, ep: int) -> Layout:
    """torchtitan's EP under FSDP2 alone (llmem.setup.expert_parallel refuses the rest): dp = gpus FSDP2 ranks,
    the routed experts Shard(0) over ep of them (efsdp x ep = dp)."""
    method = canonical_method(method)
    node = check_world(gpus, per_node)
    why = ep_mesh_refusal(method, tp, replicas, pp, cp)
    if why:
        raise LlmemError(why)
    if gpus % ep:
        raise LlmemError(f"--ep {ep} does not divide the {gpus} FSDP2 ranks (dp_shard = efsdp x ep, torchtitan's "
                         "ParallelDims): choose an --ep that divides --gpus")
    return Layout(method, gpus, 1, node, ep=ep)


def _pipeline_layout(method: str, gpus: int, tp: int | None, per_node: int | None, replicas: int, pp: int,
                     num_heads: int = 0, num_kv_heads: int = 0) -> Layout:
    """torchtitan's world = pp x dp x tp: pure PP (single, one rank per stage), FSDP2 x PP (each stage sharded over
    gpus / pp ranks), TP x PP (tp: the stage's gpus / pp ranks all tensor-parallel) or FSDP2 x TP x PP (fsdp+tp:
    each stage's ranks a dp x tp mesh, as on one stage's world of gpus / pp; torchtitan's ParallelDims, pp
    outermost), each stage's dp ranks as HSDP's replicas x shards under --dp-replicate; the other combinations are
    not modelled."""
    method = canonical_method(method)
    node = check_world(gpus, per_node)
    if method not in PP_METHODS:
        raise LlmemError(f"--pp runs under --method single (pure pipeline), fsdp (FSDP2 x PP), tp or fsdp+tp (TP x "
                         f"PP) only, got {method}")
    spec = METHODS[method]
    if replicas != 1 and not spec.shards_model_states:
        raise LlmemError(f"--dp-replicate (HSDP) replicates FSDP2's shards: use --method fsdp or fsdp+tp with --pp "
                         f"(got {method})")
    if not spec.has_tp and tp not in (None, 1):
        raise LlmemError(f"--pp with --tp under --method {method}: use --method tp or fsdp+tp for TP x PP")
    if spec.one_gpu and gpus != pp:
        raise LlmemError(f"--method single with --pp {pp} runs one stage per GPU: use --gpus {pp} (or --method "
                         "fsdp for dp x pp)")
    if gpus % pp or (spec.shards_model_states and not spec.has_tp and gpus // pp < 2):
        raise LlmemError(f"--pp {pp} with --method {method} needs --gpus a multiple of {pp} with at least 2 "
                         f"data-parallel ranks per stage (got --gpus {gpus}): use --method single for pure PP")
    if spec.has_tp:      # each stage's ranks as one stage's world: dp x tp, tp inside a node
        stage = _resolve_layout(method, gpus // pp, tp, min(node, gpus // pp), num_heads, num_kv_heads)
        if stage.tp < 2:
            raise LlmemError(f"--method {method} with --pp {pp} on {gpus} GPUs leaves one GPU per stage, no tensor "
                             "parallelism: use --method single for pure PP, or more GPUs")
        layout = replace(stage, gpus_per_node=node, pp=pp)
    else:
        layout = Layout(method, gpus // pp, 1, node, pp=pp)
    if layout.dp % replicas:     # HSDP x PP: each stage's dp ranks as replicas x shards (mesh pp, dp_replicate, ...)
        raise LlmemError(f"--dp-replicate {replicas} does not divide the {layout.dp} data-parallel ranks of each "
                         f"pipeline stage of {layout.label}: choose a divisor of {layout.dp}")
    return replace(layout, replicas=replicas)


def _resolve_layout(method: str, gpus: int, tp: int | None, per_node: int | None,
                    num_heads: int, num_kv_heads: int) -> Layout:
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
        check_heads(layout.tp, num_heads, num_kv_heads)
    return layout


def check_heads(tp: int, num_heads: int, num_kv_heads: int) -> None:
    """Megatron-style TP splits attention by heads: tp divides the query and the key/value heads (0 and 0: not
    checked, the paper's 1D TP splits weights)."""
    if num_heads % tp or num_kv_heads % tp:
        raise LlmemError(f"--tp {tp} does not divide the model's attention heads ({num_heads} query, "
                         f"{num_kv_heads} key/value): choose a tp that divides both")


def candidate_layouts(gpus: int, per_node: int | None, num_heads: int, num_kv_heads: int,
                      methods: Iterable[str] | None = None, tp: int | None = None, *,
                      limits: ModelLimits | None = None, pp: int | None = 1, cp: int | None = 1,
                      ep: int | None = 1) -> list[Layout]:
    """Every layout worth planning on `gpus` GPUs, in registry order (the paper's tie order); invalid ones skipped.

    A one-GPU method only on one GPU; DeepSpeed's only when `methods` names them; the others on more: no tp once;
    tp over all GPUs when they fit in one node; an inner tp for each tp in the divisors of the node size (> 1) with dp = gpus / tp >= 2; across nodes, each
    sharding layout also as HSDP sharded within a node. `methods` / `tp` restrict the list. num_heads =
    num_kv_heads = 0 skips the head-divisibility check. With the model's `limits`, the pipeline, context- and
    expert-parallel layouts too (`SCALE_OUT_AXES`): `pp` / `cp` / `ep` None searches every degree the model allows,
    1 none (the default), N only N (then only those layouts).
    """
    if limits is not None and (pp != 1 or cp != 1 or ep != 1):
        fixed = {name: d for name, d in (("pp", pp), ("cp", cp), ("ep", ep)) if d not in (None, 1)}
        extra = scale_out_layouts(gpus, per_node, num_heads, num_kv_heads, limits, methods, tp, fixed)
        if fixed:
            return extra
        return candidate_layouts(gpus, per_node, num_heads, num_kv_heads, methods, tp) + extra
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
    return layouts + [h for lay in layouts if (h := _hsdp_within_nodes(lay)) is not None]


@dataclass(frozen=True)
class ModelLimits:
    """What a pipeline or context-parallel degree must respect of the model and the step."""
    num_layers: int
    seq_len: int
    virtual_stages: int = 1        # the pipeline schedule's stages per rank
    experts: int = 0               # routed experts per MoE layer (0: a dense model, or a set-up EP cannot run)


def _splits(d: int, m: ModelLimits) -> bool:
    """pp x virtual stages of at least one layer each, as torchtitan splits them (llmem.setup.pipeline)."""
    if d * m.virtual_stages > m.num_layers:
        return False
    try:
        stage_splits(m.num_layers, d * m.virtual_stages)
    except LlmemError:
        return False
    return True


@dataclass(frozen=True)
class ScaleOutAxis:
    """A parallel dimension the planner searches beside dp x tp: its Layout field (and --option), the methods it
    runs under, and what the model must allow of its degree."""
    name: str
    methods: tuple[str, ...]
    allows: Callable[[int, ModelLimits], bool]
    accepts: Callable[[Layout, ModelLimits], bool] = lambda layout, m: True    # of the resolved layout


def _ep_accepts(layout: Layout, m: ModelLimits) -> bool:
    """expert_parallel's model check: ep divides the routed experts, no more FSDP2 ranks than experts."""
    try:
        check_ep_model(layout.ep, m.experts or None, layout.shard_degree)
    except LlmemError:
        return False
    return True


SCALE_OUT_AXES: tuple[ScaleOutAxis, ...] = (
    ScaleOutAxis("pp", PP_METHODS, _splits),                                     # no empty stage
    ScaleOutAxis("cp", CP_METHODS, lambda d, m: m.seq_len % (2 * d) == 0),       # the 2 x cp head-tail chunks
    ScaleOutAxis("ep", EP_METHODS, lambda d, m: m.experts > 0, _ep_accepts),     # an MoE's experts over ep ranks
)


def scale_out_layouts(gpus: int, per_node: int | None, num_heads: int, num_kv_heads: int, limits: ModelLimits,
                      methods: Iterable[str] | None = None, tp: int | None = None,
                      fixed: dict[str, int] | None = None) -> list[Layout]:
    """The pipeline, context- and expert-parallel layouts of `gpus` GPUs the model allows: each axis's degrees
    d >= 2 dividing the GPUs (only fixed[axis] where given; an axis not fixed is skipped when another is), under
    each of its methods as resolve_layout accepts them, a TP method's with each tp `_searched_tp` gives (pp x tp,
    torchtitan's 3-D layout), a pipeline layout across nodes also as HSDP within them (two axes together, or cp /
    ep with tp, is not modelled: none)."""
    node = gpus_per_node(gpus, per_node)
    wanted = {canonical_method(m) for m in methods} if methods else None
    fixed = fixed or {}
    out: list[Layout] = []
    for axis in SCALE_OUT_AXES:
        if fixed and axis.name not in fixed:
            continue
        degrees = [fixed[axis.name]] if axis.name in fixed else [d for d in range(2, gpus + 1) if gpus % d == 0]
        for d in degrees:
            if not axis.allows(d, limits):
                continue
            for method in axis.methods:
                if wanted is not None and method not in wanted:
                    continue
                for t in _searched_tp(method, tp, node):
                    try:
                        layout = resolve_layout(method, gpus, t, per_node, num_heads, num_kv_heads,
                                                **{axis.name: d})
                    except LlmemError:
                        continue
                    if axis.accepts(layout, limits):
                        out.append(layout)
                        h = _hsdp_within_nodes(layout) if axis.name == "pp" else None
                        if h is not None and h.replicas > 1:     # HSDP x PP: a stage's shards within a node
                            out.append(h)
    return out


def _searched_tp(method: str, tp: int | None, node: int) -> list[int | None]:
    """The tp degrees a scale-out layout of `method` is tried with: a method without TP none (None; nothing where
    --tp N > 1 is asked), tp its stage's GPUs (None), fsdp+tp each tp > 1 dividing the node (or the --tp asked);
    resolve_layout drops the ones that do not fit."""
    spec = METHODS[method]
    if not spec.has_tp:
        return [None] if tp in (None, 1) else []
    if tp is not None:
        return [tp]
    if spec.tensor_parallel == TP_ALL:
        return [None]
    return [t for t in range(2, node + 1) if node % t == 0]


def _hsdp_within_nodes(layout: Layout) -> Layout | None:
    """torchtitan's multi-node HSDP: FSDP2 shards within a node (its GPUs over tp) and replicates across nodes, so
    the all-gathers and reduce-scatters stay on NVLink; None where the world is one node or a node holds fewer
    than two shards."""
    if not layout.shards_model_states or layout.nodes < 2 or layout.spec.zero_stage is not None:
        return None
    shards = layout.gpus_per_node // layout.tp
    if shards < 2 or layout.dp % shards:
        return None
    return replace(layout, replicas=layout.dp // shards)
