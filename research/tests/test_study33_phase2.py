"""research/study33_phase2.py: phase 2's targets, (b)'s mechanical prediction and the run lists, from phase-1
streams, against values computed by hand (docs/evidence/study33-long-task.md)."""

import importlib.util
import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "research"))

from harness.cli import parse_args  # noqa: E402
from harness.settings import RunSpec  # noqa: E402

spec = importlib.util.spec_from_file_location("study33_phase2", os.path.join(ROOT, "research", "study33_phase2.py"))
phase2 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(phase2)

# (method, β): (final reward, final KL); constant over the run, the same for every seed
CELLS = {("none", 0.0): (0.70, None), ("none", 0.001): (0.60, 0.5), ("none", 0.01): (0.72, 0.04),
         ("none", 0.04): (0.80, 0.02), ("none", 0.1): (0.78, 0.015), ("none", 0.3): (0.65, 0.03),
         ("clip", 0.04): (0.79, 0.02), ("soft_clip", 0.04): (0.80, 0.02), ("length_normalized", 0.04): (0.80, 0.02)}


def _streams(path, skip=None):
    rows = []
    for (method, beta), (reward, kl) in CELLS.items():
        for seed in range(5):
            if (method, beta, seed) == skip:
                continue
            tag = f"long-dapo-b{beta:g}-h768x6-L192-s200-wlr0.0003"
            rows += [{"tag": tag, "method": method, "seed": seed, "step": s, "beta0": beta, "planned_steps": 200,
                      "kl_target": 0.1, "copy": f"{method}{beta}{seed}", "reward": reward,
                      "completions/mean_length": 120.0, "adaptive_kl/raw_kl": kl} for s in range(1, 201)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [str(path)]


def test_beta_needed_interpolates_log_log_and_lists_every_crossing():
    curve = [(b, k) for (m, b), (_, k) in CELLS.items() if m == "none" and b > 0]
    # 0.08 lies between β 0.001 (KL 0.5) and 0.01 (0.04): β = 0.001 x 10^(ln(0.08/0.5) / ln(0.04/0.5))
    assert phase2.beta_needed(curve, 0.08) == [pytest.approx(0.001 * 10 ** (math.log(0.16) / math.log(0.08)))]
    # 0.025: down between 0.01 and 0.04, up again between 0.1 and 0.3
    (a, b) = phase2.beta_needed(curve, 0.025)
    assert a == pytest.approx(0.01 * 4 ** (math.log(0.025 / 0.04) / math.log(0.5)))
    assert b == pytest.approx(0.1 * 3 ** (math.log(0.025 / 0.015) / math.log(2)))
    assert phase2.beta_needed(curve, 0.005) == [] and phase2.beta_needed(curve, 0.9) == []
    assert phase2.controller_room(0.1) == (pytest.approx(0.1 * 0.98 ** 150), pytest.approx(0.1 * 1.02 ** 150))


def test_targets_prediction_and_lists_from_phase_1(tmp_path, capsys):
    streams = _streams(tmp_path / "p1.jsonl")
    phase2.main(streams + ["--write", str(tmp_path)])
    out = capsys.readouterr().out
    # best fixed β > 0 is 0.04 (reward 0.80): K_nat 0.02, targets 0.005 and 0.08
    assert "K_nat (`none` at the best fixed β > 0, 0.04): 0.02; targets 0.25 x = 0.005, 4 x = 0.08" in out
    need = 0.001 * 10 ** (math.log(0.16) / math.log(0.08))  # 0.00532: inside 0.01's and 0.1's room, not 1.0's
    assert f"| 0.08 | 0.01 | {need:.3g} | [{0.01 * 0.98 ** 150:.3g}, {0.01 * 1.02 ** 150:.3g}] | holds |" in out
    assert f"| 0.08 | 0.1 | {need:.3g} |" in out and f"| 0.08 | 1 | {need:.3g} |" in out
    assert out.count("| holds |") == 2 and "does not hold (no room)" in out
    assert out.count("does not hold (β_need outside the measured range)") == 3  # 0.005 is below every fixed β's KL
    for seed in range(5):
        for part, target in (("a", 0.005), ("b", 0.08)):
            with open(tmp_path / f"study33-p2-seed{seed}-{part}.txt") as f:
                (line,) = [ln.split() for ln in f if ln.strip() and not ln.startswith("#")]
            args = parse_args(line)
            assert (args.first_seed, args.seeds, args.steps, args.backend) == (seed, 1, 200, "unsloth")
            assert "--runs" in line and line.count("--runs") == 1
            runs = line[line.index("--runs") + 1].split(",")
            assert runs[:3] == [f"target@{b:g}:kt={target:g}" for b in (0.01, 0.1, 1.0)]
            assert runs[3:] == (["none@0.04:placement=reward:estimator=k1"] if part == "a" else [])
            assert args.runs == [RunSpec("target", b, target) for b in (0.01, 0.1, 1.0)] + (
                [RunSpec("none", 0.04, None, "reward", "k1")] if part == "a" else [])  # the demo parses the overrides


def test_an_incomplete_phase_1_writes_nothing(tmp_path):
    streams = _streams(tmp_path / "p1.jsonl", skip=("none", 0.3, 4))
    with pytest.raises(SystemExit, match="phase 1 is not complete: no final value for none@0.3 seed 4"):
        phase2.main(streams + ["--write", str(tmp_path)])
    assert not [f for f in os.listdir(tmp_path) if f.startswith("study33-p2")]
