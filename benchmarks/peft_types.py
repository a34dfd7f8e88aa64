"""Every peft type of peft's own benchmark (Llama-3.2-3B adapter configs) through llmem: how its activations are
modelled on Llama-3.2-3B (hand recipe / learned from the real code / fell back to the frozen base's / refused) and
the estimate against the trace on tiny-llama (same config, same set-up, --gpu H100-80GB).

    HF_HUB_OFFLINE=1 LLMEM_CACHE_DIR=$(mktemp -d) PYTHONPATH=. python benchmarks/peft_types.py \
        [--configs ../shared/data/peft-adapters] [--only NAME ...] > benchmarks/peft_types.md

Each row is the set-up of `llmem estimate MODEL --peft-config DIR --seq-len 512` (batch 1, bf16-mixed, adamw);
the tiny-llama columns are `llmem estimate` and `llmem trace` of tiny-llama with the same flags and --gpu
H100-80GB. Run in one process (the API the CLI calls), a fresh LLMEM_CACHE_DIR so that every learning runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import llmem
from llmem.errors import LlmemError, first_line

SEQ_LEN = 512
BIG = "meta-llama/Llama-3.2-3B"
TINY = "tiny-llama"
TINY_LAYERS = 4


def source(result) -> str:
    """How the estimate's activations were modelled, from its notes (llmem.memory.activations.learned)."""
    notes = " ".join(result.notes)
    if "activations not learned" in notes or "activations as for the frozen base" in notes:
        return "fell back"
    if "learned from" in notes and "activations" in notes and "no hand-written" in notes:
        return "learned"
    return "hand recipe"


def fallback_reason(result) -> str:
    for n in result.notes:
        if n.startswith("activations not learned"):
            return n.split("(", 1)[1].rsplit("); no exact", 1)[0][:110]
    return ""


def data_free(result) -> bool:
    return any("data-free" in n for n in result.notes)


def tiny_config(folder: Path, tmp: Path) -> Path:
    """The config as peft would take it for tiny-llama: prompt learning's model dimensions (token_dim, heads,
    layers; peft's _prepare_prompt_learning_config fills the unset ones from the model's config) and adaption
    prompt's adapter_layers (all of the 3B's 28 layers: all of tiny-llama's) cut to the small model."""
    fields = json.loads((folder / "adapter_config.json").read_text())
    for name in ("token_dim", "num_attention_heads", "num_layers", "num_transformer_submodules"):
        fields.pop(name, None)
    if "adapter_layers" in fields:
        fields["adapter_layers"] = min(int(fields["adapter_layers"]), TINY_LAYERS)
    out = tmp / folder.name
    out.mkdir()
    (out / "adapter_config.json").write_text(json.dumps(fields))
    return out


def survey_one(folder: Path, tmp: Path) -> dict:
    row: dict = {"name": folder.name}
    try:
        big = llmem.estimate(BIG, peft_config=str(folder), seq_len=SEQ_LEN)
        row["kind"] = source(big)
        row["why"] = fallback_reason(big)
        row["data_free"] = data_free(big)
        row["big_gib"] = big.peak_reserved_bytes / 2**30
        row["trainable"] = big.setup.trainable_params
    except LlmemError as exc:
        row["kind"] = "refused"
        row["why"] = first_line(exc, 140)
        return row
    tiny = tiny_config(folder, tmp)
    try:
        est = llmem.estimate(TINY, peft_config=str(tiny), seq_len=SEQ_LEN, gpu="H100-80GB")
        tr = llmem.trace(TINY, peft_config=str(tiny), seq_len=SEQ_LEN, gpu="H100-80GB")
        row["alloc_err"] = 100 * (est.peak_allocated_bytes / tr.peak_allocated_bytes - 1)
        row["res_err"] = 100 * (est.peak_reserved_bytes / tr.peak_reserved_bytes - 1)
        row["tiny_kind"] = source(est)
    except Exception as exc:      # noqa: BLE001 - a trace that does not run is a row of the report
        row["tiny_error"] = f"{type(exc).__name__}: {first_line(exc, 110)}"
    return row


def table(rows: list[dict]) -> str:
    out = ["| config | 3B activations | trainable (3B) | 3B reserved | tiny alloc err % | tiny reserved err % | "
           "why / notes |", "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        kind = r["kind"] + (" (data-free init)" if r.get("data_free") else "")
        if r["kind"] == "refused":
            out.append(f"| {r['name']} | refused | | | | | {r['why']} |")
            continue
        measured = "alloc_err" in r
        errs = f"{r['alloc_err']:+.2f} | {r['res_err']:+.2f}" if measured else "- | -"
        why = "; ".join(w for w in (r["why"], "" if measured else "tiny-llama: " + r.get("tiny_error", "")) if w)
        out.append(f"| {r['name']} | {kind} | {r['trainable']:,} | {r['big_gib']:.2f} GiB | {errs} | {why} |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default=str(Path(__file__).resolve().parents[1].parent / "shared/data/peft-adapters"))
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    folders = sorted(p for p in Path(args.configs).iterdir() if (p / "adapter_config.json").is_file())
    if args.only:
        folders = [f for f in folders if any(o in f.name for o in args.only)]
    rows = []
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="peft-types-"))
    for f in folders:
        rows.append(survey_one(f, tmp))
        print(f"{f.name}: {rows[-1]}", file=sys.stderr, flush=True)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["kind"]] = counts.get(r["kind"], 0) + 1
    within = sum(1 for r in rows if "alloc_err" in r and abs(r["alloc_err"]) <= 2 and abs(r["res_err"]) <= 2)
    print(table(rows))
    print(f"\n{len(rows)} configs: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
          + f"; tiny-llama estimate within 2 % of the trace on both counters: {within}; "
          f"{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
