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


def stored_under_op_sac(monkeypatch, config, size: Callable[[torch.Tensor], int | None]) -> list[int]:
    """What torch's selective checkpoint stores of a bf16 model of `config` (SDPA as CUDA's sm90 picks it) under
    llmem's op-level policy, in one forward and backward on fake tensors of 2 x 32 tokens."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    import llmem.runtime.selective_ac as sac
    from llmem.runtime.build import enable_checkpointing
    from llmem.runtime.cuda import cuda_like_sdpa

    stored: list[int] = []
    monkeypatch.setattr(sac, "op_sac_policy", recording_policy(sac.op_sac_policy, stored, size))
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.train()
    enable_checkpointing(model, 1, "op")
    with cuda_like_sdpa((9, 0)), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        ids = mode.from_tensor(torch.randint(0, 256, (2, 32)))
        model(input_ids=ids, labels=ids).loss.backward()
    return stored
