#!/usr/bin/env bash
# Installs the package into .venv and runs a small adaptive-KL GRPO job on the CPU.
# Extra arguments go to examples/quickstart.py (e.g. --method target --steps 30).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
python examples/quickstart.py "$@"
