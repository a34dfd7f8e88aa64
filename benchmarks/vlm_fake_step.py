"""A Qwen2.5-VL training step's forward and backward on fake tensors: what the trace needs beyond a decoder's
(benchmarks/vlm_saved_tensors.md, "Tracing it on fake tensors").

transformers' vision code reads its index tensors' values (the patch grid, the windows' lengths) with .tolist() and
repeat_interleave, which a FakeTensorMode cannot answer. Each such value depends only on image_grid_thw and the
token ids, which the set-up fixes: they are computed here on real tensors before the fake mode (by transformers' own
functions), and handed back where the model asks for them.

    PYTHONPATH=. python benchmarks/vlm_fake_step.py [--image-size 224x224] [--text-tokens 64]
"""

from __future__ import annotations

import argparse
import contextlib
import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from llmem.model.config import resolve_config, training_config
from llmem.model.images import image_grid
from llmem.model.vision import vision_spec
from llmem.runtime.build import materialize
from llmem.runtime.patches import patched

MODEL = "tiny-qwen2_5_vl"


def _meta_model():
    from transformers import AutoModelForImageTextToText

    _, cfg = resolve_config(MODEL)
    cfg = training_config(cfg)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForImageTextToText.from_config(cfg)
    return model.train()


def real_inputs(model, height: int, width: int, text_tokens: int) -> dict:
    """The processor's outputs for one sample (real tensors): token ids with the image's tokens, image_grid_thw,
    mm_token_type_ids."""
    cfg = model.config
    grid = image_grid(vision_spec(cfg.model_type).processor, height, width)
    ids = torch.randint(0, cfg.get_text_config().vocab_size - 100, (1, text_tokens + grid.tokens + 2))
    ids[0, 4] = cfg.vision_start_token_id
    ids[0, 5:5 + grid.tokens] = cfg.image_token_id
    ids[0, 5 + grid.tokens] = cfg.vision_end_token_id
    return {"input_ids": ids, "image_grid_thw": torch.tensor([[grid.grid_t, grid.grid_h, grid.grid_w]]),
            "mm_token_type_ids": (ids == cfg.image_token_id).int(), "patches": grid.patches,
            "patch_values": grid.patch_values}


@contextlib.contextmanager
def known_vision_values(model, inputs: dict):
    """The vision encoder's index tensors and the values the model reads from them, computed on the real grid and
    returned where the model asks (transformers 5.25's Qwen2.5-VL; each a module-level name of its modeling file)."""
    import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl as qwen
    from transformers import vision_utils as vu

    vc = model.config.vision_config
    grid = inputs["image_grid_thw"]
    position_ids = vu.get_vision_position_ids(grid, vc.spatial_merge_size)
    cu_seqlens, max_seqlen = vu.get_vision_attention_seqlens(grid, vc)
    window_index, cu_window = vu.get_vision_window_index(grid, vc.spatial_merge_size, vc.window_size, vc.patch_size)
    # the values read with .tolist(): attention segment lengths (int32) and the merged tokens per image (int64)
    lists = {(tuple(t.shape), t.dtype): t.tolist() for t in (
        cu_seqlens[1:] - cu_seqlens[:-1], cu_window[1:] - cu_window[:-1],
        grid.prod(-1) // vc.spatial_merge_size ** 2)}

    def tolist(tensor):
        return lists[(tuple(tensor.shape), tensor.dtype)]

    with contextlib.ExitStack() as stack:
        for name, value in (("get_vision_position_ids", lambda *a, **k: position_ids),
                            ("get_vision_attention_seqlens", lambda *a, **k: (cu_seqlens, max_seqlen)),
                            ("get_vision_window_index", lambda *a, **k: (window_index, cu_window)),
                            ("get_max_seqlen", lambda *a, **k: None),
                            # the image tokens' count checked against the features: the set-up made them equal
                            ("torch_compilable_check", lambda *a, **k: None)):
            stack.enter_context(patched(qwen, name, value))
        stack.enter_context(patched(FakeTensor, "tolist", tolist))
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-size", default="224x224")
    parser.add_argument("--text-tokens", type=int, default=64)
    args = parser.parse_args()
    height, width = (int(v) for v in args.image_size.lower().split("x"))
    model = _meta_model()
    inputs = real_inputs(model, height, width, args.text_tokens)
    # the language model's 3-D rope positions, as the model computes them from the real ids
    positions, _ = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    with known_vision_values(model, inputs), FakeTensorMode(allow_non_fake_inputs=True):   # values first: real
        materialize(model, "cpu")
        pixel_values = torch.randn(inputs["patches"], inputs["patch_values"])
        loss = model(input_ids=inputs["input_ids"], labels=inputs["input_ids"], pixel_values=pixel_values,
                     image_grid_thw=inputs["image_grid_thw"], mm_token_type_ids=inputs["mm_token_type_ids"],
                     position_ids=positions).loss
        loss.backward()
        grads = sum(p.grad is not None for p in model.parameters())
    print(f"{MODEL}: forward and backward ran on fake tensors ({inputs['patches']} patches, "
          f"{inputs['input_ids'].shape[1]} tokens); {grads} of {len(list(model.parameters()))} parameters got a "
          "gradient")


if __name__ == "__main__":
    main()
