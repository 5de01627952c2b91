#!/usr/bin/env bash
# Installs everything into .venv (CPU torch 2.13 from this machine's disk, never a CUDA build)
# and runs the test suite: the product's, tests/ (pyproject's testpaths); the studies' tests, research/tests, are
# scripts/test_research.sh's (issue 54). Extra arguments go to pytest.
# Two pytest-xdist workers, each given whole files (--dist loadfile): the files' module-scoped fixtures and
# worker-result caches (one subprocess training run serves many tests) then run once, as in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
# The real_model tests (SmolLM2-135M-Instruct on the CPU, minutes) are .ci/run's own step: -m real_model runs them.
python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m "not real_model" "$@"
