"""examples/quickstart.py (what scripts/quickstart.sh runs): the Trainer's progress bar while it
trains and the table at the end, nothing else; ``--verbose`` brings back the log dictionaries."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")
STEPS = 3


def _run(tmp_path, *extra):
    env = {**os.environ, "TRITON_INTERPRET": "1", "TOKENIZERS_PARALLELISM": "false", "CI": "true"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    args = ["--steps", str(STEPS), "--warm-start-steps", "0", "--output-dir", str(tmp_path), *extra]
    proc = subprocess.run([sys.executable, QUICKSTART, *args], capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_quickstart_prints_the_progress_bar_and_the_table_only(tmp_path):
    proc = _run(tmp_path)
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split() == ["step", "reward", "raw_kl", "adapted_kl", "beta", "length"])
    assert all(not line.strip() for line in lines[: header - 1])  # before the table: its title line only
    assert lines[header - 1].startswith("model='tiny'  kl_adaptation_method=")
    assert [line.split()[0] for line in lines[header + 1 :]] == [str(step) for step in range(1, STEPS + 1)]
    # stderr: the package's one line naming the backend when the trainer is created, then tqdm's bar
    # (carriage-return updates) reaching STEPS/STEPS, and nothing else.
    parts = [part for part in re.split(r"[\r\n]", proc.stderr) if part.strip()]
    assert parts and parts[0].startswith("unsloth_adaptive_kl: backend: TRL eager loss"), proc.stderr[-2000:]
    bar_updates = parts[1:]
    assert bar_updates and all(re.search(r"\| *\d+/%d \[" % STEPS, part) for part in bar_updates), proc.stderr[-2000:]
    assert f"{STEPS}/{STEPS} [" in proc.stderr
    assert "{'loss'" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_quickstart_verbose_brings_back_the_log_dictionaries(tmp_path):
    proc = _run(tmp_path, "--verbose")
    assert (proc.stdout + proc.stderr).count("'adaptive_kl/current_beta'") == STEPS
