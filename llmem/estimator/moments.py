"""The step's moments: memory at each moment where the peak of one training step can occur, as sums of the
tensors live then (the forward's end, the loss backward, the backward of the top and the bottom decoder layer and
under FSDP2 of a middle one, the embedding's backward, FSDP2's root post-backward, the optimizer step).

They explain the peak (`--json` "moments") and give the planner a 1 ms bound for its searches; the counters
themselves come from the allocation schedule (llmem.estimator.schedule), which lays out the same tensors in
order. tests/test_schedule.py checks the two agree over the CI matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmem.estimator.objective_steps import objective_moments
from llmem.estimator.post_forward import post_forward_layer_bytes
from llmem.estimator.states import ModelStates
from llmem.memory.activations.blocks import block_owner, loss_parallel_forward_bytes
from llmem.memory.activations.profile import ActivationProfile, dims_for, virtual_tokens
from llmem.memory.quant import events_peak, is_quantised, quant_args, transients
from llmem.model.peft import element_bytes
from llmem.model.resolved import ResolvedSetup
from llmem.model.sharding import MATMUL_KINDS, fsdp_unit_numel, is_embedding, local_numel, tp_local_numel
from llmem.setup.precision import F32


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
    layer0 = [p for p in anatomy.params if p.layer_index == 0 and p.trainable]
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
    for p in anatomy.params:
        if p.layer_index == 0 and is_quantised(p, setup.quant_base):
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
    anatomy, setup, layout, regime = r.anatomy, r.setup, r.layout, r.regime
    costs = layer_costs(r, act)
    tokens_vocab = setup.batch_size * (setup.seq_len + virtual_tokens(anatomy)) * anatomy.vocab_size
    layers = anatomy.num_layers
    fsdp = layout.shards_model_states
    reshard = r.method.reshard_after_forward
    static = {
        "weights": ms.weights,
        "optimizer_states": ms.optimizer_states,
        "communication_buffers": ms.ddp_buckets,
        "cuda_workspaces": r.gpu.cublas_workspace_bytes,
    }
    layer_copies = sum(costs.copies)
    head_copy = ms.autocast_weight_copies - layers * layer_copies     # lm_head (and anything outside layers)
    root_gathered = ms.fsdp_root_gathered if fsdp else 0
    layer_gathered = ms.fsdp_layer_gathered if fsdp else 0
    all_layers_gathered = layers * layer_gathered if fsdp and not reshard else 0
    post = post_forward_layer_bytes(r)       # --reshard-after-forward N: each layer's shards until its backward
    # layers that keep everything (not checkpointed) also keep their autocast weight copies
    full_layers = 0 if act.offload else layers - act.checkpointed_layers()   # offloaded: copies on the host
    # on the device during backward (offloaded: what the checkpoints' partials and AccumulateGrad hold)
    outside = act.embed_saved + act.shared_saved if not act.offload else \
        act.shared_saved + act.embed_leaf_bytes if act.grad_ckpt else 0
    top_ckpt = act.checkpointed(layers - 1)
    # a checkpointed layer's backward: the gradient of its output (the residual stream's) is live throughout, and
    # the offloaded input copied back while it recomputes
    # (--ac-policy op: and the stored outputs its recompute never reads, llmem.memory.activations.selective)
    top_stream = act.ckpt_input_bytes + act.selective_held_bytes if top_ckpt else 0
    bottom_stream = act.ckpt_input_bytes + act.selective_held_bytes if act.checkpointed(0) else 0
    gather_bytes = setup.gather_bytes
    # gradients alive during backward for the root parameters (lm_head, final norm; embedding when tied)
    head_params = [p for p in anatomy.params if p.layer_index is None and p.trainable
                   and (not is_embedding(p) or p.tied_to is not None)]
    embed_params = [p for p in anatomy.params if p.layer_index is None and p.trainable and is_embedding(p)
                    and p.tied_to is None]
    if fsdp:
        head_live = fsdp_unit_numel(head_params, layout) * gather_bytes
        embed_live = fsdp_unit_numel(embed_params, layout) * gather_bytes
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
    if setup.loss_parallel:          # the vocab-sharded logits, x - max and its exp (loss_parallel()'s log-softmax)
        fwd_loss = loss_parallel_forward_bytes(dims_for(anatomy, setup, layout.tp), regime.mm)
    if act.fused_ce is not None:     # chunked: the hidden states, the weight cast, the kept grads, one chunk
        fwd_loss = act.fused_ce.forward_peak_bytes
        head_copy = 0                # the loss's weight cast is freed at its end (counted in fwd_loss)
    gathered_fwd = root_gathered + all_layers_gathered + layers * post
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
    gathered_top = root_gathered + (all_layers_gathered or layer_gathered) + (layers - 1) * post
    prefetch = layer_gathered if fsdp and reshard and layers > 1 else 0
    base_top = sum(static.values()) + gathered_top + other_copies + head_live + others + prefetch + top_stream
    top_peak = _walk_layer_backward(base_top, costs, regime.autocast,
                                    act.recompute_input_bytes if top_ckpt else 0)
    moments.append(_lump("backward", static, top_peak, {
        "gathered_weights": gathered_top + other_copies, "gradients": head_live,
        "communication_buffers": static["communication_buffers"] + prefetch}))
    rs_prev = ms.fsdp_layer_reduce if fsdp and layers > 1 else 0
    # 4. bottom decoder layer: every other layer's final gradients exist
    below_grads = (layers - 1) * layer_final_grads
    base_bottom = sum(static.values()) + root_gathered + (all_layers_gathered or layer_gathered) + head_live \
        + below_grads + outside + rs_prev + bottom_stream
    bottom_peak = _walk_layer_backward(base_bottom, costs, regime.autocast,
                                       act.recompute_input_bytes if bottom_stream else 0)
    moments.append(_lump("backward", static, bottom_peak, {
        "gathered_weights": root_gathered + (all_layers_gathered or layer_gathered),
        "gradients": head_live + below_grads, "communication_buffers": static["communication_buffers"] + rs_prev}))
    if fsdp and layers > 2:
        # 4b. FSDP2, the layer below the top (and so the middle layers): the previous layer's reduce-scatter input
        # is still held (FSDPParamGroup's reduce-scatter state) while the next unit is prefetched
        i = layers - 2
        ckpt = act.checkpointed(i)
        base_mid = sum(static.values()) + gathered_top - post + head_live + layer_final_grads + outside \
            + act.device_layers_saved(i) + prefetch + rs_prev \
            + (act.ckpt_input_bytes + act.selective_held_bytes if ckpt else 0)
        mid_peak = _walk_layer_backward(base_mid, costs, regime.autocast, act.recompute_input_bytes if ckpt else 0)
        moments.append(_lump("backward", static, mid_peak, {
            "gathered_weights": gathered_top - post, "gradients": head_live + layer_final_grads,
            "communication_buffers": static["communication_buffers"] + prefetch + rs_prev}))
    # 5. embedding backward: all layer gradients final; the last layer's reduce-scatter may still be in flight
    all_layer_grads = layers * layer_final_grads
    tied_extra = 0
    if anatomy.tie_word_embeddings:
        # AccumulateGrad adds the embedding's gradient to the lm_head's one out of place: old + new + sum
        tied = [p for p in anatomy.params if is_embedding(p) and p.tied_to is not None]
        tied_extra = 2 * (fsdp_unit_numel(tied, layout) * gather_bytes if fsdp
                          else sum(local_numel(p, layout) * (element_bytes(p, setup) if p.trainable
                                                             else setup.param_bytes) for p in tied))
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
        # 5b. the next forward's start, FSDP2's root unshard: the all-gather output and the unsharded parameters it
        # is copied out into, both live (FSDPParamGroup.unshard then wait_for_unshard: foreach_all_gather_copy_out)
        moments.append(Moment("forward", {
            **static,
            "gathered_weights": root_gathered,
            "communication_buffers": static["communication_buffers"] + root_gathered,
        }))
    # 6. optimizer step: every gradient, the states and the implementation's temporaries
    if not setup.optimizer_in_backward:   # in backward: the step already happened, parameter by parameter
        moments.append(Moment("optimizer_step", {
            **static,
            "gradients": ms.gradients + ms.tp_embed_grad_excess,
            "optimizer_temporaries": ms.optimizer_temporaries,
        }))
    return moments


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

