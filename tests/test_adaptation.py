"""``AdaptiveKL``: what its β controller is fed, across micro-batches and optimizer steps, against float64
references (tests/reference.py) written from the controllers' definitions."""

import logging
from types import SimpleNamespace

import pytest
import reference
import torch

from unsloth_adaptive_kl import FIELDS, AdaptiveKL
from unsloth_adaptive_kl.controllers import controller_names
from unsloth_adaptive_kl.method import Method, format_method
from unsloth_adaptive_kl.shaping import SHAPING, shaping_names

BETA, BETA_MIN, CLIP, KL_TARGET, HORIZON = 0.2, 0.01, 0.1, 0.25, 40.0
#: Each optimizer step's micro-batches, (rows, tokens): shapes and valid-token counts change every step.
STEPS = [[(3, 5), (2, 7)], [(4, 4)], [(2, 6), (3, 3), (1, 5)], [(3, 8)]]
REWARDS = [1.0, -1.0, 1.0, 1.0]


def _adaptive(method: str, **overrides) -> AdaptiveKL:
    fields = {f.name: f.default for f in FIELDS}
    fields.update(
        beta=BETA, beta_min=BETA_MIN, kl_adaptation_method=method, kl_estimator="k3", kl_clip_threshold=CLIP,
        kl_target=KL_TARGET, kl_horizon=HORIZON, dynamic_beta_decay=0.5, reward_threshold=0.0, reward_window=2,
        beta_schedule_steps=1000,
    )  # fmt: skip
    fields.update(overrides)
    return AdaptiveKL(SimpleNamespace(**fields))


def _micro_batch(rows, tokens, seed):
    """Log-ratios in [-1.2, 1.2] (per-token k3 around KL_TARGET, often above CLIP), variable lengths, one empty row."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, tokens, generator=g) * 3 - 0.5
    ref = logp + (torch.rand(rows, tokens, generator=g) * 2.4 - 1.2)
    lengths = torch.randint(1, tokens + 1, (rows,), generator=g)
    lengths[-1] = 0 if rows > 1 else lengths[-1]
    mask = (torch.arange(tokens) < lengths[:, None]).long()
    return logp, ref, mask


@pytest.mark.parametrize("shaping", shaping_names())
@pytest.mark.parametrize("controller", controller_names())
def test_every_controller_steers_on_the_raw_kl_of_the_whole_step_whatever_the_shaping(controller, shaping):
    """The controller is fed the step's token-weighted mean of the *raw* KL over all its micro-batches (the docs:
    "the controller steers on the raw KL"), not the shaped KL that β multiplies, whatever shaping is joined with it."""
    state = _adaptive(format_method(Method(controller, (shaping,))))
    betas, expected, from_adapted = [], [BETA], [BETA]
    next_expected, next_from_adapted = reference.stepper(controller), reference.stepper(controller)
    window, seed = [], 0
    for micro_batches, reward in zip(STEPS, REWARDS):
        raw_sum = adapted_sum = tokens = completions = 0.0
        for rows, length in micro_batches:
            seed += 1
            logp, ref, mask = _micro_batch(rows, length, seed)
            state.record(*state.per_token(logp, ref, mask), mask, training=True, beta=state.beta)
            raw, shaped = reference.raw_and_shaped_kl(
                state.method_text, logp, ref, logp, mask, estimator="k3", clip_threshold=CLIP, kl_target=KL_TARGET,
                bias_correction=False,
            )  # fmt: skip
            raw_sum, adapted_sum = raw_sum + raw.sum().item(), adapted_sum + shaped.sum().item()
            tokens, completions = tokens + mask.sum().item(), completions + rows
        state.observe_reward(reward)
        window = (window + [reward])[-2:]
        step = len(betas) + 1
        betas.append(state.end_step(step))
        cfg, trailing = state.controller.config, sum(window) / len(window)
        expected.append(next_expected(expected[-1], cfg, raw_sum / tokens, trailing, completions, step=step, latest=reward))
        from_adapted.append(next_from_adapted(from_adapted[-1], cfg, adapted_sum / tokens, trailing, completions, step=step, latest=reward))
    assert betas == pytest.approx(expected[1:], rel=1e-6)  # the KL itself is float32
    if controller == "ziegler" and SHAPING[shaping].per_token:  # here the shaped KL would steer elsewhere: the case tells
        assert expected[1:] != pytest.approx(from_adapted[1:], rel=1e-3)


# -- found by mutation testing (docs/reliability.md, "Mutation testing") ---------------------------------------------
def test_a_restarted_controller_says_what_it_did_not_restore_and_applies_the_resumed_steps_schedule(caplog):
    saved = _adaptive("ziegler")
    saved.controller.beta = 0.05
    fresh = _adaptive("dynamic")
    fresh.controller.config = type(fresh.controller.config)(**{**fresh.controller.config.__dict__, "beta_schedule_steps": 3})
    caplog.clear()  # creation warns of the shared config's settings other methods read: not this test's subject
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        fresh.load_state_dict(saved.state_dict(), restart=True, global_step=2)
    assert fresh.beta == BETA  # step 2 is before beta_schedule_steps=3: the configured β
    (message,) = [r.getMessage() for r in caplog.records]
    assert message == (
        "unsloth_adaptive_kl: restart_beta_controller=True: the dynamic controller starts fresh from beta=0.2; the "
        "checkpoint's controller state (kl_adaptation_method='ziegler', beta=0.05) is not restored"
    )
    fresh.load_state_dict(saved.state_dict(), restart=True, global_step=3)
    assert fresh.beta == BETA_MIN  # from beta_schedule_steps on: the floor, at once


def test_a_resume_without_a_global_step_applies_the_schedule_of_step_0():
    """``load_state_dict``'s default ``global_step`` is 0, the first step. With ``beta_schedule_steps=1``, ``dynamic``
    trains step 0 with the restored β and steps from 1 on with the floor."""
    saved = _adaptive("dynamic").state_dict()
    for kwargs, beta in (({}, BETA), ({"global_step": 0}, BETA), ({"global_step": 1}, BETA_MIN)):
        fresh = _adaptive("dynamic")
        fresh.controller.config = type(fresh.controller.config)(**{**fresh.controller.config.__dict__, "beta_schedule_steps": 1})
        fresh.load_state_dict(saved, **kwargs)
        assert fresh.beta == beta, kwargs


def test_a_checkpoint_without_its_method_text_is_named_as_a_method_in_the_resume_error():
    state = _adaptive("none").state_dict()
    del state["kl_adaptation_method"]  # written before the method was saved
    with pytest.raises(ValueError, match=r"trained with a method \(no β controller\) and this run has kl_adaptation_method='ziegler'"):
        _adaptive("ziegler").load_state_dict(state)


def test_the_step_size_check_and_the_batch_statistic_reach_the_controller_and_the_estimator():
    state = _adaptive("ziegler")
    with pytest.raises(ValueError, match=r"kl_horizon=40\.0 is not valid for 400 completions"):
        state.check_step_size(400)
    state.check_step_size(199)
    assert state.batch_statistic(-torch.rand(2, 3), torch.ones(2, 3)) is None  # k3 has none
    bottom = _adaptive("none")
    bottom.term = type(bottom.term)(bottom.term.method, "bottom_q", (("kl_bottom_q", 0.5),), bottom.term.shaping_parameters)
    ref = torch.tensor([[-1.0, -4.0, -2.0], [-3.0, -9.0, -5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    assert bottom.batch_statistic(ref, mask).item() == -4.0  # the 2nd lowest of the 5 valid (-9 is masked): floor(0.5 * 5) = 2


def test_the_resume_error_names_both_methods_and_both_ways_out():
    state = _adaptive("ziegler").state_dict()
    with pytest.raises(ValueError) as error:
        _adaptive("dynamic").load_state_dict(state)
    assert str(error.value) == (
        "cannot resume: the checkpoint was trained with kl_adaptation_method='ziegler' (the 'ziegler' β controller) and "
        "this run has kl_adaptation_method='dynamic' (the 'dynamic' β controller); one β controller's state cannot be "
        "restored into another. Allowed: set restart_beta_controller=True to start the new controller fresh from "
        "beta=0.2 (the checkpoint's controller state is then not restored), or resume with a method of the "
        "checkpoint's controller"
    )


# -- the β course: one line when train() ends ------------------------------------------------------------------------


def _steps(state, rewards):
    """Optimizer steps with a reward each and no KL (None: a step without valid tokens); the β each trained with."""
    used = []
    for step, reward in enumerate(rewards, start=1):
        used.append(state.beta)
        state.observe_reward(reward)
        state.end_step(step)
    return used


def test_the_course_gives_the_beta_of_the_first_and_last_steps_and_how_often_it_changed():
    state = _adaptive("dynamic")  # decay 0.5 while the trailing mean (window 2) > 0; floor 0.01
    used = _steps(state, [1.0, 1.0, -3.0, -3.0, 1.0])
    # trailing means 1, 1, -1, -3, -1: it decays after steps 1 and 2 only
    assert used == [BETA, BETA / 2, BETA / 4, BETA / 4, BETA / 4]
    level, message = state.course_summary()
    assert level == logging.INFO
    assert message == (f"unsloth_adaptive_kl: kl_adaptation_method='dynamic': beta {BETA:g} -> {BETA / 4:g} over the 5 "
                       f"optimizer steps of this run (the beta each step trained with; it changed at 2 of them, lowest "
                       f"{BETA / 4:g}, highest {BETA:g})")
    state.begin_training()  # a second train(): counted from its own first step
    assert state.course_summary() is None
    _steps(state, [1.0])
    assert "over the 1 optimizer step of this run" in state.course_summary()[1]


def test_a_dynamic_beta_that_never_moved_is_a_warning_with_the_reward_it_never_passed():
    state = _adaptive("dynamic", reward_threshold=0.5)
    used = _steps(state, [0.1, 0.4, 0.3, 0.2])
    assert used == [BETA] * 4
    level, message = state.course_summary()
    assert level == logging.WARNING
    assert message == (f"unsloth_adaptive_kl: kl_adaptation_method='dynamic' never moved beta in the 4 optimizer steps "
                       f"of this run: every step trained with beta {BETA:g}, as a fixed beta would; its trailing mean "
                       "reward (the last reward_window=2 rewards) peaked at 0.35, never above reward_threshold=0.5: set "
                       "reward_threshold to a reward your task reaches (adaptive_kl/current_beta logs the beta of each step)")


# not a registry list: the controllers whose bounds are [beta_min, beta] (ziegler has no upper one, target its range)
@pytest.mark.parametrize("controller", ["dynamic", "schedule", "reward_conditioned"])
def test_a_controller_whose_settings_leave_beta_one_value_is_told_so_when_it_never_moved(controller):
    """beta_min = beta: the controller cannot move β; the end-of-run warning said no reason (an audit's finding)."""
    state = _adaptive(controller, beta_min=BETA, reward_threshold=-1.0)
    assert _steps(state, [1.0, 1.0, 1.0]) == [BETA] * 3
    level, message = state.course_summary()
    assert level == logging.WARNING and f"; its settings leave beta one value, {BETA:g} (e.g. beta_min = beta) (" in message


def test_a_controller_that_moved_only_at_the_last_update_is_not_said_to_have_never_moved():
    state = _adaptive("dynamic", reward_threshold=0.5)
    assert _steps(state, [0.1, 0.2, 2.0]) == [BETA] * 3  # the decay after step 3 trains no step of this run
    level, message = state.course_summary()
    assert level == logging.INFO and f"beta {BETA:g} -> {BETA:g}" in message and "changed at 0 of them" in message


@pytest.mark.parametrize("method", [m for m in reference.METHODS if not any(p in controller_names() for p in m.split("+"))])
def test_a_fixed_beta_has_no_course_line(method):
    state = _adaptive(method)
    _steps(state, [1.0, 0.0])
    assert state.course_summary() is None


def test_the_course_keeps_the_extremes_of_a_beta_that_rose_and_fell():
    from unsloth_adaptive_kl.adaptation import BetaCourse

    course = BetaCourse()
    for used, after in [(0.1, 0.2), (0.2, 0.05), (0.05, 0.05), (0.05, 0.05)]:
        course.add(used, after)
    assert (course.steps, course.first, course.last, course.low, course.high) == (4, 0.1, 0.05, 0.05, 0.2)
    assert (course.changes, course.updates_that_moved) == (2, 2)
    state = _adaptive("ziegler")
    state.course = course
    assert state.course_summary()[1].endswith("(the beta each step trained with; it changed at 2 of them, lowest 0.05, highest 0.2)")


@pytest.mark.parametrize("controller", controller_names())
def test_a_controller_at_beta_zero_is_said_to_leave_it_at_zero(controller):
    """A β of 0 (a config refuses it; a run resumed where dynamic or schedule had reached beta_min 0 starts there)."""
    state = _adaptive(controller, beta_min=0.0)
    state.beta = 0.0
    assert _steps(state, [1.0, 1.0, 1.0]) == [0.0] * 3
    level, message = state.course_summary()
    assert level == logging.WARNING
    assert message == (f"unsloth_adaptive_kl: kl_adaptation_method={controller!r} never moved beta in the 3 optimizer "
                       f"steps of this run: every step trained with beta 0, as a fixed beta would; beta is 0, which "
                       f"{controller} leaves at 0 (adaptive_kl/current_beta logs the beta of each step)")
