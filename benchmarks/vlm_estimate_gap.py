"""What today's text estimator misses of a Qwen2.5-VL step: the trace against the estimate of the language model
alone at text + visual tokens (the trained anatomy, frozen parts and LoRA included), per freezing option
(benchmarks/vlm_saved_tensors.md, "What the text estimator misses"). A diagnostic for the vision-language estimate,
which llmem refuses until it is modelled.

    PYTHONPATH=. python benchmarks/vlm_estimate_gap.py [--image-size 448x448] [--batch-size 4] [--seq-len 64]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from llmem.estimator.engine import estimate_resolved
from llmem.model.resolved import resolve
from llmem.model.vision_inputs import vision_inputs
from llmem.runtime.trace import trace
from llmem.setup.training import TrainingSetup

MODEL = "tiny-qwen2_5_vl"
CASES = {"full fine-tuning": {}, "--freeze-vision-tower": {"freeze_vision_tower": True},
         "--freeze-projector": {"freeze_projector": True}, "--freeze-language-model": {"freeze_language_model": True},
         "--lora-rank 8": {"lora_rank": 8}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-size", default="448x448")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()
    print("| set-up | activations: text estimate / trace (MiB) | peak allocated: estimate / trace (MiB) | "
          "peak reserved: estimate / trace (MiB) |")
    print("|---|---|---|---|")
    mib = 1 << 20
    for name, fields in CASES.items():
        setup = TrainingSetup(model=MODEL, images_per_sample=1, image_size=args.image_size, seq_len=args.seq_len,
                              batch_size=args.batch_size, **fields)
        resolved = resolve(setup, traced=True)
        tokens = vision_inputs(setup, resolved.base).language_tokens
        est = estimate_resolved(replace(resolved, setup=replace(resolved.setup, seq_len=tokens)))
        got = trace(setup)

        def pair(e: int, t: int) -> str:
            return f"{e / mib:.1f} / {t / mib:.1f} ({e / t - 1:+.1%})"

        print(f"| {name} | {pair(est.components['activations'], got.components['activations'])} | "
              f"{pair(est.peak_allocated_bytes, got.peak_allocated_bytes)} | "
              f"{pair(est.peak_reserved_bytes, got.peak_reserved_bytes)} |")
    print(f"\n({MODEL}, batch {args.batch_size}, one {args.image_size} image and {args.seq_len} text tokens a sample: "
          f"the language model runs {tokens} tokens; bf16-mixed, AdamW, A100-80GB)")


if __name__ == "__main__":
    main()
