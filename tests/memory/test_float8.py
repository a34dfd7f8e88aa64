"""--float8: torchao's Float8Linear in the estimate (its casts' temporaries, FSDP2's float8 all-gather) and the set-up
checks. Bytes worked out by hand from torchao 0.18's code (float8_linear.py, float8_scaling_utils.py)."""

from __future__ import annotations

import pytest

from llmem.errors import LlmemError
from llmem.estimator.states import fsdp_gathered_tensors
from llmem.memory.activations.float8 import backward_events, cast_events, converted_linears, forward_events
from llmem.memory.activations.profile import activation_profile
from llmem.memory.quant import events_peak
from llmem.model.anatomy import ParamInfo
from llmem.model.resolved import resolve
from llmem.setup.float8 import converted
from llmem.setup.training import TrainingSetup

# tiny-llama: hidden 512, intermediate 1376, 4 layers of 7 linears; batch 2 x seq 256 = 512 tokens
T, H, INTER = 512, 512, 1376
DOWN = ParamInfo("model.layers.0.mlp.down_proj.weight", (H, INTER), "bfloat16", "Linear", 0, None)


def _setup(**kw) -> TrainingSetup:
    kw = {"model": "tiny-llama", "precision": "bf16", "optimizer": "sgd", "batch_size": 2, "seq_len": 256, **kw}
    return TrainingSetup(gpu="H100-80GB", **kw)


def _net(events) -> int:
    return sum(sign * n for sign, _, n in events)


def test_one_cast_peaks_at_nine_bytes_an_element_and_leaves_one():
    """abs (2 B, freed), the fp32 copy (4 B) and its scaled product (4 B), the copy freed, clamp (4 B) and the
    float8 result (1 B): 4 + 4 + 1 = 9 bytes an element at once; the float8 tensor (1 B) stays."""
    events = cast_events(1000, 0)
    assert events_peak(tuple(events)) == 9000
    assert _net(events) == 1000


def test_forward_casts_the_input_then_the_weight_and_frees_both():
    """down_proj's input [512, 1376] and weight [512, 1376], 704,512 elements each: the input's cast peaks at
    9 x 704,512 = 6,340,608 B, then the weight's beside the float8 input: 704,512 + 6,340,608 = 7,045,120 B; both
    float8 operands die with the Function's forward. Under FSDP2's float8 all-gather there is no weight cast."""
    events = forward_events(T, DOWN, weight_cast=True)
    assert events_peak(tuple(events)) == 7_045_120
    assert _net(events) == 0
    assert events_peak(tuple(forward_events(T, DOWN, weight_cast=False))) == 6_340_608


def test_backward_casts_grad_output_twice_and_the_input_once():
    """down_proj's grad_output [512, 512] (262,144 elements): its cast (2,359,296 B), the weight's beside it
    (262,144 + 6,340,608 = 6,602,752 B); after grad_input, grad_output cast again and the input's cast beside
    the float8 grad_output, weight and grad_output: 2 x 262,144 + 704,512 + 9 x 704,512 = 7,569,408 B.
    rowwise_with_gw_hp's weight gradient runs in bf16: only the first two casts."""
    before, after = backward_events(T, DOWN, weight_cast=True, weight_grad_float8=True)
    assert events_peak(tuple(before)) == 6_602_752
    assert _net(before) == 262_144 + 704_512
    assert events_peak(tuple(before + after)) == 7_569_408
    assert _net(before + after) == 0
    before, after = backward_events(T, DOWN, weight_cast=True, weight_grad_float8=False)
    assert events_peak(tuple(before + after)) == 6_602_752 and _net(before + after) == 0


def test_float8_keeps_what_nn_linear_keeps():
    """Float8Linear's Function saves the bf16 input and weight (ctx.save_for_backward(input_hp, weight_hp_t)): the
    kept bytes are nn.Linear's, only the casts are new (the MLP's down_proj block gets them)."""
    plain = activation_profile(resolve(_setup()))
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        fp8 = activation_profile(resolve(_setup(float8=recipe)))
        assert fp8.per_layer_saved == plain.per_layer_saved
        down = next(b for b in fp8.blocks if b.name == "down_proj")
        assert down.back_casts[0] and down.temps
    assert not any(b.back_casts[0] for b in plain.blocks)


def test_torchtitan_filter_converts_decoder_linears_only():
    """Every decoder linear of tiny-llama (dims multiples of 16) is converted, the lm_head never; a dim that is no
    multiple of 16 (torch._scaled_mm's constraint) is skipped."""
    anatomy = resolve(_setup(float8="tensorwise")).anatomy
    names = [p.name for p in converted_linears(anatomy)]
    assert len(names) == 4 * 7 and not any("lm_head" in n for n in names)
    assert converted("model.layers.0.mlp.down_proj", INTER, H)
    assert not converted("lm_head", H, 32000) and not converted("output", H, 32000)
    assert not converted("model.layers.0.mlp.up_proj", 100, 64)


def test_fsdp2_gathers_converted_weights_in_one_byte():
    """--float8-all-gather: q_proj's [512, 512] weight gathers as 262,144 float8 bytes (bf16: 524,288); the
    lm_head's [32000, 512] stays bf16, 32,768,000 B."""
    r = resolve(_setup(method="fsdp", gpus=4, precision="bf16-mixed", float8="tensorwise", float8_all_gather=True))
    plain = resolve(_setup(method="fsdp", gpus=4, precision="bf16-mixed", float8="tensorwise"))
    by_name = {p.name: p for p in r.anatomy.params}
    q, head = by_name["model.layers.0.self_attn.q_proj.weight"], by_name["lm_head.weight"]
    assert fsdp_gathered_tensors(q, r.setup, r.layout) == (262_144,)
    assert fsdp_gathered_tensors(q, plain.setup, plain.layout) == (524_288,)
    assert fsdp_gathered_tensors(head, r.setup, r.layout) == (32_768_000,)


@pytest.mark.parametrize(("kw", "words"), [
    ({"float8": "fp4"}, "unknown --float8 'fp4'"),
    ({"float8_all_gather": True}, "--float8-all-gather needs --float8 tensorwise"),
    ({"float8": "rowwise", "float8_all_gather": True}, "works with --float8 tensorwise only"),
])
def test_bad_float8_options_are_refused_in_one_line(kw, words):
    with pytest.raises(LlmemError, match=words):
        _setup(**kw)


@pytest.mark.parametrize(("kw", "words"), [
    ({"precision": "bf16-mixed"}, "over bf16 weights"),
    ({"precision": "fp32"}, "over bf16 weights"),
    ({"float8_all_gather": True}, "needs FSDP2"),
    ({"method": "tp", "gpus": 2}, "tensor / pipeline"),
    ({"lora_rank": 8}, "full fine-tune"),
])
def test_float8_outside_what_is_modelled_is_refused(kw, words):
    with pytest.raises(LlmemError, match=words):
        resolve(_setup(float8="tensorwise", **kw))
