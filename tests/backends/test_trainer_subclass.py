"""A user's subclass of TRL's GRPOTrainer that overrides the loss (issue 39, item 4).

An override that builds on ``super().compute_loss`` (or ``super()._compute_loss``) trains with the
adaptation, with the same losses, β and metrics as the trainer it subclasses; an override that
returns a loss of its own is refused at its first call, before any optimizer step, with a message
saying how to reach the patched loss. (Unsloth's generated trainer: test_unsloth.py, scenario
``subclass``.)"""

import pytest
import torch

import unsloth_adaptive_kl
import toy
from trl import GRPOConfig, GRPOTrainer

MAX_COMPLETION = 6
METHOD = dict(kl_adaptation_method="ziegler+clip", kl_clip_threshold=0.05, kl_target=0.02, kl_horizon=40.0)
LOGGED = ("loss", "kl", "adaptive_kl/raw_kl", "adaptive_kl/adapted_kl", "adaptive_kl/current_beta")


class SuperLoss(GRPOTrainer):
    """The common pattern: build on the library's loss, e.g. to add a term or log something."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.calls = getattr(self, "calls", 0) + 1
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)


class SuperInnerLoss(GRPOTrainer):
    def _compute_loss(self, model, inputs):
        return super()._compute_loss(model, inputs)


class OwnLoss(GRPOTrainer):
    """Returns a loss that never goes through GRPOTrainer's: the adaptive KL cannot reach it."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logits = model(input_ids=inputs["completion_ids"]).logits
        return logits.float().pow(2).mean()


def make(cls, checkpoint, tmp_path, **fields):
    fields = {"max_steps": 3, **fields}
    args = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=4,
        num_generations=4, max_completion_length=MAX_COMPLETION, logging_steps=1, learning_rate=2e-2,
        beta=0.04, save_strategy="no", seed=0, **fields,
    )  # fmt: skip
    return cls(model=checkpoint, reward_funcs=[toy.format_reward, toy.correctness_reward], args=args, train_dataset=toy.prompt_dataset(64))


def logged(trainer):
    return [{k: h[k] for k in LOGGED if k in h} for h in trainer.state.log_history if "loss" in h]


@pytest.fixture(scope="module")
def plain_run(tiny_checkpoint, tmp_path_factory):
    trainer = make(GRPOTrainer, tiny_checkpoint, tmp_path_factory.mktemp("plain"), **METHOD)
    trainer.train()
    return logged(trainer)


@pytest.mark.parametrize("cls", [SuperLoss, SuperInnerLoss])
def test_a_subclass_whose_override_calls_super_trains_with_the_adaptation_as_the_trainer_it_subclasses(cls, plain_run, tiny_checkpoint, tmp_path, caplog):
    # Before the fix: PatchError "the adaptive KL would not reach its loss" when the trainer was created.
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        trainer = make(cls, tiny_checkpoint, tmp_path, **METHOD)
        trainer.train()
    assert logged(trainer) == plain_run  # the same losses, β and KL metrics, to the bit
    assert len(plain_run) == 3 and all(set(h) == set(LOGGED) for h in plain_run)
    betas = [h["adaptive_kl/current_beta"] for h in plain_run]
    assert betas[0] == 0.04 and len(set(betas)) == 3  # target moved β: the adaptation acted
    assert any(h["adaptive_kl/adapted_kl"] < h["adaptive_kl/raw_kl"] for h in plain_run)  # clip acted
    if cls is SuperLoss:
        assert trainer.calls == 3  # the user's override ran at every step
    assert "unsloth_adaptive_kl" not in caplog.text  # no warning


def test_with_method_none_a_subclass_calling_super_logs_every_metric_without_a_warning(tiny_checkpoint, tmp_path, caplog):
    # Before the fix: "the adaptive_kl metrics may be missing" was logged when the trainer was created, yet all were logged.
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        trainer = make(SuperLoss, tiny_checkpoint, tmp_path, max_steps=2)
        trainer.train()
    logs = logged(trainer)
    assert len(logs) == 2 and all(set(h) == set(LOGGED) for h in logs)
    assert "unsloth_adaptive_kl" not in caplog.text


def test_a_subclass_that_returns_its_own_loss_is_refused_before_any_optimizer_step(tiny_checkpoint, tmp_path):
    trainer = make(OwnLoss, tiny_checkpoint, tmp_path, **METHOD)  # created: whether the loss is reached is seen when it runs
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(unsloth_adaptive_kl.PatchError) as info:
        trainer.train()
    message = str(info.value)
    assert "OwnLoss overrides compute_loss of GRPOTrainer" in message
    assert "did not go through GRPOTrainer.compute_loss -> GRPOTrainer._compute_loss" in message
    assert "kl_adaptation_method='ziegler+clip'" in message and "no optimizer step has applied it" in message
    assert "loss = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)" in message
    assert trainer.state.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))  # no update was applied


def test_with_method_none_a_subclass_with_its_own_loss_trains_and_warns_once_that_the_metrics_are_not_logged(tiny_checkpoint, tmp_path, caplog):
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        trainer = make(OwnLoss, tiny_checkpoint, tmp_path, max_steps=2)
        trainer.train()
    warnings = [r.getMessage() for r in caplog.records if "did not go through" in r.getMessage()]
    assert len(warnings) == 1 and "without the adaptive_kl metrics" in warnings[0] and "super().compute_loss" in warnings[0]
    assert trainer.state.global_step == 2
    assert not any("adaptive_kl/raw_kl" in h for h in trainer.state.log_history)
