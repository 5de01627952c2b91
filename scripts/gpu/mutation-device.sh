#!/usr/bin/env bash
# One part of the mutation testing (scripts/mutation.sh, docs/reliability.md "Mutation testing") on the GPU machine's
# 16 CPU cores, within one device call (10 minutes at most). The tests run on the CPU (CUDA_VISIBLE_DEVICES=), as on CI.
#
#   here, once:  bash scripts/gpu/build-mutation-site.sh         (-> .gpu-site-mut.tgz: TRL, Unsloth, Liger, mutmut...)
#   there:       bash scripts/gpu/mutation-device.sh "$OUT" PART  (carry .gpu-site-mut.tgz)
#
# PART: 1, 2 (the core's modules, split so that each part ends inside one call), 3 (the backends' KL lines), or
# "core MODULE..." / "backends NAME..." for another split. The part stops itself after MUTATION_BUDGET_S seconds
# (default 500, counted from its start) and still writes its partial score: mutants not checked by then are counted
# as such. Writes under OUT (at most 6 files): log.txt (what was printed, without the spinner), summary.txt (the score), survivors.txt
# (every survivor's diff; backends: the survivors' lines), counts.json (core: for `mutation_summary.py --merge`),
# results.tgz (the run's result files), timing.txt (one line: part, seconds, cores, mutants checked).
# A part cut short: carry its results.tgz back (under an ignored name, e.g. .gpu-site-mut-part1.tgz) and run the part
# again with MUTATION_RESUME=.gpu-site-mut-part1.tgz: its verdicts are kept, only the rest is checked.
# PYTHON (default python3), MUTATION_SITE (a site folder instead of the packed one) and MUTATION_JOBS (default: every
# core) are for a run elsewhere, e.g. on CPU here: PYTHON=.venv/bin/python MUTATION_SITE= bash ... /tmp/out core tail
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${1:?usage: mutation-device.sh OUT PART}
PART=${2:?usage: mutation-device.sh OUT PART}
shift 2
START=$(date +%s)
BUDGET=${MUTATION_BUDGET_S:-500}
case "$PART" in
  # the core in two halves of ~900 mutants and ~200 s of their tests' measured time each (commit 4e2cb2a)
  1) WHAT=core; NAMES=(estimators metrics kl_term adaptation) ;;
  2) WHAT=core; NAMES=(controllers shaping tail) ;;
  3) WHAT=backends; NAMES=() ;;
  core | backends) WHAT=$PART; NAMES=("$@") ;;
  *) echo "unknown part $PART: 1 2 3, core MODULE..., backends NAME..." >&2; exit 2 ;;
esac
VERSIONS='import sys, importlib.metadata as md, torch
assert not torch.cuda.is_available(), "the tests must run on the CPU"
names = ("mutmut", "pytest", "trl", "transformers", "unsloth", "unsloth_zoo", "liger_kernel")
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (no CUDA), " + ", ".join(f"{d} {md.version(d)}" for d in names))'
CORE_CHECKED='import glob, json, sys
codes = [c for p in glob.glob(sys.argv[1] + "/mutants/unsloth_adaptive_kl/*.meta") for c in json.load(open(p))["exit_code_by_key"].values()]
print(sum(c is not None for c in codes), "of", len(codes))'
BACKENDS_CHECKED='import json, sys
rows = [json.loads(line) for line in open(sys.argv[1] + "/backends.jsonl")]
print(sum(r["status"] != "not run" for r in rows), "of", len(rows), "written")'

main() {
  # The packages: the packed site carried with the call, unpacked outside the working tree (whose copy mutmut makes).
  if [ -z "${MUTATION_SITE+set}" ]; then
    [ -f "$ROOT/.gpu-site-mut.tgz" ] || { echo "no .gpu-site-mut.tgz: build it (scripts/gpu/build-mutation-site.sh) and carry it"; exit 1; }
    rm -rf /tmp/mutation-site && mkdir -p /tmp/mutation-site && tar xzf "$ROOT/.gpu-site-mut.tgz" -C /tmp/mutation-site
    MUTATION_SITE=/tmp/mutation-site/.gpu-site-mut
  fi
  export MUTATION_PYTHONPATH=$MUTATION_SITE PYTHON=${PYTHON:-python3} CUDA_VISIBLE_DEVICES=
  export MUTATION_JOBS=${MUTATION_JOBS:-$(OMP_NUM_THREADS= nproc)} MUTATION_DIR=${MUTATION_DIR:-/tmp/mutation-work} PYTHONUNBUFFERED=1
  [ ! -e "$MUTATION_SITE/unsloth_adaptive_kl" ] || { echo "$MUTATION_SITE holds unsloth_adaptive_kl: it would shadow mutmut's copy"; exit 1; }
  PYTHONPATH=$MUTATION_SITE "$PYTHON" -c "$VERSIONS" || { echo "the site does not import (above)"; exit 1; }

  left=$((BUDGET - ($(date +%s) - START) - 30))  # 30 s for the score and the packing
  echo "part $PART: $WHAT ${NAMES[*]:-(all)}, $MUTATION_JOBS jobs, $left s for the runs"
  MUTATION_TIMEOUT=$left bash "$ROOT/scripts/mutation.sh" "$WHAT" ${NAMES[@]+"${NAMES[@]}"}
  status=$?

  if [ "$WHAT" = core ]; then
    W=$MUTATION_DIR/core
    cp "$W/summary.txt" "$W/survivors.txt" "$W/counts.json" "$OUT/" 2>/dev/null
    (cd "$W" && tar czf "$OUT/results.tgz" setup.cfg mutants/mutmut-stats.json $(cd "$W" && ls mutants/unsloth_adaptive_kl/*.meta 2>/dev/null))
    checked=$("$PYTHON" -c "$CORE_CHECKED" "$W" 2>/dev/null || echo "? of ?")
  else
    W=$MUTATION_DIR/backends
    cp "$W/summary.txt" "$OUT/" 2>/dev/null
    grep '^SURVIVED' "$W/summary.txt" >"$OUT/survivors.txt" 2>/dev/null
    (cd "$W" && tar czf "$OUT/results.tgz" $(ls backends.json backends.jsonl 2>/dev/null))
    checked=$("$PYTHON" -c "$BACKENDS_CHECKED" "$W" 2>/dev/null || echo "? of ?")
  fi
  read -r done _ total _ <<<"$checked"
  [ "$done" = "$total" ] || checked="$checked (PARTIAL: the rest was not checked)"
  line="part $PART ($WHAT ${NAMES[*]:-all}): $(($(date +%s) - START)) s wall, $MUTATION_JOBS jobs on $(OMP_NUM_THREADS= nproc) cores, mutants checked: $checked, exit $status"
  echo "$line" | tee "$OUT/timing.txt"
  return $status
}

mkdir -p "$OUT"
main 2>&1 | "${PYTHON:-python3}" -u "$ROOT/scripts/gpu/progress_filter.py" "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
