# Sourced by the scripts here: make .venv and install the package with its test extras.
# torch is pinned to the CPU build on this machine's disk; an unpinned torch would pull CUDA.
python3 -m venv .venv
source .venv/bin/activate
python -m pip install -q --upgrade pip
# trl 1.15.0: the newest TRL that the Unsloth below accepts (the suite runs the unsloth-2026.10 stack of
# unsloth_adaptive_kl/versions.py; scripts/compat.sh runs the others).
python -m pip install -q "torch==2.13.0" "trl==1.15.0" -e ".[dev]"
# Unsloth's own dependency set pulls a CUDA torch and xformers: on this CPU machine install it
# without them. Its one runtime need beyond ours is pillow. (On a GPU machine: pip install ".[unsloth]".)
python -m pip install -q --no-deps "unsloth==2026.10.9" "unsloth_zoo==2026.10.9"
python -m pip install -q pillow
# TRL's fused log-prob kernel is Triton: without a GPU it only runs interpreted.
export TRITON_INTERPRET=1
export TOKENIZERS_PARALLELISM=false
