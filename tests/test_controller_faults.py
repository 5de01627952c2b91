"""A registered (user) β controller is checked as ``trainer.beta`` is (issue 52, findings 2-4), and the built-ins'
edges that used to pass silently (findings 6, 10, and a surviving mutant of ``reward_conditioned``): each fault is
refused or said, naming the controller."""

import logging
import math
from types import SimpleNamespace

import pytest
import torch

from unsloth_adaptive_kl import AdaptiveKL, BetaController, register_controller
from unsloth_adaptive_kl.config import DEFAULTS, FIELDS, validate
from unsloth_adaptive_kl.controllers import CONTROLLERS, ControllerConfig, make_controller, unregister_controller


def _config(method, **fields):
    return SimpleNamespace(**{**DEFAULTS, "kl_adaptation_method": method, "beta": 0.04, **fields})


@pytest.fixture
def user_controller():
    """Register ``faulty``, whose update sets ``self.beta`` to what ``BEHAVIOUR`` says and returns what it says."""
    behaviour = {}

    @register_controller("faulty")
    class Faulty(BetaController):
        def update(self, *, global_step, kl, num_completions):
            self.beta = behaviour.get("set", self.beta)
            return behaviour.get("returned", self.beta)

    yield behaviour
    unregister_controller("faulty")


@pytest.mark.parametrize(
    "bad", [math.nan, math.inf, -0.5, torch.tensor(0.02), True], ids=["nan", "inf", "negative", "tensor", "bool"]
)
def test_a_user_controllers_bad_beta_after_an_update_is_refused_naming_the_controller(user_controller, bad):
    """Finding 2: a NaN, infinite, negative, tensor or bool β trained silently (a negative β turns the KL into a
    bonus; a tensor dies at the first checkpoint save). It is refused as ``trainer.beta = bad`` is."""
    state = AdaptiveKL(_config("faulty"))
    user_controller["set"] = bad
    with pytest.raises(ValueError, match=r"β controller 'faulty' \(.*Faulty\) after update\(global_step=1\): self\.beta=") as error:
        state.end_step(1)
    assert "allowed: a finite number >= 0" in str(error.value)


def test_a_returned_beta_that_is_not_self_beta_is_refused(user_controller):
    """Finding 3: a controller that returned a new β without setting ``self.beta`` stayed at its first β."""
    state = AdaptiveKL(_config("faulty"))
    user_controller["returned"] = 0.02
    with pytest.raises(ValueError, match=r"'faulty'.*returned 0\.02 but left self\.beta=0\.04.*set self\.beta"):
        state.end_step(1)


def test_a_returned_beta_equal_to_self_beta_trains_on_and_an_int_beta_becomes_a_float(user_controller):
    state = AdaptiveKL(_config("faulty"))
    user_controller["set"] = 1
    assert state.end_step(1) == 1.0 and isinstance(state.beta, float) and isinstance(state.controller.beta, float)


def test_a_controller_that_overrides_update_without_adapts_beta_resumes_from_the_checkpoints_beta():
    """Finding 4: without ``adapts_beta = True`` a halving controller resumed at the configured β (0.04, 0.02 after a
    checkpoint at 0.01). ``register_controller`` now sets it for a class that overrides ``update``."""

    @register_controller("halving")
    class Halving(BetaController):
        def update(self, *, global_step, kl, num_completions):
            self.beta = self.beta * 0.5
            return self.beta

    try:
        assert Halving.adapts_beta is True
        uninterrupted = AdaptiveKL(_config("halving"))
        betas = [uninterrupted.end_step(step) for step in (1, 2, 3, 4)]
        assert betas == [0.02, 0.01, 0.005, 0.0025]
        first = AdaptiveKL(_config("halving"))
        first.end_step(1), first.end_step(2)
        resumed = AdaptiveKL(_config("halving"))
        resumed.load_state_dict(first.state_dict(), global_step=2)
        assert [resumed.beta, resumed.end_step(3), resumed.end_step(4)] == [0.01, 0.005, 0.0025]
    finally:
        unregister_controller("halving")


def test_a_controller_that_says_adapts_beta_false_itself_keeps_it():
    @register_controller("declared_fixed")
    class DeclaredFixed(BetaController):
        adapts_beta = False

        def update(self, *, global_step, kl, num_completions):
            return self.beta

    try:
        assert DeclaredFixed.adapts_beta is False and CONTROLLERS["declared_fixed"].cls is DeclaredFixed
    finally:
        unregister_controller("declared_fixed")


def test_schedule_with_a_zero_step_schedule_is_refused_naming_the_field():
    """Finding 6: ``schedule`` with ``beta_schedule_steps=0`` set β = beta_min (0 by default) for the whole run without
    a word, under the reward placement too, and still built a reference model."""
    for placement in ("loss", "reward"):
        with pytest.raises(ValueError, match=r"beta_schedule_steps=0 is not valid with the 'schedule' β controller.*beta_min=0"):
            validate(_config("schedule", beta_schedule_steps=0, kl_placement=placement))
    with pytest.raises(ValueError, match=r"beta_schedule_steps=0 is not valid.*beta_min=0\.01 from the first"):
        validate(_config("schedule", beta_schedule_steps=0, beta_min=0.01))
    validate(_config("schedule", beta_schedule_steps=1))


def test_the_help_of_beta_schedule_steps_gives_both_controllers_meanings():
    """Finding 6: the --help text gave only dynamic's meaning."""
    (field,) = [f for f in FIELDS if f.name == "beta_schedule_steps"]
    assert "'dynamic'" in field.help and "'schedule'" in field.help and "reaches beta_min" in field.help


@pytest.mark.parametrize("monitor", [False, True])
def test_dynamics_cut_off_to_zero_says_the_reference_model_is_off_only_without_kl_monitor(caplog, monitor):
    """Finding 10: under kl_monitor the reference model is still run at β = 0; the warning said it was off."""
    with caplog.at_level(logging.WARNING, logger="unsloth_adaptive_kl"):
        AdaptiveKL(_config("dynamic", beta_schedule_steps=0, kl_monitor=monitor))
    (message,) = [r.getMessage() for r in caplog.records if "beta_schedule_steps=0" in r.getMessage()]
    assert ("reference model are off" in message) is not monitor
    assert ("kl_monitor=True: the KL is still computed" in message) is monitor


def test_reward_conditioned_ignores_a_nan_reward_without_counting_a_skip(caplog):
    """A surviving mutant (issue 52): counting a NaN reward (every reward function returned None) as a skipped update.
    The docs: a NaN reward is no observation; ±inf is skipped and counted."""
    c = make_controller("reward_conditioned", ControllerConfig(0.1, beta_min=0.01, reward_beta_midpoint=0.5, reward_beta_width=0.1))
    with caplog.at_level(logging.WARNING, logger="unsloth_adaptive_kl"):
        c.observe_reward(math.nan)
        assert c.update(global_step=1, kl=0.1, num_completions=4) == 0.1
    assert c.skipped_updates == 0 and not caplog.records
    c.observe_reward(math.inf)
    assert c.skipped_updates == 1 and c.update(global_step=2, kl=0.1, num_completions=4) == 0.1


def test_a_user_controller_that_leaves_a_beta_of_zero_is_refused(user_controller):
    """β = 0 is final (the docs): the reference log-probs are no longer computed, so a β that came back would have
    nothing to multiply (TRL would fail with a KeyError at a later loss)."""
    state = AdaptiveKL(_config("faulty"))
    user_controller["set"] = 0.0
    assert state.end_step(1) == 0.0
    user_controller["set"] = 0.02
    with pytest.raises(ValueError, match=r"'faulty'.*moved beta from 0 to 0\.02; allowed: beta stays 0 once it is 0"):
        state.end_step(2)
