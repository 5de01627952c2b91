#!/usr/bin/env bash
# GPU verification, run on the GPU machine from the repo root (see docs/gpu-verification.md):
#   export PYTHONPATH=$PWD/.gpu-site:$PWD; bash scripts/gpu/verify.sh "$OUT"
# 1. the GPU tests (Unsloth backend: every method as 16-bit LoRA and 4-bit QLoRA; dynamic beta
#    over 32 steps), 2. the Liger benchmark, 3. a smoke pass of the Unsloth benchmark.
set -uo pipefail
OUT=${1:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false UNSLOTH_COMPILE_LOCATION=/tmp/unsloth_cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/machine.txt"
python -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability())" | tee -a "$OUT/machine.txt"
python -m unsloth_adaptive_kl doctor 2>&1 | tee "$OUT/doctor.txt"
echo "== tests/gpu"
UAKL_GPU_REPORT="$OUT/gpu-report.json" timeout 420 python -m pytest -q -s -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|error|Error|PASS|FAIL" | tail -40
echo "== bench_liger"
timeout 150 python bench/bench_liger.py 2>&1 | tee "$OUT/bench-liger.log" | tail -25
echo "== bench_unsloth --smoke"
timeout 120 python bench/bench_unsloth.py --smoke 2>&1 | tee "$OUT/bench-unsloth-smoke.log" | tail -20
