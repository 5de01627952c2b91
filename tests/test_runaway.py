"""The runaway alarm (unsloth_adaptive_kl/runaway.py, docs/runaway.md): it fires on a synthetic runaway at the step an
independent restatement of its rule (numpy, over the whole series) names, stays quiet on a calm run whose KL grows
slowly and whose reward wanders, judges a sparse KL (the sampled kl_monitor) over the same steps, and, inside a
trainer's AdaptiveKL, warns once and reports its state."""

import logging
import math
import types

import numpy as np
import pytest
import torch

from unsloth_adaptive_kl import AdaptiveKL
from unsloth_adaptive_kl.config import DEFAULTS
from unsloth_adaptive_kl.runaway import RunawayAlarm, RunawayRule

RULE = RunawayRule()


def first_alarm_step(kl: list[float | None], reward: list[float], rule: RunawayRule = RULE) -> int | None:
    """The rule, restated over whole 1-based series: the first step s >= recent + base with a KL at s, whose mean KL
    over steps s-recent+1..s is >= kl_ratio x the median KL over the base steps before them (at least
    min_base_observations of them), while the mean reward over the recent steps is below the base steps' mean."""
    for s in range(rule.recent_steps + rule.base_steps, len(kl) + 1):
        if kl[s - 1] is None:
            continue
        recent = range(s - rule.recent_steps + 1, s + 1)
        base = range(s - rule.recent_steps - rule.base_steps + 1, s - rule.recent_steps + 1)
        recent_kl = [kl[t - 1] for t in recent if kl[t - 1] is not None]
        base_kl = [kl[t - 1] for t in base if kl[t - 1] is not None]
        if len(base_kl) < rule.min_base_observations or np.median(base_kl) <= 0:
            continue
        if np.mean(recent_kl) >= rule.kl_ratio * np.median(base_kl) and np.mean([reward[t - 1] for t in recent]) < np.mean([reward[t - 1] for t in base]):
            return s
    return None


def feed(kl, reward) -> list[int]:
    alarm = RunawayAlarm()
    return [step for step, (k, r) in enumerate(zip(kl, reward), start=1) if (alarm.observe_reward(r), alarm.end_step(step, k))[1]]


def runaway_series(steps=200, start=120, seed=0):
    """A calm KL near 0.02 and a reward near 0.8, then from ``start`` the KL grows 8 % a step and the reward falls."""
    rng = np.random.default_rng(seed)
    kl = 0.02 * np.exp(rng.normal(0, 0.2, steps))
    reward = 0.8 + rng.normal(0, 0.03, steps)
    after = np.arange(steps) >= start
    kl[after] *= 1.08 ** (np.arange(steps)[after] - start)
    reward[after] -= 0.004 * (np.arange(steps)[after] - start)
    return kl.tolist(), reward.tolist()


def calm_series(steps=200, seed=1):
    """A KL that triples over the run (as study 33's calm runs' did) with step noise, a reward that rises and falls."""
    rng = np.random.default_rng(seed)
    t = np.arange(steps)
    kl = 0.01 * (1 + 2 * t / steps) * np.exp(rng.normal(0, 0.4, steps))
    reward = 0.6 + 0.2 * np.sin(t / 30) + rng.normal(0, 0.05, steps)
    return kl.tolist(), reward.tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_alarm_fires_once_on_a_synthetic_runaway_at_the_step_the_rule_names(seed):
    kl, reward = runaway_series(seed=seed)
    expected = first_alarm_step(kl, reward)
    assert expected is not None and 120 < expected <= 160  # 1.08^23 ≈ 6; the recent mean lags its last step by ~5
    assert feed(kl, reward) == [expected]


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_the_alarm_stays_quiet_on_a_calm_run(seed):
    kl, reward = calm_series(seed=seed)
    assert first_alarm_step(kl, reward) is None and feed(kl, reward) == []


def test_a_kl_rise_without_a_falling_reward_does_not_fire():
    kl, _ = runaway_series()
    assert feed(kl, [0.5 + 0.001 * s for s in range(len(kl))]) == []  # the reward keeps rising: no alarm


def test_a_sparse_kl_is_judged_over_the_same_steps():
    """The sampled monitor's KL (every 4th step): windows in steps, each holding the KLs observed in it."""
    kl, reward = runaway_series()
    sparse = [k if (step - 1) % 4 == 0 else None for step, k in enumerate(kl, start=1)]
    expected = first_alarm_step(sparse, reward)
    assert expected is not None and (expected - 1) % 4 == 0
    assert feed(sparse, reward) == [expected]


def test_too_few_kls_in_the_base_window_are_not_judged():
    kl, reward = runaway_series()
    every_30 = [k if (step - 1) % 30 == 0 else None for step, k in enumerate(kl, start=1)]  # 1-2 KLs per 50 steps
    assert feed(every_30, reward) == []


def _runtime(**fields):
    return AdaptiveKL(types.SimpleNamespace(**{**DEFAULTS, "beta": 0.04, **fields}))


def test_adaptive_kl_feeds_the_alarm_each_step_and_warns_once(caplog):
    """Through the trainer's state: each step's raw KL (record, then end_step) and reward (observe_reward)."""
    runtime = _runtime()
    kl, reward = runaway_series()
    expected = first_alarm_step(kl, reward)
    mask = torch.ones(2, 4)
    fired = []
    with caplog.at_level(logging.WARNING, logger="unsloth_adaptive_kl"):
        for step, (k, r) in enumerate(zip(kl, reward), start=1):
            runtime.observe_reward(r)
            # a KL of exactly k on every token: the log-ratio solving exp(x) - x - 1 = k, and the policy at 0
            x = torch.tensor(_k3_inverse(k), dtype=torch.float64)
            raw, adapted = runtime.per_token(torch.zeros(2, 4, dtype=torch.float64), x.expand(2, 4), mask)
            runtime.record(raw, adapted, mask, training=True, beta=0.04)
            runtime.end_step(step)
            fired.append(runtime.alarm.fired)
    assert fired.index(True) + 1 == expected and all(fired[expected - 1 :])
    warnings = [r.getMessage() for r in caplog.records if "runaway alarm" in r.getMessage()]
    assert len(warnings) == 1 and f"at step {expected}:" in warnings[0] and "adaptive_kl/runaway_alarm" in warnings[0]


def _k3_inverse(k: float) -> float:
    """The positive x with exp(x) - x - 1 = k (bisection)."""
    low, high = 0.0, 10.0
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if math.expm1(mid) - mid < k else (low, mid)
    return (low + high) / 2
