"""Re-housing check: the JSON of `estimate` (both engines), `trace` and `plan`, dumped from one checkout of llmem and
compared with another's.

    # the checkout under test (the installed one), then an older one through PYTHONPATH, run from outside the
    # repository (twice: the second run of its traces tells their run-to-run noise):
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/rehouse/compare.py dump /tmp/after
    cd /tmp && HF_HUB_OFFLINE=1 PYTHONPATH=/path/to/old/checkout /work/main/.venv/bin/python \
        /work/main/benchmarks/rehouse/compare.py dump /tmp/before
    cd /tmp && HF_HUB_OFFLINE=1 PYTHONPATH=/path/to/old/checkout /work/main/.venv/bin/python \
        /work/main/benchmarks/rehouse/compare.py dump /tmp/before2 --only trace
    .venv/bin/python benchmarks/rehouse/compare.py diff /tmp/before /tmp/after --setup-from-estimate \
        --noise /tmp/before2 > benchmarks/rehouse/result.md

What is dumped, one JSON file per case (a case is the engine, the set-up's list and a digest of the set-up's repr,
so that a row added to a matrix after the change is reported as new, not as a shifted neighbour):
- `estimate` (llmem engine), `paper` (estimate --engine paper) and `trace` for every row of the CI matrix and the
  large matrix (llmem.validate's CI_MATRIX and LARGE_MATRIX);
- `plan` for every row of the CI matrix, for benchmarks/plan_speed.py's set-ups (every catalog model on
  8x A100-80GB at 2048 tokens, at 4096 tokens with checkpointing, and on one RTX4090 at 4096 tokens) and for
  benchmarks/plan_scale.py's (8B / 70B / 405B on 8, 64 and 512 H100s, with and without checkpointing).
The large matrix holds the scale-out rows (SCALEOUT_MATRIX) and the CI matrix the objectives' rows
(OBJECTIVES_MATRIX), so the four matrices of llmem.validate are all covered.
The JSON is what `--json` prints (`to_dict()` of the result), with the one field that is not a result of the step
taken out: the trace's own wall time in its last note ("trace: N allocator events, X.X s" keeps N).

`diff` reports, per engine, how many cases are byte-identical, and lists every difference (the JSON path and both
values). A key present only after (a key added, none removed or changed, the others in their order) is not a
difference: such cases count as identical but for added keys, and those keys are named; `--strict` counts them as
differences. `--setup-from-estimate` marks the `setup` object of trace, paper and measure results as expected to equal
the llmem estimate's `setup` of the same row before the change (the typed set-up every engine now fills one way)
rather than their own earlier, engine-specific dicts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import time
import traceback
from pathlib import Path

MATRICES = ("ci", "large")


def _api():
    """The functions and matrices of whichever llmem is importable (the layout before or after the re-housing)."""
    import llmem

    api = {"module": llmem.__file__}
    try:                                    # after: the public API holds all four
        from llmem import estimate, plan, trace
        from llmem.setup import TrainingSetup
        from llmem.validate.matrices import CI_MATRIX, LARGE_MATRIX

        def paper(s):
            return estimate(s, engine="paper")

        api.update(estimate=estimate, trace=trace, plan=plan, paper=paper, TrainingSetup=TrainingSetup)
    except ImportError:                     # before
        from llmem.anatomy import load_anatomy
        from llmem.config import TrainingSetup
        from llmem.hardware import resolve_gpu
        from llmem.tracer import trace

        from llmem.estimator import estimate
        from llmem.paper import paper_estimate
        from llmem.planner import plan
        from llmem.validate import CI_MATRIX, LARGE_MATRIX

        def paper(s):
            return paper_estimate(s, load_anatomy(s.model, s.trust_remote_code),
                                  resolve_gpu(s.gpu, s.gpu_memory, s.cuda_context))

        api.update(estimate=estimate, trace=trace, plan=plan, paper=paper, TrainingSetup=TrainingSetup)
    api.update(ci=CI_MATRIX, large=LARGE_MATRIX)
    return api


def _to_json(obj) -> str:
    return json.dumps(obj, indent=2, default=lambda o: o.to_dict() if hasattr(o, "to_dict") else str(o))


_TRACE_WALL = re.compile(r"^(trace: \d+ allocator events), [0-9.]+ s$")


# how long learning the activations took (a note of every engine whose activations are learned): not a result
_LEARN_WALL = re.compile(r"learned in [0-9.]+ s")


def _normalise(engine: str, data: dict) -> dict:
    if engine == "trace":
        data["notes"] = [_TRACE_WALL.sub(r"\1", n) for n in data.get("notes", [])]
    return json.loads(_LEARN_WALL.sub("learned in (wall time) s", json.dumps(data)))


def plan_speed_setups(TrainingSetup) -> list:
    try:
        from llmem.model.catalog import catalog
    except ImportError:
        from llmem.catalog import catalog
    models = list(catalog())
    out = []
    for gpu, gpus, seq, ckpt in (("A100-80GB", 8, 2048, False), ("A100-80GB", 8, 4096, True),
                                 ("RTX4090", 1, 4096, False)):
        out += [TrainingSetup(model=m, gpus=gpus, gpu=gpu, seq_len=seq, grad_ckpt=ckpt) for m in models]
    return out


def plan_scale_setups(TrainingSetup) -> list:
    """benchmarks/plan_scale.py's set-ups: 8B / 70B / 405B on 8, 64 and 512 H100s at 4096 tokens, with and without
    checkpointing."""
    return [TrainingSetup(model=m, gpus=g, gpu="H100-80GB", seq_len=4096, grad_ckpt=ckpt)
            for m in ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-405B")
            for g in (8, 64, 512) for ckpt in (False, True)]


_PEFT_PATH = re.compile(r"peft_config='[^']*/([^/']+/[^/']+)'")


def case_key(prefix: str, setup) -> str:
    """A case's name: its list and a digest of the set-up (bundled peft configs by their last two path parts, so
    that checkouts in other places name the same case alike)."""
    text = _PEFT_PATH.sub(r"peft_config='\1'", repr(setup))
    return f"{prefix}-{hashlib.sha1(text.encode()).hexdigest()[:12]}"


PLAN_SETS = ("ci", "speed", "scale")


def cases(api, only: set[str], plan_sets: tuple[str, ...] = PLAN_SETS) -> list[tuple[str, str, object]]:
    out = []
    for name in MATRICES:
        for s in api[name]:
            for engine in ("estimate", "paper", "trace"):
                if engine in only:
                    out.append((engine, case_key(name, s), s))
    if "plan" in only:
        setups = {"ci": lambda: api["ci"], "speed": lambda: plan_speed_setups(api["TrainingSetup"]),
                  "scale": lambda: plan_scale_setups(api["TrainingSetup"])}
        for name in plan_sets:        # in the order given
            out += [("plan", case_key(name, s), s) for s in setups[name]()]
    return out


def dump(folder: Path, only: set[str], plan_workers: int | None = None,
         plan_sets: tuple[str, ...] = PLAN_SETS) -> int:
    api = _api()
    if plan_workers is not None:            # the plans' searches side by side (a checkout with PlanOptions.workers)
        from llmem.planner.options import PlanOptions

        searched = api["plan"]
        api["plan"] = lambda s: searched(s, plan_options=PlanOptions(workers=plan_workers))
    folder.mkdir(parents=True, exist_ok=True)
    todo = cases(api, only, plan_sets)
    print(f"llmem from {api['module']}: {len(todo)} cases -> {folder}", flush=True)
    t0 = time.perf_counter()
    for n, (engine, key, setup) in enumerate(todo, 1):
        path = folder / engine / f"{key}.json"
        path.parent.mkdir(exist_ok=True)
        try:
            data = json.loads(_to_json(api[engine](setup).to_dict()))
            text = _to_json(_normalise(engine, data))
        except Exception as exc:   # noqa: BLE001 - an engine's refusal is part of its answer
            text = _to_json({"error": type(exc).__name__, "message": str(exc),
                             "where": traceback.format_exc().strip().splitlines()[-1]})
        path.write_text(text + "\n")
        (folder / engine / f"{key}.setup").write_text(repr(setup) + "\n")
        if n % 25 == 0 or n == len(todo):
            print(f"  {n}/{len(todo)} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


def _walk(a, b, path: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a:
                out.append(f"{path}.{k}: (absent) -> {json.dumps(b[k])[:120]}")
            elif k not in b:
                out.append(f"{path}.{k}: {json.dumps(a[k])[:120]} -> (absent)")
            else:
                _walk(a[k], b[k], f"{path}.{k}", out)
        if list(a) != [k for k in b if k in a]:
            out.append(f"{path}: key order differs")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _walk(x, y, f"{path}[{i}]", out)
    elif a != b or type(a) is not type(b):
        out.append(f"{path}: {json.dumps(a)[:120]} -> {json.dumps(b)[:120]}")


def _portable(value):
    """Paths of the bundled peft configs name the checkout they were run from: keep their last two parts."""
    if isinstance(value, dict):
        return {k: (str(Path(v).parent.name + "/" + Path(v).name) if k == "peft_config" and isinstance(v, str)
                    else _portable(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [_portable(v) for v in value]
    return value


ADDED = ": (absent) -> "


def _added_only(found: list[str]) -> bool:
    """Every difference is a key present only after (what an added field or result key gives)."""
    return bool(found) and all(ADDED in f for f in found)


def _only_timeline(found: list[str]) -> bool:
    return bool(found) and all(f.startswith(".timeline[") for f in found)


def diff(before: Path, after: Path, setup_from_estimate: bool, noise: Path | None = None,
         strict: bool = False) -> int:
    lines = [f"# estimate / paper / trace / plan JSON: {before} (before) against {after} (after)", ""]
    if noise is not None:
        lines += [f"A trace's timeline (its allocator events, downsampled) is not the same from run to run of the same "
                  f"code: {noise} holds a second run of the before checkout; a case whose only differences are in "
                  "its timeline, and whose two runs before differ in their timelines too, counts as noise.", ""]
    failed = 0
    for engine in ("estimate", "paper", "trace", "plan"):
        names = sorted(p.name for p in (before / engine).glob("*.json")) if (before / engine).is_dir() else []
        if not names or not (after / engine).is_dir():     # an engine not dumped on one side is not compared
            continue
        new_only = sorted(p.name for p in (after / engine).glob("*.json") if not (before / engine / p.name).exists())
        same = 0
        problems: list[str] = []
        noisy: list[str] = []
        added: dict[str, int] = {}
        for name in names:
            old_text = (before / engine / name).read_text()
            new_path = after / engine / name
            if not new_path.is_file():
                problems.append(f"- {engine}/{name}: missing after")
                continue
            new_text = new_path.read_text()
            if old_text == new_text:
                same += 1
                continue
            old, new = _portable(json.loads(old_text)), _portable(json.loads(new_text))
            if setup_from_estimate and engine in ("trace", "paper") and "setup" in old and "setup" in new:
                est = _portable(json.loads((before / "estimate" / name).read_text()))
                if "setup" in est:
                    old["setup"] = est["setup"]
            found: list[str] = []
            _walk(old, new, "", found)
            if not found:
                same += 1
                continue
            if not strict and _added_only(found):
                same += 1
                for f in found:
                    key = re.sub(r"\[\d+\]", "[]", f.split(ADDED)[0])
                    added[key] = added.get(key, 0) + 1
                continue
            if noise is not None and engine == "trace" and _only_timeline(found) and (noise / engine / name).is_file():
                again: list[str] = []
                _walk(_portable(json.loads(old_text)), _portable(json.loads((noise / engine / name).read_text())),
                      "", again)
                if _only_timeline(again):
                    noisy.append(name[:-5])
                    continue
            problems.append(f"- {engine}/{name}: " + "; ".join(found[:6]) + (" ..." if len(found) > 6 else ""))
        failed += len(problems)
        lines.append(f"## {engine}: {same} of {len(names)} identical" + (
            " (the `setup` object compared with the estimate's)" if setup_from_estimate and engine in
            ("trace", "paper") else "") + (f"; {len(noisy)} differ in their timeline only, as two runs before do"
                                           if noisy else ""))
        if added:
            lines.append("identical but for keys added after: " + ", ".join(f"`{k}` ({n} cases)"
                                                                           for k, n in sorted(added.items())))
        if new_only:
            lines.append(f"(new after, nothing to compare with: {', '.join(n[:-5] for n in new_only)})")
        lines += problems + [""]
    print("\n".join(lines))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("folder", type=Path)
    d.add_argument("--only", default="estimate,paper,trace,plan")
    d.add_argument("--plan-workers", type=int, default=None, help="plan with PlanOptions(workers=N)")
    d.add_argument("--plan-sets", default=",".join(PLAN_SETS), help="the plans dumped, in this order")
    c = sub.add_parser("diff")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    c.add_argument("--setup-from-estimate", action="store_true")
    c.add_argument("--noise", type=Path, default=None, help="a second dump of the before checkout (traces)")
    c.add_argument("--strict", action="store_true", help="keys added after count as differences")
    args = ap.parse_args(argv)
    if args.cmd == "dump":
        return dump(args.folder, set(args.only.split(",")), args.plan_workers, tuple(args.plan_sets.split(",")))
    return diff(args.before, args.after, args.setup_from_estimate, args.noise, args.strict)


if __name__ == "__main__":
    sys.exit(main())
