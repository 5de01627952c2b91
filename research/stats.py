"""The research statistics the studies share, in pure Python: Student's t distribution, the paired t test, Holm's
step-down correction (study 33's corrections and study 51's part B, issue 51 item 6) and the number of seeds a paired
comparison would need.

Written from the textbook definitions, not from a library (no scipy here): the t distribution's CDF through the
regularized incomplete beta function, ``P(T <= t) = 1 - I_x(df/2, 1/2) / 2`` for t >= 0 with ``x = df / (df + t²)``
(Abramowitz & Stegun 26.7.1 with 26.5.27), the incomplete beta by its continued fraction (A&S 26.5.8, evaluated by
the modified Lentz method); its quantile by bisection on the CDF. Holm (1979): sort the m p-values, multiply the
k-th smallest by (m - k + 1), make the sequence non-decreasing, cap at 1. Power of the two-sided paired t test at
level α with n pairs and standardized effect d = mean / sd: the noncentral t's tail beyond the critical value, by
the normal approximation of A&S 26.7.10; research/tests/test_study51_arms.py checks each against tables and
against simulation, and study 33's corrections against the t tables (research/tests/test_study33_corrections.py).
"""

from __future__ import annotations

import math
import statistics

_NORMAL = statistics.NormalDist()


def regularized_incomplete_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), by the continued fraction of A&S 26.5.8 (Numerical Recipes' betacf, modified Lentz), using the
    symmetry I_x(a, b) = 1 - I_{1-x}(b, a) where the fraction converges slowly; 0 at x <= 0, 1 at x >= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - regularized_incomplete_beta(1.0 - x, b, a)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return front * h


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` > 0 degrees of freedom."""
    if not df > 0:
        raise ValueError(f"df={df!r}: allowed: a number > 0")
    tail = 0.5 * regularized_incomplete_beta(df / (df + t * t), df / 2.0, 0.5)
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p (0 < p < 1), by bisection on :func:`t_cdf`."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p={p!r}: allowed: 0 < p < 1")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, high * 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low < 1e-12 * max(1.0, high):
            break
    return 0.5 * (low + high)


def paired_t(differences: list[float]) -> tuple[float, float, float]:
    """(mean, t statistic, two-sided p) of the paired t test that the mean difference is 0; at least 2 pairs. A set
    of equal differences has no spread: p is 0 where their mean is not 0, 1 where it is."""
    n = len(differences)
    if n < 2:
        raise ValueError(f"{n} paired differences: allowed: at least 2")
    mean = sum(differences) / n
    sd = statistics.stdev(differences)
    if sd == 0:
        return mean, math.copysign(math.inf, mean) if mean else 0.0, 0.0 if mean else 1.0
    t = mean / (sd / math.sqrt(n))
    return mean, t, 2.0 * (1.0 - t_cdf(abs(t), n - 1))


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: reject the k-th hypothesis at family level α when
    its adjusted p is <= α."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def paired_power(n: int, effect: float, alpha: float) -> float:
    """Power of the two-sided paired t test at level ``alpha`` with ``n`` pairs when the mean difference is
    ``effect`` standard deviations of the differences (A&S 26.7.10's normal approximation of the noncentral t)."""
    if n < 2:
        return 0.0
    df = n - 1
    critical = t_quantile(1.0 - alpha / 2.0, df)
    shift = abs(effect) * math.sqrt(n)
    spread = math.sqrt(1.0 + critical * critical / (2.0 * df))
    return _NORMAL.cdf((shift - critical * (1.0 - 1.0 / (4.0 * df))) / spread)


def seeds_needed(effect: float, alpha: float, power: float = 0.8, most: int = 10_000) -> int | None:
    """The fewest pairs at which the two-sided paired t test at level ``alpha`` detects a mean difference of
    ``effect`` standard deviations with at least ``power``; None for no effect or more than ``most`` pairs."""
    if effect == 0 or not math.isfinite(effect):
        return None
    for n in range(2, most + 1):
        if paired_power(n, effect, alpha) >= power:
            return n
    return None
