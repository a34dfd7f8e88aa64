"""HF's RMSNorm backward op by op (llmem.memory.activations.blocks.rmsnorm_backward) against transformers'
LlamaRMSNorm itself, run forward and backward on the CPU under the ledger of llmem's CPU measurement (RealTracker):
the same allocations and frees of the backward's own tensors, in the same order; by hand below for one case."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from llmem.memory.activations.blocks import (
    events_peak_bytes,
    norm_block,
    rmsnorm_backward,
    rmsnorm_forward_temps,
)
from llmem.runtime.ledger import Ledger, RealTracker
from llmem.setup.precision import F32, Regime

T, H = 256, 64      # [t, 1] fp32 = 1 KiB and [t, h] fp32 = 64 KiB: multiples of the ledger's 512 B rounding


def _traced_backward(dtype: torch.dtype) -> list[tuple[int, int]]:
    """(+1/-1, bytes) of the storages LlamaRMSNorm's backward makes, in order (a frozen weight, as under LoRA)."""
    ledger = Ledger()
    norm = LlamaRMSNorm(H).to(dtype).requires_grad_(False)
    x = torch.randn(T, H).to(dtype).requires_grad_(True)
    with RealTracker(ledger):
        y = norm(x)
        grad = torch.empty_like(y)
        start = ledger.next_key
        y.backward(grad)
        kept = x.grad        # the input's gradient: what the backward leaves
        del y
    assert kept is not None
    return [(1 if is_alloc else -1, size) for is_alloc, key, size, *_ in ledger.events if key >= start]


def _events(r: Regime) -> list[tuple[int, int]]:
    return [(sign, n) for sign, _tag, n in rmsnorm_backward(r, T, H)]


@pytest.mark.parametrize("regime", [Regime("autocast", 2, 2), Regime("lowp", 2, 2)])
def test_the_backward_is_autograds_own_sequence(regime):
    assert _events(regime) == _traced_backward(torch.bfloat16)


def test_an_fp32_stream_keeps_the_lump():
    """On an fp32 stream the norm's input is the residual itself, whose gradient sums with the residual branch's
    as each arrives: no events, the block's backward one transient of two [t, h] fp32 as before."""
    r = Regime("fp32", F32, F32)
    block, _ = norm_block("input_norm", "rmsnorm", r, T, H, ("input_layernorm",))
    assert rmsnorm_backward(r, T, H) == () == block.back_events == block.temps
    assert block.transient == 2 * T * H * 4


def test_a_bf16_stream_by_hand():
    f, s, g = T * H * 4, T * 4, T * H * 2
    assert _events(Regime("lowp", 2, 2)) == [
        (1, g), (1, f), (-1, g),                     # grad * weight; its cast to fp32
        (1, f), (1, f), (1, s), (-1, f), (-1, f),    # x * rsqrt's two gradients, the rsqrt's summed to [t, 1]
        (1, s), (1, s), (1, s), (-1, s), (-1, s), (-1, s),     # -0.5 * grad * rsqrt^3
        (1, f), (-1, s),                             # mean's: expanded / h
        (1, f), (1, f), (1, f), (-1, f), (-1, f), (-1, f),     # pow's: grad * (2 * x)
        (1, f), (-1, f), (-1, f),                    # x's two gradients summed
        (1, g), (-1, f)]                             # cast back to bf16
    # five [t, h] fp32 tensors at once (pow's three, x's first gradient, mean's), where the lump was two
    assert events_peak_bytes(rmsnorm_backward(Regime("lowp", 2, 2), T, H)) == 5 * f


def test_the_block_transient_is_the_events_peak_and_its_forward_temporaries():
    r = Regime("autocast", 2, 2)
    block, _ = norm_block("input_norm", "rmsnorm", r, T, H, ("input_layernorm",))
    assert block.transient == events_peak_bytes(block.back_events) == 5 * T * H * 4
    # x.pow(2), variance, variance + eps; on a bf16 stream x * rsqrt too
    assert [n for n, _a, _f in rmsnorm_forward_temps(r, T, H)] == [T * H * 4, T * 4, T * 4, T * H * 4]
