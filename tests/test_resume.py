"""Resume: a run checkpointed at step k and resumed continues with exactly the controller state of
the uninterrupted run (β and the reward window), on TRL's loss and on the ``loss_class=`` (Liger)
path. Saving checkpoints does not change training, so the checkpointing run is the uninterrupted one.
Also: a resume inside a generation batch, and a resume with an edited config (beta, the method)."""

import json
import logging

import pytest
import torch
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

import reference
import unsloth_adaptive_kl
import toy
from unsloth_adaptive_kl.controllers import controller_names
from unsloth_adaptive_kl.backends.liger import AdaptiveFusedLinearGRPOLoss

STEPS, SAVED_AT = 5, 2


class RecordState(TrainerCallback):
    """The controller's state_dict after every optimizer step (added after the adaptive-KL callback)."""

    def __init__(self, trainer):
        self.trainer, self.states = trainer, {}

    def on_step_end(self, args, state, control, **kwargs):
        runtime = getattr(self.trainer, "_adaptive_kl", None)  # None: stock TRL (after unpatch())
        if runtime is not None:
            self.states[state.global_step] = json.loads(json.dumps(runtime.state_dict()))


def train(checkpoint, out, resume_from=None, loss_class=None, stop_after_checkpoint=None, **overrides):
    # two completions of one prompt per step: the claims are about the state a resume restores, whatever the group's
    # size, and a step's cost on CPU goes with its tokens (TRL's log-prob kernel runs interpreted)
    fields = dict(
        output_dir=str(out), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=2, num_generations=2,
        max_completion_length=reference.MAX_COMPLETION, max_steps=STEPS, logging_steps=1, learning_rate=2e-2, beta=0.04,
        save_strategy="steps", save_steps=SAVED_AT, seed=0,
    )  # fmt: skip
    args = GRPOConfig(**{**fields, **overrides})
    extra = {} if loss_class is None else {"loss_class": loss_class}
    trainer = GRPOTrainer(
        model=checkpoint, reward_funcs=[toy.format_reward, toy.correctness_reward], args=args, train_dataset=toy.prompt_dataset(64), **extra
    )
    recorder = RecordState(trainer)
    trainer.add_callback(recorder)
    if stop_after_checkpoint is not None:
        trainer.add_callback(reference.stop_after_checkpoint(stop_after_checkpoint))
    trainer.train(resume_from_checkpoint=resume_from)
    betas = {h["step"]: h["adaptive_kl/current_beta"] for h in trainer.state.log_history if "adaptive_kl/current_beta" in h}
    return trainer, recorder.states, betas


CASES = {
    # reward_threshold between the rewards seen, so the window's contents decide each decay
    "trl dynamic": dict(kl_adaptation_method="dynamic", reward_threshold=0.1, reward_window=3),
    "liger dynamic+clip": dict(kl_adaptation_method="dynamic+clip", reward_threshold=0.1, reward_window=3, loss_class=AdaptiveFusedLinearGRPOLoss),
    # target (issue 49): a KL far above kl_target raises β at every step; its state (smoothed KL, episode) goes on
    "trl target": dict(kl_adaptation_method="target", kl_target=1e-4),
    "liger ziegler": dict(kl_adaptation_method="ziegler", kl_target=0.01, kl_horizon=20.0, loss_class=AdaptiveFusedLinearGRPOLoss),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resumed_run_has_the_uninterrupted_controller_state_and_beta_series(tiny_checkpoint, tmp_path, case):
    overrides = CASES[case]
    full, full_states, full_betas = train(tiny_checkpoint, tmp_path / "run", **overrides)
    with open(tmp_path / "run" / f"checkpoint-{SAVED_AT}" / "trainer_state.json") as f:
        saved = json.load(f)["stateful_callbacks"]["AdaptiveKLCallback"]
    saved = saved[0] if isinstance(saved, list) else saved
    assert saved["attributes"]["adaptive_kl_state"] == full_states[SAVED_AT]  # what step k held, exactly

    resumed, resumed_states, resumed_betas = train(
        tiny_checkpoint, tmp_path / "run", resume_from=str(tmp_path / "run" / f"checkpoint-{SAVED_AT}"), **overrides
    )
    assert sorted(resumed_states) == list(range(SAVED_AT + 1, STEPS + 1))
    for step in resumed_states:  # β and the reward window, step by step, after the resume
        assert resumed_states[step] == full_states[step], step
    assert resumed._adaptive_kl.state_dict() == full._adaptive_kl.state_dict()
    assert [resumed_betas[s] for s in range(SAVED_AT + 1, STEPS + 1)] == [full_betas[s] for s in range(SAVED_AT + 1, STEPS + 1)]
    if "dynamic" in case:
        assert len(full_states[STEPS]["controller"]["rewards"]) == 3  # the window was full and was compared
    assert len(set(full_betas.values())) > 1, "β never changed: the test would not see a lost state"


# -- a resume with an edited config --------------------------------------------------------------------
EDITED_STEPS = 4  # the first run saves at SAVED_AT = 2; resumed runs train steps 3 and 4


@pytest.fixture(scope="module")
def none_checkpoint(tiny_checkpoint, tmp_path_factory):
    """checkpoint-2 of a run with method none and beta 0.04 (configured for EDITED_STEPS, stopped once it is written)."""
    out = tmp_path_factory.mktemp("none_run")
    _, _, betas = train(tiny_checkpoint, out, max_steps=EDITED_STEPS, stop_after_checkpoint=SAVED_AT)
    assert sorted(betas) == [1, SAVED_AT]
    return str(out / f"checkpoint-{SAVED_AT}")


def _logged(trainer, key):
    return {h["step"]: h[key] for h in trainer.state.log_history if key in h}


def _resumed(logged: dict) -> dict:
    """The steps a resumed run trained (its log_history also holds the checkpoint's)."""
    return {step: value for step, value in logged.items() if step > SAVED_AT}


def test_resuming_none_with_a_changed_beta_trains_as_stock_trl_bit_for_bit(tiny_checkpoint, none_checkpoint, tmp_path, caplog):
    # Before the fix the patched run kept the checkpoint's beta 0.04 for steps 3-4; stock TRL uses the new 0.1.
    with caplog.at_level(logging.INFO, logger="unsloth_adaptive_kl"):
        ours, _, betas = train(tiny_checkpoint, tmp_path / "ours", resume_from=none_checkpoint, max_steps=EDITED_STEPS, beta=0.1)
    assert _resumed(betas) == {3: 0.1, 4: 0.1} and ours.beta == 0.1
    assert "resumed with the configured beta=0.1 (the checkpoint was trained with beta=0.04)" in caplog.text
    unsloth_adaptive_kl.unpatch()
    try:
        stock, _, _ = train(tiny_checkpoint, tmp_path / "stock", resume_from=none_checkpoint, max_steps=EDITED_STEPS, beta=0.1)
    finally:
        unsloth_adaptive_kl.patch()
    assert not hasattr(stock, "_adaptive_kl") and stock.beta == 0.1  # really stock TRL
    for key in ("loss", "kl"):
        assert _logged(ours, key) == _logged(stock, key) and sorted(_resumed(_logged(ours, key))) == [3, 4], key
    for (name, mine), (_, theirs) in zip(ours.model.named_parameters(), stock.model.named_parameters()):
        assert torch.equal(mine, theirs), name


def test_a_controller_resumed_with_a_changed_beta_restarts_from_it_and_says_so(tiny_checkpoint, tmp_path, caplog):
    # reward_threshold 100: dynamic never decays, so only the resume decides the β of steps 3-4
    fields = dict(kl_adaptation_method="dynamic", reward_threshold=100.0, max_steps=EDITED_STEPS)
    train(tiny_checkpoint, tmp_path / "run", **fields, stop_after_checkpoint=SAVED_AT)  # only its checkpoint is used
    checkpoint = str(tmp_path / "run" / f"checkpoint-{SAVED_AT}")
    with caplog.at_level(logging.INFO, logger="unsloth_adaptive_kl"):
        _, _, kept = train(tiny_checkpoint, tmp_path / "kept", resume_from=checkpoint, **fields)
        assert "the dynamic controller resumes from the checkpoint's beta=0.04" in caplog.text
        _, states, raised = train(tiny_checkpoint, tmp_path / "raised", resume_from=checkpoint, **fields, beta=0.1)
    assert _resumed(kept) == {3: 0.04, 4: 0.04}
    assert _resumed(raised) == {3: 0.1, 4: 0.1}  # before the fix: 0.04, the checkpoint's
    assert "beta was changed on resume (the checkpoint was configured with beta=0.04, this run with beta=0.1)" in caplog.text
    assert len(states[3]["controller"]["rewards"]) == 3  # the rest of the state (the reward window) was kept


PAST_SCHEDULE = dict(kl_adaptation_method="dynamic", reward_threshold=100.0, beta_min=0.01, beta_schedule_steps=SAVED_AT, max_steps=EDITED_STEPS)


@pytest.fixture(scope="module")
def past_schedule_run(tiny_checkpoint, tmp_path_factory):
    """The uninterrupted run of PAST_SCHEDULE (one for both cases below: the resumed runs only read it): its β series
    and its checkpoint-2."""
    out = tmp_path_factory.mktemp("past_schedule_run")
    _, _, first = train(tiny_checkpoint, out, **PAST_SCHEDULE)
    return first, str(out / f"checkpoint-{SAVED_AT}")


@pytest.mark.parametrize("restart", [False, True])
def test_a_dynamic_run_resumed_past_its_schedule_with_a_changed_beta_trains_at_the_floor_from_its_first_step(tiny_checkpoint, past_schedule_run, tmp_path, restart):
    """beta_schedule_steps=2: from step 3 on β = beta_min. Resumed at step 2 with beta changed 0.04 -> 0.1 (restored
    or restarted), the first resumed step trained with 0.1 and only the next update dropped β to the floor."""
    first, checkpoint = past_schedule_run
    assert first == {1: 0.04, 2: 0.04, 3: 0.01, 4: 0.01}
    _, _, resumed = train(tiny_checkpoint, tmp_path / "resumed", resume_from=checkpoint, **PAST_SCHEDULE, beta=0.1, restart_beta_controller=restart)
    assert _resumed(resumed) == {3: 0.01, 4: 0.01}  # before the fix: {3: 0.1, 4: 0.01}


@pytest.mark.parametrize("method", controller_names())
def test_changing_the_controller_on_resume_names_both_methods_and_the_option_that_allows_it(tiny_checkpoint, none_checkpoint, tmp_path, method):
    # Before the fix: "rewards=None is not valid" (dynamic), "cannot load β-controller state of 'fixed'" (target).
    fields = dict(kl_adaptation_method=method, reward_threshold=-1.0, dynamic_beta_decay=0.5, beta_min=0.001, max_steps=EDITED_STEPS, beta=0.08)
    with pytest.raises(ValueError) as error:
        train(tiny_checkpoint, tmp_path / "refused", resume_from=none_checkpoint, **fields)
    message = str(error.value)
    assert "kl_adaptation_method='none' (no β controller)" in message
    assert f"kl_adaptation_method={method!r} (the {method!r} β controller)" in message
    assert "restart_beta_controller=True" in message
    trainer, states, betas = train(tiny_checkpoint, tmp_path / "fresh", resume_from=none_checkpoint, **fields, restart_beta_controller=True)
    # started fresh from the configured beta at the checkpoint's step, with no observation yet (a schedule over
    # optimizer steps is at its step-2 value, the others at 0.08)
    fresh = reference.stepper(method)(0.08, reference.controller_config(**fields), None, None, 0, step=SAVED_AT, latest=None)
    assert sorted(_resumed(betas)) == [3, 4] and betas[3] == pytest.approx(fresh, rel=1e-12)
    assert method == "schedule" or fresh == 0.08
    if method == "dynamic":  # a fresh window: the two rewards of steps 3 and 4, β halved after each
        assert betas[4] == 0.04 and len(states[4]["controller"]["rewards"]) == 2
    assert trainer.state.global_step == EDITED_STEPS


@pytest.fixture(scope="module")
def stock_checkpoint(tiny_checkpoint, tmp_path_factory):
    """checkpoint-2 written by stock TRL (the package unpatched), beta 0.04: it holds no adaptive-KL state."""
    out = tmp_path_factory.mktemp("stock_run")
    unsloth_adaptive_kl.unpatch()
    try:
        trainer, _, _ = train(tiny_checkpoint, out, max_steps=EDITED_STEPS, stop_after_checkpoint=SAVED_AT)
    finally:
        unsloth_adaptive_kl.patch()
    assert not hasattr(trainer, "_adaptive_kl")
    with open(out / f"checkpoint-{SAVED_AT}" / "trainer_state.json") as f:
        assert "AdaptiveKLCallback" not in json.load(f)["stateful_callbacks"]
    return str(out / f"checkpoint-{SAVED_AT}")


SCHEDULE = dict(kl_adaptation_method="schedule", beta_schedule_steps=4, max_steps=EDITED_STEPS)


def test_a_checkpoint_of_a_run_without_the_package_resumes_and_saves_again(tiny_checkpoint, stock_checkpoint, tmp_path, caplog):
    """Before: a run resumed from a stock TRL checkpoint trained, then failed at its next checkpoint (KeyError:
    'AdaptiveKLCallback' in the Trainer's save: the restored state lists only the writing run's callbacks), whatever the
    method; and a controller started there was not put at the resumed step (schedule trained step 3 at its step-0 β).
    Such a checkpoint trained with no β controller: resumed as `none`'s checkpoint is (a controller is refused, or
    started fresh at the checkpoint's step with restart_beta_controller=True)."""
    with caplog.at_level(logging.INFO, logger="unsloth_adaptive_kl"):
        plain, _, betas = train(tiny_checkpoint, tmp_path / "none", resume_from=stock_checkpoint, max_steps=EDITED_STEPS)
    assert _resumed(betas) == {3: 0.04, 4: 0.04} and plain.state.global_step == EDITED_STEPS
    assert "the checkpoint holds no adaptive-KL state" in caplog.text
    with open(tmp_path / "none" / f"checkpoint-{EDITED_STEPS}" / "trainer_state.json") as f:  # saved after the resume
        assert "AdaptiveKLCallback" in json.load(f)["stateful_callbacks"]
    with pytest.raises(ValueError, match=r"cannot resume: the checkpoint was trained with kl_adaptation_method='none' \(no β controller\) .* restart_beta_controller=True"):
        train(tiny_checkpoint, tmp_path / "refused", resume_from=stock_checkpoint, **SCHEDULE)
    fresh, _, betas = train(tiny_checkpoint, tmp_path / "fresh", resume_from=stock_checkpoint, **SCHEDULE, restart_beta_controller=True)
    # linear from 0.04 at step 0 to 0 at step 4: the steps after the checkpoint train at 0.02 and 0.01, as uninterrupted
    assert _resumed(betas) == pytest.approx({3: 0.02, 4: 0.01}, rel=1e-12) and fresh.state.global_step == EDITED_STEPS
    assert (tmp_path / "fresh" / f"checkpoint-{EDITED_STEPS}" / "trainer_state.json").is_file()


def test_resume_inside_a_generation_batch_keeps_the_uninterrupted_beta_series(tiny_checkpoint, tmp_path):
    # steps_per_generation=4: generations at steps 1 and 5; every reward is above -1, so β halves after each.
    # Before the fix the resumed run counted TRL's regeneration at step 3 as a new reward and generated
    # next at step 7: β .02 .01 .01 .01 for steps 3-6 instead of .02 .02 .02 .01.
    fields = dict(kl_adaptation_method="dynamic", reward_threshold=-1.0, dynamic_beta_decay=0.5, steps_per_generation=4, max_steps=6)
    _, full_states, full_betas = train(tiny_checkpoint, tmp_path / "run", **fields)
    checkpoint = str(tmp_path / "run" / f"checkpoint-{SAVED_AT}")
    _, states, betas = train(tiny_checkpoint, tmp_path / "resumed", resume_from=checkpoint, **fields)
    assert [full_betas[s] for s in range(1, 7)] == [0.04, 0.02, 0.02, 0.02, 0.02, 0.01]
    assert _resumed(betas) == {s: full_betas[s] for s in range(3, 7)}
    for step in (3, 4):  # the controller's state: exact until the next generation
        assert {k: v for k, v in states[step].items() if k != "runaway_alarm"} == {k: v for k, v in full_states[step].items() if k != "runaway_alarm"}
        # the runaway alarm keeps each step's KL: the checkpoint's steps are restored, steps 3-4 score regenerated completions
        resumed_kls, full_kls = states[step]["runaway_alarm"]["kls"], full_states[step]["runaway_alarm"]["kls"]
        assert [p for p in resumed_kls if p[0] <= SAVED_AT] == [p for p in full_kls if p[0] <= SAVED_AT] != []
        assert [p[0] for p in resumed_kls] == [p[0] for p in full_kls]
    for step in range(3, 7):  # then the same rewards counted at the same steps (their values come from other completions)
        assert len(states[step]["controller"]["rewards"]) == len(full_states[step]["controller"]["rewards"]), step
