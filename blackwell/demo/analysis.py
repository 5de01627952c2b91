"""Drift analysis of finished metrics files (``--analyze``): the length slope per run, 95 % t intervals
over seeds, and each method's paired difference from the baseline by seed."""

from __future__ import annotations

import gzip
import json
import math
import statistics

from .summary import _mean, cell, summarize_run

LENGTH = "completions/mean_length"
CORRECT = "rewards/scratchpad_correctness_reward/mean"  # 0.5 per right answer
# Two-sided 95 % quantiles of Student's t, by degrees of freedom (standard table values).
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def ols_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys on xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def second_half_slope(rows: list[dict], key: str = LENGTH, per: float = 100.0) -> float:
    """Slope of ``key`` against step over the second half of a run (steps > last step / 2), in units
    per ``per`` steps."""
    last = max(r["step"] for r in rows)
    half = [(r["step"], r[key]) for r in rows if r["step"] > last / 2 and r.get(key) is not None]
    return per * ols_slope([x for x, _ in half], [y for _, y in half])


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the two-sided 95 % Student-t interval of the mean; (v, nan, nan) for one value."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan, math.nan
    sd = statistics.stdev(values)
    half = (T975[n - 2] if n - 1 <= len(T975) else 1.96) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def paired_differences(values: dict[tuple[str, int], float], method: str, baseline: str = "none") -> list[float]:
    """``values[(method, seed)] - values[(baseline, seed)]`` for every seed both have, by seed."""
    seeds = sorted(s for m, s in values if m == method and (baseline, s) in values)
    return [values[(method, s)] - values[(baseline, s)] for s in seeds]


def fmt_interval(values: list[float], fmt: str = ".2f") -> str:
    mean, low, high = t_interval(values)
    if math.isnan(low):
        return format(mean, fmt)
    excludes = " *" if low > 0 or high < 0 else ""
    return f"{format(mean, fmt)} [{format(low, fmt)}, {format(high, fmt)}]{excludes}"


def read_rows(paths: list[str]) -> dict[str, dict[tuple[str, int], list[dict]]]:
    """{tag: {(method, seed): rows sorted by step}} from metrics files (.jsonl, or .jsonl.gz). Within one file a
    step seen twice counts once (the later row). A run found in several files (a cut run and its rerun in a
    later call) counts whole from one of them: the copy that reached the furthest step, the later file's on a
    tie. Copies are never spliced step by step, so a rerun that diverged from the cut run cannot lend it steps."""
    by_run: dict[tuple[str, str, int], dict[int, dict]] = {}
    for path in paths:
        here: dict[tuple[str, str, int], dict[int, dict]] = {}
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    here.setdefault((row.get("tag", "default"), row["method"], row["seed"]), {})[row["step"]] = row
        for key, steps in here.items():
            if key not in by_run or max(steps) >= max(by_run[key]):
                by_run[key] = steps
    out: dict[str, dict[tuple[str, int], list[dict]]] = {}
    for (tag, method, seed), steps in sorted(by_run.items()):
        out.setdefault(tag, {})[(method, seed)] = [steps[k] for k in sorted(steps)]
    return out


def run_numbers(rows: list[dict], window: float = 0.1) -> dict:
    """One run's numbers for the drift tables (summarize_run's, plus the length slope and accuracy)."""
    k = max(1, round(len(rows) * window))
    numbers = summarize_run(rows, window)
    numbers["steps"] = rows[-1]["step"]
    numbers["length_slope"] = second_half_slope(rows)
    numbers["accuracy_start"] = 2 * _mean(r.get(CORRECT) for r in rows[:k])
    numbers["accuracy_end"] = 2 * _mean(r.get(CORRECT) for r in rows[-k:])
    return numbers


def analyze(paths: list[str], baseline: str = "none") -> str:
    """Markdown: per setting (tag), the baseline's length slope over the second half with its 95 % t
    interval over seeds; per setting with several methods, each method's numbers and its paired
    difference from the baseline by seed. ``*``: the interval excludes 0."""
    data = read_rows(paths)
    out = ["| setting | seeds | steps | accuracy start → end | length start → end | length slope / 100 steps, "
           "2nd half: mean [95% CI] | per seed |", "|---|---|---|---|---|---|---|"]
    for tag, runs in data.items():
        base = {s: run_numbers(rows) for (m, s), rows in runs.items() if m == baseline}
        if not base:
            continue
        v = list(base.values())
        out.append(f"| {tag} | {len(v)} | {min(x['steps'] for x in v)} | "
                   f"{_mean(x['accuracy_start'] for x in v):.2f} → {_mean(x['accuracy_end'] for x in v):.2f} | "
                   f"{_mean(x['length_start'] for x in v):.1f} → {_mean(x['length_end'] for x in v):.1f} | "
                   f"{fmt_interval([x['length_slope'] for x in v])} | "
                   f"{', '.join(format(base[s]['length_slope'], '.2f') for s in sorted(base))} |")
    for tag, runs in data.items():
        methods = list(dict.fromkeys(m for m, _ in runs))
        if len(methods) < 2 or baseline not in methods:
            continue
        methods = [baseline] + [m for m in methods if m != baseline]
        numbers = {key: run_numbers(rows) for key, rows in runs.items()}
        out += ["", f"**{tag}**: mean ± std over seeds; Δ: paired difference from `{baseline}` by seed, mean "
                    "[95% t interval] (* excludes 0)", "",
                "| method | seeds | length end | length slope | accuracy end | reward end | raw KL end | adapted KL end "
                "| final β | Δ length end | Δ length slope | Δ reward end |", "|---" * 12 + "|"]
        for method in methods:
            mine = [numbers[(method, s)] for (m, s) in runs if m == method]
            col = lambda key, fmt: cell([x[key] for x in mine], fmt)  # noqa: E731
            diff = lambda key: (fmt_interval(paired_differences({k: x[key] for k, x in numbers.items()}, method, baseline))  # noqa: E731
                                if method != baseline else "—")
            out.append(f"| `{method}` | {len(mine)} | {col('length_end', '.2f')} | {col('length_slope', '.2f')} | "
                       f"{col('accuracy_end', '.3f')} | {col('final_reward', '.3f')} | {col('raw_kl_end', '.4f')} | "
                       f"{col('adapted_kl_end', '.4f')} | {col('final_beta', '.3g')} | {diff('length_end')} | "
                       f"{diff('length_slope')} | {diff('final_reward')} |")
    return "\n".join(out)
