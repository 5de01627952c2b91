"""An independent reanalysis of issue 33's phase 1 (docs/evidence.md section 7) against the doc's printed results.

Recomputes the three tables of section 7's "Results, phase 1: questions (a) and (c)" (the runs: copies, final values
and runaways; (a) the length slope after saturation; (c) each shaping method against `none` at β 0.04) from the raw
streams docs/evidence-data/study33-p1-*/*-stream.jsonl.gz, from section 7's written definitions alone, and asserts
that every number and verdict in the doc's tables equals the recomputation at the printed precision. Independent of
the project's analysis: nothing from blackwell/ is imported; Student-t quantiles come from bisection on the t CDF
(the regularized incomplete beta function by its continued fraction), checked against textbook values; the
thresholds on the reward (a mean of 64 rewards in {0, 0.5, 1}, so a multiple of 1/128) are compared exactly, in
rationals, so a tie with 0.02 or 0.1 is decided by the definition and not by rounding (the reward's 10-step mean
falls by exactly 0.1 at β 0's runaway steps of seeds 1 and 4).

Two conventions of the project's analysis, which the doc states and this test checks both ways: its t quantiles are
the standard table's three decimals (the doc's intervals are printed with them; no verdict changes with the exact
quantiles), and section 7 leaves the 10-step mean at steps 1-9 open (the doc's numbers take the mean of the steps so
far; its second (a) table counts only full windows; no verdict and no runaway changes).
"""

import gzip
import json
import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
EVIDENCE_DOC = ROOT / "docs" / "evidence.md"
STREAM_GLOB = "docs/evidence-data/study33-p1-*/*-stream.jsonl.gz"
RESULTS_HEADING = "### Results, phase 1: questions (a) and (c)"

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
    text = (ROOT / "scripts" / "gpu" / "evidence" / "study33-p1-seed0-shape.txt").read_text()
    (runs,) = re.findall(r"--runs (\S+)", text)
    methods = [run.split("@")[0] for run in runs.split(",")]
    assert {float(run.split("@")[1]) for run in runs.split(",")} == {SHAPING_BETA} and "none" not in methods
    return tuple(methods)


SHAPING_METHODS = shaping_runs_of_phase_1()

REWARD, LENGTH, RAW_KL = "reward", "completions/mean_length", "adaptive_kl/raw_kl"
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

    def final_value(self, field):
        """Mean over the final window's steps the copy made; None if it was cut before the window or lacks field."""
        if self.last_step < FINAL_WINDOW_FIRST_STEP:
            return None
        window = self.series[field][FINAL_WINDOW_FIRST_STEP - 1:PLANNED_STEPS]
        if np.isnan(window).any():
            assert np.isnan(window).all(), (self.method, self.beta0, self.seed, self.copy_id, field)
            return None
        return float(window.mean())


@lru_cache(maxsize=1)
def study_copies():
    rows_by_copy = defaultdict(list)
    for path in sorted(ROOT.glob(STREAM_GLOB)):
        with gzip.open(path, "rt") as stream:
            for line in stream:
                row = json.loads(line)
                rows_by_copy[(row["tag"], row["method"], row["seed"], row["copy"])].append(row)
    copies = []
    fields = (REWARD, LENGTH, RAW_KL, TAIL_P99, TAIL_MAX, TAIL_SHARE)
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
        copies.append(Copy(method, beta0, seed, copy_id, len(rows), series, exact_reward))
    return copies


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


def seed_final_values(method, beta0, field):
    return seed_values(copies_of(method, beta0), lambda copy: copy.final_value(field))


def cell_mean(method, beta0, field):
    return float(np.mean(list(seed_final_values(method, beta0, field).values())))


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


def results_section():
    text = read_evidence_doc()
    start = text.index(RESULTS_HEADING)
    following = re.search(r"^#{2,3} ", text[start + len(RESULTS_HEADING):], flags=re.MULTILINE)
    return text[start:start + len(RESULTS_HEADING) + following.start()] if following else text[start:]


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


def results_table(first_header_cells):
    matching = [rows for header, rows in markdown_tables(results_section())
                if header[:len(first_header_cells)] == list(first_header_cells)]
    assert len(matching) == 1, f"expected one table headed {first_header_cells} in {RESULTS_HEADING!r}"
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
def shaping_row(method, name, t_decimals=DOC_T_DECIMALS):
    """(Δ mean, 90 % CI, 95 % CI, verdict) of table (c), as the doc prints them."""
    field, margin, decimals = {q[0]: q[1:] for q in SHAPING_QUANTITIES}[name]
    treated = seed_final_values(method, SHAPING_BETA, field)
    baseline = seed_final_values("none", SHAPING_BETA, field)
    paired_seeds = sorted(set(treated) & set(baseline))
    assert paired_seeds == list(SEEDS), (method, name)
    interval = t_interval([treated[seed] - baseline[seed] for seed in paired_seeds], t_decimals)
    ci90 = "—" if margin is None else interval_text(interval.low90, interval.high90, decimals)
    verdict = difference_verdict(interval) if margin is None else tost_verdict(interval, margin)
    return fixed(interval.mean, decimals), ci90, interval_text(interval.low95, interval.high95, decimals), verdict


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
