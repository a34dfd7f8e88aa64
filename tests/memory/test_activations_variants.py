"""Activation options: every-k-th-layer checkpointing, fused cross-entropy, flash attention, activation
offloading. Bytes are worked out by hand from the shapes; the fused loss is checked against F.cross_entropy."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from llmem.cli import build_parser
from llmem.cli.options import setup_from_args
from llmem.errors import LlmemError
from llmem.estimator.schedule import StepSchedule
from llmem.memory.activations.profile import activation_profile
from llmem.model.resolved import resolve
from llmem.runtime.losses import chunk_tokens, fused_linear_cross_entropy
from llmem.setup.training import TrainingSetup

# tiny-llama: hidden 512, 8 heads of 64 (no GQA), intermediate 1376, vocab 32000, 4 layers
T, H, FF, V, L = 2 * 256, 512, 1376, 32000, 4


def _setup(**kw) -> TrainingSetup:
    return TrainingSetup(model="tiny-llama", batch_size=2, seq_len=256, gpu="H100-80GB", **kw)


# ---------------------------------------------------------------------------------------------- checkpointing

def test_every_second_layer_keeps_inputs_of_half_and_everything_of_the_rest():
    """bf16 Llama layer, by hand: two RMSNorms (fp32 copy 4th + rsqrt 4t + normalised 2th) = 2 x 1,574,912; the
    q/k/v input and the gate/up input 2 x 2th; SDPA q, k, v, out 4 x 2th + lse 4 x 2 x 8 x 256; SwiGLU 4 x 2ti."""
    norm = 4 * T * H + 4 * T + 2 * T * H
    full = 2 * norm + 2 * (2 * T * H) + 4 * (2 * T * H) + 4 * 2 * 8 * 256 + 4 * (2 * T * FF)
    assert full == 11_948_032
    layer_input = 2 * T * H
    prof = activation_profile(resolve(_setup(precision="bf16", grad_ckpt=True, ckpt_every=2)))
    assert [prof.checkpointed(i) for i in range(L)] == [True, False, True, False]
    # ceil(4/2) checkpointed inputs + floor(4/2) full layers
    assert prof.layers_saved() == 2 * layer_input + 2 * full == 24_944_640
    every = activation_profile(resolve(_setup(precision="bf16", grad_ckpt=True)))
    assert every.layers_saved() == 4 * layer_input
    # 5 layers, k = 2: layers 0, 2, 4 checkpointed
    assert prof.checkpointed_layers(5) == 3


def test_real_step_checkpoints_layers_whose_index_is_a_multiple_of_k():
    from transformers.modeling_layers import GradientCheckpointingLayer

    from llmem.runtime.build import enable_checkpointing, meta_model_for

    model = meta_model_for(_setup(precision="bf16"))
    assert enable_checkpointing(model, 2) == [0, 2]
    flags = [m.gradient_checkpointing for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert flags == [True, False, True, False]
    model = meta_model_for(_setup(precision="bf16"))
    assert enable_checkpointing(model, 3) == [0, 3]
    model = meta_model_for(_setup(precision="bf16"))
    assert enable_checkpointing(model, 1) == [0, 1, 2, 3]


def test_every_second_layer_sits_between_none_and_every_layer_in_the_trace():
    from llmem.runtime.trace import trace

    peaks = [trace(_setup(precision="bf16-mixed", optimizer="sgd", **kw)).peak_allocated_bytes
             for kw in ({}, {"grad_ckpt": True, "ckpt_every": 2}, {"grad_ckpt": True})]
    assert peaks[0] > peaks[1] > peaks[2]


def test_cli_grad_ckpt_every_implies_grad_ckpt_and_reaches_json():
    args = build_parser().parse_args(["estimate", "tiny-llama", "--grad-ckpt-every", "2", "--fused-ce",
                                      "--offload-activations", "--attn", "flash"])
    s = setup_from_args(args)
    assert (s.grad_ckpt, s.ckpt_every, s.fused_ce, s.offload_activations, s.attn) == (True, 2, True, True, "flash")
    d = s.to_dict()
    assert d["ckpt_every"] == 2 and d["fused_ce"] and d["offload_activations"]
    with pytest.raises(LlmemError):
        setup_from_args(build_parser().parse_args(["estimate", "tiny-llama", "--grad-ckpt-every", "0"]))


# ---------------------------------------------------------------------------------------------- fused CE

def test_liger_chunk_rule():
    # Liger's own example: BT = 4096 * 4, V = 32000, H = 4096 -> inc_factor 8, chunk 2048
    assert chunk_tokens(4096 * 4, 4096, 32000) == 2048
    # tiny-llama 2 x 256: inc_factor ceil(32000 / 512) = 63, ceil(512 / 63) = 9 -> 16
    assert chunk_tokens(512, 512, 32000) == 16
    assert chunk_tokens(3, 4096, 1000) == 3      # one chunk covers everything, never more than the tokens


def test_fused_loss_and_gradients_equal_cross_entropy():
    torch.manual_seed(0)
    b, s, h, v = 2, 37, 16, 100          # 74 tokens, chunks of 16 (inc_factor 7 -> ceil(74 / 7) = 11 -> 16)
    hidden = torch.randn(b, s, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    bias = torch.randn(v, requires_grad=True)
    labels = torch.randint(0, v, (b, s))
    labels[0, 5] = -100
    loss = fused_linear_cross_entropy(hidden, weight, bias, labels)
    loss.backward()
    got = [hidden.grad, weight.grad, bias.grad]
    h2, w2, b2 = (x.detach().clone().requires_grad_() for x in (hidden, weight, bias))
    logits = h2 @ w2.t() + b2
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, v), labels[:, 1:].reshape(-1), ignore_index=-100)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    for g, r in zip(got, (h2.grad, w2.grad, b2.grad), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


def test_fused_loss_keeps_gradients_in_the_right_dtypes():
    """bf16-mixed Llama: the final hidden states are fp32 (RMSNorm on the fp32 stream), so grad_input is fp32 t x h;
    grad_weight is the fp32 master's V x h; the weight is cast to bf16 for the loss. Pure bf16: all 2 bytes."""
    f = activation_profile(resolve(_setup(precision="bf16-mixed", fused_ce=True))).fused_ce
    assert (f.grad_input_bytes, f.grad_weight_bytes, f.weight_cast_bytes) == (T * H * 4, V * H * 4, V * H * 2)
    assert f.chunk == 16
    f = activation_profile(resolve(_setup(precision="bf16", fused_ce=True))).fused_ce
    assert (f.grad_input_bytes, f.grad_weight_bytes, f.weight_cast_bytes) == (T * H * 2, V * H * 2, 0)


def test_fused_loss_section_has_no_full_logits():
    """2 x 96 tokens (t = 192, chunks of ceil(192 / 63) = 4): neither the schedule nor the traced step allocates the
    [t, V] logits (bf16 12,288,000 B) or their fp32 upcast (24,576,000 B), which the plain loss does; the chunk's
    fp32 logits (4 x 32000 x 4 B) are there."""
    from llmem.runtime.trace import trace_with_details

    t = 2 * 96
    full = {t * V * 2, t * V * 4}
    setup = TrainingSetup(model="tiny-llama", batch_size=2, seq_len=96, gpu="H100-80GB", precision="bf16-mixed",
                          optimizer="sgd", fused_ce=True)
    act = activation_profile(resolve(setup))
    assert act.fused_ce.chunk == 4
    sch = StepSchedule(resolve(setup), act).build()
    loss_sizes = [size for sign, _k, size, _s, comp in sch.events if sign > 0 and comp == "logits_and_loss"]
    assert max(loss_sizes) == 4 * V * 4
    assert not full & {size for _sg, _k, size, _s, _c in sch.events}
    _, details = trace_with_details(setup)
    traced = {e[2] for e in details.ledger.events if e[0]}
    assert not full & traced and 4 * V * 4 in traced
    _, plain = trace_with_details(TrainingSetup(**{**setup.to_dict(), "fused_ce": False}))
    assert full <= {e[2] for e in plain.ledger.events if e[0]}


def test_fused_ce_refuses_tensor_parallelism():
    from llmem.estimator.engine import estimate

    with pytest.raises(LlmemError, match="tensor parallelism"):
        estimate(TrainingSetup(model="tiny-llama", method="tp", gpus=2, precision="bf16", fused_ce=True))


# ---------------------------------------------------------------------------------------------- flash

def test_flash_needs_half_precision_and_an_sdpa_model():
    from llmem.estimator.engine import estimate

    with pytest.raises(LlmemError, match="flash"):
        _setup(precision="fp32", attn="flash")
    with pytest.raises(LlmemError, match="flash"):
        estimate(TrainingSetup(model="tiny-bloom", precision="bf16", attn="flash"))
    assert any("flash SDPA kernel" in n for n in estimate(_setup(precision="bf16-mixed", attn="flash")).notes)


def test_packed_flash_runs_varlen_without_the_mask_sdpa_keeps():
    """--packing, tiny-llama bf16 (b=2, s=256, no GQA): SDPA gets the boolean block-diagonal mask (b x s x s = 131,072
    B, live in the forward) and keeps its bf16 bias per layer (2 x 256 x 256 x 2 = 262,144 B); flash attention runs
    varlen on cu_seqlens: neither."""
    flash = activation_profile(resolve(_setup(precision="bf16", packing=True, attn="flash")))
    sdpa = activation_profile(resolve(_setup(precision="bf16", packing=True)))
    assert (flash.mask_bytes, sdpa.mask_bytes) == (0, 131_072)
    assert sdpa.per_layer_saved - flash.per_layer_saved == 262_144
    assert flash.per_layer_saved == 11_948_032          # the unpacked layer (test_every_second_layer...)


# ---------------------------------------------------------------------------------------------- offload

def test_offload_packs_activations_but_not_parameters_or_small_tensors():
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensorMode

    from llmem.runtime.offload import ActivationOffload

    off = ActivationOffload(None)
    with FakeTensorMode():
        weight = nn.Parameter(torch.empty(64, 64))
        act = torch.empty(64, 64)
        small = torch.empty(255)               # 1020 bytes: under torchtune's 1 KiB
        off.active = True
        assert off.pack(weight) is weight and off.pack(weight.t()) is not None
        assert isinstance(off.pack(weight.t()), torch.Tensor)       # a view of a parameter stays
        assert off.pack(small) is small
        device, host = off.pack(act)
        assert host.device.type == "meta"                           # nothing on the (fake) device
        back = off.unpack((device, host))
        assert back.shape == act.shape and back.device == act.device
        off.active = False
        assert off.pack(act) is act                                 # after the lm_head: not offloaded


def test_offload_gives_back_the_saved_layout():
    """torchtune's host copy is `torch.empty_like(activation, device="cpu")` and comes back by `.to("cuda")`: a dense
    tensor's strides survive (SDPA's output as [b, s, heads, d] in [b, heads, s, d] memory, which a compiled backward
    views as saved); a non-dense slice comes back dense in its dimensions' order, as empty_like on real CPU
    tensors makes it (checked here against torch.empty_like of a real tensor of that layout)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from llmem.runtime.offload import ActivationOffload

    off = ActivationOffload(None)
    off.active = True
    with FakeTensorMode():
        out = torch.empty(2, 8, 256, 64).transpose(1, 2)           # strides (131072, 64, 16384, 1)
        back = off.unpack(off.pack(out))
        assert back.shape == out.shape and back.stride() == (131072, 64, 16384, 1)
        sliced = out[:, :, :3]                                       # not dense
        back = off.unpack(off.pack(sliced))
    real = torch.empty(2, 8, 256, 64).transpose(1, 2)[:, :, :3]
    assert back.stride() == torch.empty_like(real, device="cpu").stride() == (3 * 256 * 64, 64, 256 * 64, 1)


def _live_activations_at_backward(setup: TrainingSetup) -> int:

    act = activation_profile(resolve(setup))
    sch = StepSchedule(resolve(setup), act).build()
    start = dict((name, i) for i, name in sch.phase_starts)["it1:backward"]
    return sum(sign * size for sign, _k, size, _s, comp in sch.events[:start] if comp == "activations")


def test_offload_keeps_only_the_lm_head_input_on_the_device_at_the_loss():
    """bf16 tiny-llama, no checkpointing. Without offload, when the backward starts: 4 layers x 11,948,032, the final
    RMSNorm (fp32 copy 4th, rsqrt 4t, normalised 2th), the lm_head input 2th and rotary cos/sin (2 x 256 x 64 x 2).
    With offload only the lm_head input (not offloaded, as torchtune's NoOpManager on the output layer) is left."""
    norm = 4 * T * H + 4 * T + 2 * T * H
    assert _live_activations_at_backward(_setup(precision="bf16", optimizer="sgd")) == \
        4 * 11_948_032 + norm + 2 * T * H + 2 * (256 * 64 * 2)
    assert _live_activations_at_backward(_setup(precision="bf16", optimizer="sgd", offload_activations=True)) == \
        2 * T * H


def test_offloaded_bytes_are_the_saved_tensors_that_leave_the_device():
    """bf16 tiny-llama b=2 s=256, by hand: a layer keeps 11,948,032 B (the test above); the final RMSNorm keeps
    4th + 4t + 2th = 1,574,912 and rotary cos/sin 2 x 256 x 64 x 2 = 65,536 (both go to the host); the lm_head's
    input stays. Checkpointed, a layer's input (2th = 524,288, the hidden states torch's checkpoint saves) goes to
    the host too, while rotary cos/sin stay: the checkpoints' recompute partials hold them (the trace: the
    layer inputs packed by the offload hooks from inside torch.utils.checkpoint, cos/sin live at the loss)."""
    layer, norm, rotary, layer_input = 11_948_032, 4 * T * H + 4 * T + 2 * T * H, 2 * (256 * 64 * 2), 2 * T * H
    assert (layer, norm, rotary, layer_input) == (11_948_032, 1_574_912, 65_536, 524_288)

    def offloaded(**kw) -> int:
        setup = _setup(precision="bf16", optimizer="sgd", offload_activations=True, **kw)
        return activation_profile(resolve(setup)).offloaded_bytes

    assert offloaded() == 4 * layer + norm + rotary == 49_432_576
    assert offloaded(grad_ckpt=True) == 4 * layer_input + norm == 3_672_064
    # layers 0 and 2 checkpointed (their inputs), 1 and 3 whole
    assert offloaded(grad_ckpt=True, ckpt_every=2) == 2 * layer + 2 * layer_input + norm == 26_519_552
    assert activation_profile(resolve(_setup(precision="bf16", optimizer="sgd"))).offloaded_bytes == 0


def _offload_drop(**kw) -> tuple[int, int]:
    """(peak_allocated drop, live activations drop at the backward's start) of --offload-activations, estimate."""
    from llmem import estimate

    on, off = _setup(precision="bf16", offload_activations=True, **kw), _setup(precision="bf16", **kw)
    return (estimate(off).peak_allocated_bytes - estimate(on).peak_allocated_bytes,
            _live_activations_at_backward(off) - _live_activations_at_backward(on))


def test_offload_under_checkpointing_moves_the_checkpointed_inputs_to_the_host():
    """bf16 tiny-llama b=2 s=256 (t = 512), checkpointed. torch's non-reentrant checkpoint saves each layer's input
    (the hidden states, t x 512 x 2 B = 524,288) through the saved-tensor hooks outside its own, so torchtune's
    OffloadActivations packs it to the host; so does the final RMSNorm (fp32 copy 4th, rsqrt 4t, normalised 2th:
    1,574,912). Rotary cos/sin stay (the recompute's keyword arguments). At the loss, where the peak is, the device
    holds that much less:
    - full fine-tuning: 4 inputs + the norm = 3,672,064;
    - every 2nd layer: layers 1 and 3 whole (11,948,032 each) + the inputs of 0 and 2 + the norm = 26,519,552;
    - LoRA r8 (frozen base): the embedding's output is a leaf that requires grad (transformers'
      enable_input_require_grads under checkpointing), held by its AccumulateGrad node: layer 0's input stays; the
      frozen norm keeps no normalised tensor and the frozen lm_head no input: 3 inputs + 4th + 4t = 2,623,488.
    The trace measures the same drops (test_offload_drops_match_the_trace)."""
    layer_input, norm = 2 * T * H, 4 * T * H + 4 * T + 2 * T * H
    assert (layer_input, norm) == (524_288, 1_574_912)
    full = 4 * layer_input + norm
    assert _offload_drop(optimizer="sgd", grad_ckpt=True) == (full, full) == (3_672_064,) * 2
    every2 = 2 * 11_948_032 + 2 * layer_input + norm
    assert _offload_drop(optimizer="sgd", grad_ckpt=True, ckpt_every=2) == (every2, every2) == (26_519_552,) * 2
    lora = 3 * layer_input + 4 * T * H + 4 * T
    assert _offload_drop(lora_rank=8, grad_ckpt=True) == (lora, lora) == (2_623_488,) * 2


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{"optimizer": "sgd"}, {"optimizer": "sgd", "ckpt_every": 2}, {"lora_rank": 8}],
                         ids=["full", "every-2", "lora"])
def test_offload_drops_match_the_trace(kw):
    """The live activations when the backward starts, traced with and without offloading under checkpointing: the
    real step's drop is the estimate's (the hand numbers above)."""
    from llmem.runtime.trace import trace_with_details

    def live(setup) -> int:
        _, details = trace_with_details(setup)
        led, total = details.ledger, 0
        for is_alloc, key, size, phase, it, _m, _s in led.events:
            if it == 1 and phase == 2:
                break
            if led.cat.get(key) == "activations":
                total += size if is_alloc else -size
        return total

    on = _setup(precision="bf16", grad_ckpt=True, offload_activations=True, **kw)
    off = _setup(precision="bf16", grad_ckpt=True, **kw)
    assert live(off) - live(on) == _live_activations_at_backward(off) - _live_activations_at_backward(on)


def test_offload_trace_has_no_layer_activations_on_the_device_at_the_loss():
    from llmem.runtime.trace import trace_with_details

    _, details = trace_with_details(_setup(precision="bf16", optimizer="sgd", offload_activations=True))
    led = details.ledger
    live = 0
    for is_alloc, key, size, phase, it, _m, _s in led.events:
        if it == 1 and phase == 2:
            break
        if led.cat.get(key) == "activations":
            live += size if is_alloc else -size
    # the lm_head input (2th), the int64 input ids (2 x 256 x 8) and a few small index tensors; no layer's
    # tensors (11,948,032 B each without offload)
    assert 2 * T * H + 2 * 256 * 8 <= live < 2 * T * H + 16 * 1024


# ---------------------------------------------------------------------------------------------- packing

def test_packing_adds_the_mask_bias_and_repeats_grouped_kv():
    """tiny-mistral bf16 (8 query heads, 2 kv heads of 64; t = 512): SDPA keeps q, k, v, out and the fp32 lse.
    Unpacked, GQA runs natively: k and v are 2 x 512 x 128 bytes each. Packed, transformers passes the
    block-diagonal mask, so GQA is off (repeat_kv: k, v as large as q) and the kernel keeps the bf16 bias
    [2, 1, 256, 256]; rotary cos/sin get one row per sample row; the boolean mask lives through the forward."""
    lse = 4 * 2 * 8 * 256

    def attention(prof):
        return next(b for b in prof.blocks if b.name == "attention").saved

    def mistral(**kw):
        return replace(_setup(precision="bf16", **kw), model="tiny-mistral")

    plain = activation_profile(resolve(mistral()))
    packed = activation_profile(resolve(mistral(packing=True)))
    assert attention(plain) == 2 * T * 512 * 2 + 2 * T * 128 * 2 + lse == 1_327_104
    assert attention(packed) == 4 * (2 * T * 512) + lse + 2 * 256 * 256 * 2 == 2_375_680
    assert (plain.shared_saved, packed.shared_saved) == (2 * 256 * 64 * 2, 2 * 2 * 256 * 64 * 2)
    assert (plain.mask_bytes, packed.mask_bytes) == (0, 2 * 256 * 256)
    # flash packs through cu_seqlens: no mask, no bias
    flash = activation_profile(resolve(mistral(packing=True, attn="flash")))
    assert attention(flash) == attention(plain) and flash.mask_bytes == 0


def test_packed_position_ids_restart_per_sample():
    from llmem.runtime.build import packed_position_ids

    pos = packed_position_ids(2, 6, "cpu")
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 2, 0, 1, 2]]


def test_deep_models_extrapolate_every_kth_layer_checkpointing_exactly():
    """Extrapolation from two shallow replays is exact when both depths are congruent to the model's depth mod k
    (ceil(depth / k) checkpointed layers grows linearly along them): Qwen2.5-0.5B, 24 layers, draft depths 4 and 8
    become 4 and 9 with k = 5 (24 - 8 = 16 is 1 mod 5) and 6 and 9 with k = 3 (20 is 2 mod 3, 16 is 1 mod 3)."""
    from llmem.estimator.engine import DRAFT_FROM, replayed_step

    for k in (3, 5):
        setup = TrainingSetup(model="Qwen/Qwen2.5-0.5B", precision="bf16", optimizer="sgd", batch_size=2,
                              seq_len=2048, grad_ckpt=True, ckpt_every=k, gpu="H100-80GB")
        act = activation_profile(resolve(setup))
        draft = replayed_step(resolve(setup), act, DRAFT_FROM)
        full = replayed_step(resolve(setup), act, (10**6, 10**6))
        assert draft.peak_allocated_bytes == pytest.approx(full.peak_allocated_bytes, rel=1e-4), k


def test_fused_step_loss_and_gradients_match_the_hf_loss_on_a_real_model():
    """The step's --fused-ce wiring (causal LM forward -> base model -> lm_head forward = fused loss) on a real
    fp32 tiny-llama on the CPU: same loss and lm_head / embedding gradients as transformers' own loss."""
    from llmem.runtime.build import init_real_weights, install_fused_ce, meta_model_for

    torch.manual_seed(0)
    setup = TrainingSetup(model="tiny-llama", precision="fp32", batch_size=2, seq_len=16)
    model = meta_model_for(setup)
    model.to_empty(device="cpu")
    init_real_weights(model)
    ids = torch.randint(0, V, (2, 16))
    ref = model(input_ids=ids, labels=ids).loss
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if "lm_head" in n or "embed" in n}
    model.zero_grad(set_to_none=True)
    install_fused_ce(model)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    for n, g in ref_grads.items():
        torch.testing.assert_close(dict(model.named_parameters())[n].grad, g, rtol=1e-4, atol=1e-6)
