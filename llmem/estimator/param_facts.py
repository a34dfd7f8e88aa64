"""What a step schedule reads about each parameter and does not depend on the micro-batch shape: its element bytes,
its shard, TP-local and FSDP-unsharded element counts, its all-gather outputs, the FSDP2 group and the activation
block it belongs to. A planner's search builds tens of schedules of one set-up at different batch sizes; these
facts are worked out once per (trained model, set-up less its shape, layout, depth, blocks) and shared by them.

The mappings are read-only by contract: every schedule of the set-up reads the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmem.estimator.identity_cache import IdentityCache
from llmem.estimator.states import fsdp_gathered_tensors
from llmem.memory.activations.blocks import Block, block_owner
from llmem.memory.quant import is_quantised
from llmem.model.anatomy import ModelAnatomy, ParamInfo
from llmem.model.peft import element_bytes, view_read_part
from llmem.model.resolved import ResolvedSetup
from llmem.model.sharding import (
    fsdp_unit_numel,
    is_embedding,
    local_numel,
    local_shape,
    param_shard_degree,
    tp_local_numel,
)
from llmem.setup.float8 import gathered_in_float8
from llmem.setup.training import FLAT_ORDER, SHAPE_FIELDS, TrainingSetup

# the set-ups of one plan's searches (each layout's, at two depths for drafts, a pipeline's stages); the oldest goes
KEPT_SET_UPS = 64


@dataclass(frozen=True)
class ParamFacts:
    kept: list[ParamInfo]                          # the parameters of the first `layers` layers and the root's
    buffers: list[ParamInfo]                       # an adapter's buffers there (ModelAnatomy.buffers)
    trainable: list[ParamInfo]
    by_layer: dict[int | None, list[ParamInfo]]    # decoder layer (None: embeddings, final norm, lm_head) -> params
    element_bytes: dict[str, int]                  # per parameter: as the step holds it (a trained one: its gradient and states too)
    shard_numel: dict[str, int]                    # this rank's shard
    tp_local: dict[str, int]                       # the TP-local tensor
    unsharded: dict[str, int]                      # FSDP2's unsharded (padded) parameter; {} without FSDP
    gather_sizes: dict[str, list[int]]             # FSDP2's all-gather outputs (a quantised weight's per storage dtype)
    cast_in: dict[str, bool]                       # MixedPrecisionPolicy casts it on the all-gather
    quantised: dict[str, bool]                     # a quantised base weight (llmem.memory.quant)
    adapted: set[str]                              # base weights a LoRA adapts
    layer_blocks: dict[int, list[list[ParamInfo]]]  # decoder layer -> its params per activation block
    vocab_parallel: set[str]                       # vocab-sharded embeddings under TP
    shapes: dict[str, tuple[int, ...]]             # per trained parameter: its local shape
    shard_of: dict[str, int]                       # FSDP2's shards of dim 0 (a routed expert's over efsdp under --ep)
    shared_parts: frozenset[str] = frozenset()     # cross-layer adapter parts one layer holds (shared_parts)


_KEPT: IdentityCache[ParamFacts] = IdentityCache(KEPT_SET_UPS)
_BY_NAME: IdentityCache[dict[str, int]] = IdentityCache(KEPT_SET_UPS)
# set-up fields that decide what the activations keep and no parameter's fact (tests/estimator/test_param_facts.py
# checks each): set-ups that differ only in them (a plan's savers, an adapter menu's variants) share their facts
ACTIVATION_ONLY_FIELDS = ("grad_ckpt", "ckpt_every", "fused_ce", "offload_activations")
_FACTS_FIELDS = tuple(n for n in FLAT_ORDER if n not in SHAPE_FIELDS and n not in ACTIVATION_ONLY_FIELDS)


def activation_free_key(setup: TrainingSetup) -> tuple:
    """The set-up's values less its shape and its activation-only fields: what its parameters' facts and its model
    states (llmem.planner.engines) are worked out from."""
    return tuple(getattr(setup, n) for n in _FACTS_FIELDS)


def param_facts(r: ResolvedSetup, blocks: tuple[Block, ...], layers: int,
                cross: tuple[tuple[Block, ...], frozenset[int]] = ((), frozenset())) -> ParamFacts:
    """The facts of `r`'s parameters in its first `layers` layers, with their activation `blocks` (`cross`: the
    blocks of the decoder layers of a second kind and those layers, ActivationProfile.kinds)
    (worked out once per set-up less its shape and its activation-only fields: the trained anatomy is compared by
    identity, which `r.with_shape` keeps)."""
    key = (activation_free_key(r.setup), r.layout, layers, tuple(b.params for b in blocks),
           tuple(b.params for b in cross[0]), cross[1])
    return _KEPT.get(r.anatomy, key, lambda: _work_out(r, blocks, layers, cross))


def _work_out(r: ResolvedSetup, blocks: tuple[Block, ...], layers: int,
              cross: tuple[tuple[Block, ...], frozenset[int]]) -> ParamFacts:
    anatomy, setup, layout = r.anatomy, r.setup, r.layout
    kept = [p for p in anatomy.params if p.layer_index is None or p.layer_index < layers]
    trainable = [p for p in kept if p.trainable]
    by_layer: dict[int | None, list[ParamInfo]] = {}
    for p in kept:
        by_layer.setdefault(p.layer_index, []).append(p)
    fsdp = layout.shards_model_states
    layer_blocks: dict[int, list[list[ParamInfo]]] = {}
    owner: dict[tuple, int] = {}       # per kind: a block's weights are named alike in every layer of a kind
    for i in range(layers):
        crossing = i in cross[1]
        own = cross[0] if crossing else blocks
        groups: list[list[ParamInfo]] = [[] for _ in own]
        for p in by_layer.get(i, []):
            if (p.kind, crossing) not in owner:
                owner[p.kind, crossing] = block_owner(own, p.name)
            groups[owner[p.kind, crossing]].append(p)
        layer_blocks[i] = groups
    per_kind: dict[tuple, tuple] = {}
    for p in kept:
        if p.kind not in per_kind:
            per_kind[p.kind] = _kind_facts(p, setup, layout, fsdp)
    facts = {p.name: per_kind[p.kind] for p in kept}
    return ParamFacts(
        kept=kept, buffers=[b for b in anatomy.buffers if b.layer_index is None or b.layer_index < layers],
        trainable=trainable, by_layer=by_layer,
        element_bytes=element_bytes_by_name(anatomy, setup),
        shard_numel={n: f[0] for n, f in facts.items()},
        tp_local={n: f[1] for n, f in facts.items()},
        unsharded={n: f[2] for n, f in facts.items()} if fsdp else {},
        gather_sizes={n: f[3] for n, f in facts.items()} if fsdp else {},
        cast_in={n: f[4] for n, f in facts.items()},
        quantised={n: f[5] for n, f in facts.items()},
        adapted={p.name.split(".lora_A.")[0] + ".weight" for p in kept if ".lora_A." in p.name},
        layer_blocks=layer_blocks,
        vocab_parallel={p.name for p in by_layer.get(None, []) if layout.tp > 1 and is_embedding(p) and p.shape
                        and p.shape[0] == anatomy.vocab_size},
        shapes={p.name: facts[p.name][6] for p in trainable},
        shard_of={n: f[7] for n, f in facts.items()},
        shared_parts=shared_parts(anatomy),
    )


def shared_parts(anatomy: ModelAnatomy) -> frozenset[str]:
    """The trained parameters of a peft model learned from the real code (PeftInfo.exact False) that one decoder
    layer holds for every layer and every layer reads through a view (llmem.model.peft.VIEW_READ_PARTS: Lily's B,
    shared by all layers, peft/tuners/lily/model.py; the first layer's name is theirs): no other layer has a
    parameter of their kind, and each layer's autocast copy of them is learned with the layer."""
    if anatomy.peft is None or anatomy.peft.exact or anatomy.num_layers < 2:
        return frozenset()
    layers_of: dict[tuple, set[int]] = {}
    for p in anatomy.params:
        if p.trainable and p.layer_index is not None:
            layers_of.setdefault(p.kind, set()).add(p.layer_index)
    return frozenset(p.name for p in anatomy.params if p.trainable and p.layer_index is not None
                     and layers_of[p.kind] == {p.layer_index} and view_read_part(anatomy, p))


def element_bytes_by_name(anatomy: ModelAnatomy, setup: TrainingSetup) -> dict[str, int]:
    """Each parameter's element bytes as the step holds it (llmem.model.peft.element_bytes; worked out once per
    kind, and kept per set-up less its shape: the schedules and the job's phases read it per parameter and layer).
    Read-only by contract, as ParamFacts."""
    return _BY_NAME.get(anatomy, setup.shape_free, lambda: _element_bytes_of(anatomy.params, setup))


def _element_bytes_of(params: tuple[ParamInfo, ...], setup: TrainingSetup) -> dict[str, int]:
    per_kind: dict[tuple, int] = {}
    out = {}
    for p in params:
        if p.kind not in per_kind:
            per_kind[p.kind] = element_bytes(p, setup)
        out[p.name] = per_kind[p.kind]
    return out


def _kind_facts(p: ParamInfo, setup, layout, fsdp: bool) -> tuple:
    """One kind of parameter's facts (ParamInfo.kind: the same for its copies in identical layers): its shard, its
    TP-local numel, FSDP2's unsharded numel and all-gather outputs, the all-gather's cast, whether it is quantised,
    its local shape and its shard count."""
    quantised = is_quantised(p, setup.quant_base)
    return (local_numel(p, layout), tp_local_numel(p, layout), fsdp_unit_numel([p], layout) if fsdp else 0,
            fsdp_gathered_tensors(p, setup, layout) if fsdp else [],
            (setup.mixed and not quantised and element_bytes(p, setup) != setup.gather_bytes)
            or gathered_in_float8(setup, p), quantised, local_shape(p, layout), param_shard_degree(p, layout))
