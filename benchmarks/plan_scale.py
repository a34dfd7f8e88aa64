"""Time `llmem plan` at 8, 64 and 512 GPUs, and one estimate per layout (after import; anatomy built once).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/plan_scale.py [--gpu A100-80GB] [--seq-len 4096] [--repeat 3]
                                                               [--grad-ckpt] [--models M1,M2] [--out FILE]
                                                               [--gpu-counts 8,64,512] [--no-layout-table]
                                                               [--check-screening]

Per model and GPU count: `plan_s` is the plan (every candidate layout of that many GPUs: dp x tp, HSDP, pipeline
and context parallel; the batch search of those a bound does not rule out, the time model and, when nothing fits,
the suggestions), the median of --repeat runs (each after the first reuses the anatomy, not the estimates: every
plan builds its own engine), and its CPU seconds (this process's: on a loaded machine the wall time a quiet
one would give, the planner being one thread); `layouts` counts the candidate layouts and those searched; `estimates` the full
estimator calls of one plan. The second table is one estimate per layout of the 64-GPU plan at batch 1 (a pipeline
layout: its pp micro-batches of 1; median of --repeat). Target (issue 11): a plan at 512 GPUs under 2 s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

TARGET_512_S = 2.0
GPU_COUNTS = (8, 64, 512)
MODELS = ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-405B")


def _median_s(fn, repeat: int, cpu: list | None = None) -> tuple[float, object]:
    """The median wall seconds of `repeat` calls of fn, and its last answer; `cpu`: the median CPU seconds of this
    process (time.process_time: what a quiet machine's wall time would be, the planner being one thread) appended."""
    times, cpus, out = [], [], None
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        times.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    if cpu is not None:
        cpu.append(statistics.median(cpus))
    return statistics.median(times), out


def _same_as_unscreened(p, setup, anatomy) -> str:
    """The plan with every layout searched: the same recommendation, batch and tokens/s, and the same largest batch
    on every layout both searched?"""
    import llmem.planner.plan as planning

    real = planning._screens
    planning._screens = lambda ctx, setup: False
    try:
        full = planning.plan(setup, anatomy=anatomy)
    finally:
        planning._screens = real

    def answer(q):
        r = q.recommended
        return q.recommendation, r and r.max_batch_size, r and r.time and r.time.tokens_per_s

    batches = {c.layout.label: c.max_batch_size for c in full.candidates}
    same = answer(p) == answer(full) and all(batches[c.layout.label] == c.max_batch_size for c in p.candidates)
    return f"{'same' if same else 'DIFFERENT'} answer ({len(p.candidates)} of {len(full.candidates)} layouts searched)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="A100-80GB")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--grad-ckpt", action="store_true", help="plan with activation checkpointing")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--gpu-counts", default=",".join(map(str, GPU_COUNTS)), help="the GPU counts planned")
    ap.add_argument("--no-layout-table", action="store_true",
                    help="skip the second table (one estimate per layout of the 64-GPU plan)")
    ap.add_argument("--out", default=None, metavar="FILE", help="write the markdown tables here")
    ap.add_argument("--check-screening", action="store_true",
                    help="also plan with the screening off (every layout searched) and say whether the answer is "
                         "the same (slow: minutes per plan at 64+ GPUs)")
    args = ap.parse_args(argv)

    import llmem.planner.engines as engines
    from llmem.estimator.engine import estimate
    from llmem.model.anatomy import load_anatomy
    from llmem.planner.plan import plan
    from llmem.planner.search import layout_setup
    from llmem.setup.layout import ModelLimits, candidate_layouts
    from llmem.setup.training import TrainingSetup

    calls = {"n": 0, "verdicts": 0}
    real_full, real_step_verdict = engines.LlmemEngine.full, engines.step_verdict

    def counting(self, setup, layout=None):
        calls["n"] += 1
        return real_full(self, setup, layout)

    def counting_verdicts(r, limit_bytes):
        calls["verdicts"] += 1
        return real_step_verdict(r, limit_bytes)

    engines.LlmemEngine.full, engines.step_verdict = counting, counting_verdicts
    plan_rows, layout_rows, worst_512_s, worst_512_cpu_s = [], [], 0.0, 0.0
    for model in args.models.split(","):
        anatomy = load_anatomy(model)
        for gpus in map(int, args.gpu_counts.split(",")):
            setup = TrainingSetup(model=model, gpus=gpus, gpu=args.gpu, seq_len=args.seq_len, grad_ckpt=args.grad_ckpt)
            calls["n"] = calls["verdicts"] = 0
            plan(setup, anatomy=anatomy)                       # warm: imports and first-use caches
            per_plan, verdicts = calls["n"], calls["verdicts"]
            cpu: list[float] = []
            plan_s, p = _median_s(lambda setup=setup, anatomy=anatomy: plan(setup, anatomy=anatomy), args.repeat, cpu)
            if gpus == 512:
                worst_512_s = max(worst_512_s, plan_s)
                worst_512_cpu_s = max(worst_512_cpu_s, cpu[0])
            rec = p.recommendation or "nothing fits: " + (p.suggestions[0]["text"][:60] if p.suggestions else "")
            heads = (anatomy.num_heads, anatomy.num_kv_heads)
            limits = ModelLimits(anatomy.num_layers, args.seq_len)
            total = len(candidate_layouts(gpus, 8, *heads, limits=limits, pp=None, cp=None))
            plan_rows.append((model, gpus, plan_s, cpu[0], f"{len(p.candidates)} of {total}", per_plan, verdicts,
                              rec))
            print(f"{model:32s} {gpus:4d} GPUs  plan {plan_s:6.3f} s (cpu {cpu[0]:6.3f} s)  "
                  f"{len(p.candidates):2d} of {total:2d} layouts  "
                  f"{per_plan:4d} estimates {verdicts:4d} verdicts -> {rec}", flush=True)
            if args.check_screening:
                print(f"  screening off: {_same_as_unscreened(p, setup, anatomy)}", flush=True)
        if args.no_layout_table:
            continue
        heads = (anatomy.num_heads, anatomy.num_kv_heads)
        base = TrainingSetup(model=model, gpus=64, gpu=args.gpu, seq_len=args.seq_len, grad_ckpt=args.grad_ckpt)
        for lay in candidate_layouts(64, 8, *heads, limits=ModelLimits(anatomy.num_layers, args.seq_len),
                                     pp=None, cp=None):
            try:
                s = layout_setup(base, lay, 1)
                est_s, _ = _median_s(lambda s=s, anatomy=anatomy: estimate(s, anatomy=anatomy), args.repeat)
            except Exception as exc:                           # a layout the model refuses: say why, go on
                layout_rows.append((model, lay.label, None, str(exc)[:80]))
                continue
            layout_rows.append((model, lay.label, est_s, ""))
    engines.LlmemEngine.full, engines.step_verdict = real_full, real_step_verdict

    lines = ["| model | GPUs | plan (median) | CPU (median) | layouts searched of candidates | full estimates per plan "
             "| verdicts per plan | answer |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {m} | {g} | {s:.3f} s | {c:.3f} s | {n} | {e} | {v} | {r} |" for m, g, s, c, n, e, v, r in plan_rows]
    if layout_rows:
        lines += ["", "| model | layout (64 GPUs) | one estimate, batch 1 (median) |", "|---|---|---|"]
    lines += [f"| {m} | {lab} | " + (f"{s * 1000:.0f} ms" if s is not None else f"refused: {why}") + " |"
              for m, lab, s, why in layout_rows]
    verdict = f"worst plan at 512 GPUs: {worst_512_s:.3f} s, CPU {worst_512_cpu_s:.3f} s (target < " \
              f"{TARGET_512_S:g} s: {'met' if worst_512_s < TARGET_512_S else 'MISSED'}; on CPU time " \
              f"{'met' if worst_512_cpu_s < TARGET_512_S else 'MISSED'})"
    if any(g == 512 for _, g, *_ in plan_rows):
        lines += ["", verdict]
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0 if worst_512_s < TARGET_512_S else 1


if __name__ == "__main__":
    sys.exit(main())
