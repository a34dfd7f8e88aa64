"""The step's moments: memory at each moment where the peak of one training step can occur, as sums of the
tensors live then (the forward's end, the loss backward, the backward of the top and the bottom decoder layer and
under FSDP2 of a middle one, the embedding's backward, FSDP2's root post-backward, the optimizer step).

They explain the peak (`--json` "moments") and give the planner a 1 ms bound for its searches; the counters
themselves come from the allocation schedule (llmem.estimator.schedule), which lays out the same tensors in
order. tests/estimator/test_schedule.py checks the two agree over the CI matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmem.estimator.objective_steps import objective_moments
from llmem.estimator.post_forward import post_forward_layer_bytes
from llmem.estimator.states import ModelStates
from llmem.memory.activations.blocks import block_owner, loss_parallel_forward_bytes
from llmem.memory.activations.profile import ActivationProfile, dims_for, sequence_tokens
from llmem.memory.quant import events_peak, is_quantised, quant_args, transients
from llmem.model.peft import element_bytes
from llmem.model.resolved import ResolvedSetup
from llmem.model.sharding import MATMUL_KINDS, fsdp_unit_numel, is_embedding, local_numel, tp_local_numel


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


def layer_costs(r: ResolvedSetup, act: ActivationProfile) -> LayerCosts:
    """Assign layer 0's parameters to the activation recipe's blocks and price each block."""
    anatomy, setup, layout, regime = r.anatomy, r.setup, r.layout, r.regime
    layer0 = [p for p in anatomy.layer0_params if p.trainable]
    owner = {p.name: block_owner(act.blocks, p.name) for p in layer0}
    n = len(act.blocks)
    grads = [0] * n
    copies = [0] * n
    quant = [0] * n
    fsdp = layout.shards_model_states
    gather_bytes = setup.gather_bytes
    for p in layer0:
        i = owner[p.name]
        if fsdp:
            grads[i] += fsdp_unit_numel([p], layout) * gather_bytes
        else:
            grads[i] += local_numel(p, layout) * element_bytes(p, setup)
        if regime.autocast and p.module_kind in MATMUL_KINDS and not p.name.endswith("bias"):
            copies[i] += tp_local_numel(p, layout) * regime.mm
    # a quantised base: the largest dequantisation its linears make in the block's backward (llmem.memory.quant)
    args = quant_args(setup, fsdp)
    for p in anatomy.layer0_params:
        if is_quantised(p, setup.quant_base):
            tr = transients(p.shape, setup.quant_base, args, 0, False, p.module_kind == "Conv1D")
            i = block_owner(act.blocks, p.name)
            quant[i] = max(quant[i], events_peak(tr.backward))
    transient = [b.transient + (copies[i] if regime.autocast else 0) + quant[i] for i, b in enumerate(act.blocks)]
    return LayerCosts(tuple(b.saved for b in act.blocks), tuple(copies), tuple(grads), tuple(transient))


def _walk_layer_backward(base: int, costs: LayerCosts, keep_copies: bool, recompute_extra: int = 0) -> int:
    """Backward through one layer's blocks in reverse; the peak inside the layer.

    `base` already holds everything outside this layer. Each block's backward allocates its weight gradients and
    a transient, then frees what the block kept for backward. `recompute_extra`: held only while the layer's
    recompute runs (the unpacked input of an offloaded checkpoint).
    """
    held = base + sum(costs.saved) + (sum(costs.copies) if keep_copies else 0)
    peak = held + recompute_extra
    for i in reversed(range(len(costs.saved))):
        peak = max(peak, held + costs.grads_live[i] + costs.transient[i])
        held += costs.grads_live[i] - costs.saved[i] - (costs.copies[i] if keep_copies else 0)
    return peak


def step_moments(r: ResolvedSetup, act: ActivationProfile, ms: ModelStates) -> list[Moment]:
    """Memory at each moment where the step's peak can occur (second iteration: optimizer states exist).

    Forward end and loss backward are whole-model sums; the backward of the top and the bottom decoder layer is
    walked block by block (memory is linear in the layer index between them); then the embedding's backward and
    the optimizer step.
    """
    if r.method.zero_stage is not None:
        return zero_moments(r, act, ms)
    if r.setup.objective_spec.runs_trainer:     # TRL's trainers' steps: these moments of their batch, adjusted
        return objective_moments(r, act, ms, step_moments)
    held = _held(r, act, ms)
    return [*_vision_moments(act, held), *_loss_moments(r, act, ms, held), *_layer_moments(r, act, held),
            *_embedding_moments(r, act, ms, held), *_optimizer_moments(r, ms, held)]


def _vision_moments(act: ActivationProfile, h: _Held) -> list[Moment]:
    """0. a vision-language step's vision side in forward: the micro-batch and the most its forward holds at once
    (the crops' pixel values and their copies, the encoder's kept tensors: LLaVA-OneVision's many crops peak here)."""
    v = act.vision
    if v is None or v.side is None:
        return []
    return [Moment("forward", {**h.static, "activations": h.batch + v.side.forward_peak})]


@dataclass(frozen=True)
class _LiveGrads:
    """Gradient bytes alive during backward."""
    head: int               # the root parameters' (lm_head, final norm; embedding when tied)
    embed: int              # the untied embedding's
    layer_final: int        # one decoder layer's once its backward is done (0: stepped in backward)
    in_backward_head: int   # the lm_head's hook: its gradient and its step's temporaries (0: no such moment)


@dataclass(frozen=True)
class _Held:
    """Bytes the step's moments share: what is live outside the layer being walked."""
    static: dict[str, int]      # weights, optimizer states, DDP buckets, cuBLAS workspace: at every moment
    costs: LayerCosts           # one decoder layer, block by block
    layer_copies: int           # one decoder layer's autocast weight copies
    full_layers: int            # layers that keep their autocast weight copies through backward
    outside: int                # saved outside the decoder layers, on the device during backward
    root_gathered: int          # FSDP2's unsharded root parameters
    layer_gathered: int         # FSDP2's one unsharded decoder layer
    all_layers_gathered: int    # FSDP2 without reshard-after-forward: every layer stays unsharded
    post: int                   # --reshard-after-forward N: one layer's shards kept until its backward
    rs_prev: int                # FSDP2: the previous layer's reduce-scatter input
    grads: _LiveGrads
    batch: int = 0              # a vision-language micro-batch's tensors (ids, pixel values), held the whole step
    vision_kept: int = 0        # a vision side's kept tensors, held until its backward (after the decoder layers')

    @property
    def static_bytes(self) -> int:
        return sum(self.static.values())


def _held(r: ResolvedSetup, act: ActivationProfile, ms: ModelStates) -> _Held:
    """What every moment of the step holds, or builds on."""
    layers = r.anatomy.num_layers
    fsdp = r.layout.shards_model_states
    costs = layer_costs(r, act)
    layer_gathered = ms.fsdp_layer_gathered if fsdp else 0
    batch = sum(act.vision.batch_tensors) if act.vision is not None else 0
    # a vision side with a backward keeps its pieces' tensors until it runs, after the decoder layers' (and, with
    # cross-attention layers, after the embedding's too): outside the layers at every backward moment
    side = act.vision.side if act.vision is not None else None
    vision_kept = sum(sum(p.tensors) for p in side.pieces) if side is not None and side.backward else 0
    return _Held(
        static={
            "weights": ms.weights,
            "optimizer_states": ms.optimizer_states,
            "communication_buffers": ms.ddp_buckets,
            "cuda_workspaces": r.gpu.cublas_workspace_bytes,
        },
        costs=costs,
        layer_copies=sum(costs.copies),
        # layers that keep everything (not checkpointed) also keep their autocast weight copies
        full_layers=0 if act.offload else layers - act.checkpointed_layers(),   # offloaded: copies on the host
        # on the device during backward (offloaded: what the checkpoints' partials and AccumulateGrad hold)
        outside=batch + vision_kept + (act.embed_saved + act.shared_saved if not act.offload else
                         act.shared_saved + act.embed_leaf_bytes if act.grad_ckpt else 0),
        root_gathered=ms.fsdp_root_gathered if fsdp else 0,
        layer_gathered=layer_gathered,
        all_layers_gathered=layers * layer_gathered if fsdp and not r.method.reshard_after_forward else 0,
        post=post_forward_layer_bytes(r),       # --reshard-after-forward N: each layer's shards until its backward
        rs_prev=ms.fsdp_layer_reduce if fsdp and layers > 1 else 0,
        grads=_live_grads(r, ms),
        batch=batch, vision_kept=vision_kept,
    )


def _live_grads(r: ResolvedSetup, ms: ModelStates) -> _LiveGrads:
    anatomy, setup, layout = r.anatomy, r.setup, r.layout
    # gradients alive during backward for the root parameters (lm_head, final norm; embedding when tied)
    head_params = [p for p in anatomy.outside_layer_params if p.trainable
                   and (not is_embedding(p) or p.tied_to is not None)]
    embed_params = [p for p in anatomy.outside_layer_params if p.trainable and is_embedding(p)
                    and p.tied_to is None]
    if layout.shards_model_states:
        head_live = fsdp_unit_numel(head_params, layout) * setup.gather_bytes
        embed_live = fsdp_unit_numel(embed_params, layout) * setup.gather_bytes
    else:
        head_live = ms.head_grads + (ms.embed_grads if anatomy.tie_word_embeddings else 0)
        embed_live = ms.embed_grads - (ms.embed_grads if anatomy.tie_word_embeddings else 0)
    if not setup.optimizer_in_backward:
        return _LiveGrads(head_live, embed_live, ms.layer_grads, 0)
    # each hook steps its parameter and frees the gradient: no gradient outlives its own step. The head's step (its
    # gradient and the step's temporaries) is a moment of its own; later moments hold no head or layer gradients,
    # the embedding's moment its own gradient and step
    if anatomy.tie_word_embeddings:     # the tied weight's one hook waits for its embedding gradient
        return _LiveGrads(ms.embed_grads, embed_live, 0, 0)
    return _LiveGrads(0, embed_live + ms.optimizer_temporaries, 0, head_live + ms.optimizer_temporaries)


def _loss_moments(r: ResolvedSetup, act: ActivationProfile, ms: ModelStates, h: _Held) -> list[Moment]:
    """1. the end of forward, inside the loss; 2. the loss's backward; the lm_head's own step in backward."""
    layers = r.anatomy.num_layers
    head_copy = ms.autocast_weight_copies - layers * h.layer_copies     # lm_head (and anything outside layers)
    if act.fused_ce is not None:
        head_copy = 0                # the loss's weight cast is freed at its end (counted in the forward's loss)
    gathered_fwd = h.root_gathered + h.all_layers_gathered + layers * h.post
    saved_layers = act.device_layers_saved() + act.device_outside_saved + h.batch + h.vision_kept
    moments = [Moment("forward", {
        **h.static,
        "gathered_weights": gathered_fwd + ms.autocast_weight_copies + ms.autocast_bias_copies,
        "activations": saved_layers + act.mask_bytes,
        "logits_and_loss": _forward_loss_bytes(r, act),
    })]
    # 2. loss backward: three [tokens, vocab] tensors in the loss's dtype; the graph still holds the weight copies it saved
    kept_copies = head_copy + h.full_layers * h.layer_copies
    moments.append(Moment("backward", {
        **h.static,
        "gathered_weights": gathered_fwd + kept_copies,
        "activations": saved_layers,
        "logits_and_loss": act.loss_peak,
    }))
    if act.chunked is not None and len(act.chunked.token_chunks) > 1:
        # torchtune's chunked output: every chunk's logits gradient, while autograd sums the lm_head weight's
        # gradients out of place (the buffer, a chunk's gradient and their sum: llmem.estimator.schedule.chunked_head)
        c = act.chunked
        moments.append(Moment("backward", {
            **h.static,
            "gathered_weights": gathered_fwd + kept_copies,
            "activations": saved_layers,
            "logits_and_loss": sum(c.token_chunks) * c.vocab * c.mm,
            "gradients": 3 * h.grads.head,
        }))
    if h.grads.in_backward_head:   # the lm_head's hook: its gradient and step, the graph below still alive
        moments.append(Moment("backward", {
            **h.static,
            "gathered_weights": gathered_fwd + kept_copies - head_copy,
            "activations": saved_layers - act.device_head_saved,      # the head's saved tensors freed
            "gradients": h.grads.in_backward_head,
        }))
    return moments


def _forward_loss_bytes(r: ResolvedSetup, act: ActivationProfile) -> int:
    """1. end of forward, inside the loss: logits, their upcast (fp32 unless --logits-dtype model), the log-softmax
    output; autocast's cache."""
    anatomy, setup, regime = r.anatomy, r.setup, r.regime
    tokens_vocab = setup.batch_size * sequence_tokens(anatomy, setup) * anatomy.vocab_size
    ld = act.loss_bytes              # the upcast and log-softmax: fp32, or the logits' dtype (--logits-dtype model)
    fwd_loss = tokens_vocab * regime.mm + (tokens_vocab * ld if regime.mm != ld else 0) + tokens_vocab * ld \
        + tokens_vocab * act.nll_cast
    if setup.loss_parallel:          # the vocab-sharded logits, x - max and its exp (loss_parallel()'s log-softmax)
        fwd_loss = loss_parallel_forward_bytes(dims_for(anatomy, setup, r.layout.tp), regime.mm)
    if act.fused_ce is not None:     # chunked: the hidden states, the weight cast, the kept grads, one chunk
        fwd_loss = act.fused_ce.forward_peak_bytes
    if act.chunked is not None:      # torchtune's: every chunk's logits and log-softmax, the last one's upcast
        fwd_loss = act.chunked.forward_peak_bytes
    return fwd_loss


def _layer_moments(r: ResolvedSetup, act: ActivationProfile, h: _Held) -> list[Moment]:
    """3., 4. the backward of the top and the bottom decoder layer, 4b. under FSDP2 of the layer below the top."""
    layers = r.anatomy.num_layers
    fsdp = r.layout.shards_model_states
    gathered_top = h.root_gathered + (h.all_layers_gathered or h.layer_gathered) + (layers - 1) * h.post
    prefetch = h.layer_gathered if fsdp and r.method.reshard_after_forward and layers > 1 else 0
    moments = [_top_layer_moment(r, act, h, gathered_top, prefetch), _bottom_layer_moment(r, act, h)]
    if fsdp and layers > 2:
        moments.append(_middle_layer_moment(r, act, h, gathered_top, prefetch))
    return moments


def _checkpoint_held(act: ActivationProfile, layer: int) -> int:
    """A checkpointed layer's backward: the gradient of its output (the residual stream's) is live throughout, and
    the offloaded input copied back while it recomputes (--ac-policy op: and the stored outputs its recompute never
    reads, llmem.memory.activations.selective)."""
    return act.ckpt_input_bytes + act.selective_held_bytes if act.checkpointed(layer) else 0


def _top_layer_moment(r: ResolvedSetup, act: ActivationProfile, h: _Held, gathered_top: int,
                      prefetch: int) -> Moment:
    """3. top decoder layer: head gradients exist; the layers below still hold their activations."""
    layers = r.anatomy.num_layers
    top_ckpt = act.checkpointed(layers - 1)
    others = h.outside + act.device_layers_saved(layers - 1)
    other_copies = max(h.full_layers - (0 if top_ckpt else 1), 0) * h.layer_copies
    base = h.static_bytes + gathered_top + other_copies + h.grads.head + others + prefetch \
        + _checkpoint_held(act, layers - 1)
    peak = _walk_layer_backward(base, h.costs, r.regime.autocast, act.recompute_input_bytes if top_ckpt else 0)
    return _lump("backward", h.static, peak, {
        "gathered_weights": gathered_top + other_copies, "gradients": h.grads.head,
        "communication_buffers": h.static["communication_buffers"] + prefetch})


def _bottom_layer_moment(r: ResolvedSetup, act: ActivationProfile, h: _Held) -> Moment:
    """4. bottom decoder layer: every other layer's final gradients exist."""
    layers = r.anatomy.num_layers
    below_grads = (layers - 1) * h.grads.layer_final
    gathered = h.root_gathered + (h.all_layers_gathered or h.layer_gathered)
    stream = _checkpoint_held(act, 0)
    base = h.static_bytes + gathered + h.grads.head + below_grads + h.outside + h.rs_prev + stream
    peak = _walk_layer_backward(base, h.costs, r.regime.autocast, act.recompute_input_bytes if stream else 0)
    return _lump("backward", h.static, peak, {
        "gathered_weights": gathered,
        "gradients": h.grads.head + below_grads,
        "communication_buffers": h.static["communication_buffers"] + h.rs_prev})


def _middle_layer_moment(r: ResolvedSetup, act: ActivationProfile, h: _Held, gathered_top: int,
                         prefetch: int) -> Moment:
    """4b. FSDP2, the layer below the top (and so the middle layers): the previous layer's reduce-scatter input is
    still held (FSDPParamGroup's reduce-scatter state) while the next unit is prefetched."""
    i = r.anatomy.num_layers - 2
    ckpt = act.checkpointed(i)
    base = h.static_bytes + gathered_top - h.post + h.grads.head + h.grads.layer_final + h.outside \
        + act.device_layers_saved(i) + prefetch + h.rs_prev + _checkpoint_held(act, i)
    peak = _walk_layer_backward(base, h.costs, r.regime.autocast, act.recompute_input_bytes if ckpt else 0)
    return _lump("backward", h.static, peak, {
        "gathered_weights": gathered_top - h.post, "gradients": h.grads.head + h.grads.layer_final,
        "communication_buffers": h.static["communication_buffers"] + prefetch + h.rs_prev})


def _embedding_moments(r: ResolvedSetup, act: ActivationProfile, ms: ModelStates, h: _Held) -> list[Moment]:
    """5. the embedding's backward: all layer gradients final; the last layer's reduce-scatter may still be in
    flight. Under FSDP2 then the root's post-backward and the next forward's root unshard."""
    all_layer_grads = r.anatomy.num_layers * h.grads.layer_final
    buffers = h.static["communication_buffers"]
    moments = [Moment("backward", {
        **h.static,
        "gathered_weights": h.root_gathered + h.all_layers_gathered,
        "gradients": all_layer_grads + h.grads.head + (_tied_accumulate_bytes(r) or h.grads.embed)
        + ms.tp_embed_grad_excess,
        "activations": h.outside,
        "communication_buffers": buffers + h.rs_prev,
    })]
    if not r.layout.shards_model_states:
        return moments
    # the root's post-backward: its unsharded gradients, their reduce-scatter input and the sharded output
    # (FSDPParamGroup.post_backward reshards the root's parameters before the reduce)
    moments.append(Moment("backward", {
        **h.static,
        "gathered_weights": h.all_layers_gathered,
        "gradients": h.grads.head + h.grads.embed + ms.gradients,     # every gradient's shard, the root's unsharded
        "communication_buffers": buffers + ms.fsdp_root_reduce,
    }))
    # 5b. the next forward's start, FSDP2's root unshard: the all-gather output and the unsharded parameters it is
    # copied out into, both live (FSDPParamGroup.unshard then wait_for_unshard: foreach_all_gather_copy_out)
    moments.append(Moment("forward", {
        **h.static,
        "gathered_weights": h.root_gathered,
        "communication_buffers": buffers + h.root_gathered,
    }))
    return moments


def _tied_accumulate_bytes(r: ResolvedSetup) -> int:
    """A tied embedding: AccumulateGrad adds the embedding's gradient to the lm_head's one out of place: old + new +
    sum (0: untied)."""
    anatomy, setup, layout = r.anatomy, r.setup, r.layout
    if not anatomy.tie_word_embeddings:
        return 0
    tied = [p for p in anatomy.params if is_embedding(p) and p.tied_to is not None]
    if layout.shards_model_states:
        return 2 * fsdp_unit_numel(tied, layout) * setup.gather_bytes
    return 2 * sum(local_numel(p, layout) * (element_bytes(p, setup) if p.trainable else setup.param_bytes)
                   for p in tied)


def _optimizer_moments(r: ResolvedSetup, ms: ModelStates, h: _Held) -> list[Moment]:
    """6. optimizer step: every gradient, the states and the implementation's temporaries."""
    if r.setup.optimizer_in_backward:   # in backward: the step already happened, parameter by parameter
        return []
    return [Moment("optimizer_step", {
        **h.static,
        "gradients": ms.gradients + ms.tp_embed_grad_excess,
        "optimizer_temporaries": ms.optimizer_temporaries,
    })]


def zero_moments(r: ResolvedSetup, act: ActivationProfile, ms: ModelStates) -> list[Moment]:
    """DeepSpeed's engine (ModelStates as llmem.estimator.states.zero_model_states fills them): the loss with every
    saved activation, the end of backward (the IPG buffers and a bucket's flattened copy), the step."""
    stage = r.method.zero_stage
    static = {"weights": ms.weights, "optimizer_states": ms.optimizer_states,
              "cuda_workspaces": r.gpu.cublas_workspace_bytes}
    held = {"gradients": ms.gradients, "communication_buffers": ms.ddp_buckets} if stage == 3 else {}
    gathered = {"gathered_weights": ms.fsdp_layer_gathered}
    saved = act.device_layers_saved() + act.device_outside_saved
    return [
        Moment("forward", {**static, **held, **gathered, "activations": saved + act.mask_bytes,
                           "logits_and_loss": act.loss_peak}),
        Moment("backward", {**static, **gathered, "gradients": ms.gradients if stage == 3 else 0,
                            "communication_buffers": ms.ddp_buckets + ms.layer_grads}),
        Moment("optimizer_step", {**static, **held, "optimizer_temporaries": ms.optimizer_temporaries}),
    ]


def _lump(phase: str, static: dict[str, int], total: int, known: dict[str, int]) -> Moment:
    """A moment whose total comes from a walk: the known parts by name, the rest is activations."""
    comps = {**static, **known}
    comps["activations"] = total - sum(comps.values())
    return Moment(phase, comps)

