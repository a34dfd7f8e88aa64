"""The head and the loss in the step schedule: the final norm, the lm_head and HF's ForCausalLMLoss on full logits
(their fp32 upcast and log-softmax; with TP the vocab shards all-gathered, or under --loss-parallel kept sharded),
or llmem.runtime.losses' fused linear cross-entropy (--fused-ce); then the loss's backward and the head's
gradients (autocast's fp32 cast of the lm_head's weight gradient, and under --optimizer-in-backward its hook, once
the matmul's node has released its inputs).

Known Limitations: the loss's per-token scalars (a few KiB) are left out; the objectives' heads (TRL's fused head,
the pairwise losses) are their own events (llmem.estimator.objectives, .pairwise); the lm_head's input gradient
is made before its weight gradient (MmBackward0 makes the weight's first: a [tokens, hidden] tensor out of order);
the final norm's backward temporaries are laid out only for HF's RMSNorm (LayerRecipe.head_back).
"""

from __future__ import annotations

from llmem.estimator.events import Schedule
from llmem.estimator.schedule.chunked_head import ChunkedOutputEvents
from llmem.estimator.schedule.hooks import StepHooks
from llmem.estimator.schedule.state import HeadLoraLive, StepState
from llmem.memory.activations.blocks import MASK as MASK_BYTES
from llmem.memory.activations.loss import FusedCE
from llmem.model.adapter_params import LORA_A, LORA_B, adapter_part, is_adapter_param
from llmem.model.anatomy import ParamInfo
from llmem.model.sharding import MATMUL_KINDS, is_embedding, is_lm_head, is_wrapped_original
from llmem.setup.precision import F32


def fused_ce_forward(sch: Schedule, f: FusedCE, batch: int, seq: int) -> tuple[int, int]:
    """llmem.runtime.losses.fused_linear_cross_entropy's forward, in its allocation order (the final hidden states
    are live around it). Returns the keys of the kept grad_input and grad_weight (-1 when not made)."""
    alloc, free = sch.alloc, sch.free
    t = f.tokens
    hidden = alloc(t * f.hidden * f.hidden_bytes, "activations")        # the final norm's output
    padded = alloc(batch * (seq + 1) * 8, "logits_and_loss")           # shifted labels: pad, then a copy
    labels = alloc(t * 8, "logits_and_loss")
    free(padded)
    cast = alloc(f.weight_cast_bytes, "gathered_weights") if f.weight_cast_bytes else -1
    grad_input = alloc(f.grad_input_bytes, "activations")
    grad_weight = alloc(f.grad_weight_bytes, "gradients") if f.weight_trainable else -1
    mask = alloc(t, "logits_and_loss")
    valid = alloc(t * F32, "logits_and_loss")
    free(mask)
    scale = alloc(t * F32, "logits_and_loss")
    safe = alloc(t * 8, "logits_and_loss")
    loss_1d = alloc(t * F32, "logits_and_loss")
    for c in f.chunk_sizes:
        x = alloc(c * f.hidden * f.mm, "logits_and_loss") if f.hidden_bytes != f.mm else -1
        logits = alloc(c * f.vocab * f.mm, "logits_and_loss")
        p = logits
        if f.mm != F32:
            p = alloc(c * f.vocab * F32, "logits_and_loss")
            free(logits)
        if f.weight_trainable and f.weight_bytes != f.mm and f.hidden_bytes != F32:
            free(alloc(c * f.hidden * F32, "logits_and_loss"))        # grad_weight's fp32 chunk of hidden
        g = p
        if f.mm != F32:
            g = alloc(c * f.vocab * f.mm, "logits_and_loss")
            free(p)
        if f.hidden_bytes != f.mm:
            free(alloc(c * f.hidden * f.mm, "logits_and_loss"))       # grad_input's matmul output, copied in
        free(g)
        free(x)
    free(cast)
    for k in (valid, scale, safe, loss_1d, labels, hidden):
        free(k)
    return grad_input, grad_weight


def head_lora_rank(f) -> int:
    """The rank of LoRA on the lm_head (0: none), read off its lora_A [r, hidden]."""
    return next((p.shape[0] for p in f.root if is_lm_head(p) and adapter_part(p.name) == LORA_A), 0)


def head_lora_bytes(f) -> int:
    """The element bytes LoRA on the lm_head computes in outside autocast: its parameters' (fp32 adapters on a bf16
    base, peft's default, or the base's dtype), or FSDP2's MixedPrecisionPolicy's where it casts them on the
    all-gather."""
    p = next(p for p in f.root if is_lm_head(p) and adapter_part(p.name) == LORA_A)
    return f.gather_bytes if f.fsdp and f.params.cast_in.get(p.name) else f.params.element_bytes[p.name]


class HeadEvents:
    """The final norm, lm_head and loss: forward and backward."""

    def __init__(self, step: StepHooks, state: StepState) -> None:
        self.step, self.f, self.sch, self.state = step, step.facts, step.sch, state
        self.chunked = ChunkedOutputEvents(step, state)

    # ------------------------------------------------------------------------------------------ forward
    def forward(self) -> None:
        """The final norm, the lm_head and the loss: full logits, their fp32 upcast and log-softmax (HF's
        ForCausalLMLoss), or the fused linear cross-entropy; with TP the vocab-split logits are all-gathered (under
        --loss-parallel they stay sharded: loss_parallel_forward)."""
        f, sch, alloc, fwd = self.f, self.sch, self.sch.alloc, self.state.forward
        act, regime, tv, tp = f.act, f.regime, f.tv, f.layout.tp
        sch.mark("lm_head and loss")
        fwd.head_keys = sch.alloc_many(act.head_tensors, "activations")
        fwd.head_offloaded = []
        if act.offload:   # the final norm's tensors go to the host; the lm_head's input stays (not offloaded)
            fwd.head_offloaded = list(act.head_tensors[:-1] if act.lm_head_input else act.head_tensors)
            sch.free_all(fwd.head_keys[:len(fwd.head_offloaded)])
            fwd.head_keys = fwd.head_keys[len(fwd.head_offloaded):]
        fwd.head_copy, fwd.fused_grads = [], (-1, -1)
        fwd.logits = fwd.log_softmax = -1
        if act.fused_ce is not None:    # chunked: no [tokens, vocab] logits, the gradients kept instead
            fwd.fused_grads = fused_ce_forward(sch, act.fused_ce, f.setup.batch_size, f.setup.seq_len)
            return
        if act.chunked is not None:     # torchtune's chunked output and loss
            self.chunked.forward()
            return
        if "head" in f.own_units:       # --shard-embeddings: the lm_head's pre-forward gathers its unit
            self.step.own_forward("head")
        if regime.autocast:
            fwd.head_copy = [alloc(f.params.tp_local[p.name] * regime.mm, "gathered_weights") for p in f.root
                             if (p.module_kind in MATMUL_KINDS or is_lm_head(p)) and f.casts(p)
                             and p.name not in f.vision_params      # (the vision side's copies: its pieces')
                             and not is_wrapped_original(p)]        # (peft runs modules_to_save's copy)
        if f.setup.loss_parallel:   # ColwiseParallel(output_layouts=Shard(-1)): the logits stay vocab-sharded
            self.loss_parallel_forward()
            return
        if tp > 1:   # ColwiseParallel(output_layouts=Replicate()): all-gather the vocab shards, rearrange
            local = alloc(-(-tv // tp) * regime.mm, "logits_and_loss")
            gathered_out = alloc(tv * regime.mm, "logits_and_loss")
            rearranged = alloc(tv * regime.mm, "logits_and_loss")
            fwd.logits = alloc(tv * regime.mm, "logits_and_loss")
            sch.free(rearranged)
            sch.free(gathered_out)
            sch.free(local)
        else:
            fwd.logits = alloc(tv * regime.mm, "logits_and_loss")
        if "head" in f.own_units:       # its post-forward, once the logits are made
            self.step.own_post_forward("head")
        if head_lora_rank(f):
            self.lora_forward()
        ld = act.loss_bytes      # fp32 (HF's logits.float()), or the logits' own dtype (--logits-dtype model)
        upcast = alloc(tv * ld, "logits_and_loss") if regime.mm != ld else -1
        fwd.log_softmax = alloc(tv * ld, "logits_and_loss")
        sch.free(upcast)
        # autocast's fp32 cast of a low-precision log-softmax for nll_loss, which keeps it
        fwd.nll_cast = alloc(tv * act.nll_cast, "logits_and_loss") if act.nll_cast else -1

    def lora_forward(self) -> None:
        """LoRA on the lm_head (peft's lora.Linear, torchtune's LoRALinear; llmem.setup.support's row says which
        set-ups): `result = base(x)`, `x = _cast_input_dtype(x, adapter dtype)`, then `result +
        lora_B(lora_A(dropout(x))) * scaling`, cast back to the logits' dtype. peft's copy of the input in the
        adapters' dtype (fp32 adapters on a bf16 / fp16 base, peft's default; under autocast too) is what lora_A
        keeps, unless dropout makes its output (and a bool mask, kept) lora_A's input, or autocast casts it again
        for lora_A (the cast kept; the fp32 copy and dropout output freed); the copy lora_A does not keep dies when
        the module returns. lora_A's output [t, r] kept for lora_B's weight gradient; lora_B's output and its scaled
        copy [t, vocab] (the first freed once scaled), their sum the new logits (the scaled copy and the base output
        freed), cast back where the adapters are fp32."""
        f, sch, alloc, fwd = self.f, self.sch, self.sch.alloc, self.state.forward
        autocast, mm, th = f.regime.autocast, f.regime.mm, f.t * f.hidden_size
        ab = F32 if autocast else head_lora_bytes(f)       # _cast_input_dtype's dtype
        kept = fwd.head_lora = HeadLoraLive()
        copy = alloc(th * ab, "activations") if ab != mm else -1
        drop = alloc(th * ab, "activations") if f.setup.lora_dropout > 0 else -1
        kept.mask = alloc(th * MASK_BYTES, "activations") if drop >= 0 else -1
        if autocast:                                   # autocast's cast for lora_A; the adapter runs in bf16
            kept.input, ab = alloc(th * mm, "activations"), mm
            sch.free(drop)
        else:
            kept.input = drop if drop >= 0 else copy
        kept.out = alloc(f.t * head_lora_rank(f) * ab, "activations")
        lora_b = alloc(f.tv * ab, "logits_and_loss")
        scaled = alloc(f.tv * ab, "logits_and_loss")
        sch.free(lora_b)
        total = alloc(f.tv * ab, "logits_and_loss")
        sch.free(scaled)
        sch.free(fwd.logits)
        fwd.logits = total
        if ab != mm:                      # result.to(torch_result_dtype)
            fwd.logits = alloc(f.tv * mm, "logits_and_loss")
            sch.free(total)
        if kept.input != copy:            # peft's copy lora_A does not keep: the module returns
            sch.free(copy)

    def lora_backward(self, head_params: list[ParamInfo], cast_grad: int) -> int:
        """The lm_head's LoRA in backward, before the base linear's input gradient: the scaled gradient [t, vocab]
        (mul's backward), lora_B's weight gradient and lora_A's output gradient [t, r], then lora_A's weight
        gradient and its input gradient [t, hidden] (under autocast cast back up to the fp32 copy's dtype; with
        dropout times the mask; cast down to the base's dtype where the copy was made); the base linear's input
        gradient is added to it (a new tensor). fp32 adapters: the logits' gradient cast up first (the cast-back's
        backward), and cast down again for the base branch. Returns the key of the summed input gradient."""
        f, sch, alloc, step, kept = self.f, self.sch, self.sch.alloc, self.step, self.state.forward.head_lora
        autocast, mm, th = f.regime.autocast, f.regime.mm, f.t * f.hidden_size
        copied = autocast or head_lora_bytes(f) != mm      # lora_A's input is peft's copy (or a cast of it)
        ab = mm if autocast else head_lora_bytes(f)        # the adapter's own dtype
        lora = {adapter_part(p.name): p for p in head_params if is_lm_head(p) and is_adapter_param(p.name)}
        base_grad = cast_grad
        if ab != mm:
            wide = alloc(f.tv * ab, "logits_and_loss")          # ToCopyBackward: the gradient in fp32
            sch.free(cast_grad)
            base_grad = alloc(f.tv * mm, "logits_and_loss")     # AddBackward, for the bf16 base output
            scaled = alloc(f.tv * ab, "logits_and_loss")
            sch.free(wide)
        else:
            scaled = alloc(f.tv * mm, "logits_and_loss")
        step.make_grad(lora[LORA_B], root_unit=True)
        grad_a = alloc(f.t * head_lora_rank(f) * ab, "activations")
        sch.free(scaled)
        sch.free(kept.out)
        step.make_grad(lora[LORA_A], root_unit=True)
        grad_x_lora = alloc(th * ab, "activations")
        sch.free(grad_a)
        sch.free(kept.input)                  # lora_A's input, read by now
        sch.free_all(self.state.forward.head_keys)    # the lm_head's input, where lora_A reads it
        if autocast:                          # autocast's cast's backward: up to the fp32 copy's dtype
            grad_x_lora = self._replaced(grad_x_lora, th * F32)
        if kept.mask >= 0:                    # the dropout's backward: the gradient times the mask
            grad_x_lora = self._replaced(grad_x_lora, th * (F32 if autocast else ab))
            sch.free(kept.mask)
        if copied:                            # _cast_input_dtype's backward: the gradient cast down
            grad_x_lora = self._replaced(grad_x_lora, th * mm)
        grad_x_base = alloc(th * mm, "activations")
        sch.free(base_grad)
        grad_in = alloc(th * mm, "activations")
        sch.free(grad_x_lora)
        sch.free(grad_x_base)
        for p in head_params:
            if p not in lora.values():
                step.make_grad(p, root_unit=True)
        sch.free_all(self.state.forward.head_copy)
        return grad_in

    def _replaced(self, key: int, nbytes: int) -> int:
        """A gradient op's output of `nbytes` made from the tensor `key`, which then dies: the output's key."""
        out = self.sch.alloc(nbytes, "activations")
        self.sch.free(key)
        return out

    def loss_parallel_forward(self) -> None:
        """--loss-parallel: HF's logits.float() of the [tokens, vocab/tp] shard, then loss_parallel()'s _log_softmax
        (torch/distributed/tensor/parallel/loss.py): x - max (all-reduced), its exp (summed and all-reduced, then
        freed), the log-softmax (kept for backward); the upcast dies with the loss function."""
        sch, alloc, mm, fwd = self.sch, self.sch.alloc, self.f.regime.mm, self.state.forward
        n = self.f.t * -(-self.f.vocab_size // self.f.layout.tp)
        fwd.logits = alloc(n * mm, "logits_and_loss")
        upcast = alloc(n * F32, "logits_and_loss") if mm != F32 else -1
        shifted = alloc(n * F32, "logits_and_loss")
        sch.free(alloc(n * F32, "logits_and_loss"))          # exp(shifted), summed
        fwd.log_softmax = alloc(n * F32, "logits_and_loss")
        sch.free(shifted)
        sch.free(upcast)

    # ------------------------------------------------------------------------------------------ backward
    def loss_parallel_backward(self) -> int:
        """--loss-parallel: _nll_loss_and_log_softmax_backward on the shard: zeros_like (the one-hot), exp of the
        log-softmax, their sum, times grad_output; then the cast back to the logits' dtype. Returns its key."""
        sch, alloc, mm = self.sch, self.sch.alloc, self.f.regime.mm
        n = self.f.t * -(-self.f.vocab_size // self.f.layout.tp)
        zeros = alloc(n * F32, "logits_and_loss")
        e = alloc(n * F32, "logits_and_loss")
        total = alloc(n * F32, "logits_and_loss")
        sch.free(e)
        grad = alloc(n * F32, "logits_and_loss")
        sch.free(total)
        sch.free(zeros)
        sch.free(self.state.forward.log_softmax)
        if mm == F32:
            return grad
        cast = alloc(n * mm, "logits_and_loss")
        sch.free(grad)
        return cast

    def loss_backward(self) -> int:
        """The loss's backward: three [tokens, vocab] tensors in the loss's dtype (fp32 unless --logits-dtype model), the gradient cast to the logits' dtype; with TP
        sliced back to the vocab shard (none for the fused loss: it hands over what it kept). Returns its key."""
        f, sch, alloc = self.f, self.sch, self.sch.alloc
        regime, tv = f.regime, f.tv
        if f.act.fused_ce is not None:   # the loss's backward hands over the gradients it kept
            cast_grad = -1
        elif f.setup.loss_parallel:   # the gradient of the local vocab shard (no slicing)
            cast_grad = self.loss_parallel_backward()
        else:
            ld, fwd = f.act.loss_bytes, self.state.forward
            nll_grad = alloc(tv * (f.act.nll_cast or ld), "logits_and_loss")
            if f.act.nll_cast:      # NllLossBackward's fp32 gradient, then ToCopyBackward's cast to the log-softmax's
                sch.free(fwd.nll_cast)
                cast = alloc(tv * ld, "logits_and_loss")
                sch.free(nll_grad)
                nll_grad = cast
            ls_grad = alloc(tv * ld, "logits_and_loss")
            sch.free(self.state.forward.log_softmax)
            sch.free(nll_grad)
            if regime.mm != ld:
                cast_grad = alloc(tv * regime.mm, "logits_and_loss")
                sch.free(ls_grad)
            else:
                cast_grad = ls_grad
        if f.layout.tp > 1 and not f.setup.loss_parallel:   # the replicated gradient sliced to the shard
            shard_grad = alloc(-(-tv // f.layout.tp) * regime.mm, "logits_and_loss")
            sch.free(cast_grad)
            cast_grad = shard_grad
        return cast_grad

    def backward(self, it: int) -> None:
        """The loss's backward or the fused loss's hand-over, then the lm_head's and the final norm's gradients."""
        f, sch, alloc, fwd, step = self.f, self.sch, self.sch.alloc, self.state.forward, self.step
        if f.act.chunked is not None:   # torchtune's chunked output and loss
            return self.chunked.backward(it)
        cast_grad = self.loss_backward()
        if "head" in f.own_units:       # the lm_head's pre-backward: its unit unsharded, the last layer prefetched
            step.unshard_backward("head", f.own_units["head"])
            step.prefetch(f.layers - 1, f.unit(f.layers - 1))
        head_params = step.head_backward_params()
        fwd.head_keys += sch.alloc_many(fwd.head_offloaded, "activations")   # offloaded: unpacked
        if f.act.fused_ce is not None:
            grad_in, stolen = fwd.fused_grads
            for p in head_params:
                if stolen >= 0 and is_lm_head(p):
                    # AccumulateGrad takes the loss's grad_weight as the gradient (no copy)
                    grads = self.state.grads
                    (grads.root_unsharded if f.fsdp else grads.grads)[p.name] = stolen
                    stolen = -1
                    if f.in_backward and not f.fsdp and not (p.tied_to is not None and is_embedding(p)):
                        grads.pending_steps.append(p)
                else:
                    step.make_grad(p, root_unit=True)
            self.release_head(cast_grad)
        elif head_lora_rank(f):
            grad_in = self.lora_backward(head_params, cast_grad)
        else:
            grad_in = alloc(f.t * f.hidden_size * f.regime.mm, "activations")
            if f.fsdp:      # FSDP2: the unsharded gradients in the gathered dtype, while the node's inputs live
                for p in head_params:
                    step.make_grad(p, root_unit=True)
                self.release_head(cast_grad)
            else:
                self.linear_backward(head_params, cast_grad, it)
        if "head" in f.own_units:       # its post-backward hook, on the lm_head's input
            step.own_post_backward("head")
        step.flush_steps(it)
        sch.free_all(step.blocks.final_norm_backward(grad_in))

    def release_head(self, cast_grad: int) -> None:
        """The lm_head's node has run: the loss's gradient, the weight copies and the head's saved tensors die."""
        fwd = self.state.forward
        self.sch.free(cast_grad)
        self.sch.free_all(fwd.head_copy)
        self.sch.free_all(fwd.head_keys)

    def linear_backward(self, head_params: list[ParamInfo], cast_grad: int, it: int) -> None:
        """The lm_head's matmul node (MmBackward0) makes its weight gradient (autocast's low-precision one where
        autocast cast the weight) while the loss's gradient and what the node saved live, and releases them on
        returning; only then does the autograd engine run ToCopyBackward, which casts the weight gradient up for
        AccumulateGrad (under --optimizer-in-backward AccumulateGrad's hook steps the parameter there). The final
        norm's backward runs after."""
        sch, regime, step = self.sch, self.f.regime, self.step
        head_mm = [p for p in head_params if is_lm_head(p)]
        grads = self.state.grads.grads
        lows = {p.name: sch.alloc(self.f.params.tp_local[p.name] * regime.mm, "gradients") for p in head_mm
                if regime.autocast and self.f.casts(p) and p.name not in grads}
        for p in head_mm:          # gradients the node produces directly (no cast): while its inputs live
            if p.name not in lows:
                step.make_grad(p, root_unit=True)
        self.release_head(cast_grad)
        for p in head_mm:
            if p.name in lows:
                step.make_grad(p, root_unit=True, low=lows[p.name])
            step.flush_steps(it)
        for p in head_params:
            if p not in head_mm:
                step.make_grad(p, root_unit=True)
                step.flush_steps(it)
