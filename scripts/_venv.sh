# Sourced by the scripts here: make .venv and install the package with its test extras.
# torch is pinned to the CPU build on this machine's disk; an unpinned torch would pull CUDA.
python3 -m venv .venv
source .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0" -e ".[dev]"
# TRL's fused log-prob kernel is Triton: without a GPU it only runs interpreted.
export TRITON_INTERPRET=1
export TOKENIZERS_PARALLELISM=false
