"""--liger: Liger-Kernel's RMSNorm and SwiGLU Functions, in the estimate's recipe and in the traced step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmem.errors import LlmemError
from llmem.estimator.engine import estimate
from llmem.memory.activations.profile import activation_profile
from llmem.model.resolved import resolve
from llmem.runtime.liger import RMSNormFunction, RopeFunction, SiLUMulFunction
from llmem.runtime.trace import trace
from llmem.setup.training import TrainingSetup

# tiny-llama: hidden 512, intermediate 1376, 4 layers; batch 2 x seq 256 = 512 tokens
T, H, INTER = 512, 512, 1376


def _setup(**kw) -> TrainingSetup:
    kw = {"model": "tiny-llama", "precision": "bf16", "optimizer": "sgd", "batch_size": 2, "seq_len": 256, **kw}
    return TrainingSetup(gpu="H100-80GB", **kw)


def test_rms_norm_keeps_its_input_and_fp32_rstd_per_norm():
    """HF's LlamaRMSNorm on a bf16 stream keeps an fp32 copy of x (4 B), rsqrt (fp32 [t]) and the bf16 normalised
    tensor (2 B); Liger's keeps x itself (2 B) and RSTD: 4 bytes per element fewer, for each of a layer's two norms
    and the final norm."""
    hf = activation_profile(resolve(_setup()))
    liger = activation_profile(resolve(_setup(liger="rms_norm")))
    assert hf.per_layer_saved - liger.per_layer_saved == 2 * 4 * T * H
    assert hf.head_saved - liger.head_saved == 4 * T * H
    norm = next(b for b in liger.blocks if b.name == "input_norm")
    assert norm.tensors == (2 * T * H, 4 * T)


def test_swiglu_keeps_gate_and_up_not_the_activation():
    """HF's MLP keeps gate (silu's input), silu(gate), up and the product (down_proj's input), all bf16; Liger's
    SiLUMul keeps gate and up, down_proj the product: one [t, intermediate] bf16 tensor fewer."""
    hf = activation_profile(resolve(_setup()))
    liger = activation_profile(resolve(_setup(liger="swiglu")))
    assert hf.per_layer_saved - liger.per_layer_saved == 2 * T * INTER
    act = next(b for b in liger.blocks if b.name == "mlp_act")
    assert act.tensors == (2 * T * INTER,) * 3


def test_under_lora_the_frozen_norms_keep_what_liger_saves_regardless():
    """LoRA (norm weights frozen): HF's RMSNorm keeps only what the input gradient needs, the fp32 copy and rsqrt
    (4 B per element); Liger's Function saves X (2 B) and RSTD whatever needs a gradient: 2 B fewer per element and
    norm; the MLP as without adapters (gate and up are the LoRA sums)."""
    kw = {"lora_rank": 8, "lora_targets": "all-linear"}
    hf = activation_profile(resolve(_setup(**kw)))
    liger = activation_profile(resolve(_setup(liger="rms_norm,swiglu", **kw)))
    assert hf.per_layer_saved - liger.per_layer_saved == 2 * 2 * T * H + 2 * T * INTER
    assert hf.head_saved - liger.head_saved == 2 * T * H


@pytest.mark.parametrize("kw", [
    {"model": "tiny-llama", "precision": "bf16", "liger": "rms_norm,swiglu,rope"},
    {"model": "tiny-qwen2", "precision": "bf16-mixed", "liger": "rms_norm,swiglu"},
])
def test_estimate_matches_the_trace_within_two_percent(kw):
    s = _setup(**kw)
    e, t = estimate(s), trace(s)
    assert e.peak_allocated_bytes == pytest.approx(t.peak_allocated_bytes, rel=0.02)
    assert e.peak_reserved_bytes == pytest.approx(t.peak_reserved_bytes, rel=0.02)


def test_the_functions_compute_what_hf_computes():
    torch.manual_seed(0)
    x = torch.randn(6, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(6, 16, dtype=torch.float64)
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    gx, gw = torch.autograd.grad(want, (x, w), dy)
    got = RMSNormFunction.apply(x, w, 1e-6)
    hx, hw = torch.autograd.grad(got, (x, w), dy.clone())
    # Liger computes in fp32 (its RSTD, its dW partial): fp32's precision
    assert all(torch.allclose(u, v, rtol=1e-5, atol=1e-5) for u, v in ((got, want), (hx, gx), (hw, gw)))

    a = torch.randn(6, 16, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, 16, dtype=torch.float64, requires_grad=True)
    want = F.silu(a) * b
    ga, gb = torch.autograd.grad(want, (a, b), dy)
    a2, b2 = (a.detach() * 1).requires_grad_(), (b.detach() * 1).requires_grad_()
    got = SiLUMulFunction.apply(a2 * 1, b2 * 1)      # non-leaf inputs: backward writes the gradients over them
    ha, hb = torch.autograd.grad(got, (a2, b2), dy.clone())
    assert all(torch.allclose(u, v, rtol=1e-5, atol=1e-5) for u, v in ((got, want), (ha, ga), (hb, gb)))


def test_rope_rotates_in_place_as_hf_does():
    """HF's apply_rotary_pos_emb (q * cos + rotate_half(q) * sin), forward and backward; Liger's writes the result
    over q's own [b, s, heads, d] storage."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    b, s, heads, d = 2, 5, 3, 8
    q0, k0 = torch.randn(b, s, heads, d, dtype=torch.float64), torch.randn(b, s, heads, d, dtype=torch.float64)
    angles = torch.randn(1, s, d // 2, dtype=torch.float64)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    dq, dk = torch.randn(b, heads, s, d, dtype=torch.float64), torch.randn(b, heads, s, d, dtype=torch.float64)
    q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
    want = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    gq, gk = torch.autograd.grad(want, (q, k), (dq, dk))
    q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
    qs, ks = q * 1, k * 1                               # q_proj's / k_proj's outputs, as views [b, heads, s, d]
    got = RopeFunction.apply(qs.transpose(1, 2), ks.transpose(1, 2), cos, sin)
    assert got[0].data_ptr() == qs.data_ptr()           # in place
    hq, hk = torch.autograd.grad(got, (q, k), (dq.clone(), dk.clone()))
    assert all(torch.allclose(u, v, rtol=1e-5, atol=1e-5) for u, v in
               ((got[0], want[0]), (got[1], want[1]), (hq, gq), (hk, gk)))


@pytest.mark.parametrize("kw, words", [
    ({"model": "gpt2", "liger": "rms_norm"}, "--liger on gpt2"),
    ({"liger": "rms_norm", "lora_rank": 8, "quant_base": "nf4"}, "--liger is modelled on a full fine-tune or LoRA"),
    ({"liger": "fused_linear_cross_entropy"}, "use --fused-ce"),
    ({"liger": "layer_norm"}, "unknown Liger kernel"),
])
def test_what_is_not_modelled_is_refused_in_one_line(kw, words):
    with pytest.raises(LlmemError, match=words):
        estimate(_setup(**kw))


def test_auto_applies_the_defaults_where_modelled_and_nothing_elsewhere():
    """--liger auto (use_liger_kernel's): rms_norm, swiglu, rope on a family whose patch llmem models; on GPT-2
    (no Liger patch: transformers' Trainer applies nothing) HF's modules, not a refusal."""
    llama = activation_profile(resolve(_setup(liger="auto")))
    named = activation_profile(resolve(_setup(liger="rms_norm,swiglu,rope")))
    assert llama.per_layer_saved == named.per_layer_saved < activation_profile(resolve(_setup())).per_layer_saved
    gpt2 = activation_profile(resolve(_setup(model="gpt2", liger="auto")))
    assert gpt2.per_layer_saved == activation_profile(resolve(_setup(model="gpt2"))).per_layer_saved
