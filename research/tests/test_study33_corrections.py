"""research/study33_corrections.py (issue 51): the tests it adds to the study's analysis, against textbook values
and hand computation, and the 2026-11-28 correction of study 33 (docs/evidence/study33-long-task.md) against the
numbers it recomputes from the raw streams."""

import math
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # research/ is not installed: it is study code beside the package

from research import study33_corrections as corrections  # noqa: E402

STUDY_33 = ROOT / "docs" / "evidence" / "study33-long-task.md"
CORRECTION_HEADING = "### Correction (2026-11-28, issue 51): what the record got wrong"


def differences_with_t(t: float, n: int) -> list[float]:
    """n values whose one-sample t statistic is t: mean t x (sd / sqrt n)."""
    base = [float(i) for i in range(n)]
    centred = [x - statistics.fmean(base) for x in base]
    shift = t * statistics.stdev(centred) / math.sqrt(n)
    return [x + shift for x in centred]


@pytest.mark.parametrize("t, n, p", [(2.776, 5, 0.05), (2.132, 5, 0.10), (4.604, 5, 0.01), (12.706, 2, 0.05),
                                     (1.0, 2, 0.5), (2.228, 11, 0.05), (1.960, 2000, 0.05)])
def test_the_t_test_p_is_the_tables_two_sided_level(t, n, p):
    """Student-t table quantiles (and the Cauchy case: df 1, P(|T| >= 1) = 1/2 exactly; a large df: the normal's)."""
    assert corrections.t_test_p(differences_with_t(t, n)) == pytest.approx(p, abs=2e-4)


def test_the_t_test_refuses_a_single_value():
    with pytest.raises(ValueError, match="at least 2 values"):
        corrections.t_test_p([0.1])


def test_the_sign_flip_p_counts_the_patterns_at_least_as_extreme():
    assert corrections.sign_flip_p([1, 2, 3, 4, 5]) == 2 / 32  # all positive: only the observed pattern and its mirror
    assert corrections.sign_flip_p([1, -1]) == 1.0
    # 3, -1, 2: the eight signed sums are ±4, ±0, ±6, ±2; |sum| >= 4 in four of them
    assert corrections.sign_flip_p([3, -1, 2]) == 0.5


def test_holm_steps_down_and_stays_monotone():
    assert corrections.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert corrections.holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])


def test_step_ranges_name_single_steps_and_runs():
    assert corrections.step_ranges([192, 196, 197, 198, 199, 200]) == "at step 192 and at every step from 196 to 200"
    assert corrections.step_ranges([191, 192]) == "at every step from 191 to 192"


@pytest.fixture(scope="module")
def values():
    return corrections.corrections()


def test_the_reward_rule_alone_flags_nearly_every_run(values):
    rule = values["reward_rule"]
    assert (rule["flagged"], rule["complete"]) == (78, 80)
    assert len(rule["not_flagged"]) == 2


def test_two_runs_ended_with_every_completion_at_the_cap(values):
    capped = [(key.method, key.beta, seed) for key, seed, _, _ in values["capped"]]
    assert capped == [("none", 0.0, 4), ("target", 0.01, 1)]


def test_the_correction_states_the_recomputed_numbers(values):
    text = STUDY_33.read_text()
    assert text.count(CORRECTION_HEADING) == 1
    section = " ".join(text.split(CORRECTION_HEADING)[1].split())
    missing = [claim for claim in corrections.claims(values) if claim not in section]
    assert missing == [], f"the correction does not say (or says otherwise): {missing}"
