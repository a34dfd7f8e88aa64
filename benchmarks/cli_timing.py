"""Whole-process timing of the `llmem` command line, against `python -c "import torch"` and accelerate's
`estimate-memory --help`: what a user waits for at the shell (interpreter, imports, work), not the in-process engine
(benchmarks/estimate_speed.md).

Every command runs as its own process, in rounds: each round runs every command once, in turn (so that a drift in
the machine's speed touches them all alike); the first round is a warm-up and is not counted. The figures are the
medians of the counted rounds (min-max), wall seconds from `time.perf_counter` around the process and CPU seconds
(user + system) from `resource.getrusage(RUSAGE_CHILDREN)`. Run from a scratch folder with HF_HUB_OFFLINE=1, the
user's own llmem cache folder as it is (the warm-up fills what it lacks).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/cli_timing.py \\
        --torchtune-yaml PATH/TO/torchtune/recipes/configs/llama3_1/8B_full.yaml > benchmarks/cli_timing.md.new
    .venv/bin/python benchmarks/cli_timing.py --only estimate     # the rows whose label holds "estimate"
    .venv/bin/python benchmarks/cli_timing.py --checkout ../old --only estimate     # another checkout's figures
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLMEM = [sys.executable, "-m", "llmem.cli"]
PLANS = [
    "meta-llama/Llama-3.1-8B --gpu A100-80GB --gpus 4 --seq-len 4096",
    "meta-llama/Llama-3.1-70B --gpu H100-80GB --gpus 8 --seq-len 4096",
    "Qwen/Qwen2.5-72B --gpu H100-80GB --gpus 16 --gpus-per-node 8 --seq-len 4096",
    "meta-llama/Llama-3.1-405B --gpu H100-80GB --gpus 512 --seq-len 4096",
    "Qwen/Qwen2.5-7B --objective grpo --gpu H100-80GB --gpus 8",
    # the two plans in which nothing fits, their searches in turn (the rows above run them side by side on every
    # CPU: --workers auto, the default)
    "meta-llama/Llama-3.1-70B --gpu H100-80GB --gpus 8 --seq-len 4096 --workers 1",
    "Qwen/Qwen2.5-72B --gpu H100-80GB --gpus 16 --gpus-per-node 8 --seq-len 4096 --workers 1",
]


def rows(torchtune_yaml: str | None) -> list[tuple[str, list[str]]]:
    """(label, argv) of every command timed."""
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    out = [("python -c 'import torch'", [sys.executable, "-c", "import torch"]),
           ("accelerate estimate-memory --help", [accelerate, "estimate-memory", "--help"]),
           ("llmem --help", [*LLMEM, "--help"]),
           ("llmem estimate gpt2", [*LLMEM, "estimate", "gpt2"]),
           ("llmem estimate meta-llama/Llama-3.1-8B --gpus 8 --method fsdp",
            [*LLMEM, "estimate", "meta-llama/Llama-3.1-8B", "--gpus", "8", "--method", "fsdp"]),
           ("llmem estimate gpt2 --gpus 0 (refused)", [*LLMEM, "estimate", "gpt2", "--gpus", "0"])]
    if torchtune_yaml:
        out.append(("llmem estimate --from torchtune llama3_1/8B_full.yaml",
                    [*LLMEM, "estimate", "--from", os.path.abspath(torchtune_yaml)]))
    out += [(f"llmem plan {p}", [*LLMEM, "plan", *shlex.split(p)]) for p in PLANS]
    return out


def run_once(argv: list[str], cwd: str, env: dict[str, str]) -> tuple[float, float, int]:
    """(wall s, user + system CPU s, exit code) of one run, its output thrown away."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    code = subprocess.run(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), code


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="counted rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="rounds not counted, first (default 1)")
    parser.add_argument("--torchtune-yaml", default=None, help="torchtune's llama3_1/8B_full.yaml (its row is "
                        "left out without it)")
    parser.add_argument("--only", default=None, help="time the rows whose label holds this text")
    parser.add_argument("--checkout", default=str(Path(__file__).resolve().parents[1]),
                        help="the llmem checkout timed (default: this one; another: the figures before a change)")
    args = parser.parse_args(argv)
    table = [r for r in rows(args.torchtune_yaml) if args.only is None or args.only in r[0]]
    repo = os.path.abspath(args.checkout)
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
    walls: dict[str, list[float]] = {label: [] for label, _ in table}
    cpus: dict[str, list[float]] = {label: [] for label, _ in table}
    codes: dict[str, set[int]] = {label: set() for label, _ in table}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.warmup + args.runs):
            for label, command in table:
                wall, cpu, code = run_once(command, scratch, env)
                codes[label].add(code)
                if round_ >= args.warmup:
                    walls[label].append(wall)
                    cpus[label].append(cpu)
            print(f"round {round_ + 1} of {args.warmup + args.runs} done", file=sys.stderr)
    load = os.getloadavg()
    print(f"{os.cpu_count()} cores, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end; "
          f"{args.runs} counted rounds after {args.warmup} warm-up; medians (min-max), seconds\n")
    print("| command | wall s | cpu s | exit |\n|---|---|---|---|")
    for label, _ in table:
        print(f"| `{label}` | {_spread(walls[label])} | {_spread(cpus[label])} | "
              f"{','.join(map(str, sorted(codes[label])))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
