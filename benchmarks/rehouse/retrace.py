"""Trace again the named cases of a compare.py dump (their .setup repr) with whichever llmem is importable, into
OUT/trace/CASE.json, the same way compare.py dump writes them (for diff --noise):

    cd /tmp && HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/llmem-before /work/main/.venv/bin/python \
        /work/main/benchmarks/rehouse/retrace.py /tmp/before /tmp/before2 ci-12d676f00537 ...
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # noqa: E402

from llmem import trace  # noqa: E402
from llmem.setup.training import TrainingSetup  # noqa: E402,F401

src, out = Path(sys.argv[1]), Path(sys.argv[2])
(out / "trace").mkdir(parents=True, exist_ok=True)
for case in sys.argv[3:]:
    setup = eval((src / "trace" / f"{case}.setup").read_text())
    data = json.loads(compare._to_json(trace(setup).to_dict()))
    (out / "trace" / f"{case}.json").write_text(compare._to_json(compare._normalise("trace", data)) + "\n")
    print(case, flush=True)
