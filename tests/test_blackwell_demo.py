"""The user's demo, blackwell/test_adaptive_kl_grpo.py: run as a user runs it (a subprocess, the tiny model on the
CPU, 3 steps of `none` and `ziegler`), its table, its report of what trained and its plot checked against what it
recorded and against Ziegler's update recomputed here. (The study harness it fronted until issue 54 is
research/study_cli.py; its tests are research/tests/test_harness_demo.py.)"""

import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "blackwell", "test_adaptive_kl_grpo.py")
BETA, STEPS, METHODS = 0.04, 3, ("none", "ziegler")
RAW_KL, BETA_KEY = "adaptive_kl/raw_kl", "adaptive_kl/current_beta"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    env = dict(os.environ, TRITON_INTERPRET="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, SCRIPT, "--methods", ",".join(METHODS), "--steps", str(STEPS), "--beta", str(BETA),
                           "--output-dir", str(out)], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (out / "stderr.txt").write_text(proc.stderr)  # the package's warnings (logging) go to stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    by_method = {m: [r for r in rows if r["method"] == m] for m in METHODS}
    return out, proc.stdout, by_method


def table_rows(text: str) -> dict:
    """{method: {column: cell}} from the markdown table in ``text``."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    return {row[0].strip("`"): dict(zip(header, row)) for row in cells}


def test_every_method_logged_every_step_from_the_same_start(run):
    _, _, by_method = run
    for method, rows in by_method.items():
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), method
        assert all(0.0 <= r["reward"] <= 1.0 for r in rows)
    # the same weights, data and seed: the first step generates the same completions under every method, and the
    # policy is still the reference, so its KL is 0
    first = [rows[0] for rows in by_method.values()]
    assert len({(r["reward"], tuple(r["lengths"])) for r in first}) == 1
    assert all(r[RAW_KL] == 0 for r in first)


def test_each_step_prints_one_line_with_its_logged_numbers_and_wall_time(run):
    """One line a step as the trainer logs it, ending with the wall time since the previous line (added when the
    tiny demo under Unsloth on a GPU ran 9 steps in 200 s and its log could not say where the time went)."""
    _, stdout, by_method = run
    pattern = re.compile(r"^  step +(\d+)/(\d+)  reward (\S+)  KL \S+  beta (\S+)  length (\S+)  (\d+\.\d) s$")
    lines = [pattern.match(line) for line in stdout.splitlines() if line.startswith("  step ")]
    assert all(lines) and len(lines) == STEPS * len(by_method)
    by_order = list(by_method.values())  # the methods train one after another, in the order asked
    for i, m in enumerate(lines):
        row = by_order[i // STEPS][i % STEPS]
        assert (int(m[1]), int(m[2])) == (row["step"], STEPS)
        assert float(m[3]) == pytest.approx(row["reward"], abs=5e-4)
        assert float(m[4]) == pytest.approx(row[BETA_KEY], rel=1e-3)
        assert float(m[5]) == pytest.approx(row["completions/mean_length"], abs=0.05)
        assert float(m[6]) > 0


def test_the_table_shows_each_methods_logged_last_step(run):
    out, stdout, by_method = run
    table = table_rows((out / "summary.md").read_text())
    assert table == table_rows(stdout.split("the last step of each method:")[1].split("What each trainer")[0])
    assert sorted(table) == sorted(METHODS)
    for method, rows in by_method.items():
        cells, last = table[method], rows[-1]
        assert float(cells["KL (raw)"]) == pytest.approx(last[RAW_KL], rel=1e-3)
        assert float(cells["KL (adapted)"]) == pytest.approx(last["adaptive_kl/adapted_kl"], rel=1e-3)
        assert float(cells["beta final"]) == pytest.approx(last[BETA_KEY], rel=1e-3)
        assert float(cells["beta start"]) == pytest.approx(rows[0][BETA_KEY], rel=1e-3) == BETA
        assert float(cells["final reward"]) == pytest.approx(last["reward"], rel=1e-3)
        assert float(cells["mean length"]) == pytest.approx(last["completions/mean_length"], rel=1e-3)
        assert float(cells["median length"]) == statistics.median(last["lengths"])


def test_beta_is_fixed_under_none_and_follows_zieglers_update_under_ziegler(run):
    _, stdout, by_method = run
    assert [r[BETA_KEY] for r in by_method["none"]] == [BETA] * STEPS
    assert f"none: beta stayed {BETA:.4g} for {STEPS} steps" in stdout
    # Ziegler et al.: beta *= 1 + clip(KL / kl_target - 1, -0.2, 0.2) * n / kl_horizon, after each step, with the
    # demo's kl_target 0.01 and kl_horizon 10 steps of n = 16 completions
    rows, n = by_method["ziegler"], 16
    beta = BETA
    for row, following in zip(rows, rows[1:]):
        error = min(max(row[RAW_KL] / 0.01 - 1, -0.2), 0.2)
        beta *= 1 + error * n / (10 * n)
        assert following[BETA_KEY] == pytest.approx(beta, rel=1e-6)
    assert rows[-1][BETA_KEY] != BETA
    assert f"ziegler: beta {BETA:.4g} -> {rows[-1][BETA_KEY]:.4g}, moved at steps 2, 3" in stdout


def test_the_median_length_is_of_the_completions_the_trainer_counted(run):
    _, _, by_method = run
    for rows in by_method.values():
        for row in rows:
            lengths = row["lengths"]
            assert len(lengths) == 16  # every completion of the step: 4 prompts x 4
            assert row["median_length"] == statistics.median(lengths)
            # TRL's own mean, counted on its side: the recorded lengths are the same completions
            assert statistics.fmean(lengths) == pytest.approx(row["completions/mean_length"], rel=1e-6)
            assert min(lengths) == row["completions/min_length"] and max(lengths) == row["completions/max_length"]


def test_it_reports_what_each_trainer_trained(run):
    _, stdout, by_method = run
    report = stdout.split("What each trainer trained (read back from it")[1]
    for method, rows in by_method.items():
        line = next(line for line in report.splitlines() if line.strip().startswith(f"{method}:"))
        assert f"beta={BETA}" in line and f"kl_adaptation_method='{method}'" in line and "loss_type='dapo'" in line
        assert f"completions_per_step={len(rows[0]['lengths'])}" in line and "trainer='GRPOTrainer'" in line
        assert "epsilon_high=0.2," in line and "mask_truncated_completions=False" in line


def test_each_method_is_given_only_the_fields_it_reads(run):
    """The demo sets one group of settings (reward_threshold for dynamic, kl_target and kl_horizon for the target
    controllers, beta_min): each method gets the ones it reads, so the package's "has no effect" warning, which the
    user cannot act on here, never comes (it came for `none` and `ziegler` at every run before 2026-11-30)."""
    out, stdout, _ = run
    stderr = (out / "stderr.txt").read_text()
    assert "backend: TRL eager loss" in stderr  # the package's lines are there
    assert "has no effect" not in stdout + stderr


def test_it_draws_the_curves_or_says_why_not(run):
    out, stdout, _ = run
    if importlib.util.find_spec("matplotlib") is None:
        assert "no plot: matplotlib is not installed" in stdout
    else:
        png = (out / "curves.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000
        assert f"plot: {out / 'curves.png'}" in stdout


def test_a_misspelt_method_stops_before_anything_trains(tmp_path):
    spec = importlib.util.spec_from_file_location("user_demo", SCRIPT)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    with pytest.raises(ValueError, match="kl_adaptation_method='dynamc' has unknown part"):
        demo.main(["--methods", "none,dynamc", "--output-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
