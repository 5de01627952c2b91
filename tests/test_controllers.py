"""β controllers against step-by-step references written from their definitions."""

import pytest

from unsloth_adaptive_kl.controllers import (
    CONTROLLERS,
    ControllerConfig,
    ControllerMismatchError,
    DynamicBeta,
    FixedBeta,
    TargetKLBeta,
    controller_names,
    make_controller,
)


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


@pytest.mark.parametrize("name", ["fixed", *controller_names()])
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
    names = ["fixed", *controller_names()]
    for saved, name in zip(names, names[1:] + names[:1]):  # each into the next: every one refuses another's state
        c = make_controller(name, ControllerConfig(beta=0.1))
        with pytest.raises(ControllerMismatchError, match=f"state of {saved!r} into a {name!r} controller") as info:
            c.load_state_dict(make_controller(saved, ControllerConfig(beta=0.05)).state_dict())
        assert (info.value.saved, info.value.name) == (saved, name) and c.beta == 0.1  # the name is checked first


def test_resuming_with_another_controller_names_both_methods_and_the_restart_option():
    with pytest.raises(ValueError) as info:
        _adaptive("dynamic+clip").load_state_dict(_adaptive("length_normalized").state_dict())
    message = str(info.value)
    assert not isinstance(info.value, ControllerMismatchError)
    assert "kl_adaptation_method='length_normalized' (no β controller)" in message
    assert "kl_adaptation_method='dynamic+clip' (the 'dynamic' β controller)" in message
    assert "restart_beta_controller=True" in message and "beta=0.2" in message
    state = _adaptive("ziegler")
    state.load_state_dict(_adaptive("dynamic").state_dict(), restart=True)  # starts fresh: no error
    assert state.beta == 0.2


@pytest.mark.parametrize("name", controller_names())
def test_zero_beta_is_absorbing(name):
    c = make_controller(name, ControllerConfig(beta=0.1, beta_min=0.0, beta_schedule_steps=1, reward_threshold=-1))
    c.beta = 0.0
    assert c.update(global_step=5, kl=10.0, num_completions=8) == 0.0


# -- non-finite and empty observations (issue 15) ------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_target_skips_a_non_finite_kl_without_moving_beta_and_counts_it(bad, caplog):
    c = TargetKLBeta(ControllerConfig(beta=0.2, beta_min=0.0, kl_target=0.1, kl_horizon=100.0))
    before = c.update(global_step=1, kl=0.3, num_completions=16)  # a normal update first
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        assert c.update(global_step=2, kl=bad, num_completions=16) == before
        assert c.update(global_step=3, kl=bad, num_completions=16) == before
    assert c.skipped_updates == 2 and c.state_dict()["skipped_updates"] == 2
    assert caplog.text.count("non-finite KL") == 1  # warned once
    # the next finite KL moves β from where it was, by the usual factor
    assert c.update(global_step=4, kl=0.3, num_completions=16) == pytest.approx(before * (1 + 0.2 * 16 / 100.0), rel=1e-12)


def test_target_never_overflows_beta_to_inf():
    c = TargetKLBeta(ControllerConfig(beta=1e308, kl_target=0.1, kl_horizon=1.0))
    assert c.update(global_step=1, kl=1.0, num_completions=4) == 1e308  # 1e308 * 1.8 is inf: skipped
    assert c.skipped_updates == 1


@pytest.mark.parametrize("bad", [float("inf"), float("-inf")])
def test_dynamic_keeps_only_finite_rewards_in_its_window(bad):
    c = DynamicBeta(ControllerConfig(beta=0.1, reward_threshold=0.5, reward_window=3))
    c.observe_reward(1.0)
    c.observe_reward(bad)
    assert c.trailing_reward() == 1.0 and list(c.rewards) == [1.0]
    assert c.skipped_updates == 1
    assert c.update(global_step=1, kl=None, num_completions=4) == pytest.approx(0.09)


def test_dynamic_decays_once_per_new_reward_not_once_per_optimizer_step():
    # steps_per_generation=4 with one micro-batch per step: one reward, then 3 steps reusing its batch
    c = DynamicBeta(ControllerConfig(beta=0.04, dynamic_beta_decay=0.5, reward_threshold=0.0, beta_schedule_steps=100))
    betas = []
    for step in range(1, 9):
        if step % 4 == 1:
            c.observe_reward(1.0)
        betas.append(c.update(global_step=step, kl=None, num_completions=4))
    assert betas == [0.02] * 4 + [0.01] * 4


def test_dynamic_schedule_still_counts_optimizer_steps_without_new_rewards():
    c = DynamicBeta(ControllerConfig(beta=0.04, beta_min=0.001, reward_threshold=10.0, beta_schedule_steps=3))
    c.observe_reward(0.0)
    assert [c.update(global_step=s, kl=None, num_completions=4) for s in range(1, 5)] == [0.04, 0.04, 0.001, 0.001]


@pytest.mark.parametrize(
    "name, state, words",
    [
        ("dynamic", {"name": "dynamic", "beta": float("nan"), "rewards": []}, "beta=nan"),
        ("dynamic", {"name": "dynamic", "beta": -0.01, "rewards": []}, "beta=-0.01"),
        ("dynamic", {"name": "dynamic", "beta": 0.05, "rewards": [1.0, float("inf")]}, "rewards="),
        ("ziegler", {"name": "ziegler", "beta": float("inf")}, "beta=inf"),
        ("ziegler", {"name": "ziegler", "beta": -1.0}, "beta=-1.0"),
        ("fixed", {"name": "fixed", "beta": float("nan")}, "beta=nan"),
        ("fixed", {"name": "fixed", "beta": True}, "beta=True"),
        ("ziegler", {"name": "ziegler", "beta": 0.1, "configured_beta": float("inf")}, "configured_beta=inf"),
        ("dynamic", {"name": "dynamic", "beta": 0.1, "rewards": [], "configured_beta": -0.1}, "configured_beta=-0.1"),
    ],
)
def test_load_state_dict_refuses_a_non_finite_negative_or_impossible_beta(name, state, words):
    c = make_controller(name, ControllerConfig(beta=0.1))
    with pytest.raises(ValueError, match="allowed") as info:
        c.load_state_dict(state)
    assert words in str(info.value)
    assert c.beta == 0.1  # nothing was half-loaded


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.01, True, "0.1"])
def test_a_controller_config_refuses_a_beta_that_is_not_a_finite_number_at_least_0(bad):
    with pytest.raises(ValueError, match="allowed: a finite number >= 0") as info:
        ControllerConfig(beta=bad)
    assert f"beta={bad!r} is not valid" in str(info.value)


@pytest.mark.parametrize("bad", [float("nan"), float("-inf"), -1.0, False])
def test_setting_beta_by_hand_refuses_a_beta_that_is_not_a_finite_number_at_least_0(bad):
    import torch

    state = _adaptive("dynamic")
    for value in (bad, *([] if isinstance(bad, bool) else [torch.tensor(bad)])):
        with pytest.raises(ValueError, match="allowed: a finite number >= 0") as info:
            state.beta = value
        assert "beta=" in str(info.value) and state.beta == 0.2  # unchanged
    state.beta = torch.tensor(0.5, dtype=torch.float64)  # a 0-dim tensor or a number >= 0 is taken
    assert state.beta == 0.5 and state.controller.beta == 0.5


def test_a_restored_beta_outside_the_resumed_runs_bounds_is_brought_within_them_and_said(caplog):
    """A setting that bounds β changed on resume: the checkpoint's β is brought within the new bounds, with a warning
    naming both. Before: `dynamic` resumed with beta_min raised above the checkpoint's β trained below its floor (then
    "decayed" up to it); `target` resumed with a smaller target_beta_range, or a state above its configured β, was
    refused naming "the configured beta" (the bound is beta * target_beta_range). A β of 0 stays 0 (final)."""
    cases = [  # saved controller and β, resumed controller's settings, the β it resumes from
        ("dynamic", dict(beta=0.04), 0.01, dict(beta=0.04, beta_min=0.03), 0.03),
        ("reward_conditioned", dict(beta=0.04), 0.01, dict(beta=0.04, beta_min=0.02), 0.02),
        ("ziegler", dict(beta=0.04), 0.01, dict(beta=0.04, beta_min=0.02), 0.02),
        ("target", dict(beta=0.04, target_beta_range=5.0), 0.04312, dict(beta=0.04, target_beta_range=1.05), 0.04 * 1.05),
        ("target", dict(beta=0.04, target_beta_range=5.0), 0.01, dict(beta=0.04, target_beta_range=2.0), 0.02),
        ("dynamic", dict(beta=0.04), 0.03, dict(beta=0.04, beta_min=0.01), 0.03),  # within: as saved
    ]
    for name, before, saved_beta, after, expected in cases:
        saved = make_controller(name, ControllerConfig(**before))
        saved.beta = saved_beta
        resumed = make_controller(name, ControllerConfig(**after))
        caplog.clear()
        with caplog.at_level("INFO", logger="unsloth_adaptive_kl"):
            resumed.load_state_dict(saved.state_dict())
        assert resumed.beta == pytest.approx(expected, rel=1e-12), (name, after)
        said = caplog.text
        if expected != saved_beta:
            assert f"the checkpoint's beta={saved_beta:.6g} is outside what this run's settings allow the {name} controller" in said
            assert f"it resumes from beta={expected:.6g}" in said
        else:
            assert f"the {name} controller resumes from the checkpoint's beta={saved_beta:.6g}" in said
    old_format = make_controller("dynamic", ControllerConfig(beta=0.1))  # no configured_beta in the state: above the bound
    old_format.load_state_dict({"name": "dynamic", "beta": 0.5, "rewards": []})
    assert old_format.beta == 0.1
    zero = make_controller("dynamic", ControllerConfig(beta=0.04, beta_min=0.03))
    caplog.clear()
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        zero.load_state_dict({**make_controller("dynamic", ControllerConfig(beta=0.04)).state_dict(), "beta": 0.0})
    assert zero.beta == 0.0 and "beta=0, which is final" in caplog.text


def test_target_restarted_from_a_changed_beta_drops_the_cap_set_in_the_old_betas_units(caplog):
    """Before: resumed with beta 0.04 -> 0.4 after its target was declared unreachable (cap 0.0392), `target` trained
    one step at 0.4 and then at 0.0392, far below its new range [0.08, 2]."""
    saved = make_controller("target", ControllerConfig(beta=0.04, kl_target=0.01))
    saved.beta, saved.kl_mean, saved.updates = 0.0392, 0.5, 40
    saved.reachable, saved.ceiling, saved.least_kl, saved.least_kl_beta = False, 0.0392, 0.5, 0.0392
    saved.episode = [1, 0.0392, 0.6, 3, 1.5]
    resumed = make_controller("target", ControllerConfig(beta=0.4, kl_target=0.01))
    with caplog.at_level("INFO", logger="unsloth_adaptive_kl"):
        resumed.load_state_dict(saved.state_dict())
    assert resumed.beta == 0.4 and resumed.ceiling is None and resumed.reachable and resumed.episode is None
    assert (resumed.kl_mean, resumed.updates) == (0.5, 40)  # the smoothed KL is in KL units: kept
    assert resumed.upper() == pytest.approx(0.4 * resumed.config.target_beta_range)
    assert "start afresh" in caplog.text
    resumed.update(global_step=41, kl=0.5, num_completions=4)
    assert resumed.beta > 0.4  # the KL is above the target: β rises within the new range, no old cap
    same = make_controller("target", ControllerConfig(beta=0.04, kl_target=0.01))
    same.load_state_dict(saved.state_dict())  # the same beta: the run goes on, its cap kept
    assert same.ceiling == 0.0392 and not same.reachable


def test_target_cap_is_never_below_the_range_after_a_resume_that_changed_it():
    saved = make_controller("target", ControllerConfig(beta=0.04, target_beta_range=5.0))
    saved.beta, saved.reachable, saved.ceiling, saved.least_kl, saved.least_kl_beta = 0.01, False, 0.01, 0.3, 0.01
    resumed = make_controller("target", ControllerConfig(beta=0.04, target_beta_range=1.05))
    resumed.load_state_dict(saved.state_dict())
    assert resumed.lower() <= resumed.beta <= resumed.upper() and resumed.upper() == pytest.approx(resumed.lower())
    resumed.update(global_step=5, kl=10.0, num_completions=4)
    assert resumed.beta >= resumed.lower() - 1e-15


def test_a_schedule_resumed_with_other_steps_says_the_beta_its_schedule_sets(caplog):
    """Before: "resumes from the checkpoint's beta=0.02", and the step trained at 0.03 (the schedule recomputed)."""
    saved = _adaptive("schedule", beta=0.04, beta_schedule_steps=4)
    saved.controller.update(global_step=2, kl=None, num_completions=0)
    resumed = _adaptive("schedule", beta=0.04, beta_schedule_steps=8)
    with caplog.at_level("INFO", logger="unsloth_adaptive_kl"):
        resumed.load_state_dict(saved.state_dict(), global_step=2)
    assert resumed.beta == pytest.approx(0.03)
    assert "at optimizer step 2 the schedule controller's schedule sets beta=0.03 (from 0.02)" in caplog.text


def test_target_beta_above_the_initial_one_loads():  # target may legitimately raise β
    c = make_controller("ziegler", ControllerConfig(beta=0.1))
    c.load_state_dict({"name": "ziegler", "beta": 0.3})
    assert c.beta == 0.3 and c.skipped_updates == 0  # a checkpoint written before skipped_updates existed


def test_target_refuses_a_horizon_too_small_for_the_step_before_training():
    c = TargetKLBeta(ControllerConfig(beta=0.2, kl_horizon=0.5))
    with pytest.raises(ValueError, match=r"kl_horizon=0\.5 .*4 completions.*allowed: kl_horizon > 0\.8"):
        c.check_step_size(4)
    TargetKLBeta(ControllerConfig(beta=0.2, kl_horizon=0.81)).check_step_size(4)
    make_controller("dynamic", ControllerConfig(beta=0.2, kl_horizon=0.5)).check_step_size(4)  # not its field


def _adaptive(method, **fields):
    from types import SimpleNamespace

    from unsloth_adaptive_kl import AdaptiveKL, FIELDS

    config = SimpleNamespace(**{**{f.name: f.default for f in FIELDS}, "beta": 0.2, "kl_adaptation_method": method})
    for name, value in fields.items():
        setattr(config, name, value)
    return AdaptiveKL(config)


def test_a_step_with_no_valid_token_is_no_observation_for_target():
    import torch

    state = _adaptive("ziegler", kl_target=0.1, kl_horizon=100.0)
    mask = torch.zeros(4, 5, dtype=torch.long)  # every completion masked (e.g. all truncated)
    logp = -torch.rand(4, 5)
    raw, adapted = state.per_token(logp, logp - 3.0, mask)  # a large KL on the masked tokens
    state.record(raw, adapted, mask, training=True, beta=state.beta)
    assert state.end_step(1) == 0.2  # not treated as KL = 0 (which would lower β)
    assert state.skipped_updates == 0  # no observation, not a bad one
    mask[0, :2] = 1
    state.record(*state.per_token(logp, logp - 3.0, mask), mask, training=True, beta=state.beta)
    assert state.end_step(2) == pytest.approx(0.2 * (1 + 0.2 * 4 / 100.0))  # a real KL far above target raises β


def test_a_nan_kl_from_a_nan_reference_logprob_leaves_beta_and_is_counted():
    import torch

    state = _adaptive("ziegler", beta_min=0.0)
    mask = torch.ones(2, 3, dtype=torch.long)
    logp = -torch.rand(2, 3)
    ref = logp - 0.5
    ref[1] = float("nan")  # one completion's reference log-probs are NaN
    state.record(*state.per_token(logp, ref, mask), mask, training=True, beta=state.beta)
    assert state.end_step(1) == 0.2 and state.skipped_updates == 1


def test_dynamic_logs_once_when_the_schedule_drops_beta_to_its_floor_whatever_the_reward(caplog):
    c = DynamicBeta(ControllerConfig(beta=0.1, beta_min=0.01, beta_schedule_steps=3, reward_threshold=0.8, reward_window=2))
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        for step in range(6):
            c.observe_reward(0.1)  # far below the threshold: no decay, only the schedule acts
            c.update(global_step=step + 1, kl=0.5, num_completions=4)
    records = [r.getMessage() for r in caplog.records if "beta_schedule_steps" in r.getMessage()]
    assert c.beta == 0.01 and len(records) == 1, records
    assert "from optimizer step 3 (beta_schedule_steps=3) beta = beta_min = 0.01 (it was 0.1)" in records[0]
    assert "whatever the reward (trailing mean 0.1, reward_threshold 0.8)" in records[0]


def test_controller_mismatch_error_crosses_processes_intact():
    import pickle

    from unsloth_adaptive_kl.controllers import ControllerMismatchError

    error = pickle.loads(pickle.dumps(ControllerMismatchError("fixed", "dynamic")))
    assert (error.saved, error.name) == ("fixed", "dynamic") and str(error) == str(ControllerMismatchError("fixed", "dynamic"))


# -- every controller with a β floor (issue 38) --------------------------------------------------------------------
def test_every_registered_controller_has_a_float64_reference():
    import reference

    assert set(controller_names()) <= set(reference.NEXT_BETA) | set(reference.STATEFUL)


@pytest.mark.parametrize("name", controller_names())
def test_every_controller_stops_at_beta_min_and_leaves_it_when_the_observations_say_so(name):
    """β is floored at beta_min > 0 (never below it) and the floor is not absorbing: a KL far above target raises
    ``target`` off it again, a high reward ``reward_conditioned`` (whose logistic is within 1e-6 of its floor 20 widths
    below its midpoint). The observations (a low reward and a KL far below
    target, then the opposite) drive every adapting controller to beta_min within a few steps (``schedule``: at
    ``beta_schedule_steps``), each step checked against its float64 reference."""
    import reference

    cfg = reference.controller_config(
        0.1, beta_min=0.06, dynamic_beta_decay=0.5, reward_threshold=-2.0, reward_window=1, beta_schedule_steps=4,
        kl_target=0.1, kl_horizon=10.0, beta_schedule="linear", reward_beta_midpoint=0.0, reward_beta_width=0.05,
        target_warmup_steps=0, target_gain=1.0, target_max_fall=0.5,  # target: falls to its floor at once
    )  # fmt: skip
    c = make_controller(name, cfg)
    observations = [(-1.0, 0.0)] * 5 + [(1.0, 1.0)] * 2  # (reward, kl): low reward and KL, then high
    betas, beta, next_beta = [], cfg.beta, reference.stepper(name)
    for step, (reward, kl) in enumerate(observations, start=1):
        c.observe_reward(reward)
        betas.append(c.update(global_step=step, kl=kl, num_completions=8))
        beta = next_beta(beta, cfg, kl, reward, 8, step=step, latest=reward)
        assert betas[-1] == pytest.approx(beta, rel=1e-12), (step, betas)
    assert min(betas) >= cfg.beta_min
    assert CONTROLLERS[name].cls.adapts_beta
    assert min(betas) == pytest.approx(cfg.beta_min, rel=1e-6)  # the floor was reached, so it was tested


# -- found by mutation testing (docs/reliability.md, "Mutation testing") ---------------------------------------------
def test_dynamic_restores_a_reward_not_yet_used_and_its_window_length():
    """A checkpoint taken between a reward and the decay it causes decays at the resumed run's first update; the
    restored window keeps reward_window's length (the oldest reward leaves it)."""
    cfg = ControllerConfig(beta=0.1, beta_min=0.001, dynamic_beta_decay=0.5, reward_threshold=0.5, reward_window=2, beta_schedule_steps=50)
    saved = DynamicBeta(cfg)
    saved.observe_reward(0.9)  # not yet used by a decay
    assert saved.state_dict()["new_reward"] is True
    resumed = DynamicBeta(cfg)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.update(global_step=1, kl=None, num_completions=4) == 0.05
    assert resumed.update(global_step=2, kl=None, num_completions=4) == 0.05  # used: no second decay
    resumed.observe_reward(0.0)
    resumed.observe_reward(0.0)  # the 0.9 leaves the window of 2
    assert resumed.trailing_reward() == 0.0
    idle = DynamicBeta(cfg)
    idle.load_state_dict({**saved.state_dict(), "new_reward": False})
    assert idle.update(global_step=1, kl=None, num_completions=4) == 0.1
    old = {k: v for k, v in saved.state_dict().items() if k != "new_reward"}  # written before new_reward existed
    idle.load_state_dict(old)
    assert idle.update(global_step=1, kl=None, num_completions=4) == 0.1  # no reward is taken as unused
    with pytest.raises(ValueError, match=r"new_reward='yes' is not valid; allowed: true or false"):
        idle.load_state_dict({**saved.state_dict(), "new_reward": "yes"})


def test_the_skip_warning_names_the_controller_the_value_and_the_beta_it_kept(caplog):
    c = TargetKLBeta(ControllerConfig(beta=0.2))
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        c.update(global_step=1, kl=float("inf"), num_completions=4)
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith("unsloth_adaptive_kl: the ziegler controller got a non-finite KL (inf) and left beta at 0.2")
    assert "counted in adaptive_kl/skipped_updates (this warning is shown once)" in message


def test_a_restored_controller_keeps_its_skip_count_and_refuses_a_bad_one():
    saved = TargetKLBeta(ControllerConfig(beta=0.2))
    saved.update(global_step=1, kl=float("nan"), num_completions=4)
    state = saved.state_dict()
    assert state["skipped_updates"] == 1 and state["configured_beta"] == 0.2
    restored = TargetKLBeta(ControllerConfig(beta=0.2))
    restored.load_state_dict(state)
    assert restored.skipped_updates == 1
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=f"skipped_updates={bad!r} is not valid; allowed: an integer >= 0"):
            restored.load_state_dict({**state, "skipped_updates": bad})


def test_a_restored_beta_is_named_with_its_controller_when_refused_and_may_equal_the_configured_one(caplog):
    c = DynamicBeta(ControllerConfig(beta=0.1))
    with pytest.raises(ValueError, match=r"β-controller state of the 'dynamic' controller: beta=-1\.0"):
        c.load_state_dict({**c.state_dict(), "beta": -1.0})
    c.load_state_dict({**c.state_dict(), "beta": 0.1})  # equal to the configured β: allowed
    assert c.beta == 0.1
    fixed = FixedBeta(ControllerConfig(beta=0.1))
    with caplog.at_level("INFO", logger="unsloth_adaptive_kl"):
        fixed.load_state_dict({**fixed.state_dict(), "beta": 0.1})
        assert "resumed with the configured beta" not in caplog.text  # the same β: nothing to say
        fixed.load_state_dict({**fixed.state_dict(), "beta": 0.3})
    assert fixed.beta == 0.1 and "resumed with the configured beta=0.1 (the checkpoint was trained with beta=0.3)" in caplog.text


def test_a_changed_beta_on_resume_names_the_checkpoints_beta(caplog):
    saved = TargetKLBeta(ControllerConfig(beta=0.2))
    saved.beta = 0.15
    resumed = TargetKLBeta(ControllerConfig(beta=0.4))
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        resumed.load_state_dict(saved.state_dict())
    assert resumed.beta == 0.4
    assert "restarts from beta=0.4 instead of the checkpoint's beta=0.15, keeping the rest of its state" in caplog.text


def test_reward_conditioned_with_the_default_beta_min_of_zero_never_reaches_zero_and_recovers():
    """With ``beta_min = 0`` β is ``beta`` times the logistic of the reward: far below the midpoint (where
    ``exp`` would overflow and the logistic underflow) it stays above 0, so it is not final, and a high reward
    brings it back, each step against the float64 reference."""
    import reference

    cfg = reference.controller_config(0.1, reward_beta_midpoint=0.8, reward_beta_width=0.001)
    assert cfg.beta_min == 0.0  # the default
    c = make_controller("reward_conditioned", cfg)
    beta = cfg.beta
    for reward in (0.0, -5.0, 0.7, 0.9):  # z = -800, -5800, -100, 100
        c.observe_reward(reward)
        got = c.update(global_step=1, kl=None, num_completions=8)
        beta = reference.NEXT_BETA["reward_conditioned"](beta, cfg, None, reward, 8, step=1, latest=reward)
        assert got > 0.0 and got == pytest.approx(beta, rel=1e-12, abs=1e-300), (reward, got, beta)
    assert got == pytest.approx(cfg.beta, rel=1e-12)  # recovered to beta at a high reward


def test_target_says_why_it_never_moved_beta():
    """The reason the line said when training ends gives for a `target` that never moved β: a KL below the target
    during its warm-up (when it may raise β, not lower it), or with β at its lower bound."""
    cfg = ControllerConfig(beta=0.04, kl_target=0.01, target_warmup_steps=20, target_beta_range=5.0, beta_min=0.0)
    warming = make_controller("target", cfg)
    for step in range(1, 6):
        assert warming.update(global_step=step, kl=0.001, num_completions=4) == 0.04
    assert warming.idle_reason() == ("its smoothed KL (0.001) stayed below kl_target=0.01, and in its first "
                                     "target_warmup_steps=20 updates target may raise beta but not lower it")
    floored = make_controller("target", ControllerConfig(beta=0.04, kl_target=0.01, target_warmup_steps=0,
                                                         target_beta_range=1.0, beta_min=0.0))
    for step in range(1, 4):
        assert floored.update(global_step=step, kl=0.001, num_completions=4) == 0.04  # range 1: β0 is its floor
    assert floored.idle_reason() == ("its smoothed KL (0.001) was below kl_target=0.01 with beta at its lower bound "
                                     "(0.04: beta / target_beta_range, or beta_min)")
    assert make_controller("target", cfg).idle_reason() == "no step had a KL to steer on"
