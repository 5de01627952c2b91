"""A model of how a run's KL responds to β, fitted per run to study 33's streams (docs/evidence.md §7).

For a run with β_t the β its step t trained with (``adaptive_kl/current_beta``) and KL_t its raw KL
(``adaptive_kl/raw_kl``; step 1's is 0: the policy is still the reference), with u_t = ln β_t::

    z_1 = u_1,   z_t = z_{t-1} + (u_{t-1} - z_{t-1}) / tau          # the policy follows β with a lag tau (steps)
    ln KL_t = c + d ln t + d2 t / 100 + g(z_t) + e_t,  e_t = phi e_{t-1} + sigma w_t   # drift, AR(1) noise
    g(z) = a (z - z0)^2                                               # the KL is not monotone in β: least near e^z0

g (a, z0) is shared by all runs: fitted to the 25 complete fixed-β runs (`none`, β > 0), whose per-run level c'
(= c + g(ln β)) is a quadratic in ln β. Per run: c, d and d2 by least squares over steps 2-200 (step 1's KL is 0
or ~1e-6: the policy is the reference), phi and sigma from the residuals, and for
runs whose β moved (`target`) tau by a grid search. A fixed-β run has no information on tau (its β never moves).
Research code: numpy only, nothing here is imported by the package.
"""

from __future__ import annotations

import glob
import gzip
import json
import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

STREAMS = "research/data/study33-p[12]-*/*-stream.jsonl.gz"
TAUS = (1, 2, 3, 5, 8, 12, 20, 30, 50, 80)
STEPS = 200
LEVEL_STEP = 175


@dataclass
class Run:
    method: str
    beta0: float
    kl_target: float | None
    seed: int
    beta: np.ndarray  # β of steps 1..200
    kl: np.ndarray  # raw KL of steps 1..200


def read_runs(pattern: str = STREAMS) -> list[Run]:
    """Study 33's complete copies (200 steps) of `none` at β > 0 and of `target`, the KL in the loss (k3)."""
    copies = defaultdict(list)
    for path in sorted(glob.glob(pattern)):
        with gzip.open(path, "rt") as handle:
            for line in handle:
                row = json.loads(line)
                copies[(row["method"], row["beta0"], row.get("kl_target"), row["seed"], row["copy"], row["tag"])].append(row)
    runs = []
    for (method, beta0, kl_target, seed, _, tag), rows in sorted(copies.items(), key=lambda kv: kv[0][:4] + (kv[0][4],)):
        if method not in ("none", "target") or beta0 <= 0 or len(rows) != STEPS or "plreward" in tag:
            continue
        rows.sort(key=lambda r: r["step"])
        runs.append(Run(method, float(beta0), kl_target if method == "target" else None, int(seed),
                        np.array([r["adaptive_kl/current_beta"] for r in rows], float),
                        np.array([r["adaptive_kl/raw_kl"] for r in rows], float)))
    return runs


def lagged(log_beta: np.ndarray, tau: float) -> np.ndarray:
    z = np.empty_like(log_beta)
    z[0] = log_beta[0]
    for t in range(1, len(log_beta)):
        z[t] = z[t - 1] + (log_beta[t - 1] - z[t - 1]) / tau
    return z


@dataclass
class Shape:
    a: float
    z0: float

    def __call__(self, z):
        return self.a * (np.asarray(z) - self.z0) ** 2


@dataclass
class RunFit:
    run: Run
    c: float
    d: float
    d2: float
    tau: float | None
    phi: float
    sigma: float
    steps: np.ndarray  # the steps fitted (KL > 0)
    fitted: np.ndarray  # ln KL fitted at those steps
    observed: np.ndarray


def _level_fit(y, t, offset):
    X = np.column_stack([np.ones_like(t), np.log(t), t / 100])
    coef, *_ = np.linalg.lstsq(X, y - offset, rcond=None)
    resid = y - offset - X @ coef
    return coef, resid


def _noise(resid):
    phi = float(np.corrcoef(resid[:-1], resid[1:])[0, 1])
    innov = resid[1:] - phi * resid[:-1]
    return phi, float(innov.std(ddof=2))


def fit_run(run: Run, shape: Shape) -> RunFit:
    t = np.arange(1, STEPS + 1, dtype=float)
    keep = (run.kl > 0) & (t > 1)
    y, ts = np.log(run.kl[keep]), t[keep]
    u = np.log(run.beta)
    best = None
    for tau in (TAUS if run.method == "target" else (1,)):
        offset = shape(lagged(u, tau))[keep]
        coef, resid = _level_fit(y, ts, offset)
        sse = float(resid @ resid)
        if best is None or sse < best[0]:
            best = (sse, tau, coef, resid, offset)
    _, tau, coef, resid, offset = best
    phi, sigma = _noise(resid)
    return RunFit(run, float(coef[0]), float(coef[1]), float(coef[2]), float(tau) if run.method == "target" else None, phi, sigma,
                  ts, y - resid, y)


def fit_shape(runs: list[Run]) -> Shape:
    """a, z0 from the fixed-β runs' levels c' against ln β: their ln KL at step 175 (the middle of the final window,
    where the controllers are judged) on the run's fitted drift line."""
    levels, log_betas = [], []
    t = np.arange(1, STEPS + 1, dtype=float)
    for run in runs:
        if run.method != "none":
            continue
        keep = (run.kl > 0) & (t > 1)
        coef, _ = _level_fit(np.log(run.kl[keep]), t[keep], 0.0)
        levels.append(coef[0] + coef[1] * math.log(LEVEL_STEP) + coef[2] * LEVEL_STEP / 100)
        log_betas.append(math.log(run.beta0))
    x, y = np.array(log_betas), np.array(levels)
    q2, q1, _ = np.polyfit(x, y, 2)
    return Shape(a=float(q2), z0=float(-q1 / (2 * q2)))


def fit_all(runs: list[Run] | None = None) -> tuple[Shape, list[RunFit]]:
    runs = read_runs() if runs is None else runs
    shape = fit_shape(runs)
    return shape, [fit_run(run, shape) for run in runs]


class Plant:
    """A synthetic run drawn from one fitted fixed-β run's drift and noise, the shared shape, and a lag tau."""

    def __init__(self, fit: RunFit, shape: Shape, tau: float, rng: np.random.Generator):
        self.base = fit.c - (shape(math.log(fit.run.beta0)) if fit.run.method == "none" else 0.0)
        self.d, self.d2, self.phi, self.sigma, self.shape, self.tau, self.rng = fit.d, fit.d2, fit.phi, fit.sigma, shape, tau, rng
        self.t, self.z, self.e, self.last_log_beta = 0, None, 0.0, None

    def step(self, beta: float) -> float:
        """The raw KL of the next step, trained with ``beta`` (step 1's is 0, as in a run)."""
        self.t += 1
        u = math.log(beta)
        if self.z is None:
            self.z = u
        else:
            self.z += (self.last_log_beta - self.z) / self.tau
        self.last_log_beta = u
        self.e = self.phi * self.e + self.sigma * self.rng.standard_normal()
        if self.t == 1:
            return 0.0
        return math.exp(self.base + self.drift(self.t) + float(self.shape(self.z)) + self.e)

    def drift(self, t):
        return self.d * np.log(t) + self.d2 * np.asarray(t) / 100
