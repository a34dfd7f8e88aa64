"""torchtune's chunked output in the step schedule (`--output-chunks N`): the lm_head on each chunk of the final
hidden states, CEWithChunkedOutputLoss one chunk at a time, and their backward as the autograd engine orders it
(llmem.memory.activations.loss.ChunkedOutput says what each tensor is).

Known Limitations: the loss's per-chunk scalars and the labels' per-chunk copies (batch > 1: 8 bytes a token) are
left out; the lm_head's input gradient of each chunk is made after its weight gradient (MmBackward0's order).
"""

from __future__ import annotations

from llmem.estimator.schedule.hooks import StepHooks
from llmem.estimator.schedule.state import StepState
from llmem.model.sharding import is_lm_head
from llmem.setup.precision import F32

LABEL_BYTES = 8      # int64 labels


class ChunkedOutputEvents:
    """The chunked lm_head and loss: forward and backward."""

    def __init__(self, step: StepHooks, state: StepState) -> None:
        self.step, self.f, self.sch, self.state = step, step.facts, step.sch, state

    def forward(self) -> None:
        """chunked_output: per chunk, matmul's contiguous copy of the chunk (batch > 1; kept where the lm_head's
        weight is trained, whose gradient reads it) and the chunk's logits; then the recipe's shifted labels
        (torch.hstack) and, per chunk, logits.float() and log_softmax (kept; the upcast dies with cross_entropy);
        then `del logits`."""
        f, sch, alloc = self.f, self.sch, self.sch.alloc
        c, live, fwd = f.act.chunked, self.state.forward.chunked, self.state.forward
        for n in c.token_chunks:
            copy = alloc(n * c.hidden * c.mm, "activations") if c.copies_input else -1
            live.logits.append(alloc(n * c.vocab * c.mm, "logits_and_loss"))
            if f.act.lm_head_kept:
                live.inputs.append(copy)
            else:
                sch.free(copy)
        if c.copies_input and f.act.lm_head_kept:   # the copies are saved: the final hidden states are not
            sch.free(fwd.head_keys.pop())
        live.labels = alloc(sum(c.token_chunks) * LABEL_BYTES, "logits_and_loss")
        for n in c.token_chunks:
            if c.compiled:
                live.saved.append(self.compiled_forward(n))
                continue
            upcast = alloc(n * c.vocab * c.upcast_bytes, "logits_and_loss") if c.upcast_bytes else -1
            live.log_softmax.append(alloc(n * c.vocab * F32, "logits_and_loss"))
            sch.free(upcast)
        if not c.compiled:        # (compiled, each chunk's logits are saved for its backward)
            sch.free_all(live.logits)

    def compiled_forward(self, n: int) -> list[int]:
        """compute_cross_entropy compiled, as inductor's generated forward allocates (llmem.runtime.compiled_loss):
        one fused kernel, no [n, vocab] tensor. Returns the keys of what it saves besides the logits and labels:
        the row maxima and the log-sum-exp ([n, 1] fp32; the loss scalar left out)."""
        alloc = self.sch.alloc
        return [alloc(n * F32, "logits_and_loss"), alloc(n * F32, "logits_and_loss")]

    def compiled_backward(self, k: int) -> int:
        """compute_cross_entropy's compiled backward for chunk `k`, as inductor's generated code allocates: an
        [n, 1] fp32 temporary and the gradient in the logits' dtype (the upcast's backward fused in), then what the
        forward saved released, the chunk's logits with it. Returns the gradient's key."""
        sch, alloc = self.sch, self.sch.alloc
        c, live = self.f.act.chunked, self.state.forward.chunked
        n = c.token_chunks[k]
        temporary = alloc(n * F32, "logits_and_loss")
        grad = alloc(n * c.vocab * c.mm, "logits_and_loss")
        sch.free(temporary)
        sch.free_all(live.saved[k])
        sch.free(live.logits[k])
        return grad

    def loss_backward(self) -> None:
        """Every chunk's loss backward, newest chunk first, before any matmul's: nll_loss's fp32 gradient,
        log_softmax's (the log-softmax then freed), the cast back to the model's dtype."""
        sch, alloc = self.sch, self.sch.alloc
        c, live = self.f.act.chunked, self.state.forward.chunked
        grads: list[int] = []
        for k in reversed(range(len(c.token_chunks))):
            if c.compiled:
                grads.append(self.compiled_backward(k))
                continue
            n = c.token_chunks[k] * c.vocab
            nll = alloc(n * F32, "logits_and_loss")
            grad = alloc(n * F32, "logits_and_loss")
            sch.free(live.log_softmax[k])
            sch.free(nll)
            if c.upcast_bytes:
                cast = alloc(n * c.mm, "logits_and_loss")
                sch.free(grad)
                grad = cast
            grads.append(grad)
        live.log_softmax.clear()
        live.logits.clear()
        live.saved.clear()
        sch.free(live.labels)
        live.grads = grads[::-1]

    def backward(self, it: int) -> None:
        """The loss's backward, then each chunk's matmul (newest first): the lm_head weight's gradient (summed in
        autograd's input buffer: accumulate) and the chunk's input gradient,
        held until torch.chunk's backward concatenates them; then the final norm's gradients."""
        f, sch, alloc, step = self.f, self.sch, self.sch.alloc, self.step
        c, live = f.act.chunked, self.state.forward.chunked
        self.loss_backward()
        fwd = self.state.forward
        fwd.head_keys += sch.alloc_many(fwd.head_offloaded, "activations")   # offloaded: unpacked
        head_params = step.head_backward_params()
        head_mm = [p for p in head_params if is_lm_head(p)]
        inputs: list[int] = []
        buffers = dict.fromkeys((p.name for p in head_mm), -1)
        for k in reversed(range(len(c.token_chunks))):
            for p in head_mm:
                buffers[p.name] = self.accumulate(p, buffers[p.name], last=k == 0)
            inputs.append(alloc(c.token_chunks[k] * c.hidden * c.mm, "activations"))
            sch.free(live.grads[k])
            if live.inputs:
                sch.free(live.inputs[k])
        live.grads.clear()
        live.inputs.clear()
        grad_in = alloc(sum(c.token_chunks) * c.hidden * c.mm, "activations")   # torch.chunk's backward: cat
        sch.free_all(inputs)
        sch.free_all(fwd.head_keys)
        for p in head_params:
            if p not in head_mm:
                step.make_grad(p, root_unit=True)
        step.flush_steps(it)
        sch.free(grad_in)

    def accumulate(self, p, buffer: int, last: bool) -> int:
        """One chunk's gradient of the lm_head weight `p` into autograd's input buffer of its AccumulateGrad node,
        which sums the uses' gradients out of place (the buffer and the new gradient freed once summed) and hands
        the last sum to AccumulateGrad as the gradient. Returns the buffer's key."""
        sch, n = self.sch, self.f.params.tp_local[p.name] * self.f.params.element_bytes[p.name]
        if buffer < 0 and last:            # one chunk: its gradient is the gradient
            self.step.make_grad(p, root_unit=True)
            return -1
        grad = sch.alloc(n, "gradients")
        if buffer < 0:
            return grad
        if last:
            self.step.make_grad(p, root_unit=True)
            total = -1
        else:
            total = sch.alloc(n, "gradients")
        sch.free(buffer)
        sch.free(grad)
        return total
