#!/usr/bin/env bash
# Liger-Kernel's own GRPO tests (test/chunked_loss/test_grpo_loss.py of the liger-kernel sdist of the
# installed version) against stock LigerFusedLinearGRPOLoss (the control) and against
# AdaptiveFusedLinearGRPOLoss put in its place at run time (scripts/liger_conformance.py; the
# upstream file is not copied here and no assertion or tolerance is touched). Prints both summaries
# and the cases whose outcome differs; exit 1 when the drop-in fails a case the control passes.
#
#   bash scripts/liger_conformance.sh [--cpu] [--shards N] [--target stock|adaptive|both]
#        [--cache DIR] [--out DIR] [--timeout SECONDS] [-k EXPR]
#
# --cpu        the CI subset, on the CPU (TRITON_INTERPRET=1): the small shapes only, and of
#              test_correctness's grid the fp32, with-bias, beta=0.1, delta=None cases, plus one
#              large-shape case whose old log-probs overflow exp(0 - old) at padding (issue 10)
# --shards N   N pytest processes per target, all run at once, on disjoint cases (default 1)
# --cache DIR  where the sdist and its extracted tests live (default .cache/liger-sdist, or
#              $LIGER_SDIST_CACHE). Offline, pre-fetch: the extracted DIR/<version>/test is enough.
# --timeout S  each pytest process is interrupted after S seconds (its results so far are kept)
# PYTHON=...   the interpreter (default: python)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python}
case $PYTHON in */*) [ "${PYTHON#/}" = "$PYTHON" ] && PYTHON=$PWD/$PYTHON ;; esac  # the script cd-s below
CACHE=${LIGER_SDIST_CACHE:-$ROOT/.cache/liger-sdist}
SHARDS=1 CPU=0 TARGET=both OUTDIR="" TIMEOUT=0 KEXPR=""
while [ $# -gt 0 ]; do
  case $1 in
    --cpu) CPU=1 ;;
    --shards) SHARDS=$2; shift ;;
    --target) TARGET=$2; shift ;;
    --cache) CACHE=$2; shift ;;
    --out) OUTDIR=$2; shift ;;
    --timeout) TIMEOUT=$2; shift ;;
    -k) KEXPR=$2; shift ;;
    *) echo "liger_conformance.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done
case $TARGET in both) TARGETS="stock adaptive" ;; stock|adaptive) TARGETS=$TARGET ;;
  *) echo "--target=$TARGET is not valid; allowed: stock, adaptive, both" >&2; exit 2 ;; esac

if [ "$CPU" = 1 ]; then
  export TRITON_INTERPRET=1  # TRL's Triton log-prob kernel, interpreted; set before triton is imported
  SUBSET="not large_seq and ((not 1024-4096 and (not test_correctness[ or (test_correctness[None- and 0.1-0.2-0.2-1.0-True-1.0-dtype1)))"
  SUBSET+=" or test_correctness[None-token-grpo-False-False-True-0.1-0.2-0.2-1.0-True-1.0-dtype1-2e-05-0.001-8-128-1024-4096])"
  KEXPR=${KEXPR:+($KEXPR) and }$SUBSET
fi

VERSION=$("$PYTHON" -c "import importlib.metadata as m; print(m.version('liger-kernel'))")
TESTS=$CACHE/$VERSION
UPSTREAM=test/chunked_loss/test_grpo_loss.py
if [ ! -f "$TESTS/$UPSTREAM" ]; then
  SDIST=$CACHE/liger_kernel-$VERSION.tar.gz
  if [ ! -f "$SDIST" ]; then
    mkdir -p "$CACHE"
    "$PYTHON" -m pip download -q --no-binary :all: --no-deps -d "$CACHE" "liger-kernel==$VERSION" \
      || { echo "could not fetch the liger-kernel $VERSION sdist; offline, put it (or its extracted test/ folder) in $CACHE" >&2; exit 1; }
  fi
  mkdir -p "$TESTS"
  tar xzf "$SDIST" -C "$TESTS" --strip-components=1 "liger_kernel-$VERSION/test/__init__.py" \
    "liger_kernel-$VERSION/test/conftest.py" "liger_kernel-$VERSION/test/utils.py" \
    "liger_kernel-$VERSION/test/chunked_loss/__init__.py" "liger_kernel-$VERSION/$UPSTREAM"
fi
printf '[pytest]\n' > "$TESTS/pytest.ini"  # our options only, not the sdist's (its pythonpath holds src/)

OUTDIR=${OUTDIR:-$(mktemp -d)}
mkdir -p "$OUTDIR"
rm -f "$OUTDIR"/stock-*.xml "$OUTDIR"/adaptive-*.xml
export PYTHONPATH=$ROOT/scripts:$ROOT${PYTHONPATH:+:$PYTHONPATH}
ARGS=(-c pytest.ini -p liger_conformance -p no:cacheprovider -p no:logging -q -rfE --tb=short "$UPSTREAM")
[ -n "$KEXPR" ] && ARGS+=(-k "$KEXPR")
cd "$TESTS"
EXPECTED=$(LIGER_CONFORMANCE_TARGET=stock "$PYTHON" -m pytest "${ARGS[@]}" --collect-only 2>/dev/null | grep -oE '^[0-9]+(/[0-9]+)? tests? collected' | cut -d/ -f1 | grep -oE '^[0-9]+')
echo "liger-kernel $VERSION: $UPSTREAM, $EXPECTED applicable cases per target, $SHARDS shard(s) each; logs in $OUTDIR"
START=$(date +%s)
for target in $TARGETS; do
  for ((i = 0; i < SHARDS; i++)); do
    LIGER_CONFORMANCE_TARGET=$target LIGER_CONFORMANCE_SHARD=$i/$SHARDS \
      $( [ "$TIMEOUT" -gt 0 ] && echo timeout -k 30 -s INT "$TIMEOUT" ) \
      "$PYTHON" -m pytest "${ARGS[@]}" --junitxml="$OUTDIR/$target-$i.xml" > "$OUTDIR/$target-$i.log" 2>&1 &
  done
done
wait || true
echo "ran in $(( $(date +%s) - START )) s"
for target in $TARGETS; do tail -n 1 "$OUTDIR/$target"-*.log | grep -v '^$' | sed "s/^/  /"; done
"$PYTHON" "$ROOT/scripts/liger_conformance.py" summary "$OUTDIR" "$EXPECTED"
