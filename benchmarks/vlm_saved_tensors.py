"""What autograd keeps for backward in a Qwen2.5-VL step, by part, under each freezing option: the facts the
vision-language estimate must model (benchmarks/vlm_saved_tensors.md).

A real forward of the tiny-qwen2_5_vl config (fp32, CPU, SDPA) on one sample: random pixel_values of the shape
transformers' image processor makes for the image size given (llmem.model.images), and input_ids holding the image
token as many times as the processor expands it. torch.autograd.graph.saved_tensors_hooks records every tensor the
graph saves, the parameters aside (memory already); each storage is counted once, in the part whose module was running when it was first saved (the vision
encoder's patch embedding and blocks, the merger, the language model's embedding, layers and norm, the head; "other":
outside them all, e.g. the loss and the scatter of the image features into the embeddings).

    PYTHONPATH=. python benchmarks/vlm_saved_tensors.py [--image-size 224x224] [--text-tokens 64]
"""

from __future__ import annotations

import argparse
import contextlib
import warnings

import torch

from llmem.model.config import resolve_config, training_config
from llmem.model.images import image_grid
from llmem.model.vision import vision_spec

MODEL = "tiny-qwen2_5_vl"
CASES = {   # name -> (frozen parts, LoRA on the language model's q_proj / v_proj)
    "full fine-tuning": ((), False),
    "--freeze-vision-tower": (("vision",), False),
    "--freeze-projector": (("projector",), False),
    "--freeze-vision-tower --freeze-projector": (("vision", "projector"), False),
    "--freeze-language-model": (("language",), False),
    "--freeze-language-model --freeze-vision-tower": (("language", "vision"), False),
    "LoRA r8 on the language model (peft freezes the rest)": ((), True),
}


def _model(attn: str = "sdpa"):
    from transformers import AutoModelForImageTextToText

    _, cfg = resolve_config(MODEL)
    cfg = training_config(cfg)
    cfg._attn_implementation = attn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForImageTextToText.from_config(cfg)
    model.train()
    return model


def _inputs(model, height: int, width: int, text_tokens: int):
    spec = vision_spec(model.config.model_type)
    grid = image_grid(spec.processor, height, width)
    cfg = model.config
    ids = torch.randint(0, cfg.get_text_config().vocab_size - 100, (1, text_tokens + grid.tokens + 2))
    ids[0, 4] = cfg.vision_start_token_id
    ids[0, 5:5 + grid.tokens] = cfg.image_token_id
    ids[0, 5 + grid.tokens] = cfg.vision_end_token_id
    return {"input_ids": ids, "labels": ids, "pixel_values": torch.randn(grid.patches, grid.patch_values),
            "image_grid_thw": torch.tensor([[grid.grid_t, grid.grid_h, grid.grid_w]])}, grid


def _parts(model) -> list[tuple[str, torch.nn.Module]]:
    """(part, module) for every module whose forward is attributed: a ModuleList runs no forward of its own, so each
    block and layer is hooked."""
    inner = model.model
    lm = inner.language_model
    return [("patch embed", inner.visual.patch_embed), *(("vision blocks", b) for b in inner.visual.blocks),
            ("merger", inner.visual.merger), ("embed tokens", lm.embed_tokens),
            *(("lm layers", layer) for layer in lm.layers), ("lm norm", lm.norm), ("lm_head", model.lm_head)]


def _freeze(model, frozen: tuple[str, ...], lora: bool):
    inner = model.model
    modules = {"vision": [inner.visual.patch_embed, inner.visual.blocks], "projector": [inner.visual.merger],
               "language": [inner.language_model, model.lm_head]}
    for part in frozen:
        for module in modules[part]:
            module.requires_grad_(False)
    if lora:
        from peft import LoraConfig, get_peft_model

        return get_peft_model(model, LoraConfig(r=8, target_modules=r"model\.language_model.*\.(q_proj|v_proj)"))
    return model


def saved_by_part(model, inputs) -> dict[str, int]:
    """Bytes of the storages the forward's graph saves (parameters aside), by the part running when each was first
    saved."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    running: list[str] = ["other"]
    # the parameters (a Linear saves its weight for the input's gradient) are memory already: not counted
    seen: set[int] = {p.untyped_storage().data_ptr() for p in model.parameters()}
    out: dict[str, int] = {}

    def pack(t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            out[running[-1]] = out.get(running[-1], 0) + t.untyped_storage().nbytes()
        return t

    def leave(*_) -> None:      # a forward hook's return value would replace the module's output
        running.pop()

    with contextlib.ExitStack() as stack:
        for name, module in _parts(base):
            stack.callback(module.register_forward_pre_hook(lambda *_, n=name: running.append(n)).remove)
            stack.callback(module.register_forward_hook(leave).remove)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**inputs).loss
    loss.backward()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-size", default="224x224")
    parser.add_argument("--text-tokens", type=int, default=64)
    args = parser.parse_args()
    height, width = (int(v) for v in args.image_size.lower().split("x"))
    torch.manual_seed(0)
    order = ("patch embed", "vision blocks", "merger", "embed tokens", "lm layers", "lm norm", "lm_head", "other")
    print(f"| {MODEL}, one {height}x{width} image + {args.text_tokens} text tokens | " + " | ".join(order)
          + " | total |")
    print("|---" * (len(order) + 2) + "|")
    for name, (frozen, lora) in CASES.items():
        model = _freeze(_model(), frozen, lora)
        inputs, grid = _inputs(model, height, width, args.text_tokens)
        saved = saved_by_part(model, inputs)
        cells = [f"{saved.get(part, 0):,}" for part in order]
        print(f"| {name} | " + " | ".join(cells) + f" | {sum(saved.values()):,} |")
    print(f"\n(the image: {grid.grid_h}x{grid.grid_w} patches = {grid.patches}, {grid.tokens} visual tokens; "
          f"the language model runs {inputs['input_ids'].shape[1]} tokens)")


if __name__ == "__main__":
    main()
