"""β controllers against step-by-step references written from their definitions."""

import pytest

from unsloth_adaptive_kl.controllers import ControllerConfig, DynamicBeta, FixedBeta, TargetKLBeta, make_controller


def test_fixed_beta_never_changes():
    c = FixedBeta(ControllerConfig(beta=0.04))
    c.observe_reward(10.0)
    assert [c.update(global_step=s, kl=5.0, num_completions=8) for s in range(1, 5)] == [0.04] * 4


def test_dynamic_decays_only_while_trailing_reward_exceeds_threshold():
    cfg = ControllerConfig(beta=0.1, beta_min=0.02, dynamic_beta_decay=0.5, reward_threshold=0.8, reward_window=2, beta_schedule_steps=100)
    c = DynamicBeta(cfg)
    rewards = [0.5, 1.0, 1.0, 0.2, 0.2, 1.0, 1.0, 1.0, 1.0]
    got, window, beta = [], [], 0.1
    for step, r in enumerate(rewards, start=1):
        c.observe_reward(r)
        got.append(c.update(global_step=step, kl=None, num_completions=8))
        window = (window + [r])[-2:]
        if sum(window) / len(window) > 0.8:
            beta = max(0.02, beta * 0.5)
        assert got[-1] == pytest.approx(beta)
    assert min(got) == 0.02  # floored at beta_min


def test_dynamic_drops_to_beta_min_from_schedule_step_and_stays():
    c = DynamicBeta(ControllerConfig(beta=0.1, beta_min=0.01, reward_threshold=10.0, beta_schedule_steps=3))
    betas = [c.update(global_step=s, kl=None, num_completions=4) for s in range(1, 6)]
    assert betas == [0.1, 0.1, 0.01, 0.01, 0.01]


def test_dynamic_with_zero_schedule_starts_at_beta_min():
    assert DynamicBeta(ControllerConfig(beta=0.1, beta_min=0.03, beta_schedule_steps=0)).beta == 0.03


def test_dynamic_ignores_nan_rewards():
    c = DynamicBeta(ControllerConfig(beta=0.1, reward_threshold=0.5, reward_window=3))
    c.observe_reward(float("nan"))
    assert c.trailing_reward() is None
    assert c.update(global_step=1, kl=None, num_completions=4) == 0.1


def test_target_follows_ziegler_update():
    cfg = ControllerConfig(beta=0.2, kl_target=0.1, kl_horizon=100.0)
    c = TargetKLBeta(cfg)
    beta = 0.2
    for step, kl in enumerate([0.05, 0.1, 0.3, 0.11, 0.0, 1e9], start=1):
        error = min(max(kl / 0.1 - 1, -0.2), 0.2)
        beta *= 1 + error * 16 / 100.0
        assert c.update(global_step=step, kl=kl, num_completions=16) == pytest.approx(beta, rel=1e-12)


def test_target_refuses_a_horizon_that_would_make_beta_non_positive():
    c = TargetKLBeta(ControllerConfig(beta=0.2, kl_target=0.1, kl_horizon=1.0))
    with pytest.raises(ValueError, match="kl_horizon"):
        c.update(global_step=1, kl=0.0, num_completions=8)


@pytest.mark.parametrize("name", ["fixed", "dynamic", "target"])
def test_state_dict_round_trip_continues_identically(name):
    cfg = ControllerConfig(beta=0.1, beta_min=0.001, reward_threshold=0.3, reward_window=3, beta_schedule_steps=50, kl_target=0.05, kl_horizon=50.0)
    a = make_controller(name, cfg)
    feed = [(0.2, 0.01), (0.9, 0.2), (0.5, 0.07), (0.1, 0.3), (0.8, 0.02), (0.7, 0.09)]
    for step, (r, kl) in enumerate(feed[:3], start=1):
        a.observe_reward(r)
        a.update(global_step=step, kl=kl, num_completions=8)
    b = make_controller(name, cfg)
    b.load_state_dict(a.state_dict())
    for step, (r, kl) in enumerate(feed[3:], start=4):
        for c in (a, b):
            c.observe_reward(r)
        assert a.update(global_step=step, kl=kl, num_completions=8) == b.update(global_step=step, kl=kl, num_completions=8)


def test_loading_another_controllers_state_fails_loudly():
    with pytest.raises(ValueError, match="dynamic"):
        FixedBeta(ControllerConfig(beta=0.1)).load_state_dict(DynamicBeta(ControllerConfig(beta=0.1)).state_dict())


@pytest.mark.parametrize("name", ["dynamic", "target"])
def test_zero_beta_is_absorbing(name):
    c = make_controller(name, ControllerConfig(beta=0.1, beta_min=0.0, beta_schedule_steps=1, reward_threshold=-1))
    c.beta = 0.0
    assert c.update(global_step=5, kl=10.0, num_completions=8) == 0.0
