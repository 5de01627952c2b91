#!/usr/bin/env bash
# Builds a site folder for the GPU machine for one stack of unsloth_adaptive_kl/versions.py:
#
#   bash scripts/gpu/build-site.sh STACK [DEST]      # e.g. unsloth-2026.8 .gpu-site-old
#
# (adapted from ../shared/gpu/build-site.sh, which builds the unsloth-2026.10 stack as .gpu-site).
# The GPU machine has Python 3.12, torch 2.11 (CUDA 13), transformers 5.17, peft, accelerate and
# triton, and reaches no package index: the site holds the stack's exact pins (TRL, transformers,
# Liger, Unsloth, unsloth_zoo, datasets where pinned) and the few packages they need that the
# machine lacks, unpacked for Python 3.12 and trimmed to fit the 64 MiB that a run may carry. On it:
#   export PYTHONPATH=$PWD/DEST:$PWD
# or, with PACK=1 (DEST.tgz, for a site over the carry limit):
#   mkdir -p /tmp/site && tar xzf DEST.tgz -C /tmp/site && export PYTHONPATH=/tmp/site/DEST:$PWD
# A transformers in the site shadows the machine's own; a 4.x one brings the tokenizers and
# huggingface_hub it needs. Keep DEST out of git (add "/.gpu-site*/" to .git/info/exclude).
set -euo pipefail
cd "$(dirname "$0")/../.."
STACK=${1:?usage: build-site.sh STACK [DEST] (a stack of unsloth_adaptive_kl/versions.py)}
DEST=${2:-.gpu-site-$STACK}
PINS=$(python3 unsloth_adaptive_kl/versions.py "$STACK" | sed -n 1p)
NODEPS=$(python3 unsloth_adaptive_kl/versions.py "$STACK" | sed -n 2p)
WHL=$(mktemp -d)
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
EXTRA="bitsandbytes==0.50.2 dill==0.4.0 multiprocess==0.70.18 xxhash
tyro docstring-parser shtab typeguard msgspec cut_cross_entropy
pydantic pydantic-core annotated-types typing-inspection json5 nest-asyncio structlog"
case " $PINS " in
  *" datasets=="*) ;;
  *) EXTRA="$EXTRA datasets==4.8.5" ;;
esac
case " $PINS " in
  *" transformers==4."*) EXTRA="$EXTRA tokenizers==0.22.2 huggingface_hub==0.36.2" ;;  # what transformers 4.57 accepts
esac
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps $PLAT -d "$WHL" $PINS $NODEPS $EXTRA ${EXTRA_PKGS:-}
rm -rf "$DEST"
python3 -m pip install -q --no-deps --no-compile $PLAT --target "$DEST" "$WHL"/*.whl
# Trim what no training run imports: Unsloth's web studio and CLI, bitsandbytes builds for other
# CUDA versions, byte-code caches.
rm -rf "$DEST"/studio "$DEST"/unsloth_cli "$DEST"/bin
find "$DEST"/bitsandbytes -name 'libbitsandbytes_cuda*.so' ! -name '*cuda130.so' -delete
find "$DEST" -name '__pycache__' -prune -exec rm -rf {} +
rm -rf "$WHL"
du -sh "$DEST"
if [ -n "${PACK:-}" ]; then  # PACK=1: DEST.tgz instead (a 4.x transformers makes the folder ~110 MB; packed ~31 MB)
  tar czf "$DEST.tgz" -C "$(dirname "$DEST")" "$(basename "$DEST")" && rm -rf "$DEST" && ls -la "$DEST.tgz"
fi
