"""A bounded load on `llmem serve` over loopback, with a slow plan in flight: the server started as a user starts it
(`python -m llmem.cli serve --port 0`), warmed by one estimate, then a 512-layer model's plan posted (it runs to
the plan's time limit) and, while it runs, estimates at a fixed concurrency: first `--distinct` different set-ups
(each computed by a worker), then `--requests` requests drawn from them (answered from the cache), then each of
the first again, one at a time (a single cached answer's latency). Prints each
phase's latencies (p50, p99, max), the errors (any answer but 200), the plan's answer and how long SIGTERM took to
stop the server. benchmarks/serve_load.md holds a run's figures.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/serve_load.py --requests 200 --concurrency 20
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

HUGE = {"model_type": "llama", "num_hidden_layers": 512, "hidden_size": 8192, "num_attention_heads": 64,
        "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256, "max_position_embeddings": 8192}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _line(name: str, seconds: list[float], errors: int) -> str:
    ms = [1000 * s for s in seconds]
    return (f"{name:<28} n={len(ms):<4} errors={errors:<3} p50={_percentile(ms, .5):8.1f} ms  "
            f"p99={_percentile(ms, .99):8.1f} ms  max={max(ms):8.1f} ms")


async def _phase(client: httpx.AsyncClient, queries: list[dict], concurrency: int) -> tuple[list[float], int]:
    """Every query posted to /api/estimate, `concurrency` at a time: (latencies, answers other than 200)."""
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    errors = 0

    async def one(query: dict) -> None:
        nonlocal errors
        async with gate:
            start = time.perf_counter()
            r = await client.post("/api/estimate", json=query)
            latencies.append(time.perf_counter() - start)
            errors += r.status_code != 200

    await asyncio.gather(*(one(q) for q in queries))
    return latencies, errors


async def _load(url: str, args: argparse.Namespace) -> None:
    limits = httpx.Limits(max_connections=args.concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        while True:                 # the workers warm up (the fork server imports torch and runs an estimate)
            r = await client.post("/api/estimate", json={"model": "tiny-llama", "seq_len": "64"})
            if r.status_code == 200:
                break
            await asyncio.sleep(0.5)
        print(f"first answer {time.perf_counter() - start:.1f} s after the server printed its address")
        config = base64.urlsafe_b64encode(json.dumps(HUGE).encode()).decode().rstrip("=")
        plan_start = time.perf_counter()
        plan = asyncio.create_task(client.post("/api/plan", json={"model": "huge.json", "config": config,
                                                                  "gpus": "8"}))
        await asyncio.sleep(0.5)
        distinct = [{"model": args.model, "seq_len": str(128 + 8 * i), "batch_size": str(1 + i % 4)}
                    for i in range(args.distinct)]
        computed, errors = await _phase(client, distinct, args.concurrency)
        print(_line("estimates, each computed", computed, errors))
        repeated = [distinct[i % len(distinct)] for i in range(args.requests)]
        cached, errors = await _phase(client, repeated, args.concurrency)
        print(_line("estimates, from the cache", cached, errors))
        alone, errors = await _phase(client, distinct, 1)
        print(_line("from the cache, one at a time", alone, errors))
        print(f"plan still running after both phases: {not plan.done()}")
        r = await plan
        print(f"plan: HTTP {r.status_code} after {time.perf_counter() - plan_start:.1f} s: {r.json().get('error')}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--distinct", type=int, default=40, help="different set-ups estimated first")
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--plan-timeout", type=float, default=30.0)
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"))
    server = subprocess.Popen([sys.executable, "-m", "llmem.cli", "serve", "--port", "0", "--workers",
                               str(args.workers), "--plan-timeout", str(args.plan_timeout)],
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = server.stdout.readline()
        print(line.strip())
        asyncio.run(_load(line.split()[2], args))
        server.terminate()
        start = time.perf_counter()
        code = server.wait(60)
        print(f"SIGTERM: exit {code} after {time.perf_counter() - start:.2f} s")
    finally:
        if server.poll() is None:
            server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
