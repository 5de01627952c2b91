#!/usr/bin/env bash
# Builds the DeepSpeed site for the GPU machine (issue 24, item 5) on a CPU machine with network (paths are
# relative to the project root; the PLAT list is that of scripts/gpu/build-site.sh):
#   bash scripts/gpu/build-deepspeed-site.sh [DEST]        # DEST defaults to .gpu-site-ds
# The GPU machine has torch 2.11, Python 3.12 and no package index (see /work/shared/gpu/README.md).
# This makes:
#   DEST/              deepspeed 0.19.8 (a pure-Python wheel built here from its sdist with DS_BUILD_OPS=0:
#                      no op is compiled; ZeRO-2/3 with torch's AdamW needs none) and the packages it imports
#                      that the machine lacks: hjson, py-cpuinfo, msgpack, nvidia-ml-py, ninja, einops, psutil
#                      (binary wheels for CPython 3.12, manylinux x86_64);
#   DEST.tgz           the same, packed: what a call carries next to .gpu-site;
# and checks that .gpu-site plus DEST.tgz fit in the 64 MiB a call may carry. On the GPU machine:
#   mkdir -p /tmp/ds-site && tar xzf .gpu-site-ds.tgz -C /tmp/ds-site
#   export PYTHONPATH=$PWD/.gpu-site:/tmp/ds-site:$PWD
# (carry: [".gpu-site", ".gpu-site-ds.tgz"]). Keep both out of git (.git/info/exclude has /.gpu-site*/).
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:-.gpu-site-ds}
DS_V=${DS_V:-0.19.8}
CARRY_LIMIT=$((64 * 1024 * 1024))
# The Python that builds the wheel: one with torch, so setup.py records a torch version (no op is built either way).
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
WHL=$(mktemp -d)
trap 'rm -rf "$WHL"' EXIT
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
DEPS="hjson py-cpuinfo msgpack nvidia-ml-py ninja einops psutil"

isolation=--no-build-isolation
"$PYTHON" -c "import torch, setuptools, wheel" 2>/dev/null || isolation=""  # no torch here: build isolated (setup.py then warns)
DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps $isolation --no-binary deepspeed "deepspeed==$DS_V" -w "$WHL"
ls "$WHL"/deepspeed-"$DS_V"-py3-none-any.whl > /dev/null  # a platform wheel would mean ops were compiled
"$PYTHON" -m pip download -q --no-deps $PLAT -d "$WHL" $DEPS
rm -rf "$DEST"
"$PYTHON" -m pip install -q --no-deps --no-compile $PLAT --target "$DEST" "$WHL"/*.whl
# What deepspeed's wheel asks for, against what DEST and the GPU machine (torch, numpy, packaging, pydantic via
# .gpu-site, tqdm via .gpu-site) have: print it so a new requirement is seen when DS_V changes.
unzip -p "$WHL"/deepspeed-*.whl 'deepspeed-*.dist-info/METADATA' | sed -n '/extra ==/d; s/^Requires-Dist: /deepspeed requires: /p'
rm -rf "$DEST"/bin  # the deepspeed launcher scripts: accelerate launch starts the ranks itself
tar czf "$DEST.tgz" -C "$DEST" .
site=$(du -sb "${SITE:-.gpu-site}/" 2>/dev/null | cut -f1 || echo 0)  # SITE: the main site, if not ./.gpu-site
ds=$(du -sb "$DEST" | cut -f1)
packed=$(stat -c %s "$DEST.tgz")
echo "$DEST: $ds bytes unpacked, $DEST.tgz: $packed bytes; .gpu-site: ${site:-0} bytes; limit $CARRY_LIMIT"
for pair in "unpacked:$ds" "packed:$packed"; do
  total=$(( ${site:-0} + ${pair#*:} ))
  verdict=$([ "$total" -le "$CARRY_LIMIT" ] && echo fits || echo "does NOT fit")
  echo ".gpu-site + $DEST (${pair%%:*}): $total bytes: $verdict in 64 MiB"
done
