"""An independent reanalysis of issue 33's study (docs/evidence/study33-long-task.md) against the doc's printed results.

Recomputes the three tables of section 7's "Results, phase 1: questions (a) and (c)" (the runs: copies, final values
and runaways; (a) the length slope after saturation; (c) each shaping method against `none` at β 0.04) from the raw
streams research/data/study33-p1-*/*-stream.jsonl.gz, from section 7's written definitions alone, and asserts
that every number and verdict in the doc's tables equals the recomputation at the printed precision. It does the same
for "Results, phase 2: questions (d) and (b)", from phase 1's streams and phase 2's
(research/data/study33-p2-*/*-stream.jsonl.gz): the runs table (with β at step 200), (d) (the KL in the reward,
k1, against in the loss, k3), (b) at the low and at the high target (the final KL / kl_target as a geometric mean over
seeds, TOST on its log; Δ reward against the best fixed β), and every number of (b)'s prose at both targets (β_need,
the steps at which β and the KL crossed, the full-rate updates, the step of target's warning included); K_nat, the
best fixed β, the targets (checked against phase 2's committed run lists) and the runs come from the data and the
lists. Independent of the project's analysis: nothing from the harness (research/harness/) is imported; Student-t quantiles come from
bisection on the t CDF (the regularized incomplete beta function by its continued fraction), checked against
textbook values; the thresholds on the reward (a mean of 64 rewards in {0, 0.5, 1}, so a multiple of 1/128) are
compared exactly, in rationals, so a tie with 0.02 or 0.1 is decided by the definition and not by rounding (the
reward's 10-step mean falls by exactly 0.1 at β 0's runaway steps of seeds 1 and 4).

Two conventions of the project's analysis, which the doc states and this test checks both ways: its t quantiles are
the standard table's three decimals (the doc's intervals are printed with them; no verdict changes with the exact
quantiles), and section 7 leaves the 10-step mean at steps 1-9 open (the doc's numbers take the mean of the steps so
far; its second (a) table counts only full windows; no verdict and no runaway changes).
"""

import gzip
import json
import math
import re
import tarfile
from collections import Counter, defaultdict
from dataclasses import dataclass
from fractions import Fraction
from functools import cache, lru_cache
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
EVIDENCE_DOC = ROOT / "docs" / "evidence" / "study33-long-task.md"
PHASE_1_STREAMS = "research/data/study33-p1-*/*-stream.jsonl.gz"
PHASE_2_STREAMS = "research/data/study33-p2-*/*-stream.jsonl.gz"  # never the probe's or genspeed's streams
RESULTS_HEADING = "### Results, phase 1: questions (a) and (c)"
PHASE_2_HEADING = "### Results, phase 2: questions (d) and (b)"

# -- section 7's definitions ("Definitions fixed here", question (a), Amendment 6: S = 200) ---------------------
PLANNED_STEPS = 200
FINAL_WINDOW_FIRST_STEP = 151  # steps 151-200: the last 25 % of the planned steps
TRAILING_STEPS = 10  # the "10-step mean" of the saturation step and of the runaway criterion
SATURATION_GAP = Fraction(2, 100)  # saturated once the 10-step mean reward reaches the final-window mean - 0.02
MIN_STEPS_AFTER_SATURATION = 50  # fewer steps after the saturation step: no slope
RUNAWAY_FIRST_STEP = 20
RUNAWAY_KL_FACTOR = 10  # trailing raw KL above 10 x K_nat
RUNAWAY_REWARD_DROP = Fraction(1, 10)  # trailing reward at least 0.1 below the best trailing reward so far
REWARD_MARGIN, LENGTH_MARGIN, SLOPE_MARGIN = 0.05, 5.0, 5.0
SEEDS = (0, 1, 2, 3, 4)
FIXED_BETAS = (0.0, 0.001, 0.01, 0.04, 0.1, 0.3)  # question (a): `none` at each
SHAPING_BETA = 0.04


def shaping_runs_of_phase_1():
    """Question (c)'s methods, each at β 0.04 against `none` at 0.04, in the order phase 1's `shape` list ran them
    (read from the list rather than spelled out: tests/test_registries.py forbids hand-kept method lists)."""
    text = (ROOT / "research" / "runlists" / "study33-p1-seed0-shape.txt").read_text()
    (runs,) = re.findall(r"--runs (\S+)", text)
    methods = [run.split("@")[0] for run in runs.split(",")]
    assert {float(run.split("@")[1]) for run in runs.split(",")} == {SHAPING_BETA} and "none" not in methods
    return tuple(methods)


SHAPING_METHODS = shaping_runs_of_phase_1()


@dataclass(frozen=True)
class ListedRun:
    """One run of a phase-2 list, `METHOD@BETA[:kt=K][:placement=P][:estimator=E]`, the demo's defaults filled in."""

    method: str
    beta0: float
    kl_target: float | None = None
    kl_placement: str = "loss"
    kl_estimator: str = "k3"


def listed_run(text):
    method_and_beta, *overrides = text.split(":")
    method, beta = method_and_beta.split("@")
    names = {"kt": "kl_target", "placement": "kl_placement", "estimator": "kl_estimator"}
    settings = {names[key]: value for key, value in (override.split("=") for override in overrides)}
    if "kl_target" in settings:
        settings["kl_target"] = float(settings["kl_target"])
    return ListedRun(method, float(beta), **settings)


@lru_cache(maxsize=1)
def phase_2_lists():
    """Phase 2's committed lists, the same runs for every seed: {'a': runs, 'b': runs} (Amendment 10: `a` holds
    `target` from each β0 at the low target and (d)'s run, `b` `target` from each β0 at the high target)."""
    lists_by_seed = defaultdict(dict)
    for path in sorted((ROOT / "research" / "runlists").glob("study33-p2-seed*-*.txt")):
        seed, letter = re.fullmatch(r"study33-p2-seed(\d+)-(\w+)\.txt", path.name).groups()
        (runs,) = re.findall(r"--runs (\S+)", path.read_text())
        lists_by_seed[int(seed)][letter] = tuple(map(listed_run, runs.split(",")))
    assert sorted(lists_by_seed) == list(SEEDS)
    (lists,) = {tuple(sorted(lists.items())) for lists in lists_by_seed.values()}
    return dict(lists)


def target_method():
    """The method of the runs that name a `kl_target` (read from the lists, not spelled out)."""
    (method,) = {run.method for runs in phase_2_lists().values() for run in runs if run.kl_target is not None}
    return method


def placement_run():
    """(d)'s run: the one listed run with the KL in the reward."""
    (run,) = [run for runs in phase_2_lists().values() for run in runs if run.kl_placement == "reward"]
    return run


def target_starts(kl_target):
    """The β0s from which the lists start `target` at kl_target, in the lists' order."""
    return tuple(run.beta0 for runs in phase_2_lists().values() for run in runs if run.kl_target == kl_target)

REWARD, LENGTH, RAW_KL = "reward", "completions/mean_length", "adaptive_kl/raw_kl"
BETA, MIN_LENGTH = "adaptive_kl/current_beta", "completions/min_length"
TAIL_P99, TAIL_MAX, TAIL_SHARE = ("adaptive_kl/token_kl_p99", "adaptive_kl/token_kl_max",
                                  "adaptive_kl/token_kl_top1pct_share")
# (c)'s rows: the doc's quantity name, the stream field, the TOST margin (None: 95 % interval only), decimals printed
SHAPING_QUANTITIES = (("reward", REWARD, REWARD_MARGIN, 3), ("length", LENGTH, LENGTH_MARGIN, 3),
                      ("raw KL", RAW_KL, None, 4), ("token KL p99", TAIL_P99, None, 4),
                      ("token KL max", TAIL_MAX, None, 4), ("token KL top-1 % share", TAIL_SHARE, None, 4))


# -- Student's t quantiles, from the t CDF ----------------------------------------------------------------------
def regularized_incomplete_beta(x, a, b):
    """I_x(a, b) by the continued fraction of Abramowitz & Stegun 26.5.8, evaluated with the modified Lentz method;
    where it converges slowly (x above (a + 1) / (a + b + 2)) through I_x(a, b) = 1 - I_{1-x}(b, a)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - regularized_incomplete_beta(1.0 - x, b, a)
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 500):
        # the even term d_2m, then the odd term d_2m+1 of the continued fraction
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return math.exp(log_front) * fraction / a


def student_t_cdf(t, degrees_of_freedom):
    """P(T <= t) for Student's t: the tail beyond |t| is I_{ν / (ν + t²)}(ν / 2, 1 / 2) / 2."""
    tail = 0.5 * regularized_incomplete_beta(degrees_of_freedom / (degrees_of_freedom + t * t),
                                             degrees_of_freedom / 2.0, 0.5)
    return 1.0 - tail if t >= 0 else tail


def student_t_quantile(probability, degrees_of_freedom):
    """The t with P(T <= t) = probability (probability > 0.5), by bisection on the CDF."""
    low, high = 0.0, 1e4
    for _ in range(200):
        middle = 0.5 * (low + high)
        if student_t_cdf(middle, degrees_of_freedom) < probability:
            low = middle
        else:
            high = middle
    return 0.5 * (low + high)


@pytest.mark.parametrize("probability, degrees_of_freedom, textbook", [
    (0.975, 4, 2.776), (0.95, 4, 2.132), (0.975, 1, 12.706), (0.95, 2, 2.920), (0.975, 30, 2.042),
    (0.995, 10, 3.169)])
def test_the_t_quantile_matches_the_textbook_table(probability, degrees_of_freedom, textbook):
    assert round(student_t_quantile(probability, degrees_of_freedom), 3) == textbook


def test_the_t_cdf_is_the_integral_of_the_t_density():
    # a second route: the density integrated by the trapezoid rule on a fine grid from 0
    for degrees_of_freedom, t in ((4, 2.776), (3, 1.0), (7, 0.4)):
        grid = np.linspace(0.0, t, 200_001)
        log_norm = (math.lgamma((degrees_of_freedom + 1) / 2) - math.lgamma(degrees_of_freedom / 2)
                    - 0.5 * math.log(degrees_of_freedom * math.pi))
        density = np.exp(log_norm) * (1 + grid**2 / degrees_of_freedom) ** (-(degrees_of_freedom + 1) / 2)
        integral = float(np.sum((density[1:] + density[:-1]) * np.diff(grid)) / 2)
        assert student_t_cdf(t, degrees_of_freedom) == pytest.approx(0.5 + integral, abs=1e-9)


# -- the streams: every copy of every run ------------------------------------------------------------------------
@dataclass
class Copy:
    """One start of a run (method, β0, seed): its per-step series, steps 1 to last_step without a gap."""

    method: str
    beta0: float
    seed: int
    copy_id: str
    last_step: int
    series: dict  # field -> float64 array by step (NaN where the row lacks the field)
    exact_reward: list  # the rewards as Fractions (exact: the floats are multiples of 1/128)
    # phase 2's settings: the target of a `target` run (None for other methods, whose rows carry the unused default),
    # where the KL sits and its estimator (phase-1 rows lack them: the loss and k3, section 7's settings)
    kl_target: float | None = None
    kl_placement: str = "loss"
    kl_estimator: str = "k3"
    # the demo's recorded n (completions per optimizer step) and kl_horizon: `target`'s full-rate factor 1 ± 0.2 n / h
    completions_per_step: int | None = None
    kl_horizon: float | None = None

    def final_value(self, field):
        """Mean over the final window's steps the copy made; None if it was cut before the window or lacks field."""
        if self.last_step < FINAL_WINDOW_FIRST_STEP:
            return None
        window = self.series[field][FINAL_WINDOW_FIRST_STEP - 1:PLANNED_STEPS]
        if np.isnan(window).any():
            assert np.isnan(window).all(), (self.method, self.beta0, self.seed, self.copy_id, field)
            return None
        return float(window.mean())


def only_value(rows, field, absent=None):
    (value,) = {row.get(field, absent) for row in rows}
    return value


@cache
def read_copies(pattern):
    rows_by_copy = defaultdict(list)
    for path in sorted(ROOT.glob(pattern)):
        with gzip.open(path, "rt") as stream:
            for line in stream:
                row = json.loads(line)
                rows_by_copy[(row["tag"], row["method"], row["seed"], row["copy"])].append(row)
    copies = []
    fields = (REWARD, LENGTH, RAW_KL, TAIL_P99, TAIL_MAX, TAIL_SHARE, BETA, MIN_LENGTH)
    for (_tag, method, seed, copy_id), rows in rows_by_copy.items():
        rows.sort(key=lambda row: row["step"])
        steps = [row["step"] for row in rows]
        assert steps == list(range(1, len(rows) + 1)), f"copy {copy_id}: steps are not 1..n without a gap"
        assert {row["planned_steps"] for row in rows} == {PLANNED_STEPS}
        (beta0,) = {row["beta0"] for row in rows}
        series = {field: np.array([np.nan if row.get(field) is None else row[field] for row in rows], dtype=float)
                  for field in fields}
        exact_reward = [Fraction(row[REWARD]) for row in rows]
        assert all((128 * reward).denominator == 1 for reward in exact_reward), f"copy {copy_id}: reward not k/128"
        kl_target = only_value(rows, "kl_target") if method == target_method() else None
        copies.append(Copy(method, beta0, seed, copy_id, len(rows), series, exact_reward, kl_target,
                           only_value(rows, "kl_placement", "loss"), only_value(rows, "kl_estimator", "k3"),
                           only_value(rows, "completions_per_step"), only_value(rows, "kl_horizon")))
    return copies


def study_copies():
    """Phase 1's copies: `none` at the fixed β and the shaping methods, the KL in the loss (k3)."""
    return read_copies(PHASE_1_STREAMS)


def phase_2_copies():
    """Phase 2's copies: `target` at both targets from each β0, and (d)'s `none` with the KL in the reward (k1)."""
    return read_copies(PHASE_2_STREAMS)


def copies_of(method, beta0):
    return [copy for copy in study_copies() if copy.method == method and copy.beta0 == beta0]


def seed_values(copies, value_of):
    """A seed's value: the mean over its copies that have one (section 7: every copy counts as a draw)."""
    values_by_seed = defaultdict(list)
    for copy in copies:
        value = value_of(copy)
        if value is not None:
            values_by_seed[copy.seed].append(value)
    return {seed: float(np.mean(values)) for seed, values in values_by_seed.items()}


def seed_finals(copies, field):
    """{seed: final value of field} over copies (phase 1's cells and phase 2's runs alike)."""
    return seed_values(copies, lambda copy: copy.final_value(field))


def mean_over_seeds(values_by_seed):
    return float(np.mean(list(values_by_seed.values())))


def seed_final_values(method, beta0, field):
    return seed_finals(copies_of(method, beta0), field)


def cell_mean(method, beta0, field):
    return mean_over_seeds(seed_final_values(method, beta0, field))


@lru_cache(maxsize=1)
def natural_kl():
    """K_nat: the seed-mean final raw KL of `none` at the fixed β > 0 with the highest seed-mean final reward."""
    best_beta = max((beta for beta in FIXED_BETAS if beta > 0), key=lambda beta: cell_mean("none", beta, REWARD))
    return best_beta, cell_mean("none", best_beta, RAW_KL)


def runaway_kl_threshold():
    return RUNAWAY_KL_FACTOR * natural_kl()[1]


# -- the 10-step trailing means, saturation, slope, runaway ---------------------------------------------------------
# Section 7 does not say what "the 10-step mean" is at steps 1-9. Two readings: "fewer at the start" (the mean of the
# steps so far, so step 1's mean is its own reward) and "full windows" (no 10-step mean before step 10). The doc's
# numbers follow the first (the project's analysis, `trailing_means`, does); the literal second moves saturation
# from steps 1-8 to step 10 in most runs and changes every slope of table (a), though no verdict and no runaway
# (test_the_verdicts_and_runaways_do_not_depend_on_the_reading_of_the_first_steps). Reported to the lead as an
# ambiguity; the tables are checked under the reading the doc used.
FEWER_AT_THE_START, FULL_WINDOWS = "fewer at the start", "full windows"
DOC_READING = FEWER_AT_THE_START


def trailing_means(values, reading):
    """{step: exact mean of the 10 values ending at step}; before step 10 the mean of the steps so far (fewer at the
    start) or nothing (full windows)."""
    first_step = 1 if reading == FEWER_AT_THE_START else TRAILING_STEPS
    return {step: sum(values[max(0, step - TRAILING_STEPS):step]) / min(step, TRAILING_STEPS)
            for step in range(first_step, len(values) + 1)}


def saturation_step(copy, reading=DOC_READING):
    """The first step whose 10-step mean reward reaches the final-window mean - 0.02; None without a final window."""
    if copy.last_step < FINAL_WINDOW_FIRST_STEP:
        return None
    window = copy.exact_reward[FINAL_WINDOW_FIRST_STEP - 1:PLANNED_STEPS]
    threshold = sum(window) / len(window) - SATURATION_GAP
    for step, mean_reward in trailing_means(copy.exact_reward, reading).items():
        if mean_reward >= threshold:
            return step
    return None


def length_slope(copy, reading=DOC_READING):
    """Least-squares slope of the mean length from the saturation step to the last step, tokens per 100 steps; None
    when fewer than 50 steps follow the saturation step (last step - saturation step < 50)."""
    saturated_at = saturation_step(copy, reading)
    if saturated_at is None or copy.last_step - saturated_at < MIN_STEPS_AFTER_SATURATION:
        return None
    steps = np.arange(saturated_at, copy.last_step + 1, dtype=float)
    lengths = copy.series[LENGTH][saturated_at - 1:copy.last_step]
    centred = steps - steps.mean()
    return 100.0 * float(np.sum(centred * (lengths - lengths.mean())) / np.sum(centred * centred))


def runaway_step(copy, kl_threshold, reading=DOC_READING):
    """The first step >= 20 whose 10-step mean reward is at least 0.1 below the highest 10-step mean reached so far
    while (β > 0) its 10-step mean raw KL exceeds kl_threshold; None if there is none."""
    kl = copy.series[RAW_KL]
    best_mean_reward = None
    for step, mean_reward in trailing_means(copy.exact_reward, reading).items():
        best_mean_reward = mean_reward if best_mean_reward is None else max(best_mean_reward, mean_reward)
        if step < RUNAWAY_FIRST_STEP:
            continue
        reward_fell = best_mean_reward - mean_reward >= RUNAWAY_REWARD_DROP
        kl_high = copy.beta0 == 0 or float(np.mean(kl[step - TRAILING_STEPS:step])) > kl_threshold
        if reward_fell and kl_high:
            return step
    return None


# -- t intervals and verdicts ---------------------------------------------------------------------------------------
@dataclass
class Interval:
    mean: float
    low90: float
    high90: float
    low95: float
    high95: float


# The doc's intervals use the standard t table's three decimals (analysis.tost's convention, stated in the doc);
# None: the exact quantiles.
DOC_T_DECIMALS = 3


def t_quantile(probability, degrees_of_freedom, decimals):
    exact = student_t_quantile(probability, degrees_of_freedom)
    return exact if decimals is None else round(exact, decimals)


def t_interval(values, t_decimals=DOC_T_DECIMALS):
    n = len(values)
    mean = float(np.mean(values))
    standard_error = float(np.std(values, ddof=1)) / math.sqrt(n)
    q90, q95 = t_quantile(0.95, n - 1, t_decimals), t_quantile(0.975, n - 1, t_decimals)
    return Interval(mean, mean - q90 * standard_error, mean + q90 * standard_error,
                    mean - q95 * standard_error, mean + q95 * standard_error)


def tost_verdict(interval, margin):
    """Equivalent: the 90 % interval inside ±margin; different: the 95 % interval excludes 0."""
    equivalent = -margin < interval.low90 and interval.high90 < margin
    different = interval.low95 > 0 or interval.high95 < 0
    if equivalent and different:
        return "equivalent, and different from 0"
    return "equivalent" if equivalent else "different" if different else "inconclusive"


def difference_verdict(interval):
    return "different" if interval.low95 > 0 or interval.high95 < 0 else "not different"


def fixed(value, decimals):
    return f"{value:.{decimals}f}"


def interval_text(low, high, decimals):
    return f"[{fixed(low, decimals)}, {fixed(high, decimals)}]"


# -- the doc's tables --------------------------------------------------------------------------------------------
def read_evidence_doc():
    return EVIDENCE_DOC.read_text(encoding="utf-8")


def doc_section(heading):
    """The doc's text from heading to the next heading of level 2 or 3."""
    text = read_evidence_doc()
    start = text.index(heading)
    following = re.search(r"^#{2,3} ", text[start + len(heading):], flags=re.MULTILINE)
    return text[start:start + len(heading) + following.start()] if following else text[start:]


def results_section():
    return doc_section(RESULTS_HEADING)


def markdown_tables(text):
    """Every pipe table of text as (header cells, rows of cells), the separator row dropped; a table indented into
    a list item too."""
    tables, lines = [], []
    for line in (line.strip() for line in text.splitlines() + [""]):
        if line.startswith("|"):
            lines.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif lines:
            tables.append((lines[0], lines[2:]))
            lines = []
    return tables


def results_table(first_header_cells, heading=RESULTS_HEADING):
    matching = [rows for header, rows in markdown_tables(doc_section(heading))
                if header[:len(first_header_cells)] == list(first_header_cells)]
    assert len(matching) == 1, f"expected one table headed {first_header_cells} in {heading!r}"
    return matching[0]


def plain(cell):
    return cell.replace("**", "").replace("`", "").strip()


def parse_runaways(cell):
    """'0' or 'N: seed S step T, seed S step T (both copies), ...' -> (N, Counter of (seed, step) per copy)."""
    if cell == "0":
        return 0, Counter()
    count, listing = cell.split(": ", 1)
    steps = Counter()
    for item in listing.split(", "):
        match = re.fullmatch(r"seed (\d+) step (\d+)( \(both copies\))?", item)
        assert match, f"runaway entry not understood: {item!r}"
        steps[(int(match[1]), int(match[2]))] += 2 if match[3] else 1
    return int(count), steps


# -- table 1: the runs --------------------------------------------------------------------------------------------
def study_cells():
    return [("none", beta) for beta in FIXED_BETAS] + [(method, SHAPING_BETA) for method in SHAPING_METHODS]


def mean_and_sd_text(values_by_seed, decimals):
    assert sorted(values_by_seed) == list(SEEDS)
    values = list(values_by_seed.values())
    return f"{fixed(np.mean(values), decimals)} ± {fixed(np.std(values, ddof=1), decimals)}"


def runaway_steps_of(method, beta, reading=DOC_READING):
    """Counter of (seed, runaway step) over the cell's copies, cut copies included."""
    kl_threshold = runaway_kl_threshold()
    return Counter((copy.seed, step) for copy in copies_of(method, beta)
                   if (step := runaway_step(copy, kl_threshold, reading)) is not None)


def mismatches(where, columns, documented, recomputed):
    return [f"{where}, {column}: doc {doc!r}, recomputed {mine!r}"
            for column, doc, mine in zip(columns, documented, recomputed) if doc != mine]


def test_the_runs_table_matches_the_streams():
    rows = results_table(["method", "β0", "copies (complete)"])
    best_beta, _ = natural_kl()
    columns = ("copies (complete)", "best", "final reward", "final length", "final KL", "runaways")
    found = []
    for method_cell, beta_cell, copies_cell, reward_cell, length_cell, kl_cell, runaway_cell in rows:
        method, beta_text = plain(method_cell), plain(beta_cell)
        is_best = beta_text.endswith(" (best)")
        beta = float(beta_text.removesuffix(" (best)"))
        copies = copies_of(method, beta)
        complete = [copy for copy in copies if copy.last_step == PLANNED_STEPS]
        kl_text = "—"
        if beta > 0:
            kl_text = mean_and_sd_text(seed_final_values(method, beta, RAW_KL), 4)
            kl_text += " (K_nat)" if (method, beta) == ("none", best_beta) else ""
        runaways = runaway_steps_of(method, beta)
        recomputed = (f"{len(copies)} ({len(complete)})", (method, beta) == ("none", best_beta),
                      mean_and_sd_text(seed_final_values(method, beta, REWARD), 3),
                      mean_and_sd_text(seed_final_values(method, beta, LENGTH), 1), kl_text,
                      (sum(runaways.values()), runaways))
        documented = (copies_cell, is_best, plain(reward_cell), plain(length_cell), plain(kl_cell),
                      parse_runaways(runaway_cell))
        found += mismatches(f"{method} β {beta}", columns, documented, recomputed)
    assert [(plain(row[0]), float(plain(row[1]).removesuffix(" (best)"))) for row in rows] == study_cells()
    assert not found, "\n".join(found)
    assert f"10 × K_nat = {runaway_kl_threshold():.3f}" in results_section()


def test_the_counts_of_runs_seeds_and_copies_match_the_streams():
    # 60 copies: 45 complete ones, seed 0's nine of its one cut call, seed 2's six of its cut `none` call (the doc
    # said 63 before this test; the table's own "copies" column adds up to 6 x 7 + 3 x 6)
    runs = {(copy.method, copy.beta0, copy.seed) for copy in study_copies()}
    seeds = {copy.seed for copy in study_copies()}
    assert sorted(seeds) == list(SEEDS)
    assert f"{len(runs)} runs, {len(seeds)} seeds, {len(study_copies())} copies" in results_section()


# -- table (a): the length slope after saturation -------------------------------------------------------------------
def slope_row(beta, reading=DOC_READING, t_decimals=DOC_T_DECIMALS):
    """(seeds, mean, 90 % CI, 95 % CI, verdict) of table (a), as the doc prints them."""
    slopes = seed_values(copies_of("none", beta), lambda copy: length_slope(copy, reading))
    interval = t_interval(list(slopes.values()), t_decimals)
    return (str(len(slopes)), fixed(interval.mean, 2), interval_text(interval.low90, interval.high90, 2),
            interval_text(interval.low95, interval.high95, 2), tost_verdict(interval, SLOPE_MARGIN))


@pytest.mark.parametrize("first_header_cell, reading", [("β", FEWER_AT_THE_START),
                                                         ("β, full windows only", FULL_WINDOWS)])
def test_the_slope_tables_match_the_streams(first_header_cell, reading):
    rows = results_table([first_header_cell, "seeds", "slope: mean"])
    assert [float(row[0]) for row in rows] == list(FIXED_BETAS)
    columns = ("seeds", "slope: mean", "90 % CI", "95 % CI", "verdict")
    found = []
    for beta_cell, *documented in rows:
        found += mismatches(f"β {beta_cell} ({reading})", columns, documented, slope_row(float(beta_cell), reading))
    assert not found, "\n".join(found)


def test_the_verdicts_and_runaways_do_not_depend_on_the_reading_of_the_first_steps():
    for beta in FIXED_BETAS:
        assert slope_row(beta, FULL_WINDOWS)[4] == slope_row(beta, FEWER_AT_THE_START)[4], f"β {beta}"
    for method, beta in study_cells():
        assert runaway_steps_of(method, beta, FULL_WINDOWS) == runaway_steps_of(method, beta, FEWER_AT_THE_START)


# -- table (c): each shaping method against `none` at β 0.04 ---------------------------------------------------------
def paired_difference_row(treated, baseline, margin, decimals, t_decimals=DOC_T_DECIMALS):
    """(Δ mean, 90 % CI, 95 % CI, verdict) of seed values {seed: value} paired by seed, as (c), (d) and (b)'s reward
    print them: TOST at the margin, or with no margin ('—' for the 90 % CI) the 95 % interval alone."""
    assert sorted(treated) == sorted(baseline) == list(SEEDS)
    interval = t_interval([treated[seed] - baseline[seed] for seed in SEEDS], t_decimals)
    ci90 = "—" if margin is None else interval_text(interval.low90, interval.high90, decimals)
    verdict = difference_verdict(interval) if margin is None else tost_verdict(interval, margin)
    return fixed(interval.mean, decimals), ci90, interval_text(interval.low95, interval.high95, decimals), verdict


def shaping_row(method, name, t_decimals=DOC_T_DECIMALS):
    """(Δ mean, 90 % CI, 95 % CI, verdict) of table (c), as the doc prints them."""
    field, margin, decimals = {q[0]: q[1:] for q in SHAPING_QUANTITIES}[name]
    return paired_difference_row(seed_final_values(method, SHAPING_BETA, field),
                                 seed_final_values("none", SHAPING_BETA, field), margin, decimals, t_decimals)


def test_the_shaping_table_matches_the_streams():
    rows = results_table(["method", "quantity", "Δ mean"])
    expected_keys = [(method, name) for method in SHAPING_METHODS for name, *_ in SHAPING_QUANTITIES]
    assert [(plain(row[0]), row[1]) for row in rows] == expected_keys
    columns = ("Δ mean", "90 % CI", "95 % CI", "verdict")
    found = []
    for method_cell, name, *documented in rows:
        found += mismatches(f"{plain(method_cell)} {name}", columns, documented, shaping_row(plain(method_cell), name))
    assert not found, "\n".join(found)


def test_the_t_tables_rounding_moves_only_last_digits_and_no_verdict():
    # the doc's statement: with the exact quantiles 11 of (c)'s intervals move in their last printed digit, no verdict
    moved = 0
    for method, name in [(method, q[0]) for method in SHAPING_METHODS for q in SHAPING_QUANTITIES]:
        rounded, exact = shaping_row(method, name), shaping_row(method, name, t_decimals=None)
        assert rounded[3] == exact[3], (method, name)
        moved += sum(mine != theirs for mine, theirs in zip(rounded[1:3], exact[1:3]))
    assert moved == 11
    for beta in FIXED_BETAS:
        for reading in (FEWER_AT_THE_START, FULL_WINDOWS):
            assert slope_row(beta, reading)[4] == slope_row(beta, reading, t_decimals=None)[4]
    assert "with the exact quantiles (2.77645, 2.13185) 11 of (c)'s intervals move" in read_evidence_doc()
    assert (f"{student_t_quantile(0.975, 4):.5f}, {student_t_quantile(0.95, 4):.5f}") == "2.77645, 2.13185"


# -- the descriptive table: each run's best 10-step reward and how far its final window fell below it ------------------
def best_and_fall(copy):
    """(best full-window 10-step mean reward, its first step, best - final-window mean) of a complete copy, exactly."""
    means = trailing_means(copy.exact_reward, FULL_WINDOWS)
    best = max(means.values())
    step = min(step for step, mean in means.items() if mean == best)
    window = copy.exact_reward[FINAL_WINDOW_FIRST_STEP - 1:PLANNED_STEPS]
    return best, step, best - sum(window) / len(window)


def test_the_reward_peak_table_matches_the_streams():
    rows = results_table(["method", "β0", "copies", "best 10-step reward (mean)"])
    assert [(plain(row[0]), float(row[1])) for row in rows] == study_cells()
    columns = ("copies", "best 10-step reward (mean)", "at steps", "fall: mean", "fall: range")
    found, every_best = [], []
    for method_cell, beta_cell, *documented in rows:
        complete = [copy for copy in copies_of(plain(method_cell), float(beta_cell)) if copy.last_step == PLANNED_STEPS]
        assert sorted(copy.seed for copy in complete) == list(SEEDS)  # one complete copy a run
        bests, steps, falls = zip(*map(best_and_fall, complete))
        every_best += bests
        recomputed = (str(len(complete)), fixed(float(np.mean(bests)), 3), f"{min(steps)}-{max(steps)}",
                      fixed(float(np.mean(falls)), 3), f"{fixed(float(min(falls)), 3)}-{fixed(float(max(falls)), 3)}")
        found += mismatches(f"{method_cell} β {beta_cell}", columns, documented, recomputed)
    assert not found, "\n".join(found)
    assert (fixed(float(min(every_best)), 2), fixed(float(max(every_best)), 2)) == ("0.80", "0.87")
    assert "Every run reached a 10-step reward of 0.80-0.87" in results_section().replace("\n  ", " ")


def test_the_pinned_length_statement_matches_the_streams():
    # "Every complete copy that did not run away ends at 122.9-124.2 tokens (as do 6 of the 11 that did)"
    kl_threshold = runaway_kl_threshold()
    calm, ran_away = [], []
    for copy in study_copies():
        if copy.last_step == PLANNED_STEPS:
            (ran_away if runaway_step(copy, kl_threshold) is not None else calm).append(copy.final_value(LENGTH))
    low, high = fixed(min(calm), 1), fixed(max(calm), 1)
    inside = sum(float(low) <= round(length, 1) <= float(high) for length in ran_away)
    statement = f"ends at {low}-{high} tokens (as do {inside} of the {len(ran_away)} that did)"
    assert statement in results_section().replace("\n  ", " ")


# == phase 2: questions (d) and (b) ====================================================================================
# Section 7 and Amendments 10 and 12: phase 2's targets are 0.25 x and 4 x K_nat at 2 significant digits; (d) is
# `none` at β 0.04 with the KL in the reward (k1) against phase 1's `none` at 0.04 (in the loss, k3), with (c)'s
# tests; (b)'s "holds" is TOST on the log of the final KL / kl_target by seed, margin ±ln 1.25 ("different" when
# the 95 % interval excludes 0), and its reward the Δ final reward against `none` at the best fixed β by seed, ±0.05.
LOW_TARGET_FACTOR, HIGH_TARGET_FACTOR = 0.25, 4.0
# the targets whose (b) rows the doc reports, in the runs table's order: phase 2 is complete (Amendment 16)
REPORTED_TARGET_FACTORS = (LOW_TARGET_FACTOR, HIGH_TARGET_FACTOR)
LOG_RATIO_MARGIN = math.log(1.25)
EARLY_STEPS = (1, 50)  # the prose's "steps 1-50", against the final window's 151-200


def significant(value, digits=2):
    return float(f"{value:.{digits}g}")


def target_of(factor):
    """factor x K_nat, rounded to 2 significant digits (section 7)."""
    return significant(factor * natural_kl()[1])


def phase_2_copies_of(run):
    return [copy for copy in phase_2_copies()
            if (copy.method, copy.beta0, copy.kl_target, copy.kl_placement, copy.kl_estimator)
            == (run.method, run.beta0, run.kl_target, run.kl_placement, run.kl_estimator)]


def target_run(kl_target, beta0):
    return ListedRun(target_method(), beta0, kl_target)


def reported_runs():
    """The runs table's rows, in its order: (d)'s run, then `target` from each β0 at each reported target."""
    return [placement_run()] + [target_run(target_of(factor), beta0) for factor in REPORTED_TARGET_FACTORS
                                for beta0 in target_starts(target_of(factor))]


def run_seed_finals(run, field):
    return seed_finals(phase_2_copies_of(run), field)


def betas_at_the_end(run):
    """Each complete copy's β at step 200 (its last row's adaptive_kl/current_beta)."""
    return [float(copy.series[BETA][PLANNED_STEPS - 1]) for copy in phase_2_copies_of(run)
            if copy.last_step == PLANNED_STEPS]


# -- the runs table ---------------------------------------------------------------------------------------------
def beta_text(value):
    """A β as the doc prints it: 2 significant digits."""
    return f"{value:.2g}"


def range_text(values, text=beta_text):
    low, high = text(min(values)), text(max(values))
    return low if low == high else f"{low}-{high}"


def run_label(run):
    """The runs table's method cell, backticks dropped: the method, and where the KL sits when not in the loss."""
    if run.kl_placement == "loss":
        return run.method
    return f"{run.method}, KL in the {run.kl_placement} ({run.kl_estimator})"


def phase_2_runs_row(run):
    """(method, β0, kl_target, copies, final reward, final length, final KL, β at step 200, runaways) as printed, the
    runaways parsed."""
    copies = phase_2_copies_of(run)
    complete = [copy for copy in copies if copy.last_step == PLANNED_STEPS]
    kl_threshold = runaway_kl_threshold()
    runaways = Counter((copy.seed, step) for copy in copies
                       if (step := runaway_step(copy, kl_threshold)) is not None)
    return (run_label(run), f"{run.beta0:g}", "—" if run.kl_target is None else f"{run.kl_target:g}",
            f"{len(copies)} ({len(complete)})", mean_and_sd_text(run_seed_finals(run, REWARD), 3),
            mean_and_sd_text(run_seed_finals(run, LENGTH), 1), mean_and_sd_text(run_seed_finals(run, RAW_KL), 4),
            range_text(betas_at_the_end(run)), (sum(runaways.values()), runaways))


# the two (b) tables share their header: each is the table that follows its bold paragraph
LOW_TARGET_MARKER, HIGH_TARGET_MARKER = "**(b) `target` at the low target**", "**(b) `target` at the high target**"


def phase_2_table(first_header_cells, after=None):
    """The one table of phase 2's section headed first_header_cells; with `after`, the first table following the one
    paragraph that starts with it, which must be headed first_header_cells."""
    if after is None:
        return results_table(first_header_cells, PHASE_2_HEADING)
    section = doc_section(PHASE_2_HEADING)
    assert section.count(after) == 1, f"expected {after!r} once in {PHASE_2_HEADING!r}"
    header, rows = markdown_tables(section[section.index(after):])[0]
    assert header[:len(first_header_cells)] == list(first_header_cells), f"the table after {after!r}: {header}"
    return rows


def phase_2_prose():
    """The section's text with its wrapped lines joined (a bullet's continuation lines are indented)."""
    return re.sub(r"\n[ \t]*(?=\S)", " ", doc_section(PHASE_2_HEADING))


def test_the_phase_2_lists_start_from_phase_1s_targets():
    # Amendment 12: the lists were written from phase 1's K_nat; recomputed here, they name the same targets
    lists = phase_2_lists()
    assert {run.kl_target for run in lists["a"] if run.kl_target is not None} == {target_of(LOW_TARGET_FACTOR)}
    assert {run.kl_target for run in lists["b"]} == {target_of(HIGH_TARGET_FACTOR)}
    assert target_starts(target_of(LOW_TARGET_FACTOR)) == target_starts(target_of(HIGH_TARGET_FACTOR))
    assert (placement_run().method, placement_run().beta0) == ("none", SHAPING_BETA)
    assert f"`kl_target` {target_of(LOW_TARGET_FACTOR):g} = {LOW_TARGET_FACTOR:g} × K_nat" in phase_2_prose()


def test_every_reported_phase_2_run_has_one_complete_copy_a_seed():
    for run in reported_runs():
        assert sorted(copy.seed for copy in phase_2_copies_of(run)) == list(SEEDS), run
        assert all(copy.last_step == PLANNED_STEPS for copy in phase_2_copies_of(run)), run
    assert "every phase-2 run has one copy, complete" in phase_2_prose()


def test_the_phase_2_runs_table_matches_the_streams():
    rows = phase_2_table(["method", "β0", "`kl_target`", "copies (complete)"])
    columns = ("method", "β0", "kl_target", "copies (complete)", "final reward", "final length", "final KL",
               "β at step 200", "runaways")
    assert len(rows) == len(reported_runs())
    found = []
    for row, run in zip(rows, reported_runs()):
        documented = [plain(cell) for cell in row[:-1]] + [parse_runaways(row[-1])]
        found += mismatches(f"{run_label(run)} β0 {run.beta0:g}", columns, documented, phase_2_runs_row(run))
    assert not found, "\n".join(found)


def test_the_phase_1_comparison_line_matches_the_streams():
    best_beta, _ = natural_kl()
    finals = [[mean_and_sd_text(seed_final_values("none", beta, field), places)
               for field, places in ((REWARD, 3), (LENGTH, 1), (RAW_KL, 4))] for beta in (SHAPING_BETA, best_beta)]
    assert (f"`none` at β {SHAPING_BETA:g} (KL in the loss, k3) {', '.join(finals[0])}; at the best fixed β "
            f"{best_beta:g}, {', '.join(finals[1])} (K_nat)") in phase_2_prose()


# -- (d): the KL in the reward (k1) against in the loss (k3), `none` at β 0.04 ------------------------------------
PLACEMENT_QUANTITIES = tuple(q for q in SHAPING_QUANTITIES if q[1] in (REWARD, LENGTH, RAW_KL))  # no tail (Amdt 14)


def placement_row(name, t_decimals=DOC_T_DECIMALS):
    field, margin, decimals = {q[0]: q[1:] for q in PLACEMENT_QUANTITIES}[name]
    return paired_difference_row(run_seed_finals(placement_run(), field),
                                 seed_final_values("none", placement_run().beta0, field), margin, decimals,
                                 t_decimals)


def test_the_placement_table_matches_the_streams():
    rows = phase_2_table(["quantity", "Δ mean", "90 % CI"])
    assert [row[0] for row in rows] == [q[0] for q in PLACEMENT_QUANTITIES]
    columns = ("Δ mean", "90 % CI", "95 % CI", "verdict")
    found = []
    for name, *documented in rows:
        found += mismatches(name, columns, documented, placement_row(name))
    assert not found, "\n".join(found)


def test_the_placement_prose_matches_the_streams():
    reward, length = placement_row("reward"), placement_row("length")
    reward_reach = max(abs(float(bound)) for bound in reward[1].strip("[]").split(", "))
    prose = phase_2_prose()
    assert f"the reward is equivalent within ±{reward_reach:.3f} (90 %)" in prose
    assert float(length[0]) < 0 and f"the length is shorter by {-float(length[0]):.1f} tokens" in prose


# -- (b): `target` at a target, from each β0 ------------------------------------------------------------------------
def log_ratios(run):
    """{seed: ln(final KL / kl_target)}."""
    return {seed: math.log(kl / run.kl_target) for seed, kl in run_seed_finals(run, RAW_KL).items()}


def target_row(kl_target, beta0, t_decimals=DOC_T_DECIMALS):
    """(seeds, KL / kl_target, log ratio's 90 % CI exponentiated, verdict, Δ reward, 90 % CI, 95 % CI, verdict) of a
    (b) table's row, as the doc prints them; any kl_target and β0 (both targets' tables use it)."""
    run = target_run(kl_target, beta0)
    ratios = log_ratios(run)
    interval = t_interval(list(ratios.values()), t_decimals)
    best_beta, _ = natural_kl()
    reward = paired_difference_row(run_seed_finals(run, REWARD), seed_final_values("none", best_beta, REWARD),
                                   REWARD_MARGIN, 3, t_decimals)
    return (str(len(ratios)), fixed(math.exp(interval.mean), 2),
            interval_text(math.exp(interval.low90), math.exp(interval.high90), 2),
            tost_verdict(interval, LOG_RATIO_MARGIN), *reward)


def target_table_matches_the_streams(factor, marker):
    """Every cell of the (b) table after marker against target_row at factor x K_nat."""
    kl_target = target_of(factor)
    columns = ("seeds", "KL / kl_target", "log ratio: 90 % CI", "verdict", "Δ reward", "90 % CI", "95 % CI", "verdict")
    rows = phase_2_table(["β0", *columns], after=marker)
    assert [float(row[0]) for row in rows] == list(target_starts(kl_target))
    found = []
    for beta_cell, *documented in rows:
        found += mismatches(f"β0 {beta_cell}", columns, documented, target_row(kl_target, float(beta_cell)))
    assert not found, "\n".join(found)


def test_the_low_target_table_matches_the_streams():
    target_table_matches_the_streams(LOW_TARGET_FACTOR, LOW_TARGET_MARKER)
    best_beta = natural_kl()[0]
    assert f"Δ final reward against the best fixed β {best_beta:g}, margin ±{REWARD_MARGIN:g}" in phase_2_prose()


def test_the_high_target_table_matches_the_streams():
    target_table_matches_the_streams(HIGH_TARGET_FACTOR, HIGH_TARGET_MARKER)
    high_target = target_of(HIGH_TARGET_FACTOR)
    assert (f"{HIGH_TARGET_MARKER}, `kl_target` {high_target:g} = {HIGH_TARGET_FACTOR:g} × K_nat (the same tests as "
            f"at the low target)") in phase_2_prose()


def test_no_phase_2_verdict_depends_on_the_t_tables_rounding():
    # the doc's intervals use the t table's three decimals ("the t quantiles of phase 1's results"); the exact
    # quantiles move no verdict of (d) or (b)
    for name, *_ in PLACEMENT_QUANTITIES:
        assert placement_row(name)[3] == placement_row(name, t_decimals=None)[3], name
    for factor in (LOW_TARGET_FACTOR, HIGH_TARGET_FACTOR):
        kl_target = target_of(factor)
        for beta0 in target_starts(kl_target):
            rounded, exact = target_row(kl_target, beta0), target_row(kl_target, beta0, t_decimals=None)
            assert (rounded[3], rounded[7]) == (exact[3], exact[7]), (kl_target, beta0)


# -- (b)'s prose: what happened, against the predictions --------------------------------------------------------
def beta_minimum(copy):
    """(the step of β's lowest value, that value) over the copy's steps."""
    betas = copy.series[BETA][:copy.last_step]
    return int(np.argmin(betas)) + 1, float(np.min(betas))


def mean_over_steps(copy, field, first, last):
    return float(np.mean(copy.series[field][first - 1:last]))


def copies_from(kl_target, starts):
    return [copy for beta0 in starts for copy in phase_2_copies_of(target_run(kl_target, beta0))]


def cell_of(run, field):
    return mean_over_seeds(run_seed_finals(run, field))


def decimals(places):
    return lambda value: fixed(value, places)


def low_target_claims():
    """{claim: the sentence fragment of (b)'s prose bullets that the doc must contain, its numbers recomputed}."""
    low_target, (best_beta, natural) = target_of(LOW_TARGET_FACTOR), natural_kl()
    starts = target_starts(low_target)
    lowest, middle, highest = starts  # the prose's grouping: from 0.01 and 0.1 β dips, from 1 it falls
    assert highest == 1.0 and lowest < middle < highest
    every_run = copies_from(low_target, starts)
    final_kls = [copy.final_value(RAW_KL) for copy in every_run]
    end_betas = [float(copy.series[BETA][PLANNED_STEPS - 1]) for copy in every_run]
    growth = [beta / copy.beta0 for beta, copy in zip(end_betas, every_run)]
    dips = [beta_minimum(copy) for copy in copies_from(low_target, (lowest, middle))]
    falls = [beta_minimum(copy) for copy in copies_from(low_target, (highest,))]
    final_window_betas = [mean_over_steps(copy, BETA, FINAL_WINDOW_FIRST_STEP, PLANNED_STEPS)
                          for copy in copies_from(low_target, (lowest,))]
    costly = copies_from(low_target, (middle, highest))  # the runs that lost reward
    early_kls = [mean_over_steps(copy, RAW_KL, *EARLY_STEPS) for copy in costly]
    late_kls = [mean_over_steps(copy, RAW_KL, FINAL_WINDOW_FIRST_STEP, PLANNED_STEPS) for copy in costly]
    # the longest of each final-window step's shortest completion, over every seed from β0 1
    shortest = max(float(np.max(copy.series[MIN_LENGTH][FINAL_WINDOW_FIRST_STEP - 1:PLANNED_STEPS]))
                   for copy in copies_from(low_target, (highest,)))
    reward_delta = {beta0: mean_over_seeds(reward_deltas(target_run(low_target, beta0))) for beta0 in starts}
    final_kl = {beta0: fixed(cell_of(target_run(low_target, beta0), RAW_KL), 3) for beta0 in starts}
    ratios = [kl / low_target for kl in final_kls]
    return {
        "KL ratio": f"Every run ends with its KL {range_text(ratios, decimals(1))} times the target",
        "final KL": f"(final KL {range_text(final_kls, decimals(3))} against {low_target:g})",
        "beta growth": f"β ended {range_text(growth)} times above its start in every run",
        "beta dips": f"from β0 {lowest:g} and {middle:g} it dipped for the first "
                     f"{range_text([step for step, _ in dips], str)} steps",
        "beta falls": f"from β0 {highest:g} it fell until step {range_text([step for step, _ in falls], str)} "
                      f"(to {range_text([beta for _, beta in falls], decimals(2))}) and then rose",
        "beta reached": f"a β rising to {range_text(end_betas)} did not either",
        "reward loss": f"held from β0 {middle:g} and {highest:g} ({fixed(reward_delta[middle], 2)}, "
                       f"{fixed(reward_delta[highest], 2)}) and failed from β0 {lowest:g}** "
                       f"({fixed(reward_delta[lowest], 3)}, equivalent to the best fixed β)",
        "final-window beta": f"brought it to {range_text(final_window_betas, decimals(2))} on average over the "
                             f"final window, around and above phase 1's best fixed β ({best_beta:g})",
        "ended like the best beta": f"the runs ended like phase 1's best fixed β: KL {final_kl[lowest]}, reward "
                                    f"{fixed(cell_of(target_run(low_target, lowest), REWARD), 3)}",
        "more KL": f"end with *more* KL than the best fixed β ({final_kl[middle]} and {final_kl[highest]} against "
                   f"{fixed(natural, 3)})",
        "KL rose": f"the KL's mean over steps {EARLY_STEPS[0]}-{EARLY_STEPS[1]} was "
                   f"{range_text(early_kls, decimals(3))} and over steps {FINAL_WINDOW_FIRST_STEP}-{PLANNED_STEPS} "
                   f"{range_text(late_kls, decimals(3))}",
        "shorter": f"({mean_and_sd_text(run_seed_finals(target_run(low_target, highest), LENGTH), 1)} tokens at the "
                   f"end; every step of every seed's final window has a completion of at most {shortest:.0f} tokens",
        "beta growth, for the user": f"(here {range_text(growth, lambda value: str(round(value)))} times its start "
                                     f"by step {PLANNED_STEPS})",
    }


LOW_TARGET_CLAIMS = ("KL ratio", "final KL", "beta growth", "beta dips", "beta falls", "beta reached",
                     "reward loss", "final-window beta", "ended like the best beta", "more KL", "KL rose", "shorter",
                     "beta growth, for the user")


@pytest.mark.parametrize("claim", LOW_TARGET_CLAIMS)
def test_the_low_target_prose_matches_the_streams(claim):
    claims = low_target_claims()
    assert sorted(claims) == sorted(LOW_TARGET_CLAIMS)
    assert claims[claim] in phase_2_prose(), f"{claim}: expected {claims[claim]!r} in the doc"


# -- (b) at the high target: the prose bullets and the two paragraphs after them --------------------------------------
TARGET_ERROR_CLIP = 0.2  # `target` clips KL / kl_target - 1 at ±0.2: past ±20 % β moves at its full rate
COUNT_WORDS = ("no", "one", "two", "three", "four", "five")  # the prose's counts, in words
RUN_LOG_WARNING = re.compile(r"target: the KL has stayed more than (\d+) % below kl_target=([\d.]+) for (\d+) "
                             r"updates in a row \(optimizer steps 1-(\d+);")


def full_rate_factors(copies):
    """(down, up): β's factor at a full-rate update, 1 ∓ 0.2 n / kl_horizon, from the copies' recorded settings."""
    (rate,) = {copy.completions_per_step / copy.kl_horizon for copy in copies}
    return 1 - TARGET_ERROR_CLIP * rate, 1 + TARGET_ERROR_CLIP * rate


def beta_factors(copy):
    """β's factor at each update: β at step s + 1 over β at step s (step s's KL moves the β of step s + 1)."""
    betas = copy.series[BETA][:copy.last_step]
    return betas[1:] / betas[:-1]


def full_rate_updates(copy, factor):
    return int(np.sum(np.isclose(beta_factors(copy), factor, rtol=1e-9, atol=0.0)))


def first_step_above(copy, field, level):
    """The first step whose value of field is above level; None if none is."""
    steps = np.flatnonzero(copy.series[field][:copy.last_step] > level)
    return int(steps[0]) + 1 if steps.size else None


def beta_at(copy, step):
    return float(copy.series[BETA][step - 1])


def beta_need(kl_target):
    """((lower β, upper β), β_need): the fixed β at which phase 1's seed-mean final KL equals kl_target, by log-log
    interpolation between the neighbouring fixed β > 0 that straddle it (section 7, Amendment 10); one crossing."""
    betas = [beta for beta in FIXED_BETAS if beta > 0]
    kls = [cell_mean("none", beta, RAW_KL) for beta in betas]
    crossings = []
    for (low_beta, low_kl), (high_beta, high_kl) in zip(zip(betas, kls), zip(betas[1:], kls[1:])):
        if min(low_kl, high_kl) <= kl_target <= max(low_kl, high_kl):
            position = math.log(kl_target / low_kl) / math.log(high_kl / low_kl)
            crossings.append(((low_beta, high_beta), low_beta * (high_beta / low_beta) ** position))
    (crossing,) = crossings
    return crossing


def phase_1_kl_means(first, last):
    """Each seed's mean raw KL over steps first-last at each fixed β > 0 of phase 1 (every copy that made them)."""
    return [mean for beta in FIXED_BETAS if beta > 0
            for mean in seed_values(copies_of("none", beta), lambda copy: mean_over_steps(copy, RAW_KL, first, last)
                                    if copy.last_step >= last else None).values()]


def reward_deltas(run):
    """{seed: final reward - the best fixed β's}."""
    baseline = seed_final_values("none", natural_kl()[0], REWARD)
    return {seed: reward - baseline[seed] for seed, reward in run_seed_finals(run, REWARD).items()}


def logged_warnings():
    """{(seed, β0): (percent, kl_target, updates, last optimizer step)} of `target`'s warning in the run logs of
    phase 2's `b` calls (each call's *-runs.tar.xz holds a log.txt a run, named target-seedS-bβ0)."""
    found = {}
    for path in sorted(ROOT.glob("research/data/study33-p2-seed*-b/*-runs.tar.*")):
        with tarfile.open(path) as archive:
            for member in archive.getmembers():
                name = re.fullmatch(r"\./\d+/runs/target-seed(\d+)-b([\d.]+)/log\.txt", member.name)
                if name is None:
                    continue
                text = archive.extractfile(member).read().decode("utf-8")
                for warning in RUN_LOG_WARNING.finditer(text):
                    assert (int(name[1]), float(name[2])) not in found, member.name  # "once per direction"
                    found[(int(name[1]), float(name[2]))] = (int(warning[1]), float(warning[2]), int(warning[3]),
                                                            int(warning[4]))
    return found


def high_target_prose():
    """Phase 2's prose from the high target's (b) paragraph on (the low target's has paragraphs of the same names)."""
    prose = phase_2_prose()
    return prose[prose.index(HIGH_TARGET_MARKER):]


def signed(value, places=3):
    return f"{value:+.{places}f}"


@cache
def high_target_claims():
    """{claim: a sentence fragment of the high target's prose that the doc must contain, its numbers recomputed}."""
    high_target, natural = target_of(HIGH_TARGET_FACTOR), natural_kl()[1]
    starts = target_starts(high_target)
    lowest, middle, highest = starts  # the prose's grouping: from 0.01 β fell past β_need; from 0.1 and 1 it decayed
    assert highest == 1.0 and lowest < middle < highest
    kl_threshold = runaway_kl_threshold()
    every_run = copies_from(high_target, starts)
    down, up = full_rate_factors(every_run)
    updates = PLANNED_STEPS - 1  # β is logged at every step, one update between each two
    rows = {beta0: target_row(high_target, beta0) for beta0 in starts}
    ratio_90 = {beta0: rows[beta0][2].strip("[]").replace(", ", "-") for beta0 in starts}
    lowest_fixed = min(beta for beta in FIXED_BETAS if beta > 0)
    (below_need, above_need), need = beta_need(high_target)
    deltas = {beta0: reward_deltas(target_run(high_target, beta0)) for beta0 in starts}
    # Amendment 12's prediction: `target` holds the KL from β0 whose room, how far β can move in the steps before the
    # final window, holds β_need; at this target the reward equivalent to the best fixed β's
    room_steps = FINAL_WINDOW_FIRST_STEP - 1
    holds = [beta0 for beta0 in starts if beta0 * down ** room_steps <= need <= beta0 * up ** room_steps]
    assert holds == [lowest] and rows[lowest][3] != "equivalent"  # predicted to hold from 0.01 only; it did not
    assert all(rows[beta0][3] != "equivalent" for beta0 in starts)  # "does not hold" held from 0.1 and 1
    assert all(rows[beta0][7] != "equivalent" for beta0 in starts)  # "equivalent" failed from every β0

    def runaway(copy):
        return runaway_step(copy, kl_threshold)

    # from β0 0.01: β fell past β_need at the full rate; the KL passed the target late; three runs ran away
    small = sorted(copies_from(high_target, (lowest,)), key=lambda copy: copy.seed)
    ratios = [copy.final_value(RAW_KL) / high_target for copy in small]
    within = [ratio for ratio in ratios if abs(math.log(ratio)) < LOG_RATIO_MARGIN]
    assert len(within) == sum(abs(ratio - 1) <= 0.25 for ratio in ratios)  # either reading of "within ±25 %"
    # the first step whose β is below β_need, the same in every seed ("at step 50 in every seed")
    (need_step,) = {int(np.flatnonzero(copy.series[BETA][:copy.last_step] < need)[0]) + 1 for copy in small}
    for copy in small:  # at the full rate from the start to β_need
        assert np.allclose(beta_factors(copy)[:need_step - 1], down, rtol=1e-9, atol=0.0), copy.seed
    passes = {copy.seed: first_step_above(copy, RAW_KL, high_target) for copy in small}
    passed = [copy for copy in small if passes[copy.seed] is not None]
    assert len(small) - len(passed) == 1  # "(never in the fifth)"
    for copy in small:  # "kept falling": β fell at every update until the KL first passed the target
        assert np.all(beta_factors(copy)[:(passes[copy.seed] or copy.last_step) - 1] < 1), copy.seed
    betas_then = [beta_at(copy, passes[copy.seed]) for copy in passed]
    small_runaways = [copy for copy in small if runaway(copy) is not None]
    fastest_rise = max(float(np.max(beta_factors(copy))) for copy in every_run)
    assert fastest_rise == pytest.approx(up, rel=1e-9)  # "rising at most ×1.02 a step"
    for copy in small_runaways:  # "that fall went below β 0.001 and the runs ran away before β could climb back"
        assert float(np.min(copy.series[BETA][:runaway(copy)])) < lowest_fixed, copy.seed
    lowest_fixed_runaways = {seed for seed, _ in runaway_steps_of("none", lowest_fixed)}
    below_need_runaways = {seed for seed, _ in runaway_steps_of("none", below_need)}
    # the runaways lost the reward: theirs are the largest losses
    losses = sorted(deltas[lowest], key=deltas[lowest].get)
    assert set(losses[:len(small_runaways)]) == {copy.seed for copy in small_runaways}

    # from β0 1: a decay at the full rate, the KL below the target at every step
    large = copies_from(high_target, (highest,))
    large_full = [full_rate_updates(copy, down) for copy in large]
    large_end = [beta_at(copy, PLANNED_STEPS) for copy in large]
    large_highest = [float(np.max(copy.series[RAW_KL][:copy.last_step])) for copy in large]
    assert max(large_highest) < high_target  # "no step's KL reached the target"; its highest at 3 digits, which
    assert f"{max(large_highest):.2g}" == f"{high_target:g}"  # at 2 would print as the target itself
    assert all(delta > 0 for delta in deltas[highest].values())  # "in every seed"
    window_beta = mean_over_seeds(seed_finals(large, BETA))
    fixed_below = max(beta for beta in FIXED_BETAS if beta < window_beta)
    fixed_above = min(beta for beta in FIXED_BETAS if beta > window_beta)

    # from β0 0.1: four decays, and the fifth seed passed the target and ran away
    middle_copies = copies_from(high_target, (middle,))
    (middle_runaway,) = [copy for copy in middle_copies if runaway(copy) is not None]
    middle_calm = [copy for copy in middle_copies if copy is not middle_runaway]
    middle_pass = first_step_above(middle_runaway, RAW_KL, high_target)
    # in the four calm seeds, the steps whose KL passed the target: one, in one seed
    calm_above = [(step, float(copy.series[RAW_KL][step - 1])) for copy in middle_calm
                  for step in np.flatnonzero(copy.series[RAW_KL][:copy.last_step] > high_target) + 1]
    ((calm_pass, calm_kl),) = calm_above
    calm_excess = 100 * (calm_kl / high_target - 1)

    # the reason: phase 1's KL over a run's first half, and how early any high-target run's KL neared the target
    first_quarter, second_quarter = (1, PLANNED_STEPS // 4), (PLANNED_STEPS // 4 + 1, PLANNED_STEPS // 2)
    early, later = phase_1_kl_means(*first_quarter), phase_1_kl_means(*second_quarter)
    assert max(early + later) < high_target / 4  # "under a quarter of this target"
    near_level = (1 - TARGET_ERROR_CLIP) * high_target
    near = [step for copy in every_run if (step := first_step_above(copy, RAW_KL, near_level)) is not None]
    warning_update = math.ceil(math.log(2) / -math.log(down))  # docs/methods.md: where `target` warns, KL below
    assert min(near) > warning_update  # the KL stayed more than 20 % below the target through the warning's update
    warnings = logged_warnings()
    warned_seeds = {seed for seed, _ in warnings}
    (warned_seed,) = warned_seeds
    assert sorted(beta0 for _, beta0 in warnings) == sorted(starts)
    assert set(warnings.values()) == {(round(100 * TARGET_ERROR_CLIP), high_target, warning_update, warning_update)}

    # the cells: phase 1's and phase 2's, by final reward and (those with a KL) final KL
    cells = ([copies_of(method, beta) for method, beta in study_cells()]
             + [phase_2_copies_of(run) for run in reported_runs()])
    rewards = [mean_over_seeds(seed_finals(copies, REWARD)) for copies in cells]  # phase 1's first
    kls = [mean_over_seeds(finals) for copies in cells if (finals := seed_finals(copies, RAW_KL))]  # β 0: no KL
    best_run = target_run(high_target, highest)
    assert max(rewards) == cell_of(best_run, REWARD) and min(kls) == cell_of(best_run, RAW_KL)

    lowest_95 = [float(bound) for bound in rows[lowest][6].strip("[]").split(", ")]
    assert float(rows[lowest][4]) < 0 and lowest_95[0] < 0 <= lowest_95[1]  # lower; "the 95 % interval just reaches 0"
    assert float(rows[highest][4]) > 0  # higher

    return {
        "target": f"`kl_target` {high_target:g} = {HIGH_TARGET_FACTOR:g} × K_nat",
        "predictions": f"**The KL from β0 {lowest:g}: \"holds\" failed.**",
        "prediction from 0.1 and 1": f"**From β0 {middle:g} and {highest:g}: \"does not hold\" held**",
        "reward prediction": f"**The reward: \"equivalent at {HIGH_TARGET_FACTOR:g} × K_nat\" failed from every "
                             f"β0.**",
        "ratio from 0.01": f"The ratio is not equivalent to 1 ({rows[lowest][3]}, 90 % interval {ratio_90[lowest]}): "
                           f"by seed the final KL was {range_text(ratios)} times the target, and "
                           f"{COUNT_WORDS[len(within)]} seed of {COUNT_WORDS[len(small)]} "
                           f"({range_text(within, decimals(2))}) ended within ±25 % of it",
        "beta_need": f"β fell at its full rate (×{down:g} a step) from the start, passed β_need ({beta_text(need)}) "
                     f"at step {need_step} in every seed and kept falling",
        "KL passed": f"It first passed the target at step {', '.join(str(passes[copy.seed]) for copy in passed[:-1])} "
                     f"and {passes[passed[-1].seed]} in {COUNT_WORDS[len(passed)]} seeds (never in the fifth), by "
                     f"when β was {range_text(betas_then)}, below phase 1's lowest fixed β ({lowest_fixed:g}) in "
                     f"{COUNT_WORDS[sum(beta < lowest_fixed for beta in betas_then)]} of them",
        "runaways from 0.01": f"Rising at most ×{up:g} a step from there, β did not catch the KL: "
                              f"{COUNT_WORDS[len(small_runaways)]} of the {COUNT_WORDS[len(small)]} runs ran away "
                              f"(steps {', '.join(str(runaway(copy)) for copy in small_runaways)}; final KL "
                              f"{range_text([copy.final_value(RAW_KL) for copy in small_runaways])}), as "
                              f"{len(lowest_fixed_runaways)} of {len(SEEDS)} did at a fixed β of {lowest_fixed:g} in "
                              f"phase 1",
        "does not hold": f"as \"{rows[highest][3]}\" from {highest:g} ({rows[highest][1]}) and as not equivalent, "
                         f"{rows[middle][3]}, from {middle:g} ({rows[middle][1]}, 90 % interval {ratio_90[middle]})",
        "decay from 1": f"From {highest:g}, β fell at the full rate in {range_text(large_full, str)} of every seed's "
                        f"{updates} updates, to {range_text(large_end)} at step {PLANNED_STEPS}, and no step's KL "
                        f"reached the target (the highest {min(large_highest):.2g}-{max(large_highest):.3g})",
        "decay from 0.1": f"From {middle:g}, in {COUNT_WORDS[len(middle_calm)]} seeds, β moved at the full rate in "
                          f"{range_text([full_rate_updates(copy, down) for copy in middle_calm], str)} of the "
                          f"{updates} updates, to {range_text([beta_at(copy, PLANNED_STEPS) for copy in middle_calm])} "
                          f"at step {PLANNED_STEPS} (one step's KL, step {calm_pass} of one seed, passed the target by "
                          f"{calm_excess:.0f} %); in the fifth the KL passed the target at step {middle_pass}, "
                          f"at β {beta_text(beta_at(middle_runaway, middle_pass))}, and the run ran away at step "
                          f"{runaway(middle_runaway)} (final KL {beta_text(middle_runaway.final_value(RAW_KL))})",
        "phase 1's early KL": f"in phase 1, the KL's mean over steps {first_quarter[0]}-{first_quarter[1]} was "
                              f"{range_text(early, decimals(3))} and over steps "
                              f"{second_quarter[0]}-{second_quarter[1]} {range_text(later, decimals(3))} at every β "
                              f"from {lowest_fixed:g} to {max(FIXED_BETAS):g}, under a quarter of this target. Over "
                              f"the first half of a run no fixed β brought the KL's mean near {high_target:g}",
        "first step near": f"(the KL's first step above {1 - TARGET_ERROR_CLIP:g} × the target came no earlier than "
                           f"step {min(near)}), and from β0 {lowest:g} it went far below β_need",
        "beta_need's neighbours": f"β_need itself sits between β {below_need:g}, whose mean final KL "
                                  f"({beta_text(cell_mean('none', below_need, RAW_KL))}) comes from "
                                  f"{COUNT_WORDS[len(below_need_runaways)]} runaways in "
                                  f"{COUNT_WORDS[len(SEEDS)]} seeds, and {above_need:g}",
        "reward from 0.01": f"From {lowest:g} it was lower ({rows[lowest][4]}, not equivalent; the 95 % interval just "
                            f"reaches 0, so {rows[lowest][7]}): the runaways lost it (by seed "
                            f"{beta_text(min(deltas[lowest].values()))} to {beta_text(max(deltas[lowest].values()))})",
        "reward from 0.1": f"From {middle:g}, {rows[middle][7]} ({rows[middle][4]}; seed {middle_runaway.seed}'s "
                           f"runaway {beta_text(deltas[middle][middle_runaway.seed])})",
        "reward from 1": f"From {highest:g} it was **higher** than the best fixed β's, in every seed "
                         f"({signed(float(rows[highest][4]))}, by seed {signed(min(deltas[highest].values()))} to "
                         f"{signed(max(deltas[highest].values()))}; not equivalent, {rows[highest][7]} from 0): "
                         f"{fixed(cell_of(best_run, REWARD), 3)}, the highest final reward of any cell in the study, "
                         f"with the lowest final KL ({fixed(cell_of(best_run, RAW_KL), 4)}; the best fixed β's "
                         f"{fixed(natural, 4)})",
        "a beta schedule": f"**What the run from β0 {highest:g} was, and what it is not.** With the KL below the "
                           f"target throughout, `target` from β0 {highest:g} was a β schedule: ×{down:g} a step, "
                           f"from {highest:g} to {range_text(large_end)} (its final-window mean "
                           f"{beta_text(window_beta)}, between the fixed β {fixed_below:g} and {fixed_above:g})",
        "one cell": f"this is one cell of {COUNT_WORDS[len(large)]} seeds",
        "falling to": f"a β falling from {highest:g} to ~{round(max(large_end), 2):g} over {PLANNED_STEPS} steps "
                      f"ended with more reward and less KL than any fixed β of phase 1",
        "full-rate factor": f"`target` lowers β by `1 - {TARGET_ERROR_CLIP:g} n / kl_horizon` a step for as long as "
                            f"the KL stays more than {100 * TARGET_ERROR_CLIP:.0f} % below",
        "fall past 0.001": f"From a small β0 that fall went below β {lowest_fixed:g}, and "
                           f"{len(small_runaways)} of {len(small)} runs ran away before β could climb back (×{up:g} a "
                           f"step here)",
        "warning": f"in every high-target run the KL stayed more than {100 * TARGET_ERROR_CLIP:.0f} % below the target "
                   f"through update {warning_update}, where the warning fires at this rate",
        "warning logged": f"seed {warned_seed}'s {COUNT_WORDS[len(warnings)]} runs, made with the warning in the "
                          f"package, logged it there",
    }


HIGH_TARGET_CLAIMS = ("target", "predictions", "prediction from 0.1 and 1", "reward prediction", "ratio from 0.01",
                      "beta_need", "KL passed", "runaways from 0.01", "does not hold", "decay from 1", "decay from 0.1",
                      "phase 1's early KL", "first step near", "beta_need's neighbours", "reward from 0.01",
                      "reward from 0.1", "reward from 1", "a beta schedule", "one cell", "falling to",
                      "full-rate factor", "fall past 0.001", "warning", "warning logged")


@pytest.mark.parametrize("claim", HIGH_TARGET_CLAIMS)
def test_the_high_target_prose_matches_the_streams(claim):
    claims = high_target_claims()
    assert sorted(claims) == sorted(HIGH_TARGET_CLAIMS)
    assert claims[claim] in high_target_prose(), f"{claim}: expected {claims[claim]!r} in the doc"


def test_the_one_line_summary_of_b_matches_the_streams():
    # "of its 30 runs (two targets, three β0, five seeds) one ended with its final KL within ±25 % of its target"
    runs = [target_run(target_of(factor), beta0) for factor in REPORTED_TARGET_FACTORS
            for beta0 in target_starts(target_of(factor))]
    ratios = [kl / run.kl_target for run in runs for kl in run_seed_finals(run, RAW_KL).values()]
    within = [ratio for ratio in ratios if abs(math.log(ratio)) < LOG_RATIO_MARGIN]
    assert len(within) == sum(abs(ratio - 1) <= 0.25 for ratio in ratios)  # either reading of "within ±25 %"
    starts = {beta0 for factor in REPORTED_TARGET_FACTORS for beta0 in target_starts(target_of(factor))}
    assert (f"of its {len(ratios)} runs ({COUNT_WORDS[len(REPORTED_TARGET_FACTORS)]} targets, "
            f"{COUNT_WORDS[len(starts)]} β0, {COUNT_WORDS[len(SEEDS)]} seeds) {COUNT_WORDS[len(within)]} ended with its "
            f"final KL within ±25 % of its target ({fixed(within[0], 2)} ×)") in phase_2_prose()


def test_the_low_target_rate_and_phase_1s_rising_kl_match_the_streams():
    # "From 0.01, β's climb (at most ×1.02 a step)" and "it rose while β rose, as phase 1's final KL did from β 0.1 to
    # 0.3": the largest factor of any low-target update is the full rate up; phase 1's seed-mean final KL rose from the
    # best fixed β to the largest
    low_target = target_of(LOW_TARGET_FACTOR)
    every_run = copies_from(low_target, target_starts(low_target))
    _, up = full_rate_factors(every_run)
    assert max(float(np.max(beta_factors(copy))) for copy in every_run) == pytest.approx(up, rel=1e-9)
    best_beta, largest = natural_kl()[0], max(FIXED_BETAS)
    assert cell_mean("none", largest, RAW_KL) > cell_mean("none", best_beta, RAW_KL)
    prose = phase_2_prose()
    assert f"From {min(target_starts(low_target)):g}, β's climb (at most ×{up:g} a step)" in prose
    assert f"as phase 1's final KL did from β {best_beta:g} to {largest:g}" in prose
