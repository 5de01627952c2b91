#!/usr/bin/env bash
# Builds .gpu-site-mut.tgz (or DEST.tgz): what the GPU machine needs to run scripts/gpu/mutation-device.sh, packed to fit
# the 64 MiB a run may carry beside the working tree. It is the unsloth-2026.10 site of build-site.sh (TRL, Unsloth,
# Liger, datasets... that the core's and the backends' tests import) plus mutmut 3.8.1 and the packages it and pytest
# need, as cp312 manylinux wheels (the machine has Python 3.12 and no package index), without bitsandbytes (as CI's
# venv). Run from anywhere:
#
#   bash scripts/gpu/build-mutation-site.sh [DEST]          (DEST: .gpu-site-mut; /.gpu-site* is in .gitignore)
#
# The versions are those of the main suite's venv (mutmut's own pins are lower bounds: these are tested together).
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:-.gpu-site-mut}
MUTMUT_PKGS="mutmut==3.8.1 click==8.5.1 coverage==7.17.4 libcst==1.9.0 pyyaml==6.0.4 setproctitle==1.3.8
textual==8.2.8 rich==15.0.0 markdown-it-py==4.3.0 mdit-py-plugins==0.7.0 mdurl==0.1.2 pygments==2.21.0
platformdirs==4.14.8 typing-extensions==4.16.0 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4"
EXTRA_PKGS="$MUTMUT_PKGS ${EXTRA_PKGS:-}" bash scripts/gpu/build-site.sh unsloth-2026.10 "$DEST"
# The tests run on the CPU as on CI, whose venv has no bitsandbytes (nor has the GPU machine): none here either.
rm -rf "$DEST"/bitsandbytes "$DEST"/bitsandbytes-*.dist-info
tar czf "$DEST.tgz" -C "$(dirname "$DEST")" "$(basename "$DEST")" && rm -rf "$DEST"
# What travels: the working tree (tracked and untracked files git does not ignore) and the packed site, 64 MiB in all.
tree=$( (git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null || true) | awk '{s += $1} END {print s + 0}')
site=$(stat -c %s "$DEST.tgz")
echo "travels: working tree $((tree / 1048576)) MiB + $DEST.tgz $((site / 1048576)) MiB = $(((tree + site) / 1048576)) MiB (limit 64 MiB)"
[ $((tree + site)) -le $((64 * 1048576)) ] || { echo "over the 64 MiB a run may carry" >&2; exit 1; }
