"""In-process seconds of warm estimates and plans (anatomies loaded first), for pairing two checkouts
(benchmarks/rehouse/sections.md):

    cd /tmp && for i in 1 2 3; do for v in /tmp/llmem-before /work/main; do
        HF_HUB_OFFLINE=1 PYTHONPATH=$v /work/main/.venv/bin/python /work/main/benchmarks/rehouse/speed_pair.py; done; done
"""
import time

from llmem.estimator.engine import estimate
from llmem.model.anatomy import load_anatomy
from llmem.planner.plan import plan
from llmem.setup.training import TrainingSetup

a8 = load_anatomy("meta-llama/Llama-3.1-8B")
a70 = load_anatomy("meta-llama/Llama-3.1-70B")
s8 = TrainingSetup(model="meta-llama/Llama-3.1-8B", method="fsdp", gpus=8, seq_len=4096)
estimate(s8, a8)
t = time.perf_counter()
for _ in range(20):
    estimate(s8, a8)
est = (time.perf_counter() - t) / 20
t = time.perf_counter()
plan(TrainingSetup(model="meta-llama/Llama-3.1-8B", gpus=4, gpu="A100-80GB", seq_len=4096), anatomy=a8)
p8 = time.perf_counter() - t
t = time.perf_counter()
plan(TrainingSetup(model="meta-llama/Llama-3.1-70B", gpus=512, gpu="H100-80GB", seq_len=4096, grad_ckpt=True), anatomy=a70)
p70 = time.perf_counter() - t
print(f"estimate 8B fsdp x8 {est*1000:.1f} ms; plan 8B x4 {p8:.2f} s; plan 70B x512 ckpt {p70:.2f} s")
