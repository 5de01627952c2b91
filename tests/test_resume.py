"""Resume: a run checkpointed at step k and resumed continues with exactly the controller state of
the uninterrupted run (β and the reward window), on TRL's loss and on the ``loss_class=`` (Liger)
path. Saving checkpoints does not change training, so the checkpointing run is the uninterrupted one."""

import json

import pytest
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

import reference
from unsloth_adaptive_kl import toy
from unsloth_adaptive_kl.backends.liger import AdaptiveFusedLinearGRPOLoss

STEPS, SAVED_AT = 5, 2


class RecordState(TrainerCallback):
    """The controller's state_dict after every optimizer step (added after the adaptive-KL callback)."""

    def __init__(self, trainer):
        self.trainer, self.states = trainer, {}

    def on_step_end(self, args, state, control, **kwargs):
        self.states[state.global_step] = json.loads(json.dumps(self.trainer._adaptive_kl.state_dict()))


def train(checkpoint, out, resume_from=None, loss_class=None, **overrides):
    args = GRPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=4, num_generations=4,
        max_completion_length=reference.MAX_COMPLETION, max_steps=STEPS, logging_steps=1, learning_rate=2e-2, beta=0.04,
        save_strategy="steps", save_steps=SAVED_AT, seed=0, **overrides,
    )  # fmt: skip
    extra = {} if loss_class is None else {"loss_class": loss_class}
    trainer = GRPOTrainer(
        model=checkpoint, reward_funcs=[toy.format_reward, toy.correctness_reward], args=args, train_dataset=toy.prompt_dataset(64), **extra
    )
    recorder = RecordState(trainer)
    trainer.add_callback(recorder)
    trainer.train(resume_from_checkpoint=resume_from)
    betas = {h["step"]: h["adaptive_kl/current_beta"] for h in trainer.state.log_history if "adaptive_kl/current_beta" in h}
    return trainer, recorder.states, betas


CASES = {
    # reward_threshold between the rewards seen, so the window's contents decide each decay
    "trl dynamic": dict(kl_adaptation_method="dynamic", reward_threshold=0.1, reward_window=3),
    "liger dynamic+clip": dict(kl_adaptation_method="dynamic+clip", reward_threshold=0.1, reward_window=3, loss_class=AdaptiveFusedLinearGRPOLoss),
    "liger target": dict(kl_adaptation_method="target", kl_target=0.01, kl_horizon=20.0, loss_class=AdaptiveFusedLinearGRPOLoss),
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
