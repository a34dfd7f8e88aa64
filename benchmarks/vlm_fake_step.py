"""A Qwen2.5-VL training step's forward and backward on fake tensors, bare: what the trace needs beyond a decoder's
(benchmarks/vlm_saved_tensors.md, "Tracing it on fake tensors"), without the trace's ledger.

transformers' vision code reads its index tensors' values (the patch grid, the windows' lengths) with .tolist() and
repeat_interleave, which a FakeTensorMode cannot answer. They depend only on image_grid_thw and the token ids, which
the set-up fixes: llmem.runtime.vision computes them on real tensors before the fake mode (by transformers' own
functions) and keeps the index tensors real inside it; `llmem trace` runs the same machinery.

    PYTHONPATH=. python benchmarks/vlm_fake_step.py [--image-size 224x224] [--text-tokens 64]
"""

from __future__ import annotations

import argparse
import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from llmem.model.anatomy import load_anatomy
from llmem.model.config import resolve_config, training_config
from llmem.model.vision_inputs import vision_inputs
from llmem.runtime.build import materialize
from llmem.runtime.vision import known_vision_values, model_inputs, vision_batch
from llmem.setup.training import TrainingSetup

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-size", default="224x224")
    parser.add_argument("--text-tokens", type=int, default=64)
    args = parser.parse_args()
    setup = TrainingSetup(model=MODEL, images_per_sample=1, image_size=args.image_size, seq_len=args.text_tokens)
    model = _meta_model()
    batch = vision_batch(model, 1, vision_inputs(setup, load_anatomy(MODEL)))
    mode = FakeTensorMode()
    with known_vision_values(model, batch, mode), mode:
        materialize(model, "cpu")
        ids, extra = model_inputs(batch)
        loss = model(input_ids=ids, labels=ids, **extra).loss
        loss.backward()
        grads = sum(p.grad is not None for p in model.parameters())
    print(f"{MODEL}: forward and backward ran on fake tensors ({batch.patches} patches, {ids.shape[1]} tokens); "
          f"{grads} of {len(list(model.parameters()))} parameters got a gradient")


if __name__ == "__main__":
    main()
