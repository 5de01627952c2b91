"""Study 51 part B's figure (research/study51/figure.py): what it draws is the readout's table (arms_report.table)
and curves computed here by hand from synthetic streams."""

from __future__ import annotations

import pytest
from test_study51_arms import run_rows, write

from research.study51 import arms_report, figure
from unsloth_adaptive_kl.metrics import CURRENT_BETA

SEEDS = range(3)


@pytest.fixture()
def study(tmp_path):
    """Fixed β 0.04 (final 0.5 + 0.01 × seed) and 0.1 (0.05 lower); `schedule` from 1 with β = 0.98^step. Every
    run's median length 60 - 0.1 × step; reward 0.2 for steps 1-40, then the final value (run_rows)."""
    rows = []
    for s in SEEDS:
        rows += run_rows("none", 0.04, s, 0.5 + 0.01 * s)
        rows += run_rows("none", 0.1, s, 0.45 + 0.01 * s)
        rows += run_rows("schedule", 1.0, s, 0.4, tag_extra="-beta_min0.02", options={"controller_params": {"beta_min": 0.02}})
    for row in rows:
        row["completions/median_length"] = 60 - 0.1 * row["step"]
        row[CURRENT_BETA] = 0.98 ** row["step"] if row["method"] == "schedule" else row["beta0"]
    write(tmp_path / "study51-b-1", "study51-b-1", rows)
    return [str(tmp_path / "study51-b-1")]


def test_the_points_are_the_tables_per_seed_numbers(study):
    data = figure.figure_data(study)
    table, best = arms_report.table(study)
    assert data["labels"] == [a["label"] for a in table] == ["none β 0.04", "none β 0.1", "schedule β 1 (beta_min 0.02)"]
    assert data["points"]["reward"]["none β 0.04"] == pytest.approx([0.5, 0.51, 0.52])
    assert data["points"]["reward"]["none β 0.1"] == pytest.approx([0.45, 0.46, 0.47])
    assert data["means"]["reward"]["schedule β 1 (beta_min 0.02)"] == pytest.approx(0.4)
    assert data["points"]["kl"]["none β 0.04"] == pytest.approx([0.01] * 3)
    # the final window is steps 76-100: the mean median length 60 - 0.1 × 88
    assert data["points"]["median"]["none β 0.1"] == pytest.approx([60 - 8.8] * 3)
    assert data["best"][0] == best["label"] == "none β 0.04" and data["best"][1] == pytest.approx(0.51)


def test_the_curves_are_seed_means_with_a_ten_step_trailing_mean(study):
    curves = figure.figure_data(study)["curves"]
    assert set(curves["reward"]) == set(curves["completions/median_length"]) == {"none β 0.04", "none β 0.1"}
    assert set(curves[CURRENT_BETA]) == {"schedule β 1 (beta_min 0.02)"}
    steps, reward = curves["reward"]["none β 0.04"]
    assert steps == list(range(1, 101))
    assert reward[99] == pytest.approx(0.51)  # steps 91-100, all at the seeds' final values (mean 0.51)
    assert reward[44] == pytest.approx((5 * 0.2 + 5 * 0.51) / 10)  # steps 36-45: five at 0.2, five at 0.51
    assert reward[2] == pytest.approx(0.2)  # fewer than 10 steps at the start: the mean of those there are
    _, length = curves["completions/median_length"]["none β 0.1"]
    assert length[99] == pytest.approx(60 - 0.1 * 95.5)
    _, beta = curves[CURRENT_BETA]["schedule β 1 (beta_min 0.02)"]
    assert beta[9] == pytest.approx(sum(0.98 ** k for k in range(1, 11)) / 10)


def test_it_draws_a_png(study, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "figure.png"
    figure.main(study + ["--out", str(out)])
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
