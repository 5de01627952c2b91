"""The controllers' log lines, word for word: what a user reads when an observation is skipped, when a run resumes,
and when the dynamic controller's cut-off drops β to its floor."""

import pytest

from unsloth_adaptive_kl.controllers import (
    CONTROLLERS,
    BetaController,
    ControllerConfig,
    DynamicBeta,
    FixedBeta,
    TargetKLBeta,
    controller_names,
    make_controller,
)

#: The built-in controllers that read the reward.
READ_REWARD = [n for n in controller_names() if CONTROLLERS[n].builtin and CONTROLLERS[n].cls.observe_reward is not BetaController.observe_reward]
SKIPPED = "such observations are skipped and counted in adaptive_kl/skipped_updates (this warning is shown once)"


def messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "unsloth_adaptive_kl"]


@pytest.mark.parametrize("name", READ_REWARD)
def test_a_non_finite_reward_is_named_in_the_skip_warning(name, caplog):
    c = make_controller(name, ControllerConfig(0.1))
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        c.observe_reward(float("inf"))
        c.observe_reward(float("-inf"))
    assert messages(caplog) == [f"unsloth_adaptive_kl: the {name} controller got a non-finite reward (inf) and left beta at 0.1; {SKIPPED}"]
    assert c.skipped_updates == 2 and c.update(global_step=1, kl=None, num_completions=4) == 0.1


def test_a_beta_update_that_would_overflow_is_named_in_the_skip_warning(caplog):
    c = TargetKLBeta(ControllerConfig(1e308, kl_target=0.1, kl_horizon=1.0))
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        assert c.update(global_step=1, kl=1.0, num_completions=4) == 1e308  # 1e308 * 1.8 is inf: skipped
    assert messages(caplog) == [f"unsloth_adaptive_kl: the ziegler controller got a non-finite β update (inf) and left beta at 1e+308; {SKIPPED}"]


def test_each_way_a_resumed_controller_takes_its_beta_is_said_in_one_line(caplog):
    fixed = FixedBeta(ControllerConfig(0.1))
    saved = TargetKLBeta(ControllerConfig(0.2))
    saved.beta = 0.15
    with caplog.at_level("INFO", logger="unsloth_adaptive_kl"):
        fixed.load_state_dict({**fixed.state_dict(), "beta": 0.3})
        TargetKLBeta(ControllerConfig(0.4)).load_state_dict(saved.state_dict())
        TargetKLBeta(ControllerConfig(0.2)).load_state_dict(saved.state_dict())
    assert messages(caplog) == [
        "unsloth_adaptive_kl: resumed with the configured beta=0.1 (the checkpoint was trained with beta=0.3)",
        "unsloth_adaptive_kl: beta was changed on resume (the checkpoint was configured with beta=0.2, this run with beta=0.4): "
        "the ziegler controller restarts from beta=0.4 instead of the checkpoint's beta=0.15, keeping the rest of its state",
        "unsloth_adaptive_kl: the ziegler controller resumes from the checkpoint's beta=0.15",
    ]


def test_a_resumed_beta_is_said_to_six_significant_digits_not_as_float_noise(caplog):
    """β after three ×0.9 steps from 0.04 is 0.032400000000000005 in binary: the resume line says 0.0324, as the
    end-of-training line does (it said the float's repr)."""
    saved = TargetKLBeta(ControllerConfig(0.04))
    saved.beta = 0.04 * 0.9 * 0.9
    assert repr(saved.beta) == "0.032400000000000005"
    with caplog.at_level("INFO", logger="unsloth_adaptive_kl"):
        TargetKLBeta(ControllerConfig(0.04)).load_state_dict(saved.state_dict())
    assert messages(caplog) == ["unsloth_adaptive_kl: the ziegler controller resumes from the checkpoint's beta=0.0324"]


@pytest.mark.parametrize(
    "beta_min, reward, tail",
    [
        (0.0, None, "(trailing mean none yet, reward_threshold 0.8): the KL term and the reference model are off from now on"),
        (0.01, 0.25, "(trailing mean 0.25, reward_threshold 0.8)"),
    ],
)
def test_the_dynamic_cut_off_says_where_beta_went_and_whether_the_kl_term_is_off(beta_min, reward, tail, caplog):
    c = DynamicBeta(ControllerConfig(0.1, beta_min=beta_min, beta_schedule_steps=3, reward_threshold=0.8))
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        for step in (1, 2, 3, 4):
            if reward is not None:
                c.observe_reward(reward)
            c.update(global_step=step, kl=None, num_completions=4)
    assert messages(caplog) == [
        f"unsloth_adaptive_kl: dynamic: from optimizer step 3 (beta_schedule_steps=3) beta = beta_min = {float(beta_min)} (it was "
        f"0.1), whatever the reward {tail}"
    ]
