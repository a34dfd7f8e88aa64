#!/usr/bin/env bash
# Regenerates the screens listed in docs/screens/README.md: each text file starts with the command that made it.
#   bash docs/screens/make.sh            # estimate, trace, plan, the web page (a few minutes)
#   bash docs/screens/make.sh validate   # also validate --matrix ci at 80 and 120 columns (traces: ~10 minutes)
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
LLMEM=${LLMEM:-.venv/bin/llmem}
run() {  # file width args...: append "$ COLUMNS=w llmem args" and its output
  local out=$1 w=$2; shift 2
  { echo "\$ COLUMNS=$w llmem $*"; echo; COLUMNS=$w "$LLMEM" "$@" 2>&1 || true; echo; } >> "$out"
}
for w in 80 120; do
  rm -f docs/screens/estimate-$w.txt docs/screens/trace-$w.txt docs/screens/plan-$w.txt
  run docs/screens/estimate-$w.txt $w estimate meta-llama/Llama-3.1-8B --qlora --lora-rank 16 --lora-targets all-linear \
      --grad-ckpt --fused-ce --seq-len 4096
  run docs/screens/estimate-$w.txt $w estimate meta-llama/Llama-3.1-8B --gpus 4 --method fsdp --seq-len 4096 \
      --batch-size 6 --grad-ckpt
  run docs/screens/estimate-$w.txt $w estimate facebook/opt-1.3b --engine paper --gpus 4 --method fsdp
  run docs/screens/estimate-$w.txt $w estimate meta-llama/Llama-3.1-8B --gpus 8 --method ds-zero3 --seq-len 4096 \
      --grad-ckpt --reduce-bucket-size auto --prefetch-bucket-size auto --param-persistence-threshold auto
  run docs/screens/trace-$w.txt $w trace gpt2 --method fsdp --gpus 2 --batch-size 1 --seq-len 128 \
      --plot docs/screens/trace.png
  run docs/screens/plan-$w.txt $w plan meta-llama/Llama-3.1-8B --gpu A100-80GB --gpus 4 --seq-len 4096 --grad-ckpt \
      --plot docs/screens/plan.png
done
# the web page (llmem serve) in headless Chromium, as tests/cli/test_browser.py drives it
LLMEM_SCREENSHOT=docs/screens/serve.png .venv/bin/python -m pytest -q tests/cli/test_browser.py -k query_url
# ... and at a phone's 390 px and a laptop's 1280 px: the first page, a plan, an uploaded config.json
LLMEM_SCREENSHOTS=docs/screens .venv/bin/python -m pytest -q tests/cli/test_browser.py -k fits_a_phone
if [ "${1:-}" = validate ]; then
  for w in 80 120; do
    rm -f docs/screens/validate-$w.txt
    run docs/screens/validate-$w.txt $w validate --against trace --matrix ci --max-error 2 \
        --plot docs/screens/validate.png
  done
fi
