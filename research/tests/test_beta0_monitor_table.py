"""research/monitor/beta0_run.py's two measures of the sampled monitor, on series whose answers are known: a
constant KL is read exactly; a KL alternating 1, 0 read every 2nd step is always 100 % off (the watched value is 1
or 0 against a mean of 0.5), and so is the mean of 4 watched steps, which are all equal; a KL with period 3 read
every 3rd step gives the ratios of its three phases, computed here."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "research", "monitor"))
import beta0_run  # noqa: E402


def test_a_constant_kl_is_read_exactly_at_any_sampling():
    assert set(beta0_run.errors([0.2] * 40, 4)) == {0.0}
    assert max(beta0_run.trend_errors([0.2] * 40, 4)) < 1e-12  # a mean of four equal floats: to rounding


def test_an_alternating_kl_read_every_second_step_is_always_off_by_its_mean():
    series = [1.0, 0.0] * 20
    assert set(beta0_run.errors(series, 2)) == {1.0}
    assert set(beta0_run.trend_errors(series, 2)) == {1.0}
    # every full cycle of both phases: 20 in phase 0 and 19 in phase 1; windows of k = 4 cycles span 8 steps and
    # start at 0, 2, ..., 32 (17) and 1, 3, ..., 31 (16)
    assert len(beta0_run.errors(series, 2)) == 39 and len(beta0_run.trend_errors(series, 2)) == 17 + 16


def test_a_period_three_kl_gives_each_phases_ratio():
    series = [0.3, 0.6, 0.9] * 10  # mean of a cycle 0.6: phases read 0.3, 0.6, 0.9 -> |ratio - 1| 0.5, 0, 0.5
    e = beta0_run.errors(series, 3)
    assert sorted(set(round(x, 12) for x in e)) == [0.0, 0.5]
    assert len([x for x in e if round(x, 12) == 0.5]) == 10 + 9  # phase 0 and phase 2's cycles (phase 2 has 9)
