#!/usr/bin/env bash
# The version matrix: for each stack of unsloth_adaptive_kl/versions.py (STACKS: TRL, transformers,
# Liger, Unsloth pinned exactly) a cached venv, and in it the version-sensitive tests. Prints one
# table row per stack: stack | versions | passed | failed | skipped | date | commit.
#
#   bash scripts/compat.sh            # every stack
#   bash scripts/compat.sh ci         # what .ci/run runs: oldest and newest TRL and Unsloth
#   bash scripts/compat.sh trl-0.24 unsloth-2026.9 ...
#   bash scripts/compat.sh latest     # today's newest TRL, transformers, Liger, peft, accelerate, datasets
#                                     # within versions.py's ranges (a check by hand; rebuilt once a day)
#
# The venvs live in $UAKL_COMPAT_CACHE (default ~/.cache/uakl-compat), outside the repository:
# _base holds the CPU torch 2.13 (from this machine's disk; never an unpinned torch), triton and
# pytest, and every stack venv sees it through a .pth file, so a stack adds only its own
# libraries (~0.3 GB). A stack is rebuilt when its pins in versions.py change. Wheels come from
# pip's own cache. The package is tested from this source tree (PYTHONPATH), not installed: one
# venv serves every commit. Logs: $UAKL_COMPAT_CACHE/logs/STACK.log. Exit status 1 if any stack
# failed a test or could not be built. UAKL_COMPAT_BUILD_ONLY=1 only builds; UAKL_COMPAT_K=EXPR
# passes -k EXPR to pytest.
source "$(dirname "$0")/_compat_env.sh"
BASE_PINS="torch==2.13.0 triton==3.9.0 numpy==2.4.6 pytest==9.2.0 hypothesis==6.170.15 packaging==26.3 PyYAML==6.0.3"
# The version-sensitive tests: identity with the stock loss, shaping against float64, metrics,
# β controllers inside a trainer (end to end, β -> 0, resume), patch/unpatch, version guards,
# import order; on an Unsloth stack the CPU side door into Unsloth's generated trainer too.
# (The pure core - estimators, shaping, controllers - does not depend on these libraries and is
# covered by the main suite.)
TESTS_TRL=(tests/backends/test_trl.py tests/test_versions.py tests/test_patching.py tests/test_lifecycle.py tests/test_cli.py)
TESTS_UNSLOTH=(tests/backends/test_unsloth.py tests/backends/test_unsloth_lines.py)
K_EXPR=${UAKL_COMPAT_K:-}

stack_field() {  # stack_field STACK 1|2: its pins, or its --no-deps pins
  "$CACHE/_base/bin/python" "$ROOT/unsloth_adaptive_kl/versions.py" "$1" | sed -n "${2}p"
}

build_base() {
  if [ "$(cat "$CACHE/_base/.uakl-ready" 2>/dev/null)" = "$BASE_PINS" ]; then return 0; fi
  rm -rf "$CACHE/_base"
  "$PYTHON" -m venv "$CACHE/_base" &&
    "$CACHE/_base/bin/pip" install -q --disable-pip-version-check $BASE_PINS &&
    echo "$BASE_PINS" > "$CACHE/_base/.uakl-ready"
}

build_stack() {  # build_stack STACK: the venv, unless it exists with the same pins
  local name=$1 dir=$CACHE/$1 pins nodeps key site base_site
  pins=$(stack_field "$name" 1) || return 1
  nodeps=$(stack_field "$name" 2)
  key="$pins | $nodeps | $COMMON | $BASE_PINS"
  [ "$name" = latest ] && key="$key | $(date -u +%F)"  # unpinned: resolved again each day
  if [ "$(cat "$dir/.uakl-ready" 2>/dev/null)" = "$key" ]; then return 0; fi
  echo "building $name: $pins ${nodeps:+(--no-deps: $nodeps)}" >&2
  rm -rf "$dir"
  "$PYTHON" -m venv "$dir" || return 1
  site=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  base_site=$("$CACHE/_base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$base_site" > "$site/_uakl_base.pth"  # after the stack's own site-packages on sys.path
  # shellcheck disable=SC2086
  "$dir/bin/pip" install -q --disable-pip-version-check $pins $COMMON || return 1
  if [ -n "$nodeps" ]; then
    # shellcheck disable=SC2086
    "$dir/bin/pip" install -q --disable-pip-version-check --no-deps $nodeps || return 1
  fi
  "$dir/bin/pip" check >&2 || echo "($name: pip check above lists what the --no-deps installs leave unmet)" >&2
  echo "$key" > "$dir/.uakl-ready"
}

run_stack() {  # run_stack STACK: prints its table row
  local name=$1 dir=$CACHE/$1 log=$CACHE/logs/$1.log tests versions passed failed skipped start
  tests=("${TESTS_TRL[@]}")
  [ -n "$(stack_field "$name" 2)" ] && tests+=("${TESTS_UNSLOTH[@]}")
  versions=$("$dir/bin/python" - <<'EOF'
import importlib.metadata as m
out = []
for d in ("trl", "transformers", "liger-kernel", "unsloth", "unsloth_zoo", "torch"):
    try:
        out.append(f"{d} {m.version(d)}")
    except m.PackageNotFoundError:
        pass
print(", ".join(out))
EOF
)
  start=$SECONDS
  (
    cd "$ROOT" &&
      env PYTHONPATH="$ROOT" TRITON_INTERPRET=1 TOKENIZERS_PARALLELISM=false UNSLOTH_COMPILE_LOCATION="$CACHE/unsloth_compiled_cache-$name" \
        "$dir/bin/python" -m pytest -q -p no:cacheprovider -o addopts="" ${K_EXPR:+-k "$K_EXPR"} "${tests[@]}"
  ) > "$log" 2>&1
  pytest_counts "$log"
  printf '| %s | %s | %s | %s | %s | %s s | %s | %s |\n' "$name" "$versions" "$passed" "$failed" "$skipped" \
    "$(( SECONDS - start ))" "$(date -u +%F)" "$(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD -- unsloth_adaptive_kl tests || echo +changes)"
  [ "$passed" -gt 0 ] && [ "$failed" -eq 0 ]
}

build_base || { echo "could not build $CACHE/_base" >&2; exit 1; }
# Installed in every stack beside its pins, resolved against them (our own dependencies, versions.py's COMMON).
COMMON="$("$CACHE/_base/bin/python" "$ROOT/unsloth_adaptive_kl/versions.py" common) pillow"
ALL=$("$CACHE/_base/bin/python" -c "import runpy; print(' '.join(runpy.run_path('$ROOT/unsloth_adaptive_kl/versions.py')['STACKS']))")
CI=$("$CACHE/_base/bin/python" -c "import runpy; print(' '.join(runpy.run_path('$ROOT/unsloth_adaptive_kl/versions.py')['CI_STACKS']))")
case "${1:-all}" in
  all) set -- $ALL ;;
  ci) set -- $CI ;;
  trl) set -- $(tr ' ' '\n' <<< "$ALL" | grep '^trl-') ;;
  unsloth) set -- $(tr ' ' '\n' <<< "$ALL" | grep '^unsloth-') ;;
esac
echo "| stack | versions | passed | failed | skipped | time | date | commit |"
echo "|---|---|---|---|---|---|---|---|"
status=0
for stack in "$@"; do
  if ! grep -qw -- "$stack" <<< "$ALL"; then echo "unknown stack $stack; known: $ALL" >&2; exit 2; fi
  if ! build_stack "$stack" > "$CACHE/logs/$stack.build.log" 2>&1; then
    printf '| %s | could not be built (see %s) | 0 | - | - | - | %s | %s |\n' "$stack" "$CACHE/logs/$stack.build.log" "$(date -u +%F)" "$(git rev-parse --short HEAD)"
    status=1
    continue
  fi
  [ -n "${UAKL_COMPAT_BUILD_ONLY:-}" ] && { echo "| $stack | built |"; continue; }
  if ! run_stack "$stack"; then
    status=1
    grep -E "^(FAILED|ERROR)|^E  " "$CACHE/logs/$stack.log" | head -40 >&2  # why, for a CI log
  fi
done
exit $status
