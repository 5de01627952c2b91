#!/usr/bin/env bash
# Installs everything into .venv (CPU torch 2.13 from this machine's disk, never a CUDA build)
# and runs the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
python -m pytest -q -p no:cacheprovider "$@"
