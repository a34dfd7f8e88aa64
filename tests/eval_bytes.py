"""The loss-only eval phase of tiny-llama worked out by hand (tests/estimator/test_eval_phase.py explains each
term): shared by the estimate's and the plan's job-fit tests."""

from __future__ import annotations

from llmem.setup.gpus import resolve_gpu

H, FFN, LAYERS, V = 512, 1376, 4, 32000          # llmem/model/catalog/tiny/tiny-llama.json
EMBED = V * H
LAYER = 4 * H * H + 3 * H * FFN + 2 * H
P = 2 * EMBED + LAYERS * LAYER + H                 # 45,421,056
WORKSPACE = resolve_gpu("A100-80GB", None, None).cublas_workspace_bytes
RESIDENT = 4 * P + 8 * P + WORKSPACE               # fp32 weights, AdamW's exp_avg and exp_avg_sq, the workspace
SEQ = 256


def loss_only_eval_bytes(batch: int) -> int:
    """The loss-only eval phase's peak on tiny-llama at eval batch `batch`, worked out as test_loss_only_eval_is_the_no_grad_forward_at_its_head does."""
    t = batch * SEQ
    casts = 2 * (EMBED + LAYERS * (4 * H * H + 3 * H * FFN))
    return RESIDENT + 3 * t * 8 + casts + t * H * 4 + t * V * (2 + 4 + 4)
