"""The adaptive_kl/* metrics reach a real logger: a short run with report_to="tensorboard" writes
event files, read back here with tensorboard's own event reader, holding each metric at each
logged step with the value of ``trainer.state.log_history``."""

import glob
import os

import pytest
from tensorboard.backend.event_processing import event_accumulator  # a dev dependency: fail, never skip
from trl import GRPOConfig, GRPOTrainer

import reference
from unsloth_adaptive_kl import ADAPTED_KL, CURRENT_BETA, RAW_KL
import toy

STEPS = 3
METRICS = (RAW_KL, ADAPTED_KL, CURRENT_BETA)


def test_tensorboard_event_files_hold_the_adaptive_kl_metrics_of_log_history(tiny_checkpoint, tmp_path, monkeypatch):
    logging_dir = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(logging_dir))  # transformers' TensorBoardCallback reads it
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="tensorboard", per_device_train_batch_size=4,
        num_generations=4, max_completion_length=reference.MAX_COMPLETION, max_steps=STEPS, logging_steps=1, learning_rate=2e-2,
        beta=0.04, save_strategy="no", seed=0,
        # beta changes every step (every reward is above -1) and clip makes adapted_kl differ from raw_kl
        kl_adaptation_method="dynamic+clip", kl_clip_threshold=0.001, dynamic_beta_decay=0.5, reward_threshold=-1.0, beta_min=0.001,
    )  # fmt: skip
    trainer = GRPOTrainer(model=tiny_checkpoint, reward_funcs=[toy.format_reward, toy.correctness_reward], args=args, train_dataset=toy.prompt_dataset(64))
    trainer.train()
    logged = {h["step"]: h for h in trainer.state.log_history if CURRENT_BETA in h}
    assert sorted(logged) == list(range(1, STEPS + 1))

    event_files = glob.glob(os.path.join(logging_dir, "**", "events.out.tfevents.*"), recursive=True)
    assert event_files, f"no event file under {logging_dir}"
    scalars = {}
    for path in event_files:
        reader = event_accumulator.EventAccumulator(path, size_guidance={event_accumulator.SCALARS: 0})
        reader.Reload()
        for tag in reader.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({event.step: event.value for event in reader.Scalars(tag)})

    for name in METRICS:
        tag = f"train/{name}"  # the callback prefixes training logs with "train/"
        assert tag in scalars, f"{tag} not in {sorted(scalars)}"
        assert sorted(scalars[tag]) == sorted(logged)
        for step, value in scalars[tag].items():
            assert value == pytest.approx(logged[step][name], rel=1e-6, abs=1e-12)  # stored as float32
    betas = [scalars[f"train/{CURRENT_BETA}"][step] for step in sorted(logged)]
    assert len(set(betas)) == STEPS  # the series varies, so matching steps to values is not vacuous
    assert any(scalars[f"train/{RAW_KL}"][s] != pytest.approx(scalars[f"train/{ADAPTED_KL}"][s]) for s in logged)


def test_no_none_reaches_tensorboard_once_beta_is_zero(tiny_checkpoint, tmp_path, monkeypatch):
    # Before the fix, once β was 0 the KL metrics were logged as None and TensorBoard's callback warned
    # "Trainer is attempting to log a value of None" twice per logged step.
    from transformers.integrations import integration_utils

    warnings = []
    monkeypatch.setattr(integration_utils.logger, "warning", lambda message, *a, **k: warnings.append(str(message)))
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="tensorboard", per_device_train_batch_size=4,
        num_generations=4, max_completion_length=reference.MAX_COMPLETION, max_steps=STEPS, logging_steps=1, beta=0.04,
        save_strategy="no", seed=0, kl_adaptation_method="dynamic", beta_schedule_steps=1, beta_min=0.0,
    )  # fmt: skip
    trainer = GRPOTrainer(model=tiny_checkpoint, reward_funcs=[toy.format_reward], args=args, train_dataset=toy.prompt_dataset(64))
    trainer.train()
    logged = [h for h in trainer.state.log_history if CURRENT_BETA in h]
    assert [h[CURRENT_BETA] for h in logged] == [0.04] + [0.0] * (STEPS - 1)
    assert RAW_KL in logged[0] and all(RAW_KL not in h and ADAPTED_KL not in h for h in logged[1:])
    assert not [h for h in trainer.state.log_history if any(v is None for v in h.values())]
    assert not [w for w in warnings if "attempting to log a value" in w], warnings
