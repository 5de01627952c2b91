"""Candidate β controllers compared in the fitted plant (plant.py): from β0 0.01, 0.1 and 1, at targets 0.25 × to 4 ×
the natural KL. Prints docs/simulator.md's tables.

    PYTHONPATH=. python research/controller_sim/compare.py [--plants 40]

The controllers are the package's own classes (``ziegler``, ``target``), driven through ``update()`` exactly as a
trainer drives them (64 completions a step); the candidates that differ from ``target`` in a mechanism are small
subclasses below. Every plant is drawn with its own seed, the same for every controller (common random numbers).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plant  # noqa: E402

from unsloth_adaptive_kl.controllers import ControllerConfig, TargetKLBeta  # noqa: E402
from unsloth_adaptive_kl.target_controller import HeldTargetKL  # noqa: E402

STEPS, FINAL = 200, 150  # the final window: steps 151-200, as study 33's
N = 64  # completions per optimizer step (study 33)
BETA0S = (0.01, 0.1, 1.0)
TARGET_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)
LOW_BETA = 0.002  # between 0.001 (2 of 5 runs ran away at that fixed β in study 33) and 0.01 (none did)
K_NAT = 0.0247  # study 33's natural KL (docs/evidence.md §7, Amendment 12): its targets 0.0062 and 0.099 are 0.25 x and 4 x
#: The fixed β a plant's reachability is checked at: study 33's measured range, 0.001-0.3 (the issue's "reachable":
#: some fixed β ends a run within ±25 % of the target; the plant's shape is not extrapolated past what was measured).
GRID = np.logspace(-3, math.log10(0.3), 31)


class DesignOne(HeldTargetKL):
    """``target`` as designed first (study 49's pre-registration): a push the range's bound blocks is not frozen. The
    candidates A-J and the sweep below were compared on it, before design 2 existed (docs/simulator.md)."""

    freeze_at_bounds = False


class FallsAgain(HeldTargetKL):
    """Design 2 plus, below the target, a new episode after ``target_patience`` frozen updates: β may halve again,
    down to its floor (rejected for design 2: it winds up on tests/test_target_controller.py's lagged plant)."""

    def anti_wind_up(self, step, error, global_step):
        out = super().anti_wind_up(step, error, global_step)
        episode = self.episode
        if episode is not None and episode[0] < 0 and episode[3] >= self.config.target_patience and self.beta > self.lower():
            self.episode = [-1, self.beta, None, 0, 0.0]  # no response below: β may halve again
            return step
        return out


class NoAntiWindUp(DesignOne):
    """The log-β integral controller with no freeze and no unreachable detection."""

    def anti_wind_up(self, step, error, global_step):
        return step


class WithProportional(DesignOne):
    """Adds a proportional term kp (e_t - e_{t-1}) to the velocity form (a PI controller in ln β)."""

    kp = 0.5

    def __init__(self, config):
        super().__init__(config)
        self.previous_error = None

    def anti_wind_up(self, step, error, global_step):
        if self.previous_error is not None:
            step += self.kp * (error - self.previous_error)
        self.previous_error = error
        cfg = self.config
        step = min(max(step, math.log(cfg.target_max_fall)), math.log(cfg.target_max_rise))
        return super().anti_wind_up(step, error, global_step)


def constant(name, value):
    """target's design 1 with one class constant changed (the constants the module docstring names)."""
    return type(f"{name}_{value}", (DesignOne,), {name: value})


#: target's defaults (H below: design 1; K: design 2), the base of the candidates and of the sweep.
DEFAULT = dict(target_beta_range=5.0, target_warmup_steps=20, target_gain=0.2, target_max_rise=1.1, target_max_fall=0.98, target_patience=10)
#: The first candidates' settings: a gentler controller (±5 %/step) with a wider range and more patience.
BASE = dict(target_beta_range=10.0, target_warmup_steps=20, target_gain=0.05, target_max_rise=1.05, target_max_fall=0.98, target_patience=20)
NO_RANGE = 1e9
CANDIDATES = {
    "Z: ziegler (study 33's settings: kl_horizon 640)": (TargetKLBeta, dict(kl_horizon=640.0)),
    "A: log-β integral, gain 0.05, ±5 %/step, no range, no warm-up": (NoAntiWindUp, {**BASE, "target_beta_range": NO_RANGE, "target_warmup_steps": 0, "target_max_fall": 1 / 1.05}),
    "B: A + anti-wind-up (freeze, unreachable cap, patience 20)": (DesignOne, {**BASE, "target_beta_range": NO_RANGE, "target_warmup_steps": 0, "target_max_fall": 1 / 1.05}),
    "C: B + range [β0/10, 10 β0]": (DesignOne, {**BASE, "target_warmup_steps": 0, "target_max_fall": 1 / 1.05}),
    "D: C + warm-up 20 (no fall)": (DesignOne, {**BASE, "target_max_fall": 1 / 1.05}),
    "E: D + falls ≤ 2 %/step (rises ≤ 5 %)": (DesignOne, BASE),
    "F: E + proportional term (PI, kp 0.5)": (WithProportional, BASE),
    "G: E, gain 0.1, range 5, patience 10": (DesignOne, {**BASE, "target_gain": 0.1, "target_beta_range": 5.0, "target_patience": 10}),
    "H: G, gain 0.2, rises ≤ 10 % = target's defaults (design 1)": (DesignOne, DEFAULT),
    "I: H, falls ≤ 5 %": (DesignOne, {**DEFAULT, "target_max_fall": 0.95}),
    "J: H + proportional term (PI, kp 0.5)": (WithProportional, DEFAULT),
    "K: H + a push blocked at the range's bound counts as frozen = target's design 2": (HeldTargetKL, DEFAULT),
    "L: K + below the target β may halve again after target_patience updates (rejected)": (FallsAgain, DEFAULT),
}
SWEEP = {
    "target_gain 0.1": (DesignOne, {**DEFAULT, "target_gain": 0.1}),
    "target_gain 0.4": (DesignOne, {**DEFAULT, "target_gain": 0.4}),
    "target_beta_range 3": (DesignOne, {**DEFAULT, "target_beta_range": 3.0}),
    "target_beta_range 10": (DesignOne, {**DEFAULT, "target_beta_range": 10.0}),
    "target_warmup_steps 0": (DesignOne, {**DEFAULT, "target_warmup_steps": 0}),
    "target_warmup_steps 50": (DesignOne, {**DEFAULT, "target_warmup_steps": 50}),
    "target_max_rise 1.05": (DesignOne, {**DEFAULT, "target_max_rise": 1.05}),
    "target_max_rise 1.2": (DesignOne, {**DEFAULT, "target_max_rise": 1.2}),
    "target_max_fall 0.95": (DesignOne, {**DEFAULT, "target_max_fall": 0.95}),
    "target_max_fall 0.99": (DesignOne, {**DEFAULT, "target_max_fall": 0.99}),
    "target_patience 5": (DesignOne, {**DEFAULT, "target_patience": 5}),
    "target_patience 20": (DesignOne, {**DEFAULT, "target_patience": 20}),
    "smoothing 0.1": (constant("smoothing", 0.1), DEFAULT),
    "smoothing 0.5": (constant("smoothing", 0.5), DEFAULT),
    "response_factor 4": (constant("response_factor", 4.0), DEFAULT),
    "response 1.5 (a response: the frozen KL 1/1.5 of where it was)": (constant("response", 1.5), DEFAULT),
}


def plants(n: int, shape, fits, cell_seed: int):
    """n plants: drift and noise of a bootstrapped fixed-β run, the lag of a bootstrapped `target` run."""
    fixed = [f for f in fits if f.run.method == "none"]
    taus = [f.tau for f in fits if f.run.method == "target"]
    out = []
    for i in range(n):
        rng = np.random.default_rng([cell_seed, i])
        fit = fixed[rng.integers(len(fixed))]
        tau = taus[rng.integers(len(taus))]
        out.append((fit, tau, [cell_seed, i, 1]))
    return out


def noise_free_final(fit, shape, tau, beta):
    """A fixed β's final-window mean KL on this plant without noise (its KL is then exp(level) × E[e^noise])."""
    base = fit.c - (shape(math.log(fit.run.beta0)))
    var = fit.sigma ** 2 / max(1e-9, 1 - fit.phi ** 2)
    t = np.arange(FINAL + 1, STEPS + 1)
    return float(np.mean(np.exp(base + fit.d * np.log(t) + fit.d2 * t / 100 + shape(math.log(beta)) + var / 2)))


_REACHABLE = {}


def is_reachable(fit, shape, tau, target):
    """Whether some fixed β of GRID ends this plant's run (noise-free) within ±25 % of target (the issue's reachable)."""
    key = (id(fit), target)
    if key not in _REACHABLE:
        _REACHABLE[key] = any(abs(math.log(noise_free_final(fit, shape, tau, b) / target)) <= math.log(1.25) for b in GRID)
    return _REACHABLE[key]


def too_low(fit, shape, tau, target):
    """The target is below the final KL of every fixed β of GRID on this plant (by more than 25 %): raising β cannot
    reach it, the case target declares unreachable (a target above every fixed β's KL is not declared)."""
    return min(noise_free_final(fit, shape, tau, b) for b in GRID) > 1.25 * target


def natural_kl(shape, fits, n):
    return statistics.median(noise_free_final(f, shape, tau, 0.1) for f, tau, _ in plants(n, shape, fits, 99))


def run_one(cls, settings, beta0, target, fit, shape, tau, seed):
    controller = cls(ControllerConfig(beta0, kl_target=target, **settings))
    p = plant.Plant(fit, shape, tau, np.random.default_rng(seed))
    betas, kls, declared = [], [], None
    for step in range(1, STEPS + 1):
        betas.append(controller.beta)
        kl = p.step(controller.beta)
        kls.append(kl)
        controller.update(global_step=step, kl=kl, num_completions=N)
        if declared is None and getattr(controller, "reachable", True) is False:
            declared = controller.updates
    return np.array(betas), np.array(kls), declared


def evaluate(cls, settings, shape, fits, kn, n):
    rows = []
    for bi, beta0 in enumerate(BETA0S):
        for ti, factor in enumerate(TARGET_FACTORS):
            target = float(f"{factor * kn:.2g}")
            held = reach = low = 0
            decl, held_r, ends, tops = [], [], [], []
            for fit, tau, seed in plants(n, shape, fits, 1000 + 10 * bi + ti):
                reachable = is_reachable(fit, shape, tau, target)
                betas, kls, declared = run_one(cls, settings, beta0, target, fit, shape, tau, seed)
                ratio = float(np.mean(kls[FINAL:])) / target
                ok = abs(math.log(ratio)) <= math.log(1.25)
                reach += reachable
                held += ok
                if reachable:
                    held_r.append(ok)
                low += int(np.sum(betas < LOW_BETA) >= 10)
                ends.append(betas[-1] / beta0)
                tops.append(betas.max() / beta0)
                if too_low(fit, shape, tau, target):
                    decl.append(declared)
            rows.append(dict(beta0=beta0, factor=factor, target=target, n=n, reachable=reach, held=held,
                             held_reachable=(sum(held_r), len(held_r)), low=low, end=statistics.median(ends),
                             top=max(tops), declared=decl))
    return rows


def summary(rows):
    reach_ok = sum(r["held_reachable"][0] for r in rows)
    reach_n = sum(r["held_reachable"][1] for r in rows)
    worst = min((r["held_reachable"][0] / r["held_reachable"][1] for r in rows if r["held_reachable"][1] >= 10), default=float("nan"))
    low = sum(r["low"] for r in rows)
    total = sum(r["n"] for r in rows)
    unreachable = [d for r in rows for d in r["declared"]]
    said = [d for d in unreachable if d is not None]
    detect = f"{len(said)}/{len(unreachable)}" + (f", median {statistics.median(said):.0f}, by update 60: "
                                                   f"{sum(d <= 60 for d in said)}" if said else "")
    return reach_ok / max(reach_n, 1), worst, low / total, detect, max(r["top"] for r in rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plants", type=int, default=40, help="plants per cell (β0 × target)")
    parser.add_argument("--sweep", action="store_true", help="also the one-at-a-time sweep of target's defaults")
    args = parser.parse_args()
    shape, fits = plant.fit_all()
    kn = K_NAT
    print(f"shape: a = {shape.a:.4f}, least KL at beta = {math.exp(shape.z0):.3g}; natural KL: study 33's K_nat {K_NAT} (the "
          f"simulator's, median plant at fixed beta 0.1, final window: {natural_kl(shape, fits, 200):.4f}); targets "
          f"{[float(f'{f * kn:.2g}') for f in TARGET_FACTORS]}; {args.plants} plants a cell\n")
    print("| controller | held, reachable plants | worst reachable cell | runs with >= 10 steps at beta < 0.002 | "
          "targets below every fixed β's KL: declared (median update, declared by update 60) | max beta / beta0 |")
    print("|---|---|---|---|---|---|")
    tables = {}
    for name, (cls, settings) in {**CANDIDATES, **(SWEEP if args.sweep else {})}.items():
        rows = evaluate(cls, settings, shape, fits, kn, args.plants)
        tables[name] = rows
        held, worst, low, detect, top = summary(rows)
        print(f"| {name} | {held:.0%} | {worst:.0%} | {low:.0%} | {detect} | {top:.3g} |", flush=True)
    for name in (n for n in tables if n.startswith(("Z:", "H:", "K:"))):
        print(f"\n{name}, per cell:\n")
        print("| β0 | target (× natural) | reachable plants | held (all) | held (reachable) | >= 10 steps at β < 0.002 | median final β / β0 | declared unreachable (of targets below every fixed β's KL) |")
        print("|---|---|---|---|---|---|---|---|")
        for r in tables[name]:
            d = [x for x in r["declared"] if x is not None]
            print(f"| {r['beta0']:g} | {r['target']:g} ({r['factor']:g}×) | {r['reachable']}/{r['n']} | {r['held']}/{r['n']} | "
                  f"{r['held_reachable'][0]}/{r['held_reachable'][1]} | {r['low']} | {r['end']:.3g} | "
                  f"{len(d)}/{len(r['declared'])}{f' (updates {min(d)}-{max(d)})' if d else ''} |")


if __name__ == "__main__":
    main()
