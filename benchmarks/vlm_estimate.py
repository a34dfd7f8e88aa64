"""A vision-language step's estimate against its trace (Qwen2.5-VL's architecture): the CI matrix's tiny rows, the
same rows under checkpointing, longer images and fp32, and the vlm matrix's 7B / 3B rows at real image sizes; one
H100-80GB, bf16-mixed unless the row says otherwise. Each estimate learns its vision side from the real code first
(llmem.memory.activations.learned_vision: its own shape, so each row learns once; timed apart).

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python benchmarks/vlm_estimate.py [--large] [--gpu A100-80GB]
        # writes benchmarks/results/vlm_estimate[_<gpu>].json; benchmarks/vlm_estimate.md is written from them
    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python benchmarks/vlm_estimate.py --family gemma3 [--large]
        # Gemma 3's rows instead (tiny-gemma3, the gemma-3-*-it rows of the vlm matrix):
        # benchmarks/results/vlm_estimate_gemma3.json (--family qwen3_vl: tiny-qwen3_vl, the Qwen3-VL-* rows;
        # --family llava_onevision: tiny-llava_onevision, the llava-onevision-qwen2-* rows; --family idefics3:
        # tiny-idefics3, the Idefics3-8B and SmolVLM v1 rows; --family smolvlm: tiny-smolvlm, the SmolVLM2 row;
        # --family internvl: tiny-internvl, the InternVL3-*-hf rows; --family llama4: tiny-llama4, the
        # Llama-4-Scout rows)
    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python benchmarks/vlm_estimate.py --text-control
        # the tiny VLM's language model alone as a text model (hand recipe, then learned), at 4 x 1792 tokens
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from llmem.errors import LlmemError
from llmem.estimator.engine import estimate
from llmem.model.anatomy import load_anatomy
from llmem.model.vision import VISION_LANGUAGE
from llmem.runtime.trace import trace
from llmem.validate.compare import COUNTERS
from llmem.validate.matrices import CI_MATRIX, VLM_MATRIX, label

OUT = Path(__file__).parent / "results" / "vlm_estimate.json"


def of_family(setups: list, family: str) -> list:
    """The set-ups whose model is of `family` (a model_type of llmem.model.vision)."""
    return [s for s in setups if load_anatomy(s.model).model_type == family]


def small_rows(family: str = "qwen2_5_vl") -> list:
    """The CI matrix's vision-language rows of `family`, then the same tiny model under checkpointing, at 2 x 896x672
    images and 256 text tokens, and in fp32."""
    ci = of_family([s for s in CI_MATRIX if s.images_per_sample], family)
    base = ci[0]
    ckpt = [replace(base, grad_ckpt=True, **kw) for kw in ({}, {"freeze_language_model": True}, {"lora_rank": 8})]
    big = replace(base, images_per_sample=2, image_size="896x672", seq_len=256)
    longer = [replace(big, **kw) for kw in ({}, {"freeze_vision_tower": True}, {"freeze_language_model": True},
                                            {"lora_rank": 8}, {"grad_ckpt": True})]
    return ci + [s for s in ckpt if s not in ci] + longer + [replace(base, precision="fp32", batch_size=2)]


def text_control() -> None:
    """The tiny VLM's language model as a text-only Qwen2 config, estimate against trace with Qwen2's hand recipe
    and learned (LLMEM_LEARN=always), on both GPUs: where reserved differs without any vision side."""
    import os
    import tempfile

    from llmem.model.catalog import catalog_file
    from llmem.setup.training import TrainingSetup

    vlm = json.loads(catalog_file("tiny", "tiny-qwen2_5_vl.json"))
    text = {k: v for k, v in vlm.items() if k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                   "num_key_value_heads", "num_hidden_layers", "vocab_size",
                                                   "max_position_embeddings", "rms_norm_eps", "rope_theta",
                                                   "tie_word_embeddings", "use_sliding_window")}
    text.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(text))
        for gpu in ("H100-80GB", "A100-80GB"):
            setup = TrainingSetup(folder, gpu=gpu, precision="bf16-mixed", batch_size=4, seq_len=1792)
            truth = trace(setup)
            for mode in ("auto", "always"):
                os.environ["LLMEM_LEARN"] = mode
                est = estimate(setup)
                errs = [100 * (getattr(est, c) - getattr(truth, c)) / getattr(truth, c) for c in COUNTERS[:2]]
                print(f"{gpu} {'hand recipe' if mode == 'auto' else 'learned'}: allocated {errs[0]:+.2f} % "
                      f"reserved {errs[1]:+.2f} %", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true", help="also the vlm matrix's 7B / 3B rows (minutes each)")
    parser.add_argument("--gpu", default=None, help="every row on this GPU instead of the matrices' H100-80GB")
    parser.add_argument("--text-control", action="store_true", help="the language model alone, as a text model")
    parser.add_argument("--family", default="qwen2_5_vl", choices=sorted(VISION_LANGUAGE),
                        help="the vision-language family whose rows run")
    args = parser.parse_args()
    if args.text_control:
        text_control()
        return 0
    suffix = "".join(f"_{part}" for part in (args.gpu and args.gpu.lower(),
                                              args.family if args.family != "qwen2_5_vl" else None) if part)
    out = OUT.with_name(f"vlm_estimate{suffix}.json")
    rows = []
    for setup in small_rows(args.family) + (of_family(VLM_MATRIX, args.family) if args.large else []):
        setup = setup if args.gpu is None else replace(setup, gpu=args.gpu)
        t0 = time.perf_counter()
        try:
            estimate(setup)                               # learns the vision side (once per set-up)
        except LlmemError as refused:                     # (a variant the family refuses: SmolVLM's one part frozen)
            print(f"{label(setup):90s} refused: {refused}", flush=True)
            continue
        learn_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        est = estimate(setup)
        est_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        truth = trace(setup)
        trace_s = time.perf_counter() - t0
        row = {"config": label(setup), "setup": setup.to_dict(), "first_estimate_s": round(learn_s, 2),
               "estimate_s": round(est_s, 3), "trace_s": round(trace_s, 1),
               "estimate": {c: getattr(est, c) for c in COUNTERS}, "trace": {c: getattr(truth, c) for c in COUNTERS},
               "error_pct": {c: 100 * (getattr(est, c) - getattr(truth, c)) / getattr(truth, c) for c in COUNTERS}}
        rows.append(row)
        print(f"{row['config']:90s} alloc {row['error_pct']['peak_allocated_bytes']:+6.2f}% "
              f"resv {row['error_pct']['peak_reserved_bytes']:+6.2f}%  learn+estimate {learn_s:5.1f}s "
              f"estimate {est_s:5.2f}s trace {trace_s:5.1f}s", flush=True)
        out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
