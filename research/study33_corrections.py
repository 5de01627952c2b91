"""Issue 51, item 1: the numbers of the 2026-11-28 correction to study 33 (docs/evidence/study33-long-task.md,
"Correction"), recomputed from the raw streams research/data/study33-p[12]-*/*-stream.jsonl.gz.

    python research/study33_corrections.py            # prints every number the correction states

It reads the streams with the study's own analysis (research/harness/analysis.py: the copies, the final window, the
pre-registered runaway rule, a seed's value as the mean over its copies, the t interval with the table's
quantiles) and adds what that analysis lacks: a Student-t p-value, Bonferroni and Holm over a family, and the
exact sign-flip test. research/tests/test_study33_corrections.py checks these against textbook values and the
correction's text against this script.
"""

from __future__ import annotations

import glob
import itertools
import math
import os
import statistics
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from research.harness import analysis  # noqa: E402
from research.stats import holm, regularized_incomplete_beta  # noqa: E402

STREAMS = os.path.join(ROOT, "research", "data", "study33-p[12]-*", "*-stream.jsonl.gz")
PLANNED_STEPS = 200
LENGTH_CAP = 192  # max_completion_length of the study (section 7, "GRPO")
MIN_LENGTH, MAX_LENGTH, LENGTH = "completions/min_length", "completions/max_length", "completions/mean_length"


# -- tests the study's analysis does not have ------------------------------------------------------------------
def t_test_p(differences: list[float]) -> float:
    """Two-sided p of the one-sample t-test of mean 0: P(|T| >= |t|) with n - 1 degrees of freedom,
    = I_{df / (df + t^2)}(df / 2, 1 / 2)."""
    n = len(differences)
    if n < 2:
        raise ValueError(f"differences={differences!r}: allowed: at least 2 values")
    t = statistics.fmean(differences) / (statistics.stdev(differences) / math.sqrt(n))
    df = n - 1
    return regularized_incomplete_beta(df / (df + t * t), df / 2.0, 0.5)


def sign_flip_p(differences: list[float]) -> float:
    """Exact two-sided sign-flip (permutation) test of paired differences: the share of the 2^n sign patterns
    whose |mean| is at least the observed |mean|. With n values its smallest possible p is 2 / 2^n."""
    observed = abs(sum(differences))
    patterns = list(itertools.product((1, -1), repeat=len(differences)))
    hits = sum(abs(sum(s * d for s, d in zip(signs, differences))) >= observed - 1e-12 for signs in patterns)
    return hits / len(patterns)


# -- the study's runs ----------------------------------------------------------------------------------------
def study_cells(pattern: str = STREAMS) -> dict:
    """{CellKey: {seed: [copies]}} of phases 1 and 2 (one family: the long task)."""
    runs, planned = analysis.study_cells(sorted(glob.glob(pattern)))
    (family,) = runs
    assert planned[family] == PLANNED_STEPS, planned
    return runs[family]


def complete_copies(cells: dict):
    """(key, seed, rows) of every copy that reached the planned last step."""
    for key, by_seed in sorted(cells.items(), key=lambda item: item[0].order):
        for seed, copies in sorted(by_seed.items()):
            for rows in copies:
                if rows[-1]["step"] >= PLANNED_STEPS:
                    yield key, seed, rows


def reward_rule(cells: dict) -> dict:
    """The runaway rule's reward condition alone (what it is at β = 0) applied to every complete copy:
    {"complete": n, "flagged": n, "by_cell": {key: (flagged, copies)}}."""
    by_cell: dict = {}
    spared = []
    for key, seed, rows in complete_copies(cells):
        flagged, n = by_cell.get(key, (0, 0))
        hit = analysis.runaway_step(rows, None) is not None
        by_cell[key] = (flagged + hit, n + 1)
        if not hit:
            spared.append((key, seed))
    return {"complete": sum(n for _, n in by_cell.values()), "flagged": sum(f for f, _ in by_cell.values()),
            "by_cell": by_cell, "not_flagged": spared}


def seed_value(copies: list, key: str) -> float:
    return analysis.seed_values(copies, PLANNED_STEPS, key)


def complete_value(copies: list, key: str) -> float:
    (rows,) = [rows for rows in copies if rows[-1]["step"] >= PLANNED_STEPS]
    return analysis.copy_numbers(rows, PLANNED_STEPS, None)[key]


@dataclass(frozen=True)
class Paired:
    differences: list
    mean: float
    low95: float
    high95: float


def paired(a: dict, b: dict, value) -> Paired:
    differences = [value(a[s], "reward") - value(b[s], "reward") for s in sorted(set(a) & set(b))]
    mean, low, high = analysis.t_interval(differences)
    return Paired(differences, mean, low, high)


def beta_zero(cells: dict) -> dict:
    """β = 0 against the fixed β > 0: its seeds' final reward and length, the range of the seeds of β 0.01-0.3,
    and the paired difference of final reward against β 0.1 (seed values as section 7 defines them, and from each
    seed's complete copy alone)."""
    fixed = analysis.fixed_cells(cells)
    zero, best = fixed[analysis.CellKey("none", 0.0, None)], fixed[analysis.CellKey("none", 0.1, None)]
    calm = [fixed[k] for k in fixed if 0.01 <= k.beta <= 0.3]
    calm_values = {q: [seed_value(c, q) for cell in calm for c in cell.values()] for q in ("reward", "length")}
    return {"seeds": {s: (seed_value(c, "reward"), seed_value(c, "length")) for s, c in sorted(zero.items())},
            "calm_range": {q: (min(v), max(v)) for q, v in calm_values.items()},
            "against_0.1": paired(zero, best, seed_value),
            "against_0.1_complete_copies": paired(zero, best, complete_value)}


def capped_steps(cells: dict) -> list:
    """(key, seed, last step, [steps at which every completion of the step was cut at the length cap]) for every
    copy with such a step."""
    out = []
    for key, by_seed in sorted(cells.items(), key=lambda item: item[0].order):
        for seed, copies in sorted(by_seed.items()):
            for rows in copies:
                steps = [r["step"] for r in rows if r.get(MIN_LENGTH) == LENGTH_CAP]
                if steps:
                    out.append((key, seed, rows[-1]["step"], steps))
    return out


def target_family(cells: dict) -> list:
    """Section 7's six tests of (b)'s reward: each `target` cell against the best fixed β (β 0.1), paired by seed:
    [(kl_target, β0, mean, t-test p, sign-flip p)], with Bonferroni and Holm over the six."""
    fixed = analysis.fixed_cells(cells)
    best = fixed[analysis.CellKey("none", 0.1, None)]
    rows = []
    for key, cell in sorted(analysis.target_cells(cells).items(), key=lambda item: (item[0].kl_target, item[0].beta)):
        compared = paired(cell, best, seed_value)
        d = compared.differences
        rows.append({"kl_target": key.kl_target, "beta0": key.beta, "mean": statistics.fmean(d), "paired": compared,
                     "t_p": t_test_p(d), "sign_flip_p": sign_flip_p(d), "all_positive": all(x > 0 for x in d)})
    for row, adjusted in zip(rows, holm([r["t_p"] for r in rows])):
        row["bonferroni"] = min(1.0, len(rows) * row["t_p"])
        row["holm"] = adjusted
    return rows


def long_task_contradictions(cells: dict) -> dict:
    """The long-task numbers that contradict the toy task's general statements: `target`'s reward cost and length
    at the low target, β 0.3's KL against β 0.1's, `target`'s final-KL spread across β0 at the high target, and how
    many `target` runs ended within ±25 % of their target."""
    fixed = analysis.fixed_cells(cells)
    best = fixed[analysis.CellKey("none", 0.1, None)]
    targets = analysis.target_cells(cells)
    cell_mean = lambda cell, q: statistics.fmean(seed_value(c, q) for c in cell.values())  # noqa: E731
    low, high = sorted({k.kl_target for k in targets})
    by_target = {kt: {k.beta: cell for k, cell in targets.items() if k.kl_target == kt} for kt in (low, high)}
    high_kl = [cell_mean(cell, "kl") for cell in by_target[high].values()]
    fixed_kl = {k.beta: cell_mean(cell, "kl") for k, cell in sorted(fixed.items()) if k.beta > 0}
    spread = lambda betas: max(fixed_kl[b] for b in betas) / min(fixed_kl[b] for b in betas)  # noqa: E731
    ratios = [seed_value(c, "kl") / k.kl_target for k, cell in targets.items() for c in cell.values()]
    return {"low_target_reward": {b: paired(cell, best, seed_value).mean for b, cell in sorted(by_target[low].items())},
            "low_target_length": {b: cell_mean(cell, "length") for b, cell in sorted(by_target[low].items())},
            "kl_by_beta": fixed_kl,
            "fixed_kl_spread": {"0.01-0.3": spread([b for b in fixed_kl if b >= 0.01]), "0.001-0.3": spread(list(fixed_kl))},
            "high_target_kl": {b: cell_mean(cell, "kl") for b, cell in sorted(by_target[high].items())},
            "high_target_kl_spread": max(high_kl) / min(high_kl),
            "within_25": (sum(0.75 <= r <= 1.25 for r in ratios), len(ratios))}


def corrections(pattern: str = STREAMS) -> dict:
    cells = study_cells(pattern)
    return {"reward_rule": reward_rule(cells), "beta_zero": beta_zero(cells), "capped": capped_steps(cells),
            "family": target_family(cells), "long_task": long_task_contradictions(cells)}


def report(values: dict) -> str:
    rule, zero, long = values["reward_rule"], values["beta_zero"], values["long_task"]
    out = [f"Reward rule alone: flags {rule['flagged']} of the {rule['complete']} complete runs"]
    out += [f"  {k.method} β0 {k.beta:g} kt {k.kl_target} {k.placement}: {f} of {n}" for k, (f, n) in rule["by_cell"].items()]
    out.append("β = 0 by seed (final reward, final length): " +
               ", ".join(f"seed {s} {r:.3f} {n:.1f}" for s, (r, n) in zero["seeds"].items()))
    out.append("seeds of β 0.01-0.3: reward {:.3f}-{:.3f}, length {:.1f}-{:.1f}".format(
        *zero["calm_range"]["reward"], *zero["calm_range"]["length"]))
    for name in ("against_0.1", "against_0.1_complete_copies"):
        p = zero[name]
        out.append(f"β 0 - β 0.1, final reward ({name}): {p.mean:+.3f} [{p.low95:+.3f}, {p.high95:+.3f}]")
    for key, seed, last, steps in values["capped"]:
        out.append(f"every completion at the {LENGTH_CAP}-token cap: {key.method} β0 {key.beta:g} kt {key.kl_target} "
                   f"seed {seed} (copy to step {last}): steps {steps}")
    for row in values["family"]:
        out.append(f"(b) reward, kt {row['kl_target']} β0 {row['beta0']:g}: Δ {row['mean']:+.3f}, t-test p {row['t_p']:.4f}, "
                   f"Bonferroni {row['bonferroni']:.3f}, Holm {row['holm']:.3f}, sign-flip p {row['sign_flip_p']:.4f}")
    out.append("low target, Δ reward vs β 0.1 by β0: " +
               ", ".join(f"{b:g}: {v:+.3f}" for b, v in long["low_target_reward"].items()))
    out.append("low target, final length by β0: " + ", ".join(f"{b:g}: {v:.1f}" for b, v in long["low_target_length"].items()))
    out.append("fixed β final KL: " + ", ".join(f"{b:g}: {v:.4f}" for b, v in long["kl_by_beta"].items()))
    out.append("high target, final KL by β0: " + ", ".join(f"{b:g}: {v:.4f}" for b, v in long["high_target_kl"].items()) +
               f"; max / min {long['high_target_kl_spread']:.1f}; fixed β's final KL max / min: " +
               ", ".join(f"β {k}: {v:.1f}" for k, v in long["fixed_kl_spread"].items()))
    out.append("not flagged by the reward rule: " + ", ".join(f"{k.method} β0 {k.beta:g} kt {k.kl_target} seed {s}"
                                                               for k, s in rule["not_flagged"]))
    out.append("target runs within ±25 % of their target: {} of {}".format(*long["within_25"]))
    return "\n".join(out)


def step_ranges(steps: list[int]) -> str:
    """[192, 196, 197, 198, 199, 200] -> "at step 192 and at every step from 196 to 200"."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][-1] + 1:
            runs[-1].append(step)
        else:
            runs.append([step])
    parts = [f"at step {r[0]}" if len(r) == 1 else f"at every step from {r[0]} to {r[-1]}" for r in runs]
    return " and ".join(parts)


def table_rows(values: dict) -> list[str]:
    """The correction's table: β = 0 and the post-hoc gain against the best fixed β 0.1, final reward."""
    zero = values["beta_zero"]["against_0.1"]
    (gain,) = [row for row in values["family"] if row["mean"] > 0]
    g = gain["paired"]
    verdict = lambda p: "inconclusive" if p.low95 <= 0 <= p.high95 else "different"  # noqa: E731
    return [f"| `none` at β 0 | {len(zero.differences)} | {zero.mean:.3f} | [{zero.low95:.3f}, {zero.high95:+.3f}] | "
            f"{t_test_p(zero.differences):.3f} | — | — | {sign_flip_p(zero.differences):.4f} | {verdict(zero)} |",
            f"| `target` from β0 {gain['beta0']:g}, `kl_target` {gain['kl_target']:g} | {len(g.differences)} | "
            f"{g.mean:+.3f} | [{g.low95:+.3f}, {g.high95:+.3f}] | {gain['t_p']:.3f} | {gain['bonferroni']:.3f} | "
            f"{gain['holm']:.3f} | {gain['sign_flip_p']:.4f} | "
            f"{'not shown after correction' if gain['bonferroni'] > 0.05 else 'different'} |"]


def claims(values: dict) -> list[str]:
    """The phrases the correction must contain, made from the recomputed values (the correction's wording around
    them is the doc's; its numbers are these)."""
    rule, zero, long, family = values["reward_rule"], values["beta_zero"], values["long_task"], values["family"]
    by_beta = {k.beta: v for k, v in rule["by_cell"].items() if k.method == "none" and k.default_placement}
    low, high = sorted({row["kl_target"] for row in family})
    named = lambda k, seed: (f"`target` from β0 {k.beta:g} at the {'high' if k.kl_target == high else 'low'} target, "  # noqa: E731
                             f"seed {seed}" if k.kl_target is not None else f"`{k.method}` seed {seed}")
    (lo_r, hi_r), (lo_n, hi_n) = zero["calm_range"]["reward"], zero["calm_range"]["length"]
    calm = {s: v for s, v in zero["seeds"].items() if lo_r <= v[0] <= hi_r and lo_n <= v[1] <= hi_n}
    (collapsed,) = [v for s, v in zero["seeds"].items() if s not in calm]
    rng = lambda xs, fmt: f"{format(min(xs), fmt)}-{format(max(xs), fmt)}"  # noqa: E731
    p, pc = zero["against_0.1"], zero["against_0.1_complete_copies"]
    (gain,) = [row for row in family if row["mean"] > 0]
    losses = sorted(row["t_p"] for row in family if row["t_p"] < gain["t_p"])
    cost = long["low_target_reward"]
    claims = [f"flags {rule['flagged']} of the {rule['complete']} complete runs",
              "{} of {} at β 0.04 and {} of {} at β 0.1".format(*by_beta[0.04], *by_beta[0.1]),
              " and ".join(named(k, s) for k, s in rule["not_flagged"]) if len(rule["not_flagged"]) == 2 else "?",
              f"{len(calm)} of the {len(zero['seeds'])} β = 0 seeds ended like the seeds of β 0.01-0.3",
              f"final reward {rng([v[0] for v in calm.values()], '.3f')} and {rng([v[1] for v in calm.values()], '.1f')} tokens",
              f"(the seeds of β 0.01-0.3: {lo_r:.3f}-{hi_r:.3f} and {lo_n:.1f}-{hi_n:.1f})",
              f"ended at {collapsed[0]:.3f} and {collapsed[1]:.1f} tokens",
              f"differs by {p.mean:.3f}, 95 % interval [{p.low95:.3f}, {p.high95:+.3f}]",
              f"{pc.mean:.3f} [{pc.low95:.3f}, {pc.high95:+.3f}]",
              f"at the end of {len(values['capped'])} of the {rule['complete']} runs",
              f"cost {-cost[0.1]:.3f} and {-cost[1.0]:.3f} of final reward",
              f"shortened the completions to {long['low_target_length'][1.0]:.1f} tokens",
              f"({long['kl_by_beta'][0.3]:.4f} against {long['kl_by_beta'][0.1]:.4f})",
              f"varied {long['high_target_kl_spread']:.0f}× across β0",
              f"({long['high_target_kl'][0.01]:.3f} from 0.01, {long['high_target_kl'][1.0]:.4f} from 1)",
              f"varied {long['fixed_kl_spread']['0.01-0.3']:.1f}× across β 0.01-0.3 ({long['fixed_kl_spread']['0.001-0.3']:.0f}× with β 0.001)",
              "{} of its {} runs ended within".format(*long["within_25"]),
              f"{gain['mean']:+.3f} final reward", f"one of the {len(family)} reward comparisons",
              f"t-test p is {gain['t_p']:.3f}", f"Bonferroni gives {gain['bonferroni']:.3f} and Holm {gain['holm']:.3f}",
              "p " + " and ".join(f"{x:.4f}" for x in losses), f"gives {gain['sign_flip_p']:.4f}: all five seeds are positive"]
    below = [-d for d in p.differences]
    claims += [f"ended below β 0.1's, by {min(below):.3f}-{max(below):.3f} (exact sign-flip p {sign_flip_p(p.differences):.4f}"
               if all(d < 0 for d in p.differences) else "?", f"t-test p {t_test_p(p.differences):.3f})"]
    claims += table_rows(values)
    for key, seed, last, steps in values["capped"]:
        if key.method == "none":
            claims.append(f"β = {key.beta:g}, seed {seed}: {step_ranges(steps)}, every one")
        else:
            claims.append(f"{named(key, seed)}, every completion at the cap {step_ranges(steps)}")
    return claims


if __name__ == "__main__":
    print(report(corrections()))
