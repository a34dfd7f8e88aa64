"""Deep step schedules made from a template layer (llmem.estimator.deepen) against the same schedules built layer by
layer, over the CI matrix's set-ups moved onto deep catalog models of the same family (its tiny Llama's rows onto
Llama-3.1-70B, its Qwen2's onto Qwen2.5-72B, ...): for each, whether the engine deepens it, whether the deepened
schedule has the built one's events (keys compared by the order of their allocation), phases, marks and live
bytes, and the time of each (in-process, the median of `--runs`).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/deepen_check.py > benchmarks/deepen.md

Rows with a --peft-config (the peft zoo: its 70B anatomies take minutes each to build the first time), a pipeline
(stage schedules: tests/estimator/test_deepen.py) or a set-up the deep model refuses are left out and counted.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from dataclasses import replace

from llmem.errors import LlmemError
from llmem.estimator import engine as eng
from llmem.estimator.deepen import same_schedule
from llmem.model.resolved import resolve
from llmem.validate.matrices import CI_MATRIX

DEEP = {"tiny-llama": "meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.2-1B": "meta-llama/Llama-3.1-70B",
        "tiny-mistral": "meta-llama/Llama-3.1-70B", "tiny-qwen2": "Qwen/Qwen2.5-72B", "Qwen/Qwen2.5-0.5B":
        "Qwen/Qwen2.5-72B", "tiny-qwen3": "Qwen/Qwen3-32B", "tiny-qwen3-moe": "Qwen/Qwen3-30B-A3B", "gpt2": "gpt2-xl"}


def timed(work, runs: int) -> float:
    seconds = []
    for _ in range(runs):
        t = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - t)
    return statistics.median(seconds)


def both_times(r, act, runs: int) -> tuple[float, float]:
    """The whole schedule built layer by layer, and deepened from nothing kept (its shallow builds included)."""
    return (timed(lambda: eng.step_schedule(r, act).build(), runs),
            timed(lambda: (eng.forget_shallow_schedules(), eng.from_template(r, act)), runs))


def why_built(r, act) -> str:
    if r.method.gradient_buckets:
        return "DDP's gradient buckets"
    if not eng.alike_layers(r.anatomy, act):
        return "layers unlike each other"
    s = r.setup
    if r.method.zero_stage is not None:
        why = "DeepSpeed's engine (flat buffers sized by the whole model)"
    elif s.objective not in ("sft", "trl-sft"):
        why = f"TRL's {s.objective} (its reference copy's weights and passes are laid out outside the layers' parts)"
    elif r.optimizer.event_param is None and r.optimizer.step_events.__name__ != "_no_events":
        why = f"{s.optimizer}'s step events do not say their parameter"
    else:
        why = f"{r.layout.method}, {s.optimizer}, {s.objective}"
    return f"the check failed: {why}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    counts: collections.Counter = collections.Counter()
    built_why: collections.Counter = collections.Counter()
    times: list[tuple[float, float]] = []
    wrong = []
    for s in CI_MATRIX:
        if s.model not in DEEP or s.peft_config:
            counts["left out: not a family with a deep model here, or a --peft-config row"] += 1
            continue
        try:
            r = resolve(replace(s, model=DEEP[s.model]))
            if r.layout.pp > 1:
                counts["left out: a pipeline"] += 1
                continue
            r, act = eng.rank_step(r)
        except LlmemError:
            counts["left out: the deep model refuses the set-up"] += 1
            continue
        got = eng.from_template(r, act)
        if got is None:
            counts["built (not deepened)"] += 1
            built_why[why_built(r, act)] += 1
            continue
        built = eng.step_schedule(r, act).build()
        same = same_schedule(got, built) and (got.peak_live_bytes, got.live_bytes) == (built.peak_live_bytes,
                                                                                         built.live_bytes)
        counts["deepened, the same events" if same else "deepened, DIFFERENT events"] += 1
        if not same:
            wrong.append(r.setup)
        times.append(both_times(r, act, args.runs))
    print("# Deep step schedules: deepened from a template layer against built layer by layer\n")
    print("`HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/deepen_check.py` (the CI matrix's rows on deep catalog "
          "models)\n")
    print("| rows | count |\n|---|---|")
    for k, v in counts.most_common():
        print(f"| {k} | {v} |")
    print("\n| built instead, because | rows |\n|---|---|")
    for k, v in built_why.most_common():
        print(f"| {k} | {v} |")
    if times:
        ratios = sorted(d / b for b, d in times)
        print(f"\nDeepened rows, in-process medians of {args.runs}: built {statistics.median(b for b, _ in times) * 1e3:.1f}"
              f" ms, deepened {statistics.median(d for _, d in times) * 1e3:.1f} ms (its 5- and 8-layer builds, the "
              f"check and the copies, nothing kept from an earlier call); deepened / built per row: median "
              f"{statistics.median(ratios):.2f}, {ratios[0]:.2f}-{ratios[-1]:.2f}.")
    for s in wrong:
        print(f"- DIFFERENT: {s}")


if __name__ == "__main__":
    main()
