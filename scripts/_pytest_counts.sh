# Sourced by scripts/compat.sh and scripts/install_check.sh: `pytest_counts LOG` sets passed, failed
# (failures plus errors) and skipped from the summary line of a pytest log (0 where absent).
pytest_counts() {
  local summary errors
  summary=$(grep -E "^=*.*( passed| failed| error| skipped| no tests ran)" "$1" | tail -1)
  passed=$(grep -oE "[0-9]+ passed" <<< "$summary" | cut -d' ' -f1)
  failed=$(grep -oE "[0-9]+ failed" <<< "$summary" | cut -d' ' -f1)
  errors=$(grep -oE "[0-9]+ errors?" <<< "$summary" | cut -d' ' -f1)
  skipped=$(grep -oE "[0-9]+ skipped" <<< "$summary" | cut -d' ' -f1)
  passed=${passed:-0} failed=$(( ${failed:-0} + ${errors:-0} )) skipped=${skipped:-0}
}
