#!/usr/bin/env bash
# Installing beside the TRL and transformers a user already has (issue 21): for each pair of
# INSTALL_CHECKS in unsloth_adaptive_kl/versions.py, a venv with the CPU torch 2.13.0 only, then, as
# a user would, `pip install -e . "trl==X" "transformers==Y"`. It must succeed and keep trl,
# transformers and torch at exactly what was asked (pip may neither refuse nor downgrade them); then,
# in that venv, method `none` must train identically to stock TRL and `clip` must shape the loss:
# tests/backends/test_trl.py -k "bit_identical or (float64_reference and clip)". Prints one row per
# check: pins | installed | passed | failed | skipped | time.
#
#   bash scripts/install_check.sh            # every check (CI runs this)
#   UAKL_INSTALL_FRESH=1 bash scripts/install_check.sh   # rebuild every venv first
#
# The venvs live in $UAKL_COMPAT_CACHE/install-* (default ~/.cache/uakl-compat). A venv is built
# afresh whenever its pins, pyproject.toml's dependencies or this tree's path change (the install is
# what is checked), else reused: then only the tests run. Logs: $UAKL_COMPAT_CACHE/logs/install-*.log.
# Exit status 1 if an install failed, changed a pinned version, or a test failed.
source "$(dirname "$0")/_compat_env.sh"
TORCH=torch==2.13.0  # the CPU build on this machine's disk: never an unpinned (CUDA) torch
TEST_PINS="pytest==9.2.0 hypothesis==6.170.15"
TESTS=(tests/backends/test_trl.py -k "bit_identical or (float64_reference and clip)")
DEPS=$("$PYTHON" -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'])")

check() {  # check PIN...: build (or reuse) the venv, verify the versions, run the tests; prints a row
  local name dir log key start installed passed failed skipped
  name=install-$(tr ' =' '_-' <<< "$*")
  dir=$CACHE/$name
  log=$CACHE/logs/$name.log
  key="$* | $TORCH | $DEPS | $ROOT"
  start=$SECONDS
  if [ -n "${UAKL_INSTALL_FRESH:-}" ] || [ "$(cat "$dir/.uakl-ready" 2>/dev/null)" != "$key" ]; then
    rm -rf "$dir"
    {
      "$PYTHON" -m venv "$dir" &&
        "$dir/bin/pip" install -q --disable-pip-version-check "$TORCH" &&
        echo "+ pip install -e . $*" &&
        "$dir/bin/pip" install --disable-pip-version-check -e . "$@" &&
        "$dir/bin/pip" install -q --disable-pip-version-check $TEST_PINS
    } > "$log" 2>&1 || {
      printf '| %s | pip install failed: %s | 0 | - | - | %s s |\n' "$*" "$(grep -m1 -E "^ERROR" "$log" || tail -1 "$log")" "$(( SECONDS - start ))"
      return 1
    }
  fi
  # What the venv holds now, against what was asked (torch: its release, the +cpu tag aside).
  installed=$("$dir/bin/python" - "$TORCH" "$@" <<'EOF' 2>>"$log"
import importlib.metadata as m, sys
from packaging.version import Version
out, bad = [], []
for pin in sys.argv[1:]:
    name, _, want = pin.partition("==")
    have = m.version(name)
    out.append(f"{name} {have}")
    if Version(have).base_version != want:
        bad.append(f"{name} {have} (asked {want})")
print(", ".join(out) + (f"; CHANGED: {', '.join(bad)}" if bad else ""))
sys.exit(1 if bad else 0)
EOF
  ) || { printf '| %s | %s | 0 | - | - | %s s |\n' "$*" "$installed" "$(( SECONDS - start ))"; return 1; }
  echo "$key" > "$dir/.uakl-ready"
  (
    unset PYTHONPATH
    env TRITON_INTERPRET=1 TOKENIZERS_PARALLELISM=false "$dir/bin/python" -m pytest -q -p no:cacheprovider -o addopts="" "${TESTS[@]}"
  ) >> "$log" 2>&1
  pytest_counts "$log"
  printf '| %s | %s | %s | %s | %s | %s s |\n' "$*" "$installed" "$passed" "$failed" "$skipped" "$(( SECONDS - start ))"
  [ "$passed" -gt 0 ] && [ "$failed" -eq 0 ] || { grep -E "^(FAILED|ERROR)|^E  " "$log" | head -20 >&2; return 1; }
}

echo "| pip install -e . with | installed | passed | failed | skipped | time |"
echo "|---|---|---|---|---|---|"
status=0
while read -r -a pins; do
  check "${pins[@]}" || status=1
done < <("$PYTHON" unsloth_adaptive_kl/versions.py install-checks)
exit $status
