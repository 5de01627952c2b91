"""What a controller's checkpoint state holds (a fresh controller's, a reward not yet used) and what a resumed one
refuses (a reward that is not a finite number, an invalid configured β), checked by value."""

import math

import pytest
import reference

from unsloth_adaptive_kl.controllers import DynamicBeta, RewardConditionedBeta, TargetKLBeta, make_controller


def test_a_fresh_controllers_state_holds_its_configured_beta_and_nothing_observed():
    common = {"beta": 0.1, "skipped_updates": 0, "configured_beta": 0.1}
    dynamic = DynamicBeta(reference.controller_config(0.1, beta_schedule_steps=50))
    assert dynamic.state_dict() == {"name": "dynamic", **common, "rewards": [], "new_reward": False}
    conditioned = RewardConditionedBeta(reference.controller_config(0.1))
    assert conditioned.state_dict() == {"name": "reward_conditioned", **common, "reward": None}
    assert conditioned.update(global_step=1, kl=None, num_completions=4) == 0.1  # no reward yet: no observation


def test_reward_conditioned_restores_a_reward_not_yet_used_and_uses_it_once():
    """A checkpoint taken between a reward and the update it moves β at: the resumed run's first update uses it."""
    cfg = reference.controller_config(0.1, beta_min=0.02, reward_beta_midpoint=0.5, reward_beta_width=0.1)
    saved = make_controller("reward_conditioned", cfg)
    saved.observe_reward(0.7)
    state = saved.state_dict()
    assert state["reward"] == 0.7
    resumed = make_controller("reward_conditioned", cfg)
    resumed.load_state_dict(state)
    expected = reference.NEXT_BETA["reward_conditioned"](0.1, cfg, None, None, 4, latest=0.7)
    assert expected == pytest.approx(0.02 + 0.08 / (1 + math.exp(-2.0)), rel=1e-12)  # z = (0.7 - 0.5) / 0.1 = 2
    assert resumed.update(global_step=1, kl=None, num_completions=4) == pytest.approx(expected, rel=1e-12)
    assert resumed.state_dict()["reward"] is None  # used
    assert resumed.update(global_step=2, kl=None, num_completions=4) == pytest.approx(expected, rel=1e-12)
    assert saved.update(global_step=1, kl=None, num_completions=4) == resumed.beta  # as the uninterrupted run


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), True, "0.5"], ids=["inf", "nan", "bool", "str"])
def test_a_checkpoint_reward_that_is_not_a_finite_number_is_refused_and_nothing_is_loaded(bad):
    conditioned = RewardConditionedBeta(reference.controller_config(0.1))
    with pytest.raises(ValueError) as info:
        conditioned.load_state_dict({**conditioned.state_dict(), "beta": 0.05, "reward": bad})
    assert str(info.value) == f"β-controller state: reward={bad!r} is not valid; allowed: a finite number or null"
    assert conditioned.beta == 0.1 and conditioned.reward is None
    dynamic = DynamicBeta(reference.controller_config(0.1))
    with pytest.raises(ValueError) as info:
        dynamic.load_state_dict({**dynamic.state_dict(), "beta": 0.05, "rewards": [0.5, bad]})
    assert str(info.value) == f"β-controller state: rewards={[0.5, bad]!r} is not valid; allowed: a list of finite numbers"
    assert dynamic.beta == 0.1 and list(dynamic.rewards) == []


def test_dynamic_keeps_a_reward_that_arrives_after_its_cut_off_pending():
    """From beta_schedule_steps on β is beta_min whatever the reward, so such a reward is used by no decay: the state
    says it is still pending, and a run resumed with a new β and a later cut-off decays with it at its first update."""
    cfg = reference.controller_config(0.1, beta_min=0.01, dynamic_beta_decay=0.5, reward_threshold=0.5, reward_window=2, beta_schedule_steps=2)
    saved = DynamicBeta(cfg)
    for step in (1, 2, 3):
        if step == 3:
            saved.observe_reward(0.9)
        assert saved.update(global_step=step, kl=None, num_completions=4) == (0.1 if step == 1 else 0.01)
    state = saved.state_dict()
    assert state["new_reward"] is True and state["rewards"] == [0.9] and state["beta"] == 0.01
    later = reference.controller_config(0.2, beta_min=0.01, dynamic_beta_decay=0.5, reward_threshold=0.5, reward_window=2, beta_schedule_steps=100)
    resumed = DynamicBeta(later)
    resumed.load_state_dict(state)  # β changed on resume (0.1 -> 0.2): the controller restarts from 0.2
    resumed.resume_at(3)
    assert resumed.beta == 0.2
    assert resumed.update(global_step=3, kl=None, num_completions=4) == 0.1  # decayed once with the pending 0.9
    assert resumed.update(global_step=4, kl=None, num_completions=4) == 0.1  # and only once


def test_an_invalid_configured_beta_in_a_checkpoint_is_named_with_the_controller_it_was_read_for():
    c = TargetKLBeta(reference.controller_config(0.2))
    with pytest.raises(ValueError) as info:
        c.load_state_dict({**c.state_dict(), "configured_beta": -1.0})
    assert str(info.value) == "β-controller state of the 'ziegler' controller: configured_beta=-1.0 is not valid; allowed: a finite number >= 0"


def _top_of_range_resumes(name):
    """beta_min + (beta - beta_min) * 1 is one ulp above beta for these values (found by tests/test_fuzz.py): the
    controller's β stays within [beta_min, beta], so a checkpoint of it resumes instead of being refused."""
    beta, floor = 0.0857657750048584, 0.006867962451560926
    assert floor + (beta - floor) * 1.0 > beta  # the rounding the controllers must not pass on
    cfg = reference.controller_config(beta, beta_min=floor, beta_schedule_steps=1, reward_beta_midpoint=0.0,
                                      reward_beta_width=1.0)
    saved = make_controller(name, cfg)
    if name == "reward_conditioned":
        saved.observe_reward(50.0)  # the logistic rounds to 1
    assert saved.update(global_step=0, kl=None, num_completions=4) == beta
    resumed = make_controller(name, cfg)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.beta == beta


def test_schedule_at_its_first_step_is_the_configured_beta_and_resumes():
    _top_of_range_resumes("schedule")


def test_reward_conditioned_at_a_saturated_reward_is_the_configured_beta_and_resumes():
    _top_of_range_resumes("reward_conditioned")
