#!/usr/bin/env bash
# Mutation testing of the core, a developer's tool (docs/reliability.md, "Mutation testing"); not in .ci/run (too slow).
#
#   bash scripts/mutation.sh [core|backends|all] [MODULE...]     (default: all, every core module)
#
# core:    mutmut 3 over the computing modules (MODULE: estimators shaping controllers metrics kl_term adaptation),
#          each mutant against the fast tests of the core
#          (CORE_TESTS below), of which mutmut runs only those that execute the mutated function.
# backends: scripts/mutation_backends.py: the replacement strings that backends/trl.py and backends/unsloth.py put
#          into TRL's and Unsloth's loss (mutmut does not mutate code inside strings) and the Liger module's KL lines,
#          each against its backend's tests.
# The work happens in a copy ($MUTATION_DIR, default /tmp/unsloth-adaptive-kl-mutation): the checkout is not touched.
# Prints the score (scripts/mutation_summary.py) and writes every survivor's diff to $MUTATION_DIR/core/survivors.txt.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
WORK=${MUTATION_DIR:-${TMPDIR:-/tmp}/unsloth-adaptive-kl-mutation}
JOBS=${MUTATION_JOBS:-2}
WHAT=${1:-all}
shift || true
MODULES=("$@")
[ ${#MODULES[@]} -gt 0 ] || MODULES=(estimators shaping controllers metrics kl_term adaptation)
# The fast tests of the core: seconds each. mutmut records which of them execute each function and runs only those
# against that function's mutants; its timeout per mutant is 15x their measured time (SIGXCPU, then SIGKILL).
CORE_TESTS=(
  tests/test_estimators.py tests/test_shaping.py tests/test_controllers.py tests/test_adaptation.py tests/test_metrics.py
  tests/test_config.py
  tests/backends/test_unsloth.py::test_the_fused_losss_sums_hold_the_raw_and_the_adapted_kl_each_in_its_slot
)

export TRITON_INTERPRET=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
unset PYTHONPATH  # mutmut puts its mutated copy first on sys.path; nothing may shadow it

"$PY" -c "import mutmut" 2>/dev/null || "$PY" -m pip install -q "mutmut==3.8.1"

run_core() {
  rm -rf "$WORK/core" && mkdir -p "$WORK/core"
  # the working tree's files (committed or not, not ignored): some tests read the README, docs or examples
  (cd "$ROOT" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$WORK/core/")
  {
    echo "[mutmut]"
    echo "source_paths = unsloth_adaptive_kl"
    echo "only_mutate ="
    for module in "${MODULES[@]}"; do echo "    unsloth_adaptive_kl/$module.py"; done
    echo "also_copy ="
    for path in README.md docs examples scripts bench; do echo "    $path"; done
    # mutmut's trampolines import mutmut into the core: the layering test would count that import
    printf 'pytest_add_cli_args =\n    -p\n    no:cacheprovider\n    -q\n    --deselect\n    tests/test_config.py::test_core_modules_import_only_torch\n'
    echo "pytest_add_cli_args_test_selection ="
    for test in "${CORE_TESTS[@]}"; do echo "    $test"; done
    # torch is not fork-safe once it has run: fork the mutants from a server that has only imported the tests
    echo "process_isolation = forkserver"
  } >"$WORK/core/setup.cfg"
  (cd "$WORK/core" && "$PY" -m mutmut run --max-children "$JOBS")
  (cd "$WORK/core" && "$PY" "$ROOT/scripts/mutation_summary.py")
}

run_backends() {
  rm -rf "$WORK/backends" && mkdir -p "$WORK/backends"
  "$PY" "$ROOT/scripts/mutation_backends.py" "$ROOT" "$WORK/backends" --jobs "$JOBS"
}

start=$(date +%s)
case "$WHAT" in
  core) run_core ;;
  backends) run_backends ;;
  all) run_core; run_backends ;;
  *) echo "usage: $0 [core|backends|all] [MODULE...]" >&2; exit 2 ;;
esac
echo "mutation.sh $WHAT: $(( $(date +%s) - start )) s wall on $(nproc) cores (git $(git -C "$ROOT" rev-parse --short HEAD))"
