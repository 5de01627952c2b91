"""The figure of the pre-registered study (research/harness/study_plot.py, ``--analyze ... --study --plot``): the
streams grouped into cells as the study's report groups them, the per-step curve it draws (each seed's copies
averaged first, then the seeds; a seed without a value at a step adds nothing) against values computed by hand,
the PNG, and the command line."""

import builtins
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "research"))

from harness import analysis, study_plot  # noqa: E402
from harness.cli import parse_args  # noqa: E402

FAMILY = "long-dapo-b*-h768x6-L192-s10"
KL = "adaptive_kl/raw_kl"


def _rows(method, beta, seed, copy, steps, length, kl="absent", kl_target=0.1, tag=None):
    """One copy's rows: ``length(step)`` and ``kl(step)`` (the key left out when ``kl`` is "absent", as TRL's backend
    writes β = 0; a value of None or NaN as Unsloth's); reward 0.5 + step / 100; 10 planned steps."""
    kt = f"-kt{kl_target:g}" if method == "target" else ""
    out = []
    for s in steps:
        row = {"tag": tag or f"long-dapo-b{beta:g}-h768x6-L192-s10{kt}", "method": method, "seed": seed, "step": s,
               "beta0": beta, "planned_steps": 10, "kl_target": kl_target, "copy": copy, "reward": 0.5 + s / 100,
               analysis.LENGTH: length(s)}
        if kl != "absent":
            row[KL] = kl(s)
        out.append(row)
    return out


def _streams(tmp_path):
    """Two files (a cell's seeds may come from several calls). Family long-...-s10, 10 planned steps:
    - `none` at 0.04: seed 0 has two copies, A (steps 1-10, length 100 + s, KL 0.01 s) and B, cut after step 4
      (length 120 + s, KL 0.03); seed 1: length 90, KL 0.02 but None at step 3 (no value there); seed 2 is cut after
      step 6 (length 60 + 2 s, KL 0.05);
    - `none` at 0: seeds 0 (KL key absent) and 1 (KL NaN), length 100; `clip` at 0.04: seeds 0-1, length 95;
    - `target` from β 0.1 at kl_target 0.05: seeds 0-1, KL 0.05;
    and a second family (the easy task) with `none` at 0 only."""
    first = (_rows("none", 0.04, 0, "A", range(1, 11), lambda s: 100 + s, lambda s: 0.01 * s)
             + _rows("none", 0.04, 1, "C", range(1, 11), lambda s: 90.0, lambda s: None if s == 3 else 0.02)
             + _rows("none", 0.0, 0, "D", range(1, 11), lambda s: 100.0)
             + _rows("none", 0.0, 1, "E", range(1, 11), lambda s: 100.0, lambda s: math.nan)
             + _rows("none", 0.0, 0, "F", range(1, 11), lambda s: 20.0, tag="easy-dapo-b0-h32x2-L24-s10"))
    second = (_rows("none", 0.04, 0, "B", range(1, 5), lambda s: 120 + s, lambda s: 0.03)
              + _rows("none", 0.04, 2, "G", range(1, 7), lambda s: 60 + 2 * s, lambda s: 0.05)
              + [r for seed in (0, 1) for r in _rows("clip", 0.04, seed, f"H{seed}", range(1, 11), lambda s: 95.0,
                                                     lambda s: 0.02)]
              + [r for seed in (0, 1) for r in _rows("target", 0.1, seed, f"T{seed}", range(1, 11), lambda s: 110.0,
                                                     lambda s: 0.05, kl_target=0.05)])
    paths = []
    for name, rows in (("a.jsonl", first), ("b.jsonl", second)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(str(tmp_path / name))
    return paths


def test_cells_are_keyed_as_the_study_report_keys_them(tmp_path):
    families, planned = analysis.study_cells(_streams(tmp_path))
    assert sorted(families) == ["easy-dapo-b*-h32x2-L24-s10", FAMILY]
    cells = families[FAMILY]
    assert planned[FAMILY] == 10
    assert sorted(cells) == [analysis.CellKey(*k) for k in [("clip", 0.04, None), ("none", 0.0, None), ("none", 0.04, None),
                                                            ("target", 0.1, 0.05)]]  # KL in the loss, k3: rows without the fields
    none = cells[analysis.CellKey("none", 0.04, None)]
    assert sorted(none) == [0, 1, 2] and [len(c) for c in none[0]] == [10, 4]  # seed 0: both copies, B cut


def test_the_curve_averages_copies_within_a_seed_then_seeds(tmp_path):
    cell = analysis.study_cells(_streams(tmp_path))[0][FAMILY][analysis.CellKey("none", 0.04, None)]
    steps, values = study_plot.step_curve(cell, analysis.LENGTH)
    assert steps == list(range(1, 11))
    # steps 1-4: seed 0 = ((100 + s) + (120 + s)) / 2 = 110 + s, seed 1 = 90, seed 2 = 60 + 2 s: (260 + 3 s) / 3;
    # steps 5-6: copy B is cut, seed 0 = 100 + s: (250 + 3 s) / 3; steps 7-10: seed 2 is cut too: (190 + s) / 2.
    # (Pooling the copies instead would give step 1 = (101 + 121 + 90 + 62) / 4 = 93.5.)
    hand = [263 / 3, 266 / 3, 269 / 3, 272 / 3, 265 / 3, 268 / 3, 98.5, 99.0, 99.5, 100.0]
    assert values == pytest.approx(hand, abs=1e-12)
    steps, smoothed = study_plot.smoothed_curve(cell, analysis.LENGTH)  # the 10-step trailing mean
    assert smoothed[0] == pytest.approx(hand[0]) and smoothed[1] == pytest.approx((hand[0] + hand[1]) / 2)
    assert smoothed[9] == pytest.approx(sum(hand) / 10)


def test_a_seed_without_a_value_at_a_step_adds_nothing_there(tmp_path):
    cells = analysis.study_cells(_streams(tmp_path))[0][FAMILY]
    steps, values = study_plot.step_curve(cells[analysis.CellKey("none", 0.04, None)], KL)
    # step 1: seed 0 = (0.01 + 0.03) / 2 = 0.02, seed 1 = 0.02, seed 2 = 0.05: 0.03; step 3: seed 1 logged None:
    # seed 0 = (0.03 + 0.03) / 2, seed 2 = 0.05: 0.04 (not 0.0267, as a None read as 0 would give);
    # step 5: seed 0 = 0.05 (B cut), seed 1 = 0.02, seed 2 = 0.05: 0.04; step 8: seed 0 = 0.08, seed 1 = 0.02: 0.05
    assert steps == list(range(1, 11))
    assert [values[i - 1] for i in (1, 3, 5, 8)] == pytest.approx([0.03, 0.04, 0.04, 0.05], abs=1e-12)
    # β = 0 logs no KL (the key absent in seed 0, NaN in seed 1): no curve at all, and no KL for the panel
    assert study_plot.step_curve(cells[analysis.CellKey("none", 0.0, None)], KL) == ([], [])
    assert not study_plot.has_kl(cells[analysis.CellKey("none", 0.0, None)]) and study_plot.has_kl(cells[analysis.CellKey("target", 0.1, 0.05)])


def test_plot_study_writes_the_png(tmp_path):
    path = tmp_path / "study.png"
    assert study_plot.plot_study(_streams(tmp_path), str(path)) == f"plot: {path}"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_plot_study_without_matplotlib_says_so(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    path = tmp_path / "study.png"
    assert study_plot.plot_study(_streams(tmp_path), str(path)).startswith("PNG skipped: matplotlib is not installed")
    assert not path.exists()


def test_plot_study_needs_rows(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no rows in .*empty.jsonl"):
        study_plot.plot_study([str(tmp_path / "empty.jsonl")], str(tmp_path / "x.png"))


def test_the_command_line_prints_the_study_and_writes_its_figure(tmp_path):
    paths, png = _streams(tmp_path), tmp_path / "fig.png"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "research", "study_cli.py"), "--analyze",
                           *paths, "--study", "--plot", str(png)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"## {FAMILY} (10 planned steps; final window: steps 9-10)" in proc.stdout
    assert "| `none` | 0.04 | — | 3 | 4 (2) |" in proc.stdout  # the study's table: 3 seeds, 4 copies, B and G cut
    assert proc.stdout.rstrip().endswith(f"plot: {png}") and png.stat().st_size > 10_000


def test_plot_goes_with_analyze():
    assert parse_args(["--analyze", "s.jsonl", "--study", "--plot", "f.png"]).plot == "f.png"
    with pytest.raises(SystemExit):
        parse_args(["--smoke", "--plot", "f.png"])


def _with_reward_placement(tmp_path):
    """The streams above plus (d)'s run: `none` at 0.04 with the KL in the reward (k1), seeds 0-1, reward 0.6 + s / 100."""
    rows = [dict(r, kl_placement="reward", kl_estimator="k1", reward=0.6 + r["step"] / 100, tag=r["tag"] + "-plreward-estk1")
            for seed in (0, 1) for r in _rows("none", 0.04, seed, f"R{seed}", range(1, 11), lambda s: 100.0,
                                              lambda s: 0.02)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return _streams(tmp_path) + [str(tmp_path / "d.jsonl")]


def test_the_runs_of_d_are_those_with_another_placement_whose_baseline_ran(tmp_path):
    cells = analysis.study_cells(_with_reward_placement(tmp_path))[0][FAMILY]
    moved = analysis.CellKey("none", 0.04, None, "reward", "k1")
    assert sorted(analysis.moved_cells(cells)) == [moved]
    assert moved not in analysis.fixed_cells(cells)  # not a fixed-β run of (a)
    del cells[analysis.CellKey("none", 0.04, None)]
    assert analysis.moved_cells(cells) == {}  # no baseline, nothing to compare


def _figure(monkeypatch, paths, tmp_path):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    study_plot.plot_study(paths, str(tmp_path / "study.png"))
    (fig,) = figures
    (row,) = [sub for sub in fig.subfigs if sub._suptitle.get_text().startswith(FAMILY + ":")]
    return row.axes


def test_the_d_panel_draws_each_moved_runs_reward_against_its_baseline(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    axes = _figure(monkeypatch, _with_reward_placement(tmp_path), tmp_path)
    assert len(axes) == 6 and axes[5].get_title().startswith("(d) reward")
    lines = {line.get_label(): line for line in axes[5].get_lines()}
    cells = analysis.study_cells(_with_reward_placement(tmp_path))[0][FAMILY]
    moved, base = (lines[f"none β=0.04, KL in the {p} ({e}) ({n} seeds)"] for p, e, n in
                   (("reward", "k1", 2), ("loss", "k3", 3)))
    for line, key in ((moved, analysis.CellKey("none", 0.04, None, "reward", "k1")), (base, analysis.CellKey("none", 0.04, None))):
        steps, values = study_plot.smoothed_curve(cells[key], "reward")
        assert list(line.get_xdata()) == steps and list(line.get_ydata()) == pytest.approx(values)
    # the moved run's reward is 0.6 + s / 100 in both seeds: its 10-step trailing mean at step 10 is 0.655
    assert moved.get_ydata()[-1] == pytest.approx(0.655) and moved.get_linestyle() == "-" and base.get_linestyle() == "--"


def test_without_a_moved_run_the_d_panel_says_so(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    axes = _figure(monkeypatch, _streams(tmp_path), tmp_path)
    assert not axes[5].axison and "no run with another KL placement" in axes[5].texts[0].get_text()
