"""Study 51 part B's statistics (research/stats.py) against closed forms, tables and simulation, and its
readout (research/study51/arms_report.py) on synthetic streams whose verdicts are known by construction."""

from __future__ import annotations

import gzip
import json
import math
import random

import pytest

from research.harness.analysis import T95, T975
from research import stats
from research.study51 import arms_report

# -- the t distribution ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [-30.0, -2.5, -0.3, 0.0, 0.7, 1.96, 4.2, 50.0])
def test_t_cdf_matches_the_closed_forms_at_1_2_and_4_degrees_of_freedom(t):
    assert stats.t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)  # Cauchy
    assert stats.t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)
    assert stats.t_cdf(t, 4) == pytest.approx(0.5 + t * (t * t + 6) / (2 * (t * t + 4) ** 1.5), abs=1e-12)


def test_t_cdf_and_quantile_reproduce_the_printed_tables():
    for df in range(1, 31):
        assert stats.t_cdf(T975[df - 1], df) == pytest.approx(0.975, abs=6e-5 * T975[df - 1])
        assert stats.t_cdf(T95[df - 1], df) == pytest.approx(0.95, abs=1e-4 * T95[df - 1])
        assert stats.t_quantile(0.975, df) == pytest.approx(T975[df - 1], abs=5.1e-4)
        assert stats.t_quantile(0.05, df) == pytest.approx(-T95[df - 1], abs=5.1e-4)
    assert stats.t_quantile(0.975, 10_000) == pytest.approx(1.960, abs=1e-3)  # the normal's


def test_paired_t_gives_the_two_sided_p_of_its_statistic():
    diffs = [1.0, 2.0, 3.0, 4.0, 5.0]  # mean 3, sd sqrt(2.5), t = 3 / sqrt(0.5), df 4
    mean, t, p = stats.paired_t(diffs)
    assert (mean, t) == pytest.approx((3.0, 3 / math.sqrt(0.5)))
    closed = 0.5 + t * (t * t + 6) / (2 * (t * t + 4) ** 1.5)
    assert p == pytest.approx(2 * (1 - closed), rel=1e-10)
    assert stats.paired_t([0.1, 0.1, 0.1])[2] == 0.0 and stats.paired_t([0.0, 0.0])[2] == 1.0
    with pytest.raises(ValueError, match="1 paired differences: allowed: at least 2"):
        stats.paired_t([0.3])


def test_holm_adjusts_step_down_in_the_given_order():
    # sorted 0.005 (x4 = 0.02), 0.01 (x3 = 0.03), 0.03 (x2 = 0.06), 0.04 (x1, raised to 0.06): Holm 1979
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats.holm([0.5, 0.6]) == pytest.approx([1.0, 1.0])
    assert stats.holm([0.2]) == [0.2]


@pytest.mark.parametrize("n, effect, alpha", [(5, 1.5, 0.05), (10, 0.8, 0.05 / 15), (20, 0.5, 0.01)])
def test_paired_power_agrees_with_simulated_paired_t_tests(n, effect, alpha):
    rng, trials, rejected = random.Random(51), 3000, 0
    for _ in range(trials):
        diffs = [rng.gauss(effect, 1.0) for _ in range(n)]
        rejected += stats.paired_t(diffs)[2] < alpha
    assert stats.paired_power(n, effect, alpha) == pytest.approx(rejected / trials, abs=0.035)


def test_seeds_needed_is_the_first_n_with_the_power():
    for effect, alpha in ((1.0, 0.05), (0.4, 0.05 / 15), (-0.6, 0.01)):
        n = stats.seeds_needed(effect, alpha)
        assert stats.paired_power(n, effect, alpha) >= 0.8 > stats.paired_power(n - 1, effect, alpha)
    assert stats.seeds_needed(0.0, 0.05) is None
    assert stats.seeds_needed(1e-4, 0.05, most=50) is None


# -- the readout ----------------------------------------------------------------------------------------------------

STEPS, SEEDS = 100, range(5)


def run_rows(method, beta0, seed, final, *, tag_extra="", kl=0.01, alarm_at=None, options=None, steps=STEPS):
    """A run: reward 0.2 for steps 1-40, then ``final`` (so the final window's and the best window's mean are
    ``final``); KL ``kl`` every step (none at β 0 unless monitored: every 16th step)."""
    options = options or {}
    tag = f"addition-dapo-b{beta0:g}-smollm2-s{STEPS}{tag_extra}"
    rows = []
    for step in range(1, steps + 1):
        row = {"tag": tag, "method": method, "seed": seed, "step": step, "copy": f"{tag}{seed}", "beta0": beta0,
               "kl_target": options.get("kl_target", 0.1), "reward": 0.2 if step <= 40 else final,
               "completions/median_length": 60.0, "adaptive_kl/runaway_alarm": int(alarm_at is not None and step >= alarm_at)}
        if beta0 > 0 or (options.get("kl_monitor") and step % 16 == 0):
            row["adaptive_kl/raw_kl"] = kl
        row.update({k: v for k, v in options.items() if k != "kl_target"})
        rows.append(row)
    return rows


def write(directory, name, rows):
    directory.mkdir(parents=True, exist_ok=True)
    with gzip.open(directory / f"{name}-stream.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


@pytest.fixture()
def study(tmp_path):
    """Fixed β 0.04 the best (final reward 0.5 + 0.01 × seed); β 0 monitored (0.3); `schedule` 0.2 above the best
    in every seed, give or take 0.01 (beats it); `dynamic` within ±0.004 of it (matches it); `target` 0.03 above it on average, ±0.1 (inconclusive); `reward_conditioned` runs away in two seeds."""
    jitter = [0.004, -0.004, 0.002, -0.002, 0.0]
    noisy = [0.10, -0.05, 0.08, -0.03, 0.05]
    rows = []
    for s in SEEDS:
        best = 0.5 + 0.01 * s
        rows += run_rows("none", 0.04, s, best)
        rows += run_rows("none", 0.1, s, best - 0.05)
        rows += run_rows("none", 0.0, s, 0.3, tag_extra="-mon", options={"kl_monitor": True})
        rows += run_rows("schedule", 1.0, s, best + 0.2 + jitter[s] * 2.5, tag_extra="-schedcosine-beta_min0.02",
                         options={"lr_scheduler_type": "cosine", "controller_params": {"beta_min": 0.02, "beta_schedule": "cosine"}})
        rows += run_rows("dynamic", 0.04, s, best + jitter[s])
        rows += run_rows("target", 0.01, s, best + noisy[s], tag_extra="-kt0.02", options={"kl_target": 0.02})
        rows += run_rows("reward_conditioned", 0.04, s, best - 0.01, alarm_at=60 if s < 2 else None)
    write(tmp_path / "study51-b-1", "study51-b-1", rows)
    return tmp_path


def test_each_arm_is_compared_with_the_best_fixed_beta_holm_corrected(study):
    arms, best = arms_report.table([str(study / "study51-b-1")])
    by = {a["label"]: a for a in arms}
    assert best["label"] == "none β 0.04"
    assert set(by) == {"none β 0.04", "none β 0.1", "none β 0 (kl_monitor)", "dynamic β 0.04", "reward_conditioned β 0.04",
                       "schedule β 1 (cosine lr, beta_min 0.02, beta_schedule cosine)", "target β 0.01 (kl_target 0.02)"}
    verdicts = {label: a["test"]["verdict"] for label, a in by.items() if "test" in a}
    assert verdicts == {"none β 0.1": "lost", "none β 0 (kl_monitor)": "lost", "dynamic β 0.04": "matched",
                        "reward_conditioned β 0.04": "lost, within ±0.05",  # 0.01 below in every seed
                        "schedule β 1 (cosine lr, beta_min 0.02, beta_schedule cosine)": "beat",
                        "target β 0.01 (kl_target 0.02)": "inconclusive"}
    tests = [a["test"] for a in arms if "test" in a]
    assert [t["p_holm"] for t in tests] == pytest.approx(stats.holm([t["p"] for t in tests]))
    assert [t["p_tost_holm"] for t in tests] == pytest.approx(stats.holm([t["p_tost"] for t in tests]))
    target = by["target β 0.01 (kl_target 0.02)"]["test"]
    noisy = [0.10, -0.05, 0.08, -0.03, 0.05]
    mean, sd = sum(noisy) / 5, math.sqrt(sum((x - sum(noisy) / 5) ** 2 for x in noisy) / 4)
    assert (target["mean"], target["sd"]) == pytest.approx((mean, sd))
    assert target["seeds_needed"] == stats.seeds_needed(mean / sd, 0.05 / 6)
    assert by["reward_conditioned β 0.04"]["runaways"] == 2 and by["none β 0.04"]["runaways"] == 0
    assert by["none β 0 (kl_monitor)"]["kl"] == pytest.approx(0.01)  # the monitored steps of its final window
    assert by["schedule β 1 (cosine lr, beta_min 0.02, beta_schedule cosine)"]["best"] == pytest.approx(0.72)


def test_the_report_prints_one_row_an_arm_and_names_the_family(study):
    text = arms_report.report([str(study / "study51-b-1")])
    assert "Best fixed β: **none β 0.04** (mean final reward 0.520)" in text
    assert "Holm-adjusted over the family of 6 comparisons" in text
    assert "| none β 0.04 | 5 (5) | 0.520 | 0.520 | — | 0.01 | 60.0 | 0 | best fixed β | — | — | — | — |" in text
    schedule = next(line for line in text.splitlines() if line.startswith("| schedule β 1"))
    assert schedule.startswith("| schedule β 1 (cosine lr, beta_min 0.02, beta_schedule cosine) | 5 (5) | 0.720 | 0.720 | +0.200 |")
    row = next(line for line in text.splitlines() if line.startswith("| target β 0.01"))
    assert "| inconclusive |" in row and not row.endswith("| — |")


def test_a_second_copy_of_a_seed_is_refused(tmp_path):
    rows = run_rows("none", 0.04, 0, 0.5)
    again = [dict(r, copy="restart") for r in rows[:30]]
    write(tmp_path / "d", "d", rows + again)
    with pytest.raises(ValueError, match="two copies of none .* seed 0: part B counts one copy a seed"):
        arms_report.table([str(tmp_path / "d")])


def test_a_cut_run_has_no_final_numbers_and_is_not_complete(tmp_path):
    write(tmp_path / "d", "d", run_rows("none", 0.04, 0, 0.5) + run_rows("none", 0.1, 0, 0.4, steps=60))
    arms, _best = arms_report.table([str(tmp_path / "d")])
    cut = next(a for a in arms if a["beta0"] == 0.1)
    assert cut["complete"] == 0 and cut["reward"] is None and cut["best"] == pytest.approx(0.4)


def test_an_arm_with_one_paired_seed_stays_in_the_family_at_p_1(tmp_path):
    """The page's family is every comparison: one with too few paired seeds to test stays in Holm's family (at p 1) and
    in the seeds-needed level, so that a lost run never makes the other comparisons' correction milder."""
    rows = []
    for s in SEEDS:
        rows += run_rows("none", 0.04, s, 0.5 + 0.01 * s) + run_rows("target", 0.01, s, 0.5 + [0.1, -0.05, 0.08, -0.03, 0.05][s],
                                                                    tag_extra="-kt0.02", options={"kl_target": 0.02})
    rows += run_rows("dynamic", 0.04, 0, 0.6)  # one seed only
    write(tmp_path / "d", "d", rows)
    arms, _best = arms_report.table([str(tmp_path / "d")])
    by = {a["label"]: a["test"] for a in arms if "test" in a}
    assert by["dynamic β 0.04"]["verdict"] == "too few seeds" and by["dynamic β 0.04"]["p_holm"] is None
    target = by["target β 0.01 (kl_target 0.02)"]
    assert target["p_holm"] == pytest.approx(min(1.0, 2 * target["p"]))  # a family of two: Holm's first step, x2
    assert target["seeds_needed"] == stats.seeds_needed(target["mean"] / target["sd"], 0.05 / 2)
    assert "over the family of 2 comparisons (family-wise" in arms_report.report([str(tmp_path / "d")])


def test_with_one_seed_an_arm_nothing_is_tested_and_the_report_says_so(tmp_path):
    write(tmp_path / "d", "d", run_rows("none", 0.04, 0, 0.5) + run_rows("dynamic", 0.04, 0, 0.6))
    text = arms_report.report([str(tmp_path / "d")])
    assert "Every other arm against it, no arm has two seeds paired with it, so nothing is tested" in text
    assert "(a family of 1 comparison, none tested)" in text and "α/" not in text and "too few seeds" in text


def test_a_run_cut_inside_its_final_window_has_no_final_value_and_its_seed_drops_out_of_the_pairs(tmp_path):
    """The page: a run that did not finish has no final value and its seed drops out of the paired comparisons. A run
    cut at step 85 has 10 steps of its final window (76-100): they are not its final reward."""
    rows = []
    for s in SEEDS:
        rows += run_rows("none", 0.04, s, 0.5 + 0.01 * s)
        rows += run_rows("dynamic", 0.04, s, 0.52 + 0.01 * s + [0.01, -0.01, 0.0, 0.005, -0.005][s], steps=85 if s == 4 else STEPS)
    write(tmp_path / "d", "d", rows)
    arms, _best = arms_report.table([str(tmp_path / "d")])
    dynamic = next(a for a in arms if a["method"] == "dynamic")
    assert dynamic["complete"] == 4 and dynamic["numbers"][4]["reward"] is None and dynamic["numbers"][4]["median"] is None
    assert dynamic["test"]["n"] == 4
    assert dynamic["test"]["mean"] == pytest.approx((0.03 + 0.01 + 0.02 + 0.025) / 4)
    assert dynamic["numbers"][4]["best"] == pytest.approx(0.555)  # its best window stays: the steps it ran


def test_a_run_that_never_logged_the_alarm_is_counted_apart_not_as_calm(tmp_path):
    rows = run_rows("none", 0.04, 0, 0.5) + run_rows("none", 0.04, 1, 0.5)
    rows += [{k: v for k, v in r.items() if k != "adaptive_kl/runaway_alarm"} for r in run_rows("dynamic", 0.04, 0, 0.5)]
    rows += run_rows("dynamic", 0.04, 1, 0.5)
    write(tmp_path / "d", "d", rows)
    arms, _best = arms_report.table([str(tmp_path / "d")])
    dynamic = next(a for a in arms if a["method"] == "dynamic")
    assert (dynamic["runaways"], dynamic["alarms_missing"]) == (0, 1)
    row = next(line for line in arms_report.report([str(tmp_path / "d")]).splitlines() if line.startswith("| dynamic"))
    assert "| 0 (1 not logged) |" in row


def test_a_window_holding_a_nan_reward_is_not_the_best_window(tmp_path):
    rows = run_rows("none", 0.04, 0, 0.5)
    rows[4]["reward"] = float("nan")  # step 5: the first windows hold it (max() over a list that starts with NaN is NaN)
    rows[45]["reward"] = 0.9  # step 46: the best windows (41-50 ... 46-55) hold nine steps of 0.5 and this one
    write(tmp_path / "d", "d", rows)
    arms, _best = arms_report.table([str(tmp_path / "d")])
    best = arms[0]["numbers"][0]["best"]
    assert best == pytest.approx(0.5 + 0.4 / 10) and not math.isnan(best)


def test_phase_two_kl_target_is_the_median_fixed_beta_runs_final_kl(tmp_path, capsys):
    """K: the lower median of the fixed-β (β > 0) runs' final KL, 2 significant digits; β 0's monitored KL and the
    other arms' are not in it."""
    rows, kls = [], {0.01: [0.0031, 0.0052, 0.0047, 0.0060, 0.0044], 0.04: [0.0029, 0.0033, 0.0041, 0.0038, 0.0036]}
    for beta, values in kls.items():
        for s, kl in zip(SEEDS, values):
            rows += run_rows("none", beta, s, 0.5, kl=kl)
    for s in SEEDS:
        rows += run_rows("none", 0.0, s, 0.5, tag_extra="-mon", kl=0.5, options={"kl_monitor": True})
        rows += run_rows("dynamic", 0.04, s, 0.5, kl=0.9)
    write(tmp_path / "d", "d", rows)
    ordered = sorted(kls[0.01] + kls[0.04])
    assert arms_report.phase_two_kl_target([str(tmp_path / "d")]) == float(f"{ordered[4]:.2g}") == 0.0038
    arms_report.main([str(tmp_path / "d"), "--kl-target"])
    assert capsys.readouterr().out == "0.0038\n"


def test_phase_two_kl_target_leaves_out_a_run_cut_before_its_final_window(tmp_path):
    """A fixed-β run cut before step 76 has no final KL: K is the lower median of the others (it was a TypeError)."""
    rows = []
    for s, kl in zip(SEEDS, [0.0031, 0.0052, 0.0047, 0.0060, 0.0044]):
        rows += run_rows("none", 0.01, s, 0.5, kl=kl)
    rows += run_rows("none", 0.04, 0, 0.5, kl=0.0029, steps=60)
    write(tmp_path / "d", "d", rows)
    assert arms_report.phase_two_kl_target([str(tmp_path / "d")]) == 0.0047
