"""torchtitan's op-level SAC policy (llmem.runtime.selective_ac) wrapped to record what it stores: the bytes of
every output the real policy marks MUST_SAVE in a forward (not its recompute), for the tests that check the
estimate's stored tensors against torch's own selective checkpoint."""

from __future__ import annotations

from collections.abc import Callable

import torch


def recording_policy(real_policy: Callable, stored: list[int], size: Callable[[torch.Tensor], int | None]):
    """A stand-in for `op_sac_policy` that appends size(t) of each stored output tensor (None: not counted)."""
    def recording(meta):
        policy = real_policy(meta)

        def decide(ctx, func, *args, **kwargs):
            out = policy(ctx, func, *args, **kwargs)
            if out == torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
                outs = ctx.op_output if isinstance(ctx.op_output, tuple) else (ctx.op_output,)
                stored.extend(n for t in outs if isinstance(t, torch.Tensor) and (n := size(t)) is not None)
            return out
        return decide
    return recording
