"""User code through the trainers (issue 39): the probe's plain scripts, a method registered with
``register_shaping`` and a tiny GRPO run, on TRL's loss and through ``GRPOTrainer(loss_class=...)`` (Liger);
Unsloth's are in test_unsloth.py (``user_code`` scenario). The core is tests/test_user_code.py."""

import logging
import math

import pytest
import torch

import unsloth_adaptive_kl
from unsloth_adaptive_kl import metrics
import toy
from unsloth_adaptive_kl.backends.liger import AdaptiveFusedLinearGRPOLoss
from trl import GRPOConfig, GRPOTrainer

BACKENDS = ["trl", "loss_class"]


def make_trainer(checkpoint, tmp_path, backend, trainer_cls=GRPOTrainer, **overrides):
    args = dict(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=4, num_generations=4,
        max_completion_length=6, max_steps=2, logging_steps=1, learning_rate=2e-2, beta=0.04, save_strategy="no", seed=0,
    )  # fmt: skip
    args.update(overrides)
    extra = {"loss_class": AdaptiveFusedLinearGRPOLoss} if backend == "loss_class" else {}
    return trainer_cls(
        model=checkpoint, reward_funcs=[toy.format_reward, toy.correctness_reward], args=GRPOConfig(**args),
        train_dataset=toy.prompt_dataset(64), **extra,
    )  # fmt: skip


def logs_of(trainer):
    return [h for h in trainer.state.log_history if metrics.CURRENT_BETA in h]


def nan_reference(generations, rows=slice(0, 1)):
    """A trainer class whose generation batches number ``generations`` (1-based) have NaN reference log-probs on
    ``rows``: the model's NaN, not a user function's. (Stock TRL's gradients are NaN then, so a run ends with such
    a batch: the next generation would sample from NaN weights.) Every reference log-prob is also lowered by 0.5,
    so that the KL is not 0 at the first step, where policy and reference are the same model."""

    class NaNReference(GRPOTrainer):
        calls = 0

        def _generate_and_score_completions(self, *args, **kwargs):
            output = super()._generate_and_score_completions(*args, **kwargs)
            output["ref_per_token_logps"] = output["ref_per_token_logps"] - 0.5
            NaNReference.calls += 1
            if NaNReference.calls in generations:
                output["ref_per_token_logps"][rows] = float("nan")
            return output

    return NaNReference


# -- item 1 -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_target_with_a_method_capping_its_input_in_place_is_refused_naming_it(tiny_checkpoint, tmp_path, backend, user_shaping):
    """The probe: ``kl.clamp_(max=1e-3)`` registered and run as ``target+mymethod`` made TRL's kl, raw_kl and the
    controller's input the capped value, so β fell where ``target+clip`` raises it."""
    user_shaping("mymethod", lambda kl: kl.clamp_(max=1e-3))
    with pytest.raises(ValueError, match=r"shaping method 'mymethod' changed its input in place"):
        make_trainer(tiny_checkpoint, tmp_path, backend, kl_adaptation_method="ziegler+mymethod", kl_target=0.02, kl_horizon=40.0).train()


# -- item 2 -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "fn, what",
    [(lambda kl: kl.detach(), "no gradient"), (lambda kl: kl.double(), "dtype torch.float64"), (lambda kl: kl * torch.nan, "NaN or inf")],
    ids=["detached", "float64", "nan"],
)
def test_a_detached_float64_or_nan_method_is_refused_naming_it_before_training(tiny_checkpoint, tmp_path, backend, fn, what, user_shaping):
    """The probe: a detached output trained with no KL gradient while the logs showed a KL; float64 was accepted; NaN
    gave grad_norm nan and then a generation crash that did not name the method."""
    user_shaping("mymethod", fn)
    with pytest.raises(ValueError, match=rf"shaping method 'mymethod'.*{what}"):
        make_trainer(tiny_checkpoint, tmp_path, backend, kl_adaptation_method="mymethod").train()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_method_returning_nan_on_real_kls_is_refused_by_name_before_it_reaches_the_weights(tiny_checkpoint, tmp_path, backend, user_shaping):
    """kl ** 1.5 is NaN for the negative KLs of k1 (the reference likelier than the policy), which the check at
    creation (KL >= 0) cannot see. Refused at the first micro-batch that has one (k1 is exactly 0 at the first step,
    where policy and reference are equal), before its optimizer step: the weights stay finite. The check rides
    on the metric sums' existing read."""
    user_shaping("power", lambda kl: kl**1.5)
    trainer = make_trainer(tiny_checkpoint, tmp_path, backend, kl_adaptation_method="power", kl_estimator="k1", max_steps=4)
    with pytest.raises(ValueError, match=r"shaping method 'power' returned NaN or inf on valid tokens whose KL was finite \(\d+ of them\)"):
        trainer.train()
    assert 0 < trainer.state.global_step < 4 and all(torch.isfinite(p).all() for p in trainer.model.parameters())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_user_estimator_returning_nan_on_real_log_probs_is_refused_by_name_before_it_reaches_the_weights(tiny_checkpoint, tmp_path, backend):
    """NaN for log-probs below -3.5: the check at creation (log-probs in [-3, 0]) passes; the tiny model's sampled
    tokens are near log(1/64). Refused at the first micro-batch with one (the eager check of every call), by name."""
    unsloth_adaptive_kl.register_estimator("shaky")(lambda logp, ref: (logp - ref) * torch.sqrt(logp + 3.5))
    try:
        trainer = make_trainer(tiny_checkpoint, tmp_path, backend, kl_estimator="shaky", max_steps=4)
        with pytest.raises(ValueError, match=r"KL estimator 'shaky' returned NaN or inf on valid tokens whose log-probs were finite \(\d+ of them\)"):
            trainer.train()
    finally:
        unsloth_adaptive_kl.unregister_estimator("shaky")
    assert trainer.state.global_step < 4 and all(torch.isfinite(p).all() for p in trainer.model.parameters())


def user_k3(logp, ref):
    """k3 as a user would write it, with the usual clamp of the log-ratio (its gradient is 0 where that is NaN)."""
    r = (ref - logp).clamp(-20.0, 20.0)
    return torch.exp(r) - r - 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_reference_with_a_user_method_and_estimator_is_not_blamed_on_them_and_is_counted(tiny_checkpoint, tmp_path, backend, user_shaping, caplog):
    user_shaping("halve", lambda kl: kl * 0.5)
    unsloth_adaptive_kl.register_estimator("user_k3")(user_k3)
    try:
        trainer = make_trainer(
            tiny_checkpoint, tmp_path, backend, nan_reference({2}), kl_adaptation_method="ziegler+halve", kl_estimator="user_k3",
            kl_target=0.02, kl_horizon=40.0, max_steps=2,
        )  # fmt: skip
        with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
            trainer.train()
    finally:
        unsloth_adaptive_kl.unregister_estimator("user_k3")
    logs = logs_of(trainer)
    assert [h[metrics.NONFINITE_KL_BATCHES] for h in logs] == [0.0, 1.0]
    assert [h[metrics.SKIPPED_UPDATES] for h in logs] == [0.0, 1.0]
    assert metrics.RAW_KL not in logs[1] and metrics.ADAPTED_KL not in logs[1]
    assert "adaptive_kl/nonfinite_kl_batches" in caplog.text


# -- item 3 -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", ["one completion", "every completion"])
def test_a_window_with_a_nan_micro_batch_counts_it_and_logs_raw_and_adapted_over_the_same_micro_batches(
    tiny_checkpoint, tmp_path, backend, rows, caplog
):
    """One logging window of two micro-batches (gradient_accumulation_steps=2). One completion's reference is NaN:
    one micro-batch has a NaN KL; the window counts it and its raw_kl and adapted_kl are the other micro-batch's
    (the probe: adapted_kl 0.0, one step alone, next to raw_kl 0.72 over both). Every completion's: both are NaN;
    the window counts 2 and has no KL mean (the probe: no adapted_kl key and no word of why)."""
    trainer = make_trainer(
        tiny_checkpoint, tmp_path, backend, nan_reference({1}, slice(0, 1) if rows == "one completion" else slice(None)),
        kl_adaptation_method="sigmoid", kl_target=0.02, max_steps=1, gradient_accumulation_steps=2,
    )  # fmt: skip
    micro_batches = []
    original = trainer._adaptive_kl.record_sums

    def spy(local_sums, *, training, beta):
        micro_batches.append(original(local_sums, training=training, beta=beta))
        return micro_batches[-1]

    trainer._adaptive_kl.record_sums = spy
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        trainer.train()
    (log,) = logs_of(trainer)
    finite = [m for m in micro_batches if math.isfinite(m[metrics.RAW_KL])]
    assert len(micro_batches) == 2 and len(finite) == (1 if rows == "one completion" else 0)
    assert log[metrics.NONFINITE_KL_BATCHES] == 2.0 - len(finite)
    if finite:
        assert log[metrics.RAW_KL] == finite[0][metrics.RAW_KL] and log[metrics.ADAPTED_KL] == finite[0][metrics.ADAPTED_KL]
        assert 0 < log[metrics.ADAPTED_KL] < log[metrics.RAW_KL]  # sigmoid damps it: the two means are of one micro-batch
    else:
        assert metrics.RAW_KL not in log and metrics.ADAPTED_KL not in log
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING and metrics.NONFINITE_KL_BATCHES in r.getMessage()]
    assert "left out" in warning.getMessage()
