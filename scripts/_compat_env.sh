# Sourced by scripts/compat.sh and scripts/install_check.sh: what they share, the repository root
# (ROOT, and the working directory), the venv cache (CACHE, $UAKL_COMPAT_CACHE, default
# ~/.cache/uakl-compat, with its logs/), the interpreter venvs are made from (PYTHON), and
# `pytest_counts LOG`, which sets passed, failed (failures plus errors) and skipped from the summary
# line of a pytest log (0 where absent).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
CACHE=${UAKL_COMPAT_CACHE:-$HOME/.cache/uakl-compat}
PYTHON=${PYTHON:-python3}
mkdir -p "$CACHE/logs"
pytest_counts() {
  local summary errors
  summary=$(grep -E "^=*.*( passed| failed| error| skipped| no tests ran)" "$1" | tail -1)
  passed=$(grep -oE "[0-9]+ passed" <<< "$summary" | cut -d' ' -f1)
  failed=$(grep -oE "[0-9]+ failed" <<< "$summary" | cut -d' ' -f1)
  errors=$(grep -oE "[0-9]+ errors?" <<< "$summary" | cut -d' ' -f1)
  skipped=$(grep -oE "[0-9]+ skipped" <<< "$summary" | cut -d' ' -f1)
  passed=${passed:-0} failed=$(( ${failed:-0} + ${errors:-0} )) skipped=${skipped:-0}
}
