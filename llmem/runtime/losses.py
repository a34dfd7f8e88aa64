"""Fused linear cross-entropy in pure PyTorch, with the memory behaviour of Liger-Kernel's
`LigerFusedLinearCrossEntropyFunction` (liger_kernel/ops/fused_linear_cross_entropy.py, v0.8):

- the tokens are processed in chunks; per chunk the logits are h_chunk @ W^T in the compute dtype, upcast to fp32,
  turned into the loss and, in place, into d loss / d logits (softmax minus one-hot, scaled by 1 / n_valid);
- the gradients of the hidden states (grad_input, [tokens, hidden] in the hidden states' dtype) and of the lm_head
  weight (grad_weight, [vocab, hidden] in the weight's dtype) are computed in the forward and kept for backward;
  the full [tokens, vocab] logits never exist;
- Liger's chunk rule: inc_factor = ceil(V / H), chunk = next_power_of_2(ceil(BT / inc_factor)), at most BT, so a
  chunk's logits are about BT x H elements;
- backward multiplies the kept gradients by grad_output in place (Liger's element_mul_kernel) and returns them.

Where Liger's Triton kernel writes the logit gradient over the low-precision logits, this version keeps an fp32
upcast of the chunk (the softmax is computed in fp32) and casts the gradient back to the compute dtype for the
matmuls; grad_weight is accumulated in place (Liger's `addmm(..., out=grad_weight)` path, no parameter-sized
temporary), from the fp32 gradient when the accumulator is fp32 (autocast with fp32 master weights).
"""

from __future__ import annotations

import torch

from llmem.memory.activations.loss import chunk_tokens

IGNORE_INDEX = -100   # HF's ForCausalLMLoss ignore_index


class FusedLinearCrossEntropy(torch.autograd.Function):
    """loss = mean over non-ignored tokens of cross_entropy(hidden @ weight^T + bias, target)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                compute_dtype: torch.dtype):
        tokens, hid = hidden.shape
        vocab = weight.shape[0]
        chunk = chunk_tokens(tokens, hid, vocab)
        w = weight.to(compute_dtype)                  # autocast's cast of the weight (a no-op when it matches)
        b = bias.to(compute_dtype) if bias is not None else None
        grad_input = torch.zeros_like(hidden) if hidden.requires_grad else None
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        grad_bias = torch.zeros_like(bias) if bias is not None and bias.requires_grad else None
        valid = (target != IGNORE_INDEX).to(torch.float32)
        scale = valid / valid.sum().clamp(min=1.0)    # mean over the non-ignored tokens, no host sync
        safe = target.clamp(min=0)
        loss_1d = torch.zeros(tokens, dtype=torch.float32, device=hidden.device)
        for start in range(0, tokens, chunk):
            end = min(start + chunk, tokens)
            x = hidden[start:end].to(compute_dtype)
            logits = x @ w.t()
            if b is not None:
                logits += b
            p = logits.float()                        # the fp32 upcast (the logits themselves when fp32)
            del logits
            tgt = safe[start:end, None]
            lse = torch.logsumexp(p, dim=-1)
            loss_1d[start:end] = (lse - p.gather(1, tgt).squeeze(1)) * scale[start:end]
            p.sub_(lse[:, None]).exp_()               # softmax, in place
            p.scatter_add_(1, tgt, torch.full_like(lse[:, None], -1.0))
            p.mul_(scale[start:end, None])            # d loss / d logits (fp32)
            del lse
            if grad_weight is not None and grad_weight.dtype != compute_dtype:
                grad_weight.addmm_(p.t(), hidden[start:end].float())   # fp32 accumulator, fp32 gradient
            g = p.to(compute_dtype)
            del p
            if grad_input is not None:
                if grad_input.dtype == compute_dtype:
                    torch.mm(g, w, out=grad_input[start:end])
                else:
                    grad_input[start:end] = g @ w
            if grad_weight is not None and grad_weight.dtype == compute_dtype:
                grad_weight.addmm_(g.t(), x)
            if grad_bias is not None:
                grad_bias += g.sum(0).to(grad_bias.dtype)
            del g, x
        del w, b
        ctx.save_for_backward(grad_input, grad_weight, grad_bias)
        return loss_1d.sum()

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight, grad_bias = ctx.saved_tensors
        for g in (grad_input, grad_weight, grad_bias):   # Liger's element_mul_kernel: in place
            if g is not None:
                g.mul_(grad_output)
        return grad_input, grad_weight, grad_bias, None, None


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF's ForCausalLMLoss: the label of token i is token i + 1; the last token of each row predicts nothing."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               labels: torch.Tensor) -> torch.Tensor:
    """The causal-LM loss of `hidden` ([batch, seq, hidden]) through the lm_head (weight [vocab, hidden]) without the
    full logits. Under autocast the matmuls run in the autocast dtype (autocast itself is off inside)."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = hidden.dtype
    with torch.autocast(device_type, enabled=False):
        return FusedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias,
                                             shifted_labels(labels), compute_dtype)


def causal_lm_loss_in_model_dtype(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                                  num_items_in_batch: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX,
                                  shift_labels: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """transformers' ForCausalLMLoss (loss/loss_utils.py) without its `logits = logits.float()`: cross_entropy on the
    logits in the dtype the lm_head produced them (--logits-dtype model), as a trainer computing its own loss on bf16
    logits does. Under autocast, log_softmax and nll_loss still run in fp32 (its CUDA policy)."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = torch.nn.functional.cross_entropy(logits.view(-1, vocab_size), shift_labels.view(-1).to(logits.device),
                                             ignore_index=ignore_index, reduction=reduction)
    if reduction == "sum":
        loss = loss / num_items_in_batch
    return loss


class CEWithChunkedOutputLoss(torch.nn.Module):
    """torchtune's CEWithChunkedOutputLoss (torchtune/modules/loss/ce_chunked_output_loss.py, 0.6.1), as written
    there: each chunk of logits upcast and cross-entropied on its own (reduction "sum"), the sum divided by the
    number of labelled tokens. llmem does not depend on torchtune; this is its code."""

    def __init__(self, num_output_chunks: int = 8, ignore_index: int = IGNORE_INDEX) -> None:
        super().__init__()
        self.num_output_chunks = num_output_chunks
        self.ignore_index = ignore_index

    def compute_cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=self.ignore_index,
                                                 reduction="sum")

    def forward(self, logits: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        total_elements = (labels != self.ignore_index).sum()
        labels = [target_chunk.reshape(-1) for target_chunk in labels.chunk(self.num_output_chunks, dim=1)]
        logits = [logit_chunk.reshape(-1, logit_chunk.size(-1)) for logit_chunk in logits]
        total_loss = 0.0
        for logits_chunk, labels_chunk in zip(logits, labels, strict=True):
            total_loss += self.compute_cross_entropy(logits_chunk, labels_chunk)
        return total_loss / total_elements


def torchtune_shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """torchtune's recipes' `_loss_step`: `torch.hstack((labels[..., 1:], ignore_labels_cache[:batch]))`, the last
    position of each row labelled with the ignore index."""
    ignore = torch.full((labels.shape[0], 1), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
    return torch.hstack((labels[..., 1:], ignore))
