"""Study 51 part B's prediction checker (research/study51/predictions.py) on synthetic streams whose every clause's
outcome is set by construction: each clause held, failed, or unmeasured as built, and a change to one arm flips the
clause it touches."""

from __future__ import annotations

import gzip
import json

from research.study51 import predictions

STEPS, SEEDS = 100, range(5)
JITTER = [0.004, -0.004, 0.002, -0.002, 0.0]  # within ±0.01 of the best: matched
NOISY = [0.10, -0.05, 0.08, -0.03, 0.05]  # +0.03 ± 0.07: inconclusive with 5 seeds


def run(method, beta0, seed, final, *, tag="", betas=None, kl=0.01, kl_target=0.1, params=None, median=60.0,
        alarm_at=None, monitor=False):
    """A run: reward 0.2 for steps 1-40, then ``final`` (so the final and best windows' means are ``final``); β
    ``betas(step)`` (β0 throughout by default); KL ``kl`` every step (at β 0 only when monitored, every 16th)."""
    rows = []
    for step in range(1, STEPS + 1):
        row = {"tag": f"smollm2-b{beta0:g}-s{STEPS}{tag}", "method": method, "seed": seed, "step": step,
               "copy": f"{method}{tag}{beta0}{seed}", "beta0": beta0, "kl_target": kl_target,
               "reward": 0.2 if step <= 40 else final, "completions/median_length": median,
               "adaptive_kl/current_beta": betas(step) if betas else beta0,
               "adaptive_kl/runaway_alarm": int(alarm_at is not None and step >= alarm_at)}
        if beta0 > 0 or (monitor and step % 16 == 0):
            row["adaptive_kl/raw_kl"] = kl
        if params:
            row["controller_params"] = params
        if monitor:
            row["kl_monitor"] = True
        rows.append(row)
    return rows


def decay(beta0, floor):
    return lambda step: max(beta0 * 0.9 ** step, floor)


def write_study(directory, change=None):
    """The study's stream in ``directory``: fixed β 0.04 best (0.6 + 0.01 × seed), 14 arms of 5 seeds;
    ``change(name, seed, (method, beta0, final, kwargs))`` edits one run's arguments."""
    rows = []
    for s in SEEDS:
        best = 0.6 + 0.01 * s
        arms = {
            "none 0.04": ("none", 0.04, best, {}),
            "none 0.01": ("none", 0.01, best - 0.1, {}),
            "none 0.1": ("none", 0.1, best - 0.02, {}),
            "none 0.3": ("none", 0.3, 0.40, {}),
            "none 0": ("none", 0.0, best - 0.3, {"tag": "-mon", "monitor": True}),
            "dynamic defaults": ("dynamic", 0.04, best + JITTER[s], {"tag": "-rw10", "params": {"reward_window": 10}}),
            "dynamic acting": ("dynamic", 0.04, best + NOISY[s], {
                "tag": "-rt0.48-rw10", "params": {"reward_threshold": 0.48, "reward_window": 10},
                "betas": decay(0.04, 0.002 if s < 3 else 0.01)}),
            "schedule linear": ("schedule", 1.0, best - 0.02, {"tag": "-lin", "params": {"beta_schedule": "linear"},
                                                                "betas": decay(1.0, 0.02)}),
            "schedule cosine": ("schedule", 1.0, best - 0.2, {"tag": "-cos", "params": {"beta_schedule": "cosine"},
                                                               "betas": decay(1.0, 0.02)}),
            "reward_conditioned": ("reward_conditioned", 0.04, best + NOISY[::-1][s],
                                   {"median": 75.0, "alarm_at": 70 if s == 2 else None}),
            "target 0.01": ("target", 0.01, best + NOISY[s], {"tag": "-kt0.02", "kl_target": 0.02, "kl": 0.02,
                                                              "betas": lambda step: 0.01 * min(1 + step / 20, 5)}),
            "target 1": ("target", 1.0, best - 0.1, {"tag": "-kt0.02", "kl_target": 0.02, "kl": 0.05,
                                                     "betas": lambda step: max(1.0 - step / 100, 0.2)}),
            "ziegler 0.01": ("ziegler", 0.01, best - 0.01, {"tag": "-kt0.02", "kl_target": 0.02, "kl": 0.021}),
            "ziegler 1": ("ziegler", 1.0, best - 0.01, {"tag": "-kt0.02", "kl_target": 0.02,
                                                        "kl": 0.024 if s == 0 else 0.04}),
        }
        for name, (method, beta0, final, kwargs) in arms.items():
            if change:
                method, beta0, final, kwargs = change(name, s, (method, beta0, final, dict(kwargs)))
            rows += run(method, beta0, s, final, **kwargs)
    directory.mkdir(parents=True, exist_ok=True)
    with gzip.open(directory / f"{directory.name}-stream.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return directory


def build(tmp_path, change=None):
    """The study's clauses, by (number, claim up to a colon)."""
    directory = write_study(tmp_path / "study51-b-x", change)
    return {(r["number"], r["claim"].split(":")[0]): r for r in predictions.check([str(directory)])}


def verdicts(result):
    return {key: r["verdict"] for key, r in result.items()}


def test_each_clause_comes_out_as_the_study_was_built(tmp_path):
    result = build(tmp_path)
    v = verdicts(result)
    assert v[("1", "no controller arm beats the best fixed β (Holm)")] == "held"
    assert result[("1", "no controller arm beats the best fixed β (Holm)")]["measured"] == "0 of 9 beat"
    # inconclusive: the acting dynamic, reward_conditioned and target from 0.01 (±0.07 around +0.03): 3 of 13
    assert (v[("1a", "most comparisons inconclusive")], result[("1a", "most comparisons inconclusive")]["measured"]) == ("failed", "3 of 13")
    spread = result[("1b", "fixed β 0.01-0.3 within ±0.05 of each other (mean final reward)")]
    assert spread["verdict"] == "failed" and spread["measured"].startswith("largest − smallest 0.220 (β 0.01: 0.520, β 0.04: 0.620")
    assert v[("2a", "`dynamic` at its defaults never moves β")] == "held"
    assert v[("2b", "its final reward within 0.01 of fixed β 0.04's in every seed")] == "held"
    acting = result[("2c", "the acting `dynamic` drops β below 0.004 in at least 3 of 5 seeds")]
    assert acting["verdict"] == "held" and acting["measured"].startswith("3 of 5 (smallest β: 0.002, 0.002, 0.002, 0.01, 0.01)")
    assert (v[("3", "no runaway in any arm")], result[("3", "no runaway in any arm")]["measured"]) == (
        "failed", "1 of 70 runs alarmed: reward_conditioned β 0.04 seed 2")
    schedule = {k[1]: r for k, r in result.items() if k[0] == "4"}
    linear, cosine = (next(r for label, r in schedule.items() if kind in label) for kind in ("linear", "cosine"))
    assert linear["verdict"] == "held" and linear["measured"] == "Δ -0.020; best window 0.600 (best fixed β 0.620)"
    assert cosine["verdict"] == "failed" and cosine["measured"].startswith("Δ -0.200")
    five = {k[1]: r for k, r in result.items() if k[0] == "5"}
    # target: 0.02 / 0.02 held in 5, 0.05 / 0.02 not in 5: 5 of 10, at most half; ziegler: 0.021 in 5, 0.024 in 1: 6 of 10
    assert (five["`target` holds K (±25%) in at most half of its runs"]["measured"], five["`target` holds K (±25%) in at most half of its runs"]["verdict"]) == ("5 of 10", "held")
    assert (five["`ziegler` holds K (±25%) in at most half of its runs"]["measured"], five["`ziegler` holds K (±25%) in at most half of its runs"]["verdict"]) == ("6 of 10", "failed")
    assert five["`target`'s β within [β0/5, 5 β0]"]["verdict"] == "held"
    length = result[("6", "every arm's final median length within ±10 tokens of fixed β 0.04's")]
    assert (length["verdict"], length["measured"]) == ("failed", "1 of 13 arms outside: reward_conditioned β 0.04 +15.0")


def test_a_change_to_one_arm_flips_the_clause_it_touches(tmp_path):
    def change(name, seed, args):
        method, beta0, final, kwargs = args
        if name == "schedule cosine":  # 0.2 above the best in every seed: beats it
            final += 0.4
        if name == "dynamic defaults" and seed == 3:  # β moves once, and the reward leaves the ±0.01
            kwargs["betas"] = lambda step: 0.036 if step > 50 else 0.04
            final += 0.02
        if name == "dynamic acting" and seed == 2:  # the third seed below 0.004 stays above it
            kwargs["betas"] = decay(0.04, 0.005)
        if name == "target 1" and seed == 4:  # from β0 1: 0.1, below β0 / 5
            kwargs["betas"] = lambda step: 0.1
        if name == "reward_conditioned":
            kwargs.update(alarm_at=None, median=62.0)
        return method, beta0, final, kwargs

    v = verdicts(build(tmp_path, change))
    expected = {("1", "no controller arm beats the best fixed β (Holm)"): "failed",
                ("2a", "`dynamic` at its defaults never moves β"): "failed",
                ("2b", "its final reward within 0.01 of fixed β 0.04's in every seed"): "failed",
                ("2c", "the acting `dynamic` drops β below 0.004 in at least 3 of 5 seeds"): "failed",
                ("3", "no runaway in any arm"): "held",
                ("5", "`target`'s β within [β0/5, 5 β0]"): "failed",
                ("6", "every arm's final median length within ±10 tokens of fixed β 0.04's"): "held"}
    assert {key: v[key] for key in expected} == expected


def test_clauses_without_their_arms_are_not_measured(tmp_path):
    only = {"none 0.04", "none 0.1", "none 0.01"}
    v = verdicts(build(tmp_path, lambda name, seed, args: args if name in only else ("none", 0.04, 0.6 + 0.01 * seed, {"tag": f"-{name.replace(' ', '')}"})))
    # every other arm became a fixed β 0.04 copy under its own tag: no controller, no schedule, target or dynamic runs
    unmeasured = [("1", "no controller arm beats the best fixed β (Holm)"), ("2a", "`dynamic` at its defaults never moves β"),
                  ("2c", "the acting `dynamic` drops β below 0.004 in at least 3 of 5 seeds"),
                  ("4", "`schedule` from 1 within the best fixed β's ±0.05"),
                  ("5", "`target` holds K (±25%) in at most half of its runs"), ("5", "`target`'s β within [β0/5, 5 β0]")]
    assert [v[key] for key in unmeasured] == ["not measured"] * len(unmeasured)
    assert v[("3", "no runaway in any arm")] == "held"  # measured on the runs there are


def test_the_report_prints_a_row_a_clause(tmp_path):
    build(tmp_path)
    text = predictions.report([str(tmp_path / "study51-b-x")])
    lines = text.splitlines()
    assert lines[0] == "| prediction | claim | measured | verdict |"
    assert len(lines) == 2 + 13  # 1, 1a, 1b, 2a-2c, 3, 4 (two arms), 5 (three clauses), 6
    assert "| 3 | no runaway in any arm | 1 of 70 runs alarmed: reward_conditioned β 0.04 seed 2 | failed |" in lines


def test_holding_k_is_study_49s_rule_on_the_log_scale(tmp_path):
    """"Holds K" is study 49's held: within ×1.25 either way (0.8-1.25 × K), so a final KL of 0.78 × K did not hold it."""
    def change(name, seed, args):
        method, beta0, final, kwargs = args
        if name == "ziegler 0.01":
            kwargs["kl"] = 0.0156  # 0.78 × the kl_target 0.02
        return method, beta0, final, kwargs

    five = {k[1]: r for k, r in build(tmp_path, change).items() if k[0] == "5"}
    ziegler = five["`ziegler` holds K (±25%) in at most half of its runs"]
    assert (ziegler["measured"], ziegler["verdict"]) == ("1 of 10", "held")  # seed 0 of ziegler 1 (1.2 × K) alone


def test_no_runaway_is_not_measured_while_a_run_never_logged_the_alarm(tmp_path):
    """A run without ``adaptive_kl/runaway_alarm`` is not a calm run: with no alarm elsewhere clause 3 is not measured
    (it was "held"); an alarm elsewhere still fails it."""
    def calm(name, seed, args):
        method, beta0, final, kwargs = args
        if name == "reward_conditioned":
            kwargs["alarm_at"] = None
        return method, beta0, final, kwargs

    directory = write_study(tmp_path / "study51-b-x", calm)
    path = directory / "study51-b-x-stream.jsonl.gz"
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    for r in rows:
        if r["method"] == "ziegler" and r["seed"] == 1 and r["beta0"] == 1.0:
            del r["adaptive_kl/runaway_alarm"]
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    (three,) = [r for r in predictions.check([str(directory)]) if r["number"] == "3"]
    assert (three["verdict"], three["measured"]) == ("not measured", "0 of 70 runs alarmed; 1 run never logged the alarm")
    for r in rows:
        if r["method"] == "none" and r["seed"] == 0 and r["beta0"] == 0.3 and r["step"] >= 80:
            r["adaptive_kl/runaway_alarm"] = 1
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    (three,) = [r for r in predictions.check([str(directory)]) if r["number"] == "3"]
    assert three["verdict"] == "failed" and three["measured"].startswith("1 of 70 runs alarmed: none β 0.3 seed 0;")
