"""β step by step at the controllers' edges (a β of exactly 1, a β of 0, a cut-off at step 0 or 1, the cosine
schedule, the target controller's smallest horizon, the reward-conditioned logistic's floor), against the float64
references of tests/reference.py or values derived by hand from the documented formulas."""

import math

import pytest
import reference

from unsloth_adaptive_kl.controllers import CONTROLLERS, DynamicBeta, TargetKLBeta, controller_names, make_controller

BUILTIN = [name for name in controller_names() if CONTROLLERS[name].builtin]


def config(beta, **settings):
    base = dict(
        beta_min=0.06, dynamic_beta_decay=0.5, reward_threshold=-2.0, reward_window=1, beta_schedule_steps=4, kl_target=0.1,
        kl_horizon=10.0, beta_schedule="linear", reward_beta_midpoint=0.0, reward_beta_width=0.5,
        target_warmup_steps=0, target_gain=1.0, target_max_fall=0.5,  # target: a KL of 0 lowers β at once
    )  # fmt: skip
    return reference.controller_config(beta, **{**base, **settings})


@pytest.mark.parametrize("name", BUILTIN)
def test_every_controller_moves_a_beta_of_exactly_one_as_its_reference_does(name):
    """β = 1 is a β like any other (only β = 0 is final): each step against the float64 reference."""
    cfg = config(1.0)
    c = make_controller(name, cfg)
    beta, next_beta = cfg.beta, reference.stepper(name)
    for step, (reward, kl) in enumerate([(-1.0, 0.0), (-1.0, 0.0), (1.0, 1.0)], start=1):
        c.observe_reward(reward)
        got = c.update(global_step=step, kl=kl, num_completions=8)
        beta = next_beta(beta, cfg, kl, reward, 8, step=step, latest=reward)
        assert got == pytest.approx(beta, rel=1e-12), (step, got, beta)
    assert c.beta < 1.0


@pytest.mark.parametrize("name", BUILTIN)
def test_a_beta_of_zero_stays_zero_whatever_the_reward_the_kl_or_the_schedule_says(name):
    """β = 0 is final (the reference model is no longer run): a high reward, a KL far above target and a schedule
    that has not reached its end would each give a β > 0 otherwise."""
    cfg = config(0.1, beta_min=0.0, beta_schedule_steps=10, reward_threshold=2.0, reward_beta_midpoint=0.0)
    c = make_controller(name, cfg)
    c.beta = 0.0
    for step in (1, 2):
        c.observe_reward(1.0)
        assert c.update(global_step=step, kl=1.0, num_completions=8) == 0.0
    c.resume_at(3)
    assert c.beta == 0.0


@pytest.mark.parametrize("shape", ["linear", "cosine"])
@pytest.mark.parametrize("steps", [0, 1, 4])
def test_the_schedule_follows_its_shape_from_beta_to_beta_min_then_stays(shape, steps):
    cfg = config(0.1, beta_min=0.02, beta_schedule=shape, beta_schedule_steps=steps)
    c = make_controller("schedule", cfg)
    assert c.beta == pytest.approx(reference.NEXT_BETA["schedule"](None, cfg, None, None, 0, step=0), rel=1e-12)
    assert c.beta == (0.02 if steps == 0 else 0.1)  # a cut-off at step 0: beta_min from the first step
    for step in range(1, steps + 3):
        c.observe_reward(1.0)
        got = c.update(global_step=step, kl=0.5, num_completions=8)
        assert got == pytest.approx(reference.NEXT_BETA["schedule"](None, cfg, 0.5, 1.0, 8, step=step), rel=1e-12), (step, got)
    assert c.beta == pytest.approx(0.02, rel=1e-12)


def test_the_cosine_schedule_is_half_a_cosine_period_by_hand():
    c = make_controller("schedule", config(0.1, beta_min=0.02, beta_schedule="cosine", beta_schedule_steps=4))
    left = [(1 + math.cos(math.pi * t / 4)) / 2 for t in range(1, 5)]  # 0.8536, 0.5, 0.1464, 0
    got = [c.update(global_step=t, kl=None, num_completions=8) for t in range(1, 5)]
    assert got == pytest.approx([0.02 + 0.08 * x for x in left], rel=1e-12)
    assert got[1] == pytest.approx(0.06, rel=1e-12)  # halfway in steps, halfway in β


@pytest.mark.parametrize("shape", ["linear", "cosine"])
def test_a_resumed_schedule_sets_the_beta_of_the_step_about_to_start(shape):
    cfg = config(0.1, beta_min=0.02, beta_schedule=shape, beta_schedule_steps=8)
    for step in (0, 3, 8, 12):
        c = make_controller("schedule", cfg)
        c.resume_at(step)
        assert c.beta == pytest.approx(reference.NEXT_BETA["schedule"](None, cfg, None, None, 0, step=step), rel=1e-12), step


def test_dynamic_trains_its_first_step_with_beta_when_the_cut_off_is_step_one():
    c = DynamicBeta(config(0.1, beta_min=0.01, beta_schedule_steps=1))
    assert c.beta == 0.1  # step 0 is before the cut-off
    assert c.update(global_step=1, kl=None, num_completions=8) == 0.01


def test_target_refuses_a_horizon_of_exactly_a_fifth_of_the_steps_completions():
    """kl_horizon = 0.2 n makes the factor 1 - 0.2 n / kl_horizon exactly 0 (β would drop to beta_min at once)."""
    with pytest.raises(ValueError, match=r"allowed: kl_horizon > 2\.0$"):
        TargetKLBeta(config(0.1, kl_horizon=2.0)).check_step_size(10)
    TargetKLBeta(config(0.1, kl_horizon=2.0000001)).check_step_size(10)  # just above: allowed


def test_reward_conditioned_far_below_its_midpoint_holds_the_documented_floor():
    """The logistic's argument is floored at -700 (documented): far below the midpoint β = beta_min + (beta -
    beta_min) / (1 + e^700), a positive number, not 0."""
    c = make_controller("reward_conditioned", config(0.1, beta_min=0.0, reward_beta_midpoint=0.0, reward_beta_width=1.0))
    c.observe_reward(-800.0)
    floor = 0.1 / (1.0 + math.exp(700.0))  # 9.9e-306
    assert c.update(global_step=1, kl=None, num_completions=8) == pytest.approx(floor, rel=1e-12, abs=0.0)
    assert c.beta > 0.0
