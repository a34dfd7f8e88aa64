"""torchtitan's op-level selective activation checkpointing (--ac-policy op), written from torch's API: the
`context_fn` that torch.utils.checkpoint runs each checkpointed layer's forward and recompute under.

torchtitan/distributed/activation_checkpoint.py (`_apply_op_sac`, its `_op_sac_save_list`) wraps each block in
`checkpoint_wrapper(..., context_fn=selective_checkpointing_context_fn)`, whose policy returns MUST_SAVE for the ops
of its save list - except every second aten.mm of the forward (it counts them per checkpointed call and saves the
1st, 3rd, ...) - and PREFER_RECOMPUTE for all else. torch.utils.checkpoint.create_selective_checkpoint_contexts
runs the forward under a dispatch mode that keeps the MUST_SAVE ops' outputs and hands them back, instead of
recomputing them, in the backward's recompute. (torchtitan also MUST_SAVEs a device-to-host `_to_copy`, its
activation offloading, which llmem does not combine with this policy; per-fqn forced recompute of mm shapes is not
modelled either.)"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten


def _save_list() -> frozenset:
    """torchtitan's _op_sac_save_list, less the ops this torch build does not have."""
    ops = [_aten.mm.default, _aten._scaled_dot_product_efficient_attention.default,
           _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_cudnn_attention.default,
           _aten.max.default, _aten.abs.default]
    if hasattr(_aten, "_scaled_dot_product_attention_math"):
        ops.append(_aten._scaled_dot_product_attention_math.default)
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None and hasattr(functional, "reduce_scatter_tensor"):
        ops.append(functional.reduce_scatter_tensor.default)
    try:
        from torch._higher_order_ops.flex_attention import flex_attention
        ops.append(flex_attention)
    except ImportError:     # pragma: no cover - older torch
        pass
    return frozenset(ops)


OP_SAC_SAVE_LIST = _save_list()


def op_sac_policy(meta: dict[str, int]) -> Callable:
    """torchtitan's `_custom_policy`: the ops of the save list saved, every second mm of a forward recomputed."""
    def policy(ctx, func, *args, **kwargs):
        mm_key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func == _aten.mm.default:
            meta[mm_key] += 1
        to_save = func in OP_SAC_SAVE_LIST and not (func == _aten.mm.default and meta[mm_key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if to_save else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def op_sac_context():
    """torchtitan's selective_checkpointing_context_fn: a fresh mm count per checkpointed call."""
    return create_selective_checkpoint_contexts(op_sac_policy(defaultdict(int)))


CONTEXT_FNS: dict[str, Callable] = {"op": op_sac_context}   # --ac-policy rows that are selective
