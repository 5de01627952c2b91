#!/usr/bin/env bash
# Mutation testing of the core, a developer's tool (docs/reliability.md, "Mutation testing"); not in .ci/run (too slow).
#
#   bash scripts/mutation.sh [core|backends|all] [NAME...]     (default: all; NAME: core modules or backends, default all)
#
# core:    mutmut 3 over the computing modules (MODULE: estimators shaping controllers metrics kl_term adaptation tail),
#          each mutant against the fast tests of the core
#          (CORE_TESTS below), of which mutmut runs only those that execute the mutated function.
# backends: scripts/mutation_backends.py: the replacement strings that backends/trl.py and backends/unsloth.py put
#          into TRL's and Unsloth's loss (mutmut does not mutate code inside strings), the Liger module's KL lines and
#          backends/reward_placement.py (strings and code), each against its backend's tests (NAME: trl unsloth liger reward).
# The work happens in a copy ($MUTATION_DIR, default /tmp/unsloth-adaptive-kl-mutation): the checkout is not touched.
# Prints the score (scripts/mutation_summary.py) and writes every survivor's diff to $MUTATION_DIR/core/survivors.txt.
# MUTATION_TIMEOUT=SECONDS stops each mutation run after that long (mutmut gets SIGINT and keeps what it checked; the
# backends run starts no mutant it cannot finish) and still writes the partial score. MUTATION_PYTHONPATH: the
# PYTHONPATH of the runs (a site folder of packages, never the checkout: mutmut's copy must be the package imported).
# MUTATION_RESUME=results.tgz (written by scripts/gpu/mutation-device.sh: mutmut's result files of a core run of the
# same modules, code and CORE_TESTS, cut short): its verdicts are kept and only the mutants it did not check run
# (mutmut drops them all if CORE_TESTS changed, and those of a function whose code changed).
# scripts/gpu/mutation-device.sh runs this in parts on the GPU machine's CPU cores.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
WORK=${MUTATION_DIR:-${TMPDIR:-/tmp}/unsloth-adaptive-kl-mutation}
JOBS=${MUTATION_JOBS:-2}
WHAT=${1:-all}
shift || true
ARGS=("$@")
MODULES=("$@")
[ ${#MODULES[@]} -gt 0 ] || MODULES=(estimators shaping controllers metrics kl_term adaptation tail)
# The fast tests of the core: seconds each. mutmut records which of them execute each function and runs only those
# against that function's mutants; its timeout per mutant is 15x their measured time (SIGXCPU, then SIGKILL).
CORE_TESTS=(
  tests/test_estimators.py tests/test_shaping.py tests/test_controllers.py tests/test_adaptation.py tests/test_metrics.py
  tests/test_config.py tests/test_tail.py tests/test_metric_sums.py tests/test_kl_term_exclusion_and_reward.py
  tests/test_kl_term_per_token.py tests/test_bottom_q_edges.py tests/test_estimator_registry_queries.py
  tests/test_estimate_kl_masking_and_errors.py tests/test_tail_bins_and_bounds.py tests/test_shaping_user_steps.py
  tests/test_user_code.py tests/test_adaptation_micro_batches.py tests/test_adaptation_user_faults.py
  tests/test_controller_registration.py tests/test_controller_steps.py tests/test_controller_checkpoints.py
  tests/test_controller_config.py tests/test_controller_messages.py tests/test_target_saturation.py
  tests/backends/test_unsloth.py::test_the_fused_losss_sums_hold_the_raw_and_the_adapted_kl_each_in_its_slot
)

export TRITON_INTERPRET=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
unset PYTHONPATH  # mutmut puts its mutated copy first on sys.path; nothing may shadow it
[ -z "${MUTATION_PYTHONPATH:-}" ] || export PYTHONPATH=$MUTATION_PYTHONPATH
TIMEOUT=${MUTATION_TIMEOUT:-}
RESUME=${MUTATION_RESUME:+$(realpath "$MUTATION_RESUME")}

"$PY" -c "import mutmut" 2>/dev/null || "$PY" -m pip install -q "mutmut==3.8.1"

run_core() {
  rm -rf "$WORK/core" && mkdir -p "$WORK/core"
  # the working tree's files (committed or not, not ignored): some tests read the README, docs or examples
  if git -C "$ROOT" rev-parse --show-toplevel >/dev/null 2>&1; then
    (cd "$ROOT" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$WORK/core/")
  else  # a copy of the working tree without its git directory (the GPU machine's): all of it but the sites
    tar -C "$ROOT" --exclude='./.gpu-site*' --exclude=./mutants --exclude=./.venv -cf - . | tar -C "$WORK/core" -xf -
  fi
  # The unmutated tests first, as mutmut will run them: a failure here would fail mutmut's stats run without a word.
  # A test failing on this machine is left out of the run, and named, so the rest still gets a score.
  local baseline failing=()
  baseline=$(cd "$WORK/core" && "$PY" -m pytest -q -p no:cacheprovider -rfE --deselect tests/test_config.py::test_core_modules_import_only_torch "${CORE_TESTS[@]}" 2>&1) || true
  echo "$baseline" | tail -3
  mapfile -t failing < <(echo "$baseline" | sed -n 's/^\(FAILED\|ERROR\) \([^ ]*\).*/\2/p' | sort -u)
  if [ ${#failing[@]} -gt 0 ]; then
    echo "$baseline" | grep -E "^E |^FAILED|Error" | head -40
    echo "left out of this run: the ${#failing[@]} tests above that fail unmutated here: ${failing[*]}"
  fi
  {
    echo "[mutmut]"
    echo "source_paths = unsloth_adaptive_kl"
    echo "only_mutate ="
    for module in "${MODULES[@]}"; do echo "    unsloth_adaptive_kl/$module.py"; done
    echo "also_copy ="
    for path in README.md docs examples scripts bench blackwell; do echo "    $path"; done
    # mutmut's trampolines import mutmut into the core: the layering test would count that import
    printf 'pytest_add_cli_args =\n    -p\n    no:cacheprovider\n    -q\n    --deselect\n    tests/test_config.py::test_core_modules_import_only_torch\n'
    # a test that fails is deselected; a file that cannot even be collected is ignored
    for test in "${failing[@]}"; do printf '    %s\n    %s\n' "$([[ $test == *::* ]] && echo --deselect || echo --ignore)" "$test"; done
    echo "pytest_add_cli_args_test_selection ="
    for test in "${CORE_TESTS[@]}"; do echo "    $test"; done
    # torch is not fork-safe once it has run: fork the mutants from a server that has only imported the tests
    echo "process_isolation = forkserver"
  } >"$WORK/core/setup.cfg"
  if [ -n "$RESUME" ]; then  # mutmut keeps the verdicts (and the test stats) of an earlier run, and checks the rest
    tar xzf "$RESUME" -C "$WORK/core" --wildcards 'mutants/*'
    echo "resumed from $RESUME"
  fi
  if [ -n "$TIMEOUT" ]; then  # SIGINT to mutmut and its workers: it records no verdict for the mutants in flight
    (cd "$WORK/core" && timeout --signal=INT --kill-after=30 "$TIMEOUT" "$PY" -m mutmut run --max-children "$JOBS") ||
      echo "mutmut run stopped (exit $?; 124: after MUTATION_TIMEOUT=$TIMEOUT s): the score below is partial"
  else
    (cd "$WORK/core" && "$PY" -m mutmut run --max-children "$JOBS")
  fi
  (cd "$WORK/core" && "$PY" "$ROOT/scripts/mutation_summary.py" --json counts.json | tee summary.txt)
}

run_backends() {
  local BACKENDS=()
  [ "$WHAT" != backends ] || BACKENDS=("${ARGS[@]}")
  rm -rf "$WORK/backends" && mkdir -p "$WORK/backends"
  "$PY" "$ROOT/scripts/mutation_backends.py" "$ROOT" "$WORK/backends" --jobs "$JOBS" ${TIMEOUT:+--budget "$TIMEOUT"} ${BACKENDS:+"${BACKENDS[@]/#/--backend=}"}
}

start=$(date +%s)
commit=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo "unknown: no git directory")
case "$WHAT" in
  core) run_core ;;
  backends) run_backends ;;
  all) run_core; run_backends ;;
  *) echo "usage: $0 [core|backends|all] [NAME...]" >&2; exit 2 ;;
esac
echo "mutation.sh $WHAT: $(( $(date +%s) - start )) s wall on $(OMP_NUM_THREADS= nproc) cores (git $commit)"
