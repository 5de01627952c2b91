#!/usr/bin/env bash
# The research suite (research/tests: the studies' reanalyses, the demo's study options, the GPU run lists, the
# mutation tools), apart from the product suite of scripts/test.sh (issue 54). Same venv, two pytest-xdist workers,
# whole files to a worker. Extra arguments go to pytest. The real_model tests (the harness's --model smollm2 step)
# are .ci/run's real-model step, as in the product suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m "not real_model" research/tests "$@"
