"""The pre-registered analysis of docs/evidence/study33-long-task.md (research/harness/analysis.py): TOST, the runaway
criterion, the final window, the drift after saturation, every copy a draw, and the report, against values
computed by hand (t quantiles from the standard table: t(0.95; 2) = 2.920, t(0.975; 2) = 4.303)."""

import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "research"))

from harness import analysis  # noqa: E402


# -- TOST ----------------------------------------------------------------------------------------------
# [0.01, 0.03, 0.02]: mean 0.02, sd 0.01, se 0.01 / sqrt 3 = 0.0057735; 90 %: ± 2.920 se = ± 0.016859;
# 95 %: ± 4.303 se = ± 0.024843.
def test_tost_equivalent_when_the_90_interval_is_inside_the_margin():
    e = analysis.tost([0.01, 0.03, 0.02], 0.05)
    assert (e.n, e.mean, e.se) == (3, pytest.approx(0.02), pytest.approx(0.0057735, rel=1e-5))
    assert (e.low90, e.high90) == (pytest.approx(0.003141, abs=1e-6), pytest.approx(0.036859, abs=1e-6))
    assert (e.low95, e.high95) == (pytest.approx(-0.004843, abs=1e-6), pytest.approx(0.044843, abs=1e-6))
    assert e.equivalent and not e.different and e.verdict == "equivalent"


@pytest.mark.parametrize("differences, verdict", [
    ([0.10, 0.12, 0.08], "different"),  # 90 %: [0.0663, 0.1337] crosses 0.05; 95 %: [0.0503, 0.1497] excludes 0
    ([0.01, 0.012, 0.008], "equivalent, and different from 0"),  # 90 %: [0.0066, 0.0134]; 95 %: [0.0050, 0.0150]
    ([-0.1, 0.1, 0.0], "inconclusive"),  # mean 0, se 0.057735: 90 % ± 0.1686 crosses both margins; 95 % holds 0
    ([0.01], "too few seeds"),
])
def test_tost_verdicts(differences, verdict):
    assert analysis.tost(differences, 0.05).verdict == verdict


def test_tost_needs_a_positive_margin():
    with pytest.raises(ValueError, match="margin=0"):
        analysis.tost([0.1, 0.2], 0)


# -- the runaway criterion ---------------------------------------------------------------------------------
def _runaway_rows():
    # reward 0.8 and KL 0.1 to step 25, then 0.5 and 3.0: k steps after 25 the 10-step means are
    # KL 0.1 + 0.29 k and reward 0.8 - 0.03 k (the best so far: 0.8)
    return [{"step": s, "reward": 0.8 if s <= 25 else 0.5, "adaptive_kl/raw_kl": 0.1 if s <= 25 else 3.0}
            for s in range(1, 41)]


def test_runaway_is_the_first_step_with_a_high_kl_and_a_fallen_reward():
    rows = _runaway_rows()
    assert analysis.runaway_step(rows, 1.0) == 29  # k = 4: KL 1.26 > 1, reward down 0.12 >= 0.1 (k = 3: 0.09)
    assert analysis.runaway_step(rows, 2.0) == 32  # k = 7: KL 2.13 (k = 6: 1.84)
    assert analysis.runaway_step(rows, 5.0) is None
    assert analysis.runaway_step(rows, None) == 29  # β = 0: the reward condition alone
    assert analysis.runaway_step(rows, 1.0, first_step=30) == 30


def test_the_final_window_is_the_last_quarter_of_the_planned_steps():
    rows = [{"step": s} for s in range(1, 201)]
    assert [r["step"] for r in analysis.final_window(rows, 200)] == list(range(151, 201))
    assert analysis.final_window(rows[:140], 200) == []  # cut before the window: no final values
    assert [r["step"] for r in analysis.final_window(rows[:2], 2)] == [2]  # round(0.5) is 0: at least one step


def test_drift_is_the_length_slope_from_saturation_on():
    # reward 0.2 to step 30, then 0.8: the 10-step mean reaches 0.78 at step 40 (0.74 at 39); the length grows
    # 0.3 tokens a step from step 40: 30 tokens per 100 steps over the 61 steps 40-100
    rows = [{"step": s, "reward": 0.2 if s <= 30 else 0.8, analysis.LENGTH: 50.0 + 0.3 * max(0, s - 40)}
            for s in range(1, 101)]
    d = analysis.drift_after_saturation(rows, 100)
    assert d["saturation_step"] == 40 and d["steps_after"] == 61 and d["slope"] == pytest.approx(30.0)
    assert analysis.drift_after_saturation(rows, 100, min_steps=70)["slope"] is None


# -- every copy a draw, and the report ---------------------------------------------------------------------
def _stream(path):
    lines = []

    def run(method, beta, seed, reward, kl, copy="c", kl_target=None, after=None):
        tag = f"long-dapo-b{beta:g}-h768x6-L192-s100" + (f"-kt{kl_target:g}" if kl_target else "")
        for s in range(1, 101):
            r, k = (reward, kl) if after is None or s <= 50 else after
            lines.append({"tag": tag, "method": method, "seed": seed, "step": s, "beta0": beta, "planned_steps": 100,
                          "kl_target": kl_target or 0.1, "copy": f"{copy}{method}{beta}{seed}", "reward": r,
                          analysis.LENGTH: 100.0, "adaptive_kl/raw_kl": None if beta == 0 else k})

    for seed in range(3):
        run("none", 0.0, seed, 0.7, None)
        run("none", 0.1, seed, 0.8 + 0.01 * seed, 0.2)
        run("target", 0.1, seed, 0.79 + 0.012 * seed, 0.5 * (1 + 0.1 * seed), kl_target=0.5)
        run("clip", 0.1, seed, 0.7 if seed == 0 else 0.8 + 0.01 * seed, 0.2)
    run("clip", 0.1, 0, 0.8, 0.2, copy="second", after=(0.3, 5.0))  # a second copy of seed 0, which runs away
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return str(path)


def test_every_copy_of_a_run_is_kept_and_averaged_into_its_seed(tmp_path):
    data = analysis.read_copies([_stream(tmp_path / "s.jsonl")])
    copies = data["long-dapo-b0.1-h768x6-L192-s100"][("clip", 0)]
    assert len(copies) == 2 and all(len(c) == 100 for c in copies)
    assert analysis.seed_values(copies, 100, "reward") == pytest.approx((0.7 + 0.3) / 2)
    old = tmp_path / "old.jsonl"  # rows without a copy id: one copy per file
    old.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "copy"}) + "\n"
                           for r in map(json.loads, (tmp_path / "s.jsonl").read_text().splitlines()) if r["method"] == "none"))
    twice = analysis.read_copies([str(old), str(old)])
    assert len(twice["long-dapo-b0.1-h768x6-L192-s100"][("none", 0)]) == 1  # the same file twice: one copy
    assert len(analysis.read_copies([str(old), str(tmp_path / "s.jsonl")])["long-dapo-b0.1-h768x6-L192-s100"][("none", 0)]) == 2


def test_the_study_report_applies_the_pre_registered_tests(tmp_path):
    text = analysis.study_report([_stream(tmp_path / "s.jsonl")])
    assert "## long-dapo-b*-h768x6-L192-s100 (100 planned steps; final window: steps 76-100)" in text
    assert "Best fixed β (highest seed-mean final reward of `none`): 0.1" in text
    assert "Natural KL (best fixed β > 0, 0.1): 0.2; runaway threshold 10 x = 2" in text
    # the runaway copy: KL's 10-step mean 0.2 + 0.48 k, k steps after 50: above 2 at k = 4 (2.12), the reward
    # by then 0.2 below its best
    assert "| `clip` | 0.1 | — | 3 | 4 (4) |" in text and "| 1: seed 0 step 54 |" in text
    assert "| `none` | 0 | — | 3 | 3 (3) | 0.700 ± 0.000 | 100.0 ± 0.0 | — | 0 |" in text
    # (b) KL / kl_target 1, 1.1, 1.2: log mean 0.092543, se 0.052632, 90 % ± 0.153686 -> [0.94, 1.28], past 1.25;
    # Δ reward -0.010, -0.008, -0.006: mean -0.008, se 0.0011547: 90 % ± 0.0033717, 95 % ± 0.0049687
    assert ("| 0.5 | 0.1 | 3 | 1.10 | [0.94, 1.28] | inconclusive | -0.008 | [-0.011, -0.005] | [-0.013, -0.003] | "
            "equivalent, and different from 0 |") in text
    # (c) clip - none by seed: (0.7 + 0.3) / 2 - 0.8 = -0.3, 0, 0: mean -0.1, se 0.1: 90 % ± 0.292
    assert "| `clip` | 0.1 | reward | -0.100 | [-0.392, 0.192] | [-0.530, 0.330] | inconclusive |" in text
    assert "| `clip` | 0.1 | length | 0.000 | [0.000, 0.000] | [0.000, 0.000] | equivalent |" in text
    # (c)'s raw KL, 95 % interval only: clip's seed 0 is (0.2 + 5.0) / 2 = 2.6 (its second copy's window KL is 5.0):
    # differences 2.4, 0, 0: mean 0.8, sd 1.385641, se 0.8, 95 % ± 3.4424
    assert "| `clip` | 0.1 | raw KL | 0.8000 | — | [-2.6424, 4.2424] | not different |" in text
    assert math.isclose(analysis.KL_RATIO_MARGIN, math.log(1.25))


def test_c_reports_the_kls_token_tail_against_none_with_its_95_interval(tmp_path):
    # Amendment 14: (c)'s token-tail rows, final-window means of the logged tail metrics, paired by seed, 95 % only.
    # Every KL-logging row gets p99 = 2 x its raw KL, max = 10 x, top-1 % share 0.05.
    path = _stream(tmp_path / "s.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    for r in rows:
        if r["adaptive_kl/raw_kl"] is not None:
            k = r["adaptive_kl/raw_kl"]
            r.update({"adaptive_kl/token_kl_p99": 2 * k, "adaptive_kl/token_kl_max": 10 * k,
                      "adaptive_kl/token_kl_top1pct_share": 0.05})
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    copies = analysis.read_copies([path])["long-dapo-b0.1-h768x6-L192-s100"]
    assert analysis.copy_numbers(copies[("none", 1)][0], 100, None)["kl_p99"] == pytest.approx(0.4)
    assert analysis.copy_numbers(copies[("none", 1)][0], 100, None)["kl_max"] == pytest.approx(2.0)
    # β = 0 logs no KL and so no tail
    none0 = analysis.read_copies([path])["long-dapo-b0-h768x6-L192-s100"][("none", 0)][0]
    assert analysis.copy_numbers(none0, 100, None)["kl_p99"] is None
    text = analysis.study_report([path])
    # p99: clip's seed 0 (0.4 + 10.0) / 2 = 5.2 against 0.4: differences 4.8, 0, 0: mean 1.6, se 1.6, 95 % ± 6.8848
    assert "| `clip` | 0.1 | token KL p99 | 1.6000 | — | [-5.2848, 8.4848] | not different |" in text
    # max: (2 + 50) / 2 = 26 against 2: differences 24, 0, 0: mean 8, se 8, 95 % ± 34.424
    assert "| `clip` | 0.1 | token KL max | 8.0000 | — | [-26.4240, 42.4240] | not different |" in text
    assert "| `clip` | 0.1 | token KL top-1 % share | 0.0000 | — | [0.0000, 0.0000] | not different |" in text
    assert "| token KL" not in text.split("**(c)")[0]  # only (c) has the rows
    # a stream without the tail metrics (rows before issue 36): the rows say so rather than invent a value
    for r in rows:
        for metric, _ in analysis.TAIL_METRICS.values():
            r.pop(metric, None)
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    assert "| `clip` | 0.1 | token KL p99 | — | — | — | no seeds |" in analysis.study_report([path])


def test_a_seed_with_two_copies_gives_question_a_one_slope(tmp_path):
    # reward 0.8 throughout: saturation at step 1; the length grows 0.1 or 0.2 tokens a step in seed 0's two
    # copies (10 and 20 tokens / 100 steps), 0 in seeds 1 and 2: seed values 15, 0, 0, not four draws.
    # mean 5, sd 8.660254, se 5: 90 % ± 14.60, 95 % ± 21.515
    lines = [{"tag": "long-dapo-b0.1-h768x6-L192-s100", "method": "none", "seed": seed, "step": s, "beta0": 0.1,
              "planned_steps": 100, "copy": f"{seed}-{rate}", "reward": 0.8, analysis.LENGTH: 100.0 + rate * s,
              "adaptive_kl/raw_kl": 0.2}
             for seed, rate in ((0, 0.1), (0, 0.2), (1, 0.0), (2, 0.0)) for s in range(1, 101)]
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    copies = analysis.read_copies([str(path)])["long-dapo-b0.1-h768x6-L192-s100"][("none", 0)]
    assert analysis.seed_slope(copies, 100) == pytest.approx(15.0)
    text = analysis.study_report([str(path)])
    assert "| 0.1 | 3 | 5.00 | [-9.60, 19.60] | [-16.52, 26.52] | inconclusive |" in text


# -- the long task's solutions -----------------------------------------------------------------------------
def test_column_solutions_add_up_column_by_column_and_earn_the_full_reward():
    import random
    import statistics

    from harness.settings import SOLUTIONS, TASKS

    import toy

    assert toy.column_solution([4821, 7390], 2) == "1+0+0=1,2+9+0=11,8+3+1=12,4+7+1=12,1>12211"
    assert toy.column_solution([4821, 7390], 1) == "1,11,12,12,1>12211" and toy.column_solution([4821, 7390], 0) == ">12211"
    rows = toy.sum_problems(2000, seed=3, **TASKS["long"])
    solution, weights = SOLUTIONS["long"]
    for r in rows[:200]:
        for style in range(3):
            text = solution(r["terms"], style)
            assert toy.scratchpad_format_reward([text]) == [0.5] and toy.scratchpad_correctness_reward([text], [r["answer"]]) == [0.5]
        columns, answer = solution(r["terms"], 2).split(">")
        width = max(len(str(t)) for t in r["terms"])
        carry, digits = 0, []
        for i, column in enumerate(columns.split(",")):
            if i == width:  # the last carry, alone
                assert column == str(carry) and carry > 0
                digits.append(column)
                continue
            left, total = column.split("=")
            terms = [int(x) for x in left.split("+")]
            assert terms[:-1] == [int(str(t).rjust(width, "0")[::-1][i]) for t in r["terms"]] and terms[-1] == carry
            assert int(total) == sum(terms)
            carry = int(total) // 10
            digits.append(str(int(total) % 10))
        assert "".join(reversed(digits)).lstrip("0") == answer
    rng = random.Random(0)  # the warm-start mix: a median of at least 100 tokens (end-of-sequence included), at most 132
    lengths = [len(solution(r["terms"], rng.choices(range(3), weights)[0])) + 1 for r in rows]
    assert statistics.median(lengths) >= 100 and max(lengths) <= 132
