#!/usr/bin/env bash
# Packaging check (CI runs it after the tests): build the sdist and the wheel (python -m build),
# check their metadata (twine check --strict) and contents (the sdist is the source tree, the wheel
# the package only), install the wheel into a fresh venv and smoke-test it from outside the source
# tree: import, a config, `doctor`, the TRL CLI recipe for 2 steps and tests/test_config.py from
# the unpacked sdist.
#
# PYTHON: the interpreter that has `build` and `twine` (default .venv/bin/python, made by
# scripts/_venv.sh with the dev extra). BASE_PYTHON: the one the fresh venv is made from (python3).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
BASE_PYTHON=${BASE_PYTHON:-python3}
"$PYTHON" -c "import build, twine" 2>/dev/null || {
    echo "check_package.sh: $PYTHON lacks build/twine (pip install -e '.[dev]', or set PYTHON)" >&2
    exit 1
}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/adaptive-kl-package.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

echo "== build"
"$PYTHON" -m build --outdir "$WORK/dist" . >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; exit 1; }
SDIST=$(ls "$WORK"/dist/*.tar.gz)
WHEEL=$(ls "$WORK"/dist/*.whl)
echo "$(basename "$SDIST") $(basename "$WHEEL")"

echo "== twine check"
"$PYTHON" -m twine check --strict "$SDIST" "$WHEEL"

echo "== contents"
"$PYTHON" - "$ROOT" "$SDIST" "$WHEEL" <<'EOF'
import os, sys, tarfile, zipfile

root, sdist, wheel = sys.argv[1:]
PACKAGE = "unsloth_adaptive_kl"
SOURCE_DIRS = ("tests", "examples", "scripts", "blackwell", "bench", "docs", "research")  # MANIFEST.in's grafts


def files_under(top):
    for folder, dirs, files in os.walk(os.path.join(root, top)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if not name.endswith((".pyc", ".pyo")):
                yield os.path.relpath(os.path.join(folder, name), root)


problems = []
package_files = {f for f in files_under(PACKAGE) if f.endswith(".py")}

# sdist: the package, the grafted folders and the top-level files, plus the generated metadata.
with tarfile.open(sdist) as tar:
    names = [m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile()]
metadata = {n for n in names if n in ("PKG-INFO", "setup.cfg") or n.startswith(f"{PACKAGE}.egg-info/")}
expected = package_files | {"README.md", "pyproject.toml", "MANIFEST.in", "mkdocs.yml", ".ci/run"}
expected |= {f for top in SOURCE_DIRS for f in files_under(top)}
shipped = set(names) - metadata
problems += [f"sdist lacks {f}" for f in sorted(expected - shipped)]
problems += [f"sdist ships {f}, which is not part of the source tree it should be" for f in sorted(shipped - expected)]

# wheel: the package's modules and the dist-info, nothing else (no tests, no outputs).
with zipfile.ZipFile(wheel) as whl:
    entries = [n for n in whl.namelist() if not n.endswith("/")]
    entry_points = next((whl.read(n).decode() for n in entries if n.endswith(".dist-info/entry_points.txt")), "")
dist_info = {n for n in entries if n.split("/", 1)[0].endswith(".dist-info")}
problems += [f"wheel ships {n}" for n in sorted(set(entries) - dist_info - package_files)]
problems += [f"wheel lacks {f}" for f in sorted(package_files - set(entries))]
# The toy task is the examples' (examples/toy.py, issue 54), no module of the package: a stale build must not bring it back.
problems += [f"wheel ships the toy task: {n}" for n in entries if n.rsplit("/", 1)[-1] == "toy.py"]
if "unsloth-adaptive-kl = unsloth_adaptive_kl.__main__:main" not in entry_points:
    problems.append(f"wheel's entry_points.txt lacks the unsloth-adaptive-kl console script:\n{entry_points}")

if problems:
    sys.exit("\n".join(problems))
print(f"sdist: {len(shipped)} files (+{len(metadata)} metadata); wheel: {len(package_files)} modules + dist-info")
EOF

echo "== fresh venv with the wheel"
"$BASE_PYTHON" -m venv "$WORK/venv"
VENV_PY=$WORK/venv/bin/python
"$VENV_PY" -m pip install -q --upgrade pip
# torch pinned: the CPU build on this machine's disk (an unpinned torch pulls a CUDA build).
"$VENV_PY" -m pip install -q "torch==2.13.0" "$WHEEL" pytest hypothesis

echo "== smoke test, outside the source tree"
mkdir -p "$WORK/smoke" "$WORK/sdist"
tar xzf "$SDIST" -C "$WORK/sdist"
SRC=$(ls -d "$WORK"/sdist/*/)
# The recipe's reward functions are examples.toy.* (examples/toy.py), which TRL's script imports from the working
# directory: the sdist's examples/ beside the smoke run, as in a checkout (its package is not copied: the wheel's runs).
cp -r "$SRC/examples" "$WORK/smoke/examples"
cd "$WORK/smoke"
export TRITON_INTERPRET=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
unset PYTHONPATH
"$VENV_PY" - "$WORK/venv" <<'EOF'
import os, sys

import unsloth_adaptive_kl
from trl import GRPOConfig

venv = os.path.realpath(sys.argv[1])
assert os.path.realpath(unsloth_adaptive_kl.__file__).startswith(venv), unsloth_adaptive_kl.__file__
config = GRPOConfig(output_dir="out", use_cpu=True, bf16=False, beta=0.04, kl_adaptation_method="dynamic+length_normalized", reward_threshold=0.5)
assert (config.kl_adaptation_method, config.reward_threshold) == ("dynamic+length_normalized", 0.5)
try:
    GRPOConfig(output_dir="out", use_cpu=True, bf16=False, beta=0.04, kl_clip_threshold=-1.0)
except ValueError as error:
    assert "kl_clip_threshold" in str(error), error
else:
    raise AssertionError("kl_clip_threshold=-1.0 was accepted")
print(f"import and config: ok ({unsloth_adaptive_kl.__file__})")
EOF
"$WORK/venv/bin/unsloth-adaptive-kl" doctor --backend trl --backend liger
"$WORK/venv/bin/unsloth-adaptive-kl" grpo --help >"$WORK/grpo-help.txt"
grep -q -- "--kl_adaptation_method" "$WORK/grpo-help.txt" || { echo "grpo --help does not list the fields" >&2; exit 1; }
echo "grpo --help lists the fields: ok"
"$VENV_PY" "$SRC/examples/prepare_toy.py" toy --warm-start-steps 0 --prompts 64 >/dev/null 2>&1
"$WORK/venv/bin/unsloth-adaptive-kl" grpo --config "$SRC/examples/grpo_recipe.yaml" --max_steps 2 --save_strategy steps --save_steps 2 \
    >"$WORK/grpo.log" 2>&1 || { tail -50 "$WORK/grpo.log"; exit 1; }
grep -q '"adaptive_kl/current_beta"' toy/out/checkpoint-2/trainer_state.json || { echo "no adaptive_kl metrics logged" >&2; exit 1; }
echo "TRL CLI recipe, 2 steps: ok"

echo "== the sdist's tests/test_config.py against the installed wheel"
# Run from the smoke folder: the sdist's own copy of the package is not on sys.path (pytest puts
# tests/ there, which has no __init__.py), so the tests import the wheel's.
"$VENV_PY" -m pytest -q -p no:cacheprovider --rootdir "$SRC" "$SRC/tests/test_config.py" 2>&1 | tail -3
echo "packaging check: ok"
