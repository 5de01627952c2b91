#!/usr/bin/env bash
# Which model loading works with Unsloth's GRPO trainer on this GPU: one GPU test per loader/size,
# each in its own process (a device-side assert poisons the process).
set -uo pipefail
OUT=${1:-/tmp/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false UNSLOTH_COMPILE_LOCATION=/tmp/unsloth_cache
for cfg in "fast 256" "fast 512" "peft 256"; do
  set -- $cfg
  echo "== loader=$1 hidden=$2"
  UAKL_GPU_LOADER=$1 UAKL_GPU_HIDDEN=$2 timeout 150 python -m pytest -q -x -p no:cacheprovider "tests/gpu/test_unsloth_gpu.py::test_unsloth_grpo_run_on_gpu[clip-lora16]" "tests/gpu/test_unsloth_gpu.py::test_unsloth_grpo_run_on_gpu[clip-qlora4]" 2>&1 | tee "$OUT/diag-$1-$2.log" | grep -E "passed|failed|Assertion|Error:" | head -5
done
echo "== bench_unsloth --smoke"
timeout 150 python bench/bench_unsloth.py --smoke 2>&1 | tee "$OUT/bench-unsloth-smoke.log" | tail -18
