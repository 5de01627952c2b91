"""Drift analysis of finished metrics files (``--analyze``): the length slope per run, 95 % t intervals
over seeds, and each method's paired difference from the baseline by seed."""

from __future__ import annotations

import gzip
import json
import math
import statistics
from dataclasses import dataclass
from typing import NamedTuple

from unsloth_adaptive_kl import metrics

from .settings import Settings
from .summary import _mean, cell, summarize_run

LENGTH = "completions/mean_length"
# The KL's token tail (docs/metrics-tail.md), which (c) reports (Amendment 14): a copy's key -> (the logged metric,
# its row in the report).
TAIL_METRICS = {"kl_p99": (metrics.TOKEN_KL_P99, "token KL p99"), "kl_max": (metrics.TOKEN_KL_MAX, "token KL max"),
                "kl_top1": (metrics.TOKEN_KL_TOP1PCT_SHARE, "token KL top-1 % share")}
CORRECT = "rewards/scratchpad_correctness_reward/mean"  # 0.5 per right answer
# Each task's correctness reward and what one right answer scores: the tiny tasks' 0.5 (the scratchpad task and
# examples/toy.py's), SmolLM2's chat addition 1.0 (unsloth_adaptive_kl.smollm2.correct_answer_reward).
ACCURACY_REWARDS = {CORRECT: 0.5, "rewards/correctness_reward/mean": 0.5, "rewards/correct_answer_reward/mean": 1.0}
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
    numbers["accuracy_start"] = _mean(accuracy(r) for r in rows[:k])
    numbers["accuracy_end"] = _mean(accuracy(r) for r in rows[-k:])
    return numbers


def accuracy(row: dict) -> float | None:
    """The step's fraction of right answers, from its task's correctness reward (ACCURACY_REWARDS); None for a task
    without one (its table cell then says nan)."""
    for key, right in ACCURACY_REWARDS.items():
        if row.get(key) is not None:
            return row[key] / right
    return None


def analyze(paths: list[str], baseline: str = "none") -> str:
    """Markdown: per setting (tag), the baseline's length slope over the second half with its 95 % t
    interval over seeds (a setting without a baseline run: each method's, labelled); per setting with several
    methods, each method's numbers and its paired difference from the baseline by seed. ``*``: the interval
    excludes 0."""
    data = read_rows(paths)
    out = ["| setting | seeds | steps | accuracy start → end | length start → end | length slope / 100 steps, "
           "2nd half: mean [95% CI] | per seed |", "|---|---|---|---|---|---|---|"]
    for tag, runs in data.items():
        methods = list(dict.fromkeys(m for m, _ in runs))
        # a setting's row is its baseline's runs; a setting run without one (study 51's lists of only dynamic or
        # schedule arms, whose table was silently empty on the GPU) gets a row per method, labelled with it
        for method in [baseline] if baseline in methods else methods:
            base = {s: run_numbers(rows) for (m, s), rows in runs.items() if m == method}
            v = list(base.values())
            label = tag if method == baseline else f"{tag} · `{method}`"
            out.append(f"| {label} | {len(v)} | {min(x['steps'] for x in v)} | "
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


# -- the pre-registered tests of docs/evidence/study33-long-task.md (issue 33) -----------------------------
# One-sided 95 % quantiles of Student's t by degrees of freedom 1-30 (standard table values): the two
# one-sided tests at α = 0.05 of TOST are the 90 % two-sided interval.
T95 = [6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753,
       1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697]


def _t(table: list[float], df: int, normal: float) -> float:
    return table[df - 1] if df <= len(table) else normal


@dataclass(frozen=True)
class Equivalence:
    """TOST (Schuirmann 1987) on paired differences: equivalent at α = 0.05 when both one-sided tests reject,
    i.e. the 90 % t interval of the mean difference lies inside (-margin, margin); different when the 95 %
    interval excludes 0. Both can hold (a difference smaller than the margin); neither: inconclusive."""

    n: int
    mean: float
    se: float
    margin: float
    low90: float
    high90: float
    low95: float
    high95: float

    @property
    def equivalent(self) -> bool:
        return self.n >= 2 and -self.margin < self.low90 and self.high90 < self.margin

    @property
    def different(self) -> bool:
        return self.n >= 2 and (self.low95 > 0 or self.high95 < 0)

    @property
    def verdict(self) -> str:
        if self.n < 2:
            return "too few seeds"
        if self.equivalent:
            return "equivalent, and different from 0" if self.different else "equivalent"
        return "different" if self.different else "inconclusive"


def tost(differences: list[float], margin: float) -> Equivalence:
    """Paired differences (one per seed) against the equivalence margin ``margin`` > 0."""
    if not margin > 0:
        raise ValueError(f"margin={margin!r}: allowed: a number > 0")
    n = len(differences)
    mean = sum(differences) / n if n else math.nan
    if n < 2:
        return Equivalence(n, mean, math.nan, margin, math.nan, math.nan, math.nan, math.nan)
    se = statistics.stdev(differences) / math.sqrt(n)
    h90, h95 = _t(T95, n - 1, 1.645) * se, _t(T975, n - 1, 1.96) * se
    return Equivalence(n, mean, se, margin, mean - h90, mean + h90, mean - h95, mean + h95)


def trailing_means(values: list[float], window: int) -> list[float]:
    """Mean of each value with the ``window - 1`` before it (fewer at the start); None counts as missing."""
    out = []
    for i in range(len(values)):
        out.append(_mean(values[max(0, i - window + 1): i + 1]))
    return out


def runaway_step(rows: list[dict], kl_threshold: float | None, *, window: int = 10, reward_drop: float = 0.1,
                 first_step: int = 20) -> int | None:
    """The pre-registered runaway criterion: the first step ``s >= first_step`` at which the trailing
    ``window``-step mean raw KL (``adaptive_kl/raw_kl``) exceeds ``kl_threshold`` while the trailing mean
    reward is at least ``reward_drop`` below the highest trailing mean reward the run had reached by then.
    ``kl_threshold=None`` (β = 0: no KL is computed) uses the reward condition alone. None: no runaway."""
    kl = trailing_means([r.get(metrics.RAW_KL) for r in rows], window)
    reward = trailing_means([r.get("reward") for r in rows], window)
    best = -math.inf
    for row, k, rw in zip(rows, kl, reward):
        best = max(best, rw)
        if row["step"] < first_step:
            continue
        kl_high = kl_threshold is None or (not math.isnan(k) and k > kl_threshold)
        if kl_high and rw <= best - reward_drop:
            return row["step"]
    return None


def final_window(rows: list[dict], planned_steps: int, fraction: float = 0.25) -> list[dict]:
    """The rows of the pre-registered final window: steps after (1 - fraction) x planned_steps, i.e. the last
    ``fraction`` of the planned run (steps 151-200 of 200). A run cut before the window has none."""
    start = final_window_start(planned_steps, fraction)
    return [r for r in rows if start < r["step"] <= planned_steps]


def final_window_start(planned_steps: int, fraction: float = 0.25) -> int:
    """The last step before the final window: the window holds at least one step, however short the run."""
    return planned_steps - max(1, round(planned_steps * fraction))


def saturation_step(rows: list[dict], final_reward: float, *, window: int = 10, tolerance: float = 0.02) -> int | None:
    """The first step at which the trailing ``window``-step mean reward reaches ``final_reward - tolerance``
    (the run's final-window mean reward): where question (a) starts to look for a length drift."""
    for row, rw in zip(rows, trailing_means([r.get("reward") for r in rows], window)):
        if rw >= final_reward - tolerance:
            return row["step"]
    return None


def drift_after_saturation(rows: list[dict], planned_steps: int, *, fraction: float = 0.25,
                           min_steps: int = 50) -> dict:
    """Question (a) for one run: the saturation step, and the least-squares slope of the mean completion
    length against step from there to the end, in tokens per 100 steps (None when fewer than ``min_steps``
    steps follow saturation: no room to see a drift)."""
    window = final_window(rows, planned_steps, fraction)
    if not window:
        return {"saturation_step": None, "slope": None, "steps_after": 0}
    final = _mean(r["reward"] for r in window)
    s = saturation_step(rows, final)
    after = [r for r in rows if s is not None and r["step"] >= s and r.get(LENGTH) is not None]
    slope = 100.0 * ols_slope([r["step"] for r in after], [r[LENGTH] for r in after]) if len(after) >= min_steps else None
    return {"saturation_step": s, "slope": slope, "steps_after": len(after)}


def read_copies(paths: list[str]) -> dict[str, dict[tuple[str, int], list[list[dict]]]]:
    """Every copy of every run, none dropped (the rule of section 7: every copy counts as a draw):
    {tag: {(method, seed): [rows of one copy sorted by step, ...]}}. A copy is one training process: rows
    carry its ``copy`` id (the demo writes one per process); rows without it count one copy per file."""
    copies: dict[tuple[str, str, int, str], dict[int, dict]] = {}
    for path in paths:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    key = (row.get("tag", "default"), row["method"], row["seed"], row.get("copy") or path)
                    copies.setdefault(key, {})[row["step"]] = row
    out: dict[str, dict[tuple[str, int], list[list[dict]]]] = {}
    for (tag, method, seed, _), steps in sorted(copies.items()):
        out.setdefault(tag, {}).setdefault((method, seed), []).append([steps[k] for k in sorted(steps)])
    return out


def logged_kl(row: dict) -> bool:
    """Whether a row carries a KL: at β = 0 TRL computes none, and the row has no ``adaptive_kl/raw_kl`` (TRL's
    backend), or None (Unsloth's: the package logs NaN, which TRL's ``log`` turns into None), or NaN."""
    value = row.get(metrics.RAW_KL)
    return value is not None and not math.isnan(value)


def copy_numbers(rows: list[dict], planned_steps: int, kl_threshold: float | None, fraction: float = 0.25) -> dict:
    """One copy's pre-registered numbers: final-window means (None when the copy stopped before the window),
    whether it was complete, and its runaway step. The runaway rule (section 7): at β = 0 (the rows'
    ``beta0``; rows without it: a copy that logged no KL) the reward condition alone; at β > 0 the KL and
    the reward conditions, so without a ``kl_threshold`` (no natural KL) it is not assessed (None)."""
    window = final_window(rows, planned_steps, fraction)
    has_kl = any(logged_kl(r) for r in rows)
    beta0 = rows[0].get("beta0")
    reward_only = float(beta0) == 0 if beta0 is not None else not has_kl
    mean = (lambda key: _mean(r.get(key) for r in window) if window else None)  # noqa: E731
    if reward_only:
        runaway = runaway_step(rows, None)
    else:
        runaway = runaway_step(rows, kl_threshold) if kl_threshold is not None else None
    tail = {key: mean(metric) if has_kl else None for key, (metric, _) in TAIL_METRICS.items()}
    tail = {key: None if value is None or math.isnan(value) else value for key, value in tail.items()}
    return {"complete": rows[-1]["step"] >= planned_steps, "last_step": rows[-1]["step"], "reward": mean("reward"),
            "length": mean(LENGTH), "kl": mean(metrics.RAW_KL) if has_kl else None, "runaway_step": runaway,
            **tail}


def seed_values(copies: list[list[dict]], planned_steps: int, key: str, kl_threshold: float | None = None) -> float | None:
    """A seed's value of ``key``: the mean over its copies that reached the final window (every copy a draw)."""
    values = [copy_numbers(rows, planned_steps, kl_threshold)[key] for rows in copies]
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def seed_slope(copies: list[list[dict]], planned_steps: int) -> float | None:
    """Question (a)'s value of one seed: the mean length slope after saturation over its copies that have one
    (every copy a draw; a seed counts once however many copies it has)."""
    slopes = [drift_after_saturation(rows, planned_steps)["slope"] for rows in copies]
    slopes = [s for s in slopes if s is not None]
    return sum(slopes) / len(slopes) if slopes else None


def paired_by_seed(a: dict[int, list[list[dict]]], b: dict[int, list[list[dict]]], planned_steps: int, key: str) -> list[float]:
    """``key``'s seed value of ``a`` minus ``b``'s, for every seed both have a value for, by seed."""
    out = []
    for seed in sorted(set(a) & set(b)):
        x, y = seed_values(a[seed], planned_steps, key), seed_values(b[seed], planned_steps, key)
        if x is not None and y is not None:
            out.append(x - y)
    return out


def fmt_equivalence(e: Equivalence, fmt: str = ".3f") -> str:
    if e.n < 2:
        return f"{format(e.mean, fmt)} (n={e.n}) | — | — | {e.verdict}"
    return (f"{format(e.mean, fmt)} | [{format(e.low90, fmt)}, {format(e.high90, fmt)}] | "
            f"[{format(e.low95, fmt)}, {format(e.high95, fmt)}] | {e.verdict}")


def fmt_difference(differences: list[float], fmt: str = ".4f") -> str:
    """A paired difference with its 95 % t interval and no margin: "different" when the interval excludes 0."""
    if len(differences) < 2:
        return f"{format(differences[0], fmt)} (n=1) | — | — | too few seeds" if differences else "— | — | — | no seeds"
    mean, low, high = t_interval(differences)
    verdict = "different" if low > 0 or high < 0 else "not different"
    return f"{format(mean, fmt)} | — | [{format(low, fmt)}, {format(high, fmt)}] | {verdict}"


# The numbers section 7 pre-registers (docs/evidence/study33-long-task.md); the report below applies them and nothing else.
REWARD_MARGIN = 0.05  # equivalence margin for the final-window reward (reward in [0, 1])
LENGTH_MARGIN = 5.0  # tokens: final-window length, and tokens per 100 steps for the drift slope
KL_RATIO_MARGIN = math.log(1.25)  # target's final KL / kl_target, on the log scale
RUNAWAY_KL_FACTOR = 10.0  # a runaway's KL threshold: this x the natural KL (the best fixed β > 0's final KL)


def _family(tag: str) -> str:
    from .grid import BETA_IN_TAG, KT_IN_TAG
    from .settings import ESTIMATOR_IN_TAG, PLACEMENT_IN_TAG

    return ESTIMATOR_IN_TAG.sub("", PLACEMENT_IN_TAG.sub("", KT_IN_TAG.sub("", BETA_IN_TAG.sub("-b*", tag))))


# The KL placement and estimator of rows written before the demo recorded them: the demo's only ones then, its
# defaults now.
DEFAULT_PLACEMENT, DEFAULT_ESTIMATOR = Settings.kl_placement, Settings.kl_estimator


class CellKey(NamedTuple):
    """A cell of the study: a method at an initial β (and, for a controller that reads it, a kl_target), with a KL placement and
    estimator; the defaults (loss, k3) are every run of phase 1."""

    method: str
    beta: float
    kl_target: float | None
    placement: str = DEFAULT_PLACEMENT
    estimator: str = DEFAULT_ESTIMATOR

    @property
    def default_placement(self) -> bool:
        return (self.placement, self.estimator) == (DEFAULT_PLACEMENT, DEFAULT_ESTIMATOR)

    def baseline(self) -> "CellKey":
        """The same method, β and kl_target with the default placement and estimator: what (d) compares with."""
        return self._replace(placement=DEFAULT_PLACEMENT, estimator=DEFAULT_ESTIMATOR)

    @property
    def order(self) -> tuple:
        """The tables' and the figure's order of cells (a kl_target of None sorts as 0)."""
        return self.method, self.beta, self.kl_target or 0, self.placement, self.estimator

    def label(self) -> str:
        """The method as the tables write it: `none`, or `none` (KL in the reward, k1) for another placement."""
        return f"`{self.method}`" + ("" if self.default_placement else f" (KL in the {self.placement}, {self.estimator})")


def reads_kl_target(method: str) -> bool:
    """Whether ``method`` (a ``kl_adaptation_method``, parts joined by ``+``) has a β controller that reads
    ``kl_target`` (``target``, ``ziegler``): read from the controllers' registry, where each declares its parameters.
    Its runs are then cells by kl_target too (study 49 runs both controllers at several targets)."""
    from unsloth_adaptive_kl.controllers import CONTROLLERS

    return any(p.name == "kl_target" for part in method.split("+") if part in CONTROLLERS
               for p in CONTROLLERS[part].parameters)


def study_cells(paths: list[str]) -> tuple[dict, dict[str, int]]:
    """The study's runs by family (tags that differ only in the initial β, kl_target, KL placement and estimator):
    ({family: {CellKey(method, β0, kl_target or None, placement, estimator): {seed: copies}}}, {family: planned
    steps}). Rows without ``kl_placement`` / ``kl_estimator`` are the demo's defaults then, loss and k3."""
    runs: dict[str, dict[CellKey, dict[int, list[list[dict]]]]] = {}
    planned: dict[str, int] = {}
    for tag, by_run in read_copies(paths).items():
        family = _family(tag)
        for (method, seed), copies in by_run.items():
            first = copies[0][0]
            key = CellKey(method, float(first["beta0"]), first.get("kl_target") if reads_kl_target(method) else None,
                          first.get("kl_placement") or DEFAULT_PLACEMENT, first.get("kl_estimator") or DEFAULT_ESTIMATOR)
            runs.setdefault(family, {}).setdefault(key, {})[seed] = copies
            planned[family] = max(planned.get(family, 0), int(first["planned_steps"]))
    return runs, planned


def cell_mean(cell: dict[int, list[list[dict]]], steps: int, key: str) -> float:
    """The seed mean of ``key``'s seed values (each seed: the mean over its copies that reached the window)."""
    return _mean(seed_values(copies, steps, key) for copies in cell.values())


def natural_kl(cells: dict, steps: int) -> tuple[tuple | None, tuple | None, float]:
    """Section 7's reference points from the `none` cells with the KL in the loss (k3; (d)'s other placements are
    not fixed-β runs of (a)): the best fixed β (highest seed-mean final reward, β = 0 included), the best fixed
    β > 0, and the natural KL K_nat (that β's seed-mean final KL; nan if none)."""
    fixed = fixed_cells(cells)
    best = max(fixed, key=lambda k: cell_mean(fixed[k], steps, "reward")) if fixed else None
    positive = [k for k in fixed if k[1] > 0]
    natural_key = max(positive, key=lambda k: cell_mean(fixed[k], steps, "reward")) if positive else None
    return best, natural_key, cell_mean(fixed[natural_key], steps, "kl") if natural_key else math.nan


def fixed_cells(cells: dict) -> dict:
    """The fixed-β runs of (a): `none` with the default KL placement and estimator."""
    return {k: v for k, v in cells.items() if k.method == "none" and k.default_placement}


def target_cells(cells: dict) -> dict:
    """The `target` runs of (b): the default KL placement and estimator."""
    return {k: v for k, v in cells.items() if k.method == "target" and k.default_placement}


def compared_cells(cells: dict) -> dict:
    """The runs of (c): every other method (default placement and estimator) that has `none` at its β."""
    return {k: v for k, v in cells.items() if k.method not in ("none", "target") and k.default_placement
            and CellKey("none", k.beta, None) in cells}


def moved_cells(cells: dict) -> dict:
    """The runs of (d): another KL placement or estimator, whose method and β have a run with the KL in the loss (k3)."""
    return {k: v for k, v in cells.items() if not k.default_placement and k.baseline() in cells}


def study_report(paths: list[str]) -> str:
    """Markdown: the pre-registered analysis of section 7, per family of settings (tags that differ only in
    the initial β, kl_target, KL placement and estimator): every run's final-window numbers and runaways, (a) the length slope after
    saturation of every fixed β, (b) target's KL / kl_target and its reward against the best fixed β, (c)
    every other method against `none` at the same β, (d) each run with another KL placement or estimator against
    the same method and β with the KL in the loss (k3); paired by seed, TOST at the pre-registered margins.
    (a), (b), (c) and K_nat read only runs with the KL in the loss (k3)."""
    runs, planned = study_cells(paths)
    out = []
    for family, cells in runs.items():
        steps = planned[family]
        fixed = fixed_cells(cells)
        best, natural_key, natural = natural_kl(cells, steps)
        threshold = RUNAWAY_KL_FACTOR * natural if not math.isnan(natural) else None
        out += [f"## {family} ({steps} planned steps; final window: steps {final_window_start(steps) + 1}-{steps})", "",
                f"Best fixed β (highest seed-mean final reward of `none`): {best[1]:g}" if best else "No `none` runs.",
                f"Natural KL (best fixed β > 0, {natural_key[1]:g}): {natural:.4g}; runaway threshold "
                f"{RUNAWAY_KL_FACTOR:g} x = {threshold:.4g} (β = 0 logs no KL: the reward condition alone)" if threshold else
                "No natural KL (no `none` run with β > 0): runaways at β > 0 not assessed; at β = 0 the reward condition "
                "alone.", "",
                "| method | β0 | kl_target | seeds | copies (complete) | final reward | final length | final KL | runaways |",
                "|---|---|---|---|---|---|---|---|---|"]
        for key, by_seed in sorted(cells.items(), key=lambda item: item[0].order):
            beta, kt = key.beta, key.kl_target
            numbers = [copy_numbers(rows, steps, threshold) for copies in by_seed.values() for rows in copies]
            ran = [f"seed {s} step {copy_numbers(rows, steps, threshold)['runaway_step']}" for s, copies in by_seed.items()
                   for rows in copies if copy_numbers(rows, steps, threshold)["runaway_step"] is not None]
            col = lambda key, fmt: cell_text([seed_values(c, steps, key) for c in by_seed.values()], fmt)  # noqa: E731
            runaways = ("— (no natural KL)" if threshold is None and beta > 0 else
                        f"{len(ran)}{': ' + ', '.join(ran) if ran else ''}")
            out.append(f"| {key.label()} | {beta:g} | {kt if kt is not None else '—'} | {len(by_seed)} | {len(numbers)} "
                       f"({sum(n['complete'] for n in numbers)}) | {col('reward', '.3f')} | {col('length', '.1f')} | "
                       f"{col('kl', '.4f')} | {runaways} |")
        out += ["", f"**(a) Length slope after saturation** (tokens / 100 steps, from the first step whose 10-step mean "
                    f"reward reaches the final-window mean - 0.02; a seed's slope: the mean over its copies with >= 50 such "
                    f"steps). TOST margin ±{LENGTH_MARGIN:g}.", "",
                "| β | seeds | slope: mean | 90 % CI | 95 % CI | verdict |", "|---|---|---|---|---|---|"]
        for (_, beta, *_), by_seed in sorted(fixed.items(), key=lambda kv: kv[0][1]):
            slopes = [seed_slope(copies, steps) for copies in by_seed.values()]
            slopes = [s for s in slopes if s is not None]
            out.append(f"| {beta:g} | {len(slopes)} | {fmt_equivalence(tost(slopes, LENGTH_MARGIN), '.2f')} |")
        targets = target_cells(cells)
        if targets and best:
            out += ["", f"**(b) `target`**: final KL / kl_target (geometric mean; TOST on the log ratio, margin ±ln 1.25) "
                        f"and Δ final reward against the best fixed β {best[1]:g} by seed (margin ±{REWARD_MARGIN:g}).", "",
                    "| kl_target | β0 | seeds | KL / kl_target | log ratio: 90 % CI | verdict | Δ reward | 90 % CI | 95 % CI | verdict |",
                    "|---|---|---|---|---|---|---|---|---|---|"]
            for (_, beta, kt, *_), by_seed in sorted(targets.items(), key=lambda kv: (kv[0][2], kv[0][1])):
                logs = [math.log(v / kt) for v in (seed_values(c, steps, "kl") for c in by_seed.values()) if v and v > 0]
                hold = tost(logs, KL_RATIO_MARGIN)
                ratio = f"{math.exp(hold.mean):.2f}" if logs else "—"
                ci = f"[{math.exp(hold.low90):.2f}, {math.exp(hold.high90):.2f}]" if hold.n >= 2 else "—"
                reward = tost(paired_by_seed(by_seed, fixed[best], steps, "reward"), REWARD_MARGIN)
                out.append(f"| {kt:g} | {beta:g} | {len(by_seed)} | {ratio} | {ci} | {hold.verdict} | {fmt_equivalence(reward)} |")
        others = compared_cells(cells)
        if others:
            out += ["", f"**(c) Against `none` at the same β**, paired by seed: Δ final reward (margin ±{REWARD_MARGIN:g}), "
                        f"Δ final length (margin ±{LENGTH_MARGIN:g} tokens), Δ final raw KL and the KL's token tail "
                        "(p99, max and top-1 % share of the per-token raw KL, final-window means; Amendment 14) with the "
                        "95 % interval only: no margin was set.", "",
                    "| method | β0 | quantity | Δ mean | 90 % CI | 95 % CI | verdict |", "|---|---|---|---|---|---|---|"]
            for (method, beta, *_), by_seed in sorted(others.items()):
                out += _against(f"`{method}`", beta, by_seed, cells[CellKey("none", beta, None)], steps, tail=True)
        moved = moved_cells(cells)
        if moved:
            out += ["", f"**(d) KL placement and estimator**: each run against the same method at the same β with the KL "
                        f"in the loss ({DEFAULT_ESTIMATOR}), paired by seed, the tests of (c): Δ final reward (margin "
                        f"±{REWARD_MARGIN:g}), Δ final length (margin ±{LENGTH_MARGIN:g} tokens), Δ final raw KL (95 % "
                        "interval only); no token tail (Amendment 14: k1's per-token values and k3's differ in their "
                        "tails by estimator).", "",
                    "| method | β0 | quantity | Δ mean | 90 % CI | 95 % CI | verdict |", "|---|---|---|---|---|---|---|"]
            for key, by_seed in sorted(moved.items(), key=lambda item: item[0].order):
                out += _against(key.label(), key.beta, by_seed, cells[key.baseline()], steps)
            out += [_raw_kl_note(key) for key in sorted({k._replace(beta=0.0, kl_target=None) for k in moved})
                    if key.estimator != DEFAULT_ESTIMATOR]
        out.append("")
    return "\n".join(out)


def cell_text(values: list[float | None], fmt: str) -> str:
    return cell([v for v in values if v is not None], fmt)


def _against(label: str, beta: float, cell: dict, baseline: dict, steps: int, tail: bool = False) -> list[str]:
    """The rows of (c) and (d): Δ final reward and length (TOST at their margins) and Δ final raw KL (95 % only);
    with ``tail`` (c's rows, Amendment 14) Δ of the token tail's final-window means too (95 % only)."""
    rows = [f"| {label} | {beta:g} | {key} | {fmt_equivalence(tost(paired_by_seed(cell, baseline, steps, key), margin))} |"
            for key, margin in (("reward", REWARD_MARGIN), ("length", LENGTH_MARGIN))]
    differences = [("raw KL", "kl")] + ([(label, key) for key, (_, label) in TAIL_METRICS.items()] if tail else [])
    return rows + [f"| {label} | {beta:g} | {name} | {fmt_difference(paired_by_seed(cell, baseline, steps, key))} |"
                   for name, key in differences]


def _raw_kl_note(key: CellKey) -> str:
    """What (d)'s Δ raw KL compares when the two runs log it with different estimators: ``adaptive_kl/raw_kl`` is
    the per-token KL in the loss by the run's own ``kl_estimator``, whatever the placement (docs/kl-placement.md,
    "Metrics")."""
    head = (f"Note on Δ raw KL of {key.label()}: its `adaptive_kl/raw_kl` is the per-token KL in the loss as "
            f"{key.estimator} measures it, the baseline's as {DEFAULT_ESTIMATOR} measures it (docs/kl-placement.md, "
            "\"Metrics\"). ")
    if key.estimator == "k1":
        return head + ("On the policy's own samples (one optimizer step per generation batch, as section 7 runs) k1 "
                       "(log π/π_ref) and k3 are both unbiased for the same per-token KL(π‖π_ref), so the row compares "
                       "the two runs' KL; k1's per-token values can be negative and vary more, which widens the interval.")
    return head + (f"{key.estimator} need not estimate the quantity {DEFAULT_ESTIMATOR} estimates (docs/estimators.md): "
                   "the row compares two measurements, not one KL.")
