#!/usr/bin/env bash
# One prepared script for one GPU (sized for an H200: 61 configurations, 125M to 8B, every method with its ranks
# emulated on the one device through a fake process group; the 43 of 2026-11 ran in under 8 minutes, the 18 since
# (issues 10-12, 31: the chunked loss, Unsloth's checkpoint) are not timed on a device yet: check the timeout below; then up to 2 more for the OOM boundary
# of benchmarks/oom_boundary.py). It measures the three counters
# (max_memory_allocated, max_memory_reserved, NVML device-used) of the real training step and compares them with
# the estimate. Results: benchmarks/results/gpu_<gpu>.json and .png (and copies under $OUT when it is set).
#
#   bash benchmarks/gpu_validation.sh            # uses the python3 that holds a CUDA build of torch
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
gpu=$($PY -c "import torch; print(torch.cuda.get_device_name(0).split()[-1])" 2>/dev/null || echo none)
[ "$gpu" = none ] && { echo "no CUDA device visible to $PY"; exit 2; }
mkdir -p benchmarks/results
out=benchmarks/results/gpu_${gpu,,}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out.nvidia-smi.txt"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)" | tee -a "$out.nvidia-smi.txt"
status=0
timeout 500 $PY -m llmem.cli validate --against measure --matrix gpu --device cuda --max-error 5 \
    --out "$out.json" --plot "$out.png" || status=$?
# torchao's float8 training (--float8, llmem.runtime.float8) where torchao is installed: the float8 matrix measured
# (not yet run on a device: torch._scaled_mm's CUDA kernels, FSDP2's float8 all-gather on the fake process group)
if $PY -c "import torchao.float8" 2>/dev/null; then
    timeout 120 $PY -m llmem.cli validate --against measure --matrix float8 --device cuda --max-error 5 \
        --out "$out.float8.json" || status=$?
fi
# a vision-language step (Qwen2.5-VL: llmem.runtime.vision, its vision side learned by the estimate): tiny rows (one
# GPU, DDP and FSDP2, the tower's blocks units of their own), then the 3B and 7B at a 1024x768 image, the 3B under
# FSDP2 x 2 too (not yet run on a device)
timeout 300 $PY -m llmem.cli validate --against measure --matrix vlm-gpu --device cuda --max-error 5 \
    --out "$out.vlm.json" || status=$?
# the OOM boundary: the real step under a memory fraction, batch by batch, against the capacity-aware fit
timeout 120 $PY benchmarks/oom_boundary.py --out "$out.oom_boundary.json" || status=$?
# the job's loading and saving phases on one GPU (from_pretrained, save_pretrained) against llmem's analytic ones
timeout 180 $PY benchmarks/job_phases_gpu.py --out "$out.job_phases.json" || status=$?
# --compile: inductor's real kernels on each decoder layer, CUDA's counters against the estimate
timeout 240 $PY benchmarks/compile_gpu.py --out "$out.compile.json" || status=$?
if [ -n "${OUT:-}" ]; then cp "$out".* "$OUT"/ 2>/dev/null || true; fi
exit $status
