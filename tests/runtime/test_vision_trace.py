"""llmem trace of a Qwen2.5-VL step: the real HF forward and backward on fake tensors, each part trained or frozen,
LoRA on the language model; what it keeps for backward checked against autograd's saved tensors in a real CPU step."""

from __future__ import annotations

import warnings

import pytest
import torch

from llmem.errors import LlmemError
from llmem.model.config import resolve_config, training_config
from llmem.runtime.trace import trace_with_details
from llmem.setup.training import TrainingSetup

MODEL = "tiny-qwen2_5_vl"
# tiny-qwen2_5_vl's parts by hand (tests/model/test_vision.py's formulas): the vision encoder is a Conv3d patch
# embedding 3*2*14*14*128 = 150,528 and 4 blocks of 199,216 (two norms 256, qkv 49,536, proj 16,512, gate and up
# 2*44,376, down 44,160); the merger a norm 128 and Linear(512, 512) + Linear(512, 512), biased; the language model
# embeddings and head 2 * 16000*512, 4 layers of 7,997,568 (q 262,656, k and v 2*65,664, o 262,144, MLP 3*512*1408,
# two norms 1,024), the final norm 512
VISION, MERGER = 150_528 + 4 * 199_216, 128 + 2 * (512 * 512 + 512)
LANGUAGE = 2 * 16_000 * 512 + 4 * (262_656 + 2 * 65_664 + 262_144 + 3 * 512 * 1408 + 1024) + 512
# LoRA r8 on q_proj (512 -> 512) and v_proj (512 -> 128) of the 4 language layers: A [8, in] + B [out, 8]
LORA = 4 * (8 * (512 + 512) + 8 * (512 + 128))

CASES = {   # name -> (set-up fields, trained parameters, the parts frozen by hand in the real run)
    "full": ({}, VISION + MERGER + LANGUAGE, ()),
    "freeze vision tower": ({"freeze_vision_tower": True}, MERGER + LANGUAGE, ("vision",)),
    "freeze projector": ({"freeze_projector": True}, VISION + LANGUAGE, ("projector",)),
    "freeze both": ({"freeze_vision_tower": True, "freeze_projector": True}, LANGUAGE, ("vision", "projector")),
    "freeze language model": ({"freeze_language_model": True}, VISION + MERGER, ("language",)),
    "lora": ({"lora_rank": 8}, LORA, ()),
}


def _setup(**fields) -> TrainingSetup:
    base = {"model": MODEL, "images_per_sample": 1, "image_size": "112x112", "seq_len": 32, "precision": "fp32"}
    return TrainingSetup(**(base | fields))


def _round(n: int) -> int:      # the CUDA caching allocator's 512-byte blocks
    return -(-n // 512) * 512


def _live_before_backward(ledger) -> int:
    """The trace's bytes live when the backward starts, the weights aside: what the graph keeps, the inputs and
    the loss."""
    live: dict[int, int] = {}
    for is_alloc, key, size, phase, *_ in ledger.events:
        if phase == 2:      # backward
            break
        if is_alloc:
            live[key] = size
        else:
            live.pop(key, None)
    return sum(size for key, size in live.items() if ledger.cat.get(key) not in ("weights", "cuda_workspaces"))


def _real_kept_bytes(frozen: tuple[str, ...], lora: bool, height: int, width: int, text: int, batch: int = 1,
                     images: int = 1) -> int:
    """A real CPU forward of the same model: the storages autograd saves for backward (parameters aside), the
    inputs (ids, pixel values, 3-D positions) and the loss, each rounded to the allocator's 512 bytes. Inputs made
    here from the processor's arithmetic (224 // 14 patches a side per 224 pixels, 4 patches a token)."""
    from transformers import AutoModelForImageTextToText

    _, cfg = resolve_config(MODEL)
    cfg = training_config(cfg)
    cfg._attn_implementation = "sdpa"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForImageTextToText.from_config(cfg).train()
    inner = model.model
    parts = {"vision": [inner.visual.patch_embed, inner.visual.blocks], "projector": [inner.visual.merger],
             "language": [inner.language_model, model.lm_head]}
    for part in frozen:
        for module in parts[part]:
            module.requires_grad_(False)
    gh, gw = height // 14, width // 14
    tokens = gh * gw // 4
    ids = torch.randint(0, 15_000, (batch, text + images * tokens))
    for k in range(images):
        at = 1 + k * (tokens + 2)
        ids[:, at], ids[:, at + 1:at + 1 + tokens], ids[:, at + 1 + tokens] = 15_992, 15_995, 15_993
    grid = torch.tensor([[1, gh, gw]] * (batch * images))
    positions, _ = inner.get_rope_index(ids, mm_token_type_ids=(ids == 15_995).int(), image_grid_thw=grid)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules=r"model\.language_model.*\.(q_proj|v_proj)"))
    pixels = torch.randn(batch * images * gh * gw, 3 * 2 * 14 * 14)
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = [0]

    def count(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            kept[0] += _round(t.untyped_storage().nbytes())
        return t

    for t in (ids, pixels, positions):
        count(t)
    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        loss = model(input_ids=ids, labels=ids, pixel_values=pixels, image_grid_thw=grid, position_ids=positions).loss
    return kept[0] + _round(loss.untyped_storage().nbytes())


@pytest.mark.parametrize("case", CASES)
def test_trace_trains_what_the_switches_leave_and_keeps_what_autograd_keeps(case):
    fields, trained, frozen = CASES[case]
    result, details = trace_with_details(_setup(**fields), cuda_kernels=False)   # CPU's SDPA, as the real run
    assert result.setup.trainable_params == trained
    # fp32 gradients of the trained parameters, each a block of its own (at most 512 bytes of rounding each)
    grads = details.category_max["gradients"]
    assert 4 * trained <= grads < 4 * trained + 512 * 80
    assert details.category_max["optimizer_states"] == pytest.approx(2 * grads, abs=512)   # AdamW: m and v
    # the index tensors the trace keeps real (the windows' order, a few bytes a patch) are not traced: 2 KiB
    expected = _real_kept_bytes(frozen, bool(fields.get("lora_rank")), 112, 112, 32)
    assert abs(_live_before_backward(details.ledger) - expected) <= 2048, case


def test_several_images_per_sample_and_samples():
    setup = _setup(images_per_sample=2, image_size="224x112", batch_size=2, seq_len=40)
    result, details = trace_with_details(setup, cuda_kernels=False)
    # 224x112 is already a multiple of 28: 16 x 8 patches, 32 visual tokens an image, 64 a sample
    assert any("16x8 patches (128) and 32 visual tokens each; the language model runs 40 text + 64 visual = 104"
               in note for note in result.notes)
    expected = _real_kept_bytes((), False, 224, 112, 40, batch=2, images=2)
    assert abs(_live_before_backward(details.ledger) - expected) <= 4096


@pytest.mark.parametrize(("fields", "words"), [
    ({"images_per_sample": 0, "image_size": None}, "a text-only step is not wired"),
    ({"gpus": 2, "method": "tp"}, "--method tp is not wired"),
    ({"lora_rank": 8, "freeze_language_model": True}, "leaves nothing to train"),
    ({"packing": True}, "--packing is not wired"),
    ({"images_per_sample": 2, "seq_len": 4}, "give --seq-len >= 5"),
])
def test_what_is_not_wired_is_refused_in_one_line(fields, words):
    with pytest.raises(LlmemError) as err:
        trace_with_details(_setup(**fields))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_patches_are_restored():
    import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl as qwen
    from transformers import vision_utils

    from llmem.runtime.ledger import TracingFakeMode

    dispatch = TracingFakeMode.__dict__["__torch_dispatch__"]
    trace_with_details(_setup(), iterations=1)
    assert TracingFakeMode.__dict__["__torch_dispatch__"] is dispatch
    assert qwen.get_vision_window_index is vision_utils.get_vision_window_index
    assert qwen.get_vision_attention_seqlens is vision_utils.get_vision_attention_seqlens
    assert not TracingFakeMode().allow_non_fake_inputs


@pytest.mark.parametrize(("fields", "fp32", "bf16"), [
    ({}, VISION + MERGER + LANGUAGE, 0),
    ({"freeze_vision_tower": True}, MERGER + LANGUAGE, VISION),
    ({"freeze_language_model": True}, VISION + MERGER, LANGUAGE),
])
def test_frozen_parts_are_held_in_the_compute_dtype_under_mixed_precision(fields, fp32, bf16):
    """LLaMA-Factory loads the model in bf16 and upcasts only the trained parameters to fp32 masters."""
    _, details = trace_with_details(_setup(precision="bf16-mixed", **fields), iterations=1)
    weights = details.category_max["weights"]
    # each parameter and rotary buffer a block of its own: at most 512 bytes of rounding each (110 tensors)
    assert 4 * fp32 + 2 * bf16 <= weights < 4 * fp32 + 2 * bf16 + 512 * 110
