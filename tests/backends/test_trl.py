"""TRL backend: bit-identity with unpatched TRL, the KL part of the loss against float64
references for every loss type and method, metrics, end-to-end runs, resume and β -> 0."""

import math
import re
import sys
import types

import pytest
import torch

import reference
import unsloth_adaptive_kl
from unsloth_adaptive_kl import versions
import toy
from unsloth_adaptive_kl._source_patch import version_of
from unsloth_adaptive_kl.backends import trl as trl_backend
from trl import GRPOConfig, GRPOTrainer

LOSS_TYPES = list(versions.ALL_LOSS_TYPES)
METHODS = [*reference.METHODS, "ziegler+clip+sigmoid"]
MAX_COMPLETION = reference.MAX_COMPLETION
TRL_VERSION = version_of("trl")
OFFERED = versions.offered_loss_types(TRL_VERSION)  # loss type -> None where offered, else why not
BIAS_CORRECTION = "use_bias_correction_kl" in GRPOConfig.__dataclass_fields__  # TRL >= 0.26
# Where a test's claim is about the schedule of β and not about the group's size: two completions of one prompt per
# micro-batch (a training step's cost on CPU goes with its tokens: TRL's log-prob kernel runs interpreted).
SMALL_BATCH = dict(per_device_train_batch_size=2, num_generations=2)


def grpo_config(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=MAX_COMPLETION,
        max_steps=3,
        logging_steps=1,
        learning_rate=5e-3,
        beta=0.04,
        save_strategy="no",
        seed=0,
    )
    base.update(overrides)
    return GRPOConfig(**base)


def make_trainer(checkpoint, tmp_path, **overrides):
    return GRPOTrainer(
        model=checkpoint,
        reward_funcs=[toy.format_reward, toy.correctness_reward],
        args=grpo_config(tmp_path, **overrides),
        train_dataset=toy.prompt_dataset(64),
    )


def loss_test_trainer(checkpoint, folder):
    """A trainer whose loss the tests call directly: in training mode, one micro-batch per optimizer step."""
    t = make_trainer(checkpoint, folder)
    t.model.train()
    t.current_gradient_accumulation_steps = 1
    return t


@pytest.fixture(scope="module")
def trainer(tiny_checkpoint, tmp_path_factory):
    return loss_test_trainer(tiny_checkpoint, tmp_path_factory.mktemp("trl"))


def loss_inputs(trainer, seed=0):
    return reference.loss_inputs(trainer.model.config.vocab_size, seed=seed, pad_token_id=trainer.processing_class.pad_token_id)


def set_method(trainer, method, loss_type="dapo", importance_sampling_level="token", **fields):
    """Point the trainer's adaptive-KL runtime at another method (fresh runtime, same trainer)."""
    if OFFERED.get(loss_type, "") is not None:
        pytest.skip(f"loss_type {loss_type!r} is not offered with trl {TRL_VERSION}: {OFFERED.get(loss_type) or 'TRL lacks it'}")
    if not BIAS_CORRECTION and fields.pop("use_bias_correction_kl", False):
        pytest.skip(f"trl {TRL_VERSION} has no use_bias_correction_kl (its KL is never importance-weighted)")
    args = trainer.args
    for name, value in dict(kl_adaptation_method=method, loss_type=loss_type, importance_sampling_level=importance_sampling_level, **fields).items():
        setattr(args, name, value)
    trainer.loss_type = loss_type
    trainer.importance_sampling_level = importance_sampling_level
    trainer._adaptive_kl = trl_backend.TRLAdaptiveKL(trainer)
    trainer.beta = trainer._adaptive_kl.beta


def loss_and_grads(trainer, inputs, compute=None):
    compute = compute or GRPOTrainer._compute_loss
    trainer.model.zero_grad(set_to_none=True)
    loss = compute(trainer, trainer.model, inputs)
    loss.backward()
    grads = [p.grad.detach().clone() for p in trainer.model.parameters() if p.grad is not None]
    return loss.detach(), grads


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence"])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_method_none_with_k3_is_bit_identical_to_unpatched_trl(trainer, loss_type, importance_sampling_level, bias_correction):
    if importance_sampling_level == "sequence" and loss_type in ("cispo", "sapo", "vespo"):
        pytest.skip("TRL does not combine this loss type with sequence-level importance sampling")
    set_method(trainer, "none", loss_type, importance_sampling_level, kl_estimator="k3", use_bias_correction_kl=bias_correction)
    inputs = loss_inputs(trainer)
    original = trl_backend.original(GRPOTrainer, "_compute_loss")
    assert original is not GRPOTrainer._compute_loss
    torch.manual_seed(0)
    loss_patched, grads_patched = loss_and_grads(trainer, inputs)
    torch.manual_seed(0)
    loss_original, grads_original = loss_and_grads(trainer, inputs, original)
    assert torch.equal(loss_patched, loss_original)
    assert len(grads_patched) == len(grads_original) > 0
    assert all(torch.equal(a, b) for a, b in zip(grads_patched, grads_original))


def _capture_logps(trainer, monkeypatch):
    seen = {}
    original = trainer._adaptive_kl.loss_kl  # the runtime hook the rewritten loss hands its log-probs to

    def spy(logp, inputs, **kwargs):
        seen["logp"] = logp.detach().clone()
        return original(logp, inputs, **kwargs)

    monkeypatch.setattr(trainer._adaptive_kl, "loss_kl", spy)
    return seen


SHAPING_CASES = [
    ("clip", "k3"),
    ("soft_clip", "k3"),
    ("soft_clip+sigmoid", "k2"),
    ("sigmoid", "k3"),
    ("length_normalized", "k3"),
    ("clip+sigmoid+length_normalized", "k3"),
    ("none", "k1"),
    ("clip", "k2"),
    ("sigmoid", "abs"),
]


def kl_part_of_the_loss(trainer, monkeypatch, inputs) -> tuple[float, dict]:
    """The loss at the trainer's β minus the loss at β = 0, and the log-probs the KL term saw."""
    seen = _capture_logps(trainer, monkeypatch)
    with torch.no_grad():
        loss_with_kl = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
        trainer.beta = 0.0
        loss_without_kl = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    return (loss_with_kl.double() - loss_without_kl.double()).item(), seen


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("method, estimator", SHAPING_CASES)
def test_kl_part_of_the_loss_matches_float64_reference(trainer, monkeypatch, loss_type, method, estimator):
    beta, clip_threshold, kl_target = 0.3, 0.4, 0.2
    set_method(trainer, method, loss_type, kl_estimator=estimator, beta=beta, kl_clip_threshold=clip_threshold, kl_target=kl_target, use_bias_correction_kl=BIAS_CORRECTION)
    inputs = loss_inputs(trainer, seed=1)
    got, seen = kl_part_of_the_loss(trainer, monkeypatch, inputs)
    expected, _, _ = reference.kl_part(
        method, seen["logp"], inputs, loss_type, beta=beta, estimator=estimator, clip_threshold=clip_threshold, kl_target=kl_target,
        bias_correction=BIAS_CORRECTION,
    )
    assert got == pytest.approx(expected.item(), rel=2e-4, abs=1e-6)
    sequence_mean_loss = loss_type in ("grpo", "sapo")  # length normalisation is what these already do
    if method != "none" and not (method == "length_normalized" and sequence_mean_loss):
        # the shaping reached the loss, not only a metric
        unshaped, _, _ = reference.kl_part("none", seen["logp"], inputs, loss_type, beta=beta, estimator=estimator, clip_threshold=clip_threshold, kl_target=kl_target, bias_correction=BIAS_CORRECTION)
        assert abs(unshaped.item() - got) > 1e-4


@pytest.mark.parametrize("method", ["none", "clip+sigmoid", "length_normalized"])
def test_metrics_match_float64_reference_on_the_same_logps(trainer, monkeypatch, method):
    set_method(trainer, method, "dapo", kl_estimator="k3", beta=0.25, kl_clip_threshold=0.5, kl_target=0.3, use_bias_correction_kl=BIAS_CORRECTION)
    inputs = loss_inputs(trainer, seed=2)
    seen = _capture_logps(trainer, monkeypatch)
    metrics = trainer._metrics["train"]
    metrics.clear()
    with torch.no_grad():
        GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    _, raw, shaped = reference.kl_part(method, seen["logp"], inputs, "dapo", beta=0.25, estimator="k3", clip_threshold=0.5, kl_target=0.3, bias_correction=BIAS_CORRECTION)
    raw_mean, adapted_mean = reference.metric_reference(method, raw, shaped, inputs["completion_mask"])
    assert metrics[unsloth_adaptive_kl.RAW_KL] == [pytest.approx(raw_mean, rel=1e-5)]
    assert metrics[unsloth_adaptive_kl.ADAPTED_KL] == [pytest.approx(adapted_mean, rel=1e-5)]
    assert metrics[unsloth_adaptive_kl.CURRENT_BETA] == [0.25]
    assert metrics["kl"] == [pytest.approx(raw_mean, rel=1e-5)]  # TRL's own kl stays unshaped


def test_length_normalized_changes_nothing_under_grpo_but_reweights_under_dapo(trainer):
    results = {}
    for loss_type in ("grpo", "dapo"):
        for method in ("none", "length_normalized"):
            set_method(trainer, method, loss_type, kl_estimator="k3", beta=0.5)
            with torch.no_grad():
                results[loss_type, method] = GRPOTrainer._compute_loss(trainer, trainer.model, loss_inputs(trainer, seed=3)).item()
    assert results["grpo", "length_normalized"] == pytest.approx(results["grpo", "none"], rel=1e-6)
    assert abs(results["dapo", "length_normalized"] - results["dapo", "none"]) > 1e-4


# -- end to end ------------------------------------------------------------------------------------
def missing(value) -> bool:
    """A metric with no value in the log: TRL >= 1.0 logs it as None, TRL 0.2x as the NaN itself."""
    return value is None or math.isnan(value)


def _run(checkpoint, tmp_path, **overrides):
    trainer = make_trainer(checkpoint, tmp_path, **overrides)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "adaptive_kl/current_beta" in h]
    return trainer, logs


@pytest.mark.parametrize("method", METHODS)
def test_grpo_trains_end_to_end_logging_metrics_and_beta_trajectory(tiny_checkpoint, tmp_path, method, caplog):
    overrides = dict(kl_adaptation_method=method, **reference.training_settings(), kl_clip_threshold=0.05, learning_rate=2e-2)
    with caplog.at_level("INFO", logger="unsloth_adaptive_kl"):
        trainer, logs = _run(tiny_checkpoint, tmp_path, **overrides)
    assert len(logs) == 3
    betas = [h["adaptive_kl/current_beta"] for h in logs]
    # when train() ends, one line says what β did, from the same β the steps logged (none for a fixed β)
    reference.assert_course_logged([r.getMessage() for r in caplog.records if " of this run" in r.getMessage()], method, betas)
    for h in logs:
        assert math.isfinite(h["adaptive_kl/raw_kl"]) and math.isfinite(h["adaptive_kl/adapted_kl"])
        assert h["adaptive_kl/raw_kl"] == pytest.approx(h["kl"], rel=1e-6)  # k3 raw == TRL's kl
    # dynamic: the reward is always above its threshold, so beta decays at every optimizer step
    assert betas == pytest.approx(reference.expected_betas(method, logs), rel=1e-9)
    if "clip" in method.split("+") or "soft_clip" in method.split("+"):
        assert all(h["adaptive_kl/adapted_kl"] <= 0.05 + 1e-9 for h in logs)
    # once the policy has left the reference, the shaping is visible in the adapted KL
    moved = [h for h in logs if h["adaptive_kl/raw_kl"] > 0.06]
    if method in ("clip", "soft_clip", "sigmoid", "ziegler+clip+sigmoid"):
        assert moved, "the policy never left the reference: the test proves nothing"
        assert all(h["adaptive_kl/adapted_kl"] < h["adaptive_kl/raw_kl"] for h in moved)
    if method == "none":
        assert all(h["adaptive_kl/adapted_kl"] == h["adaptive_kl/raw_kl"] for h in logs)


def test_beta_reaching_zero_skips_kl_and_reference_forward_with_reused_generations(tiny_checkpoint, tmp_path):
    overrides = dict(
        kl_adaptation_method="dynamic", reward_threshold=100.0, beta_min=0.0, beta_schedule_steps=2, max_steps=6, steps_per_generation=2, num_iterations=2,
        **SMALL_BATCH,
    )  # fmt: skip
    trainer = make_trainer(tiny_checkpoint, tmp_path, **overrides)
    ref_calls = []
    trainer.ref_model.register_forward_hook(lambda *a: ref_calls.append(trainer.state.global_step))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "adaptive_kl/current_beta" in h]
    assert [h["adaptive_kl/current_beta"] for h in logs] == [0.04, 0.04, 0.0, 0.0, 0.0, 0.0]
    assert ref_calls and max(ref_calls) < 2  # no reference forward once beta is 0
    # no KL observed: not logged at all (a None would make TensorBoard warn at every logged step), as TRL's own kl
    assert all("adaptive_kl/raw_kl" not in h and "adaptive_kl/adapted_kl" not in h and "kl" not in h for h in logs[2:])
    assert all(not missing(h["adaptive_kl/raw_kl"]) for h in logs[:2])


@pytest.mark.parametrize("method", reference.controller_names())
def test_resume_from_checkpoint_continues_the_beta_series(tiny_checkpoint, tmp_path, method, caplog):
    overrides = dict(kl_adaptation_method=method, **reference.RESUME_SETTINGS, max_steps=5, learning_rate=2e-2, **SMALL_BATCH)
    _, full = _run(tiny_checkpoint, tmp_path / "full", **overrides)
    first = make_trainer(tiny_checkpoint, tmp_path / "resumed", **overrides, save_strategy="steps", save_steps=2)
    first.add_callback(reference.stop_after_checkpoint(2))  # only its checkpoint-2 is used: steps 3-5 are the resumed run's
    first.train()
    assert first.state.global_step == 2
    saved = first._adaptive_kl.state_dict()
    resumed = make_trainer(tiny_checkpoint, tmp_path / "resumed", **overrides)
    caplog.clear()
    with caplog.at_level("INFO", logger="unsloth_adaptive_kl"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-2"))
    after = [h["adaptive_kl/current_beta"] for h in resumed.state.log_history if "adaptive_kl/current_beta" in h and h["step"] > 2]
    full_betas = [h["adaptive_kl/current_beta"] for h in full]
    assert saved["controller"]["name"] == method
    assert after == pytest.approx(full_betas[2:], rel=1e-12)
    assert after[0] != 0.04  # the controller's state came back, not the configured beta
    # the line said when it ends counts the resumed run's 3 steps, from the checkpoint's beta
    reference.assert_course_logged([r.getMessage() for r in caplog.records if " of this run" in r.getMessage()], method, after)


def test_the_trainer_signature_shows_the_loss_class_keyword_it_accepts():
    import inspect

    shown = inspect.signature(GRPOTrainer.__init__).parameters
    own = inspect.signature(trl_backend.original(GRPOTrainer, "__init__")).parameters
    assert shown["loss_class"].kind is inspect.Parameter.KEYWORD_ONLY
    assert [name for name in shown if name != "loss_class"] == list(own)


def test_patch_is_idempotent_and_unpatch_restores_identity():
    patched_loss = GRPOTrainer._compute_loss
    unsloth_adaptive_kl.patch()
    assert GRPOTrainer._compute_loss is patched_loss
    original_loss = trl_backend.original(GRPOTrainer, "_compute_loss")
    original_init = trl_backend.original(GRPOConfig, "__init__")
    try:
        unsloth_adaptive_kl.unpatch()
        assert GRPOTrainer._compute_loss is original_loss
        assert GRPOConfig.__init__ is original_init
        assert "kl_adaptation_method" not in GRPOConfig.__dataclass_fields__
        assert "_load_callback_state" not in GRPOTrainer.__dict__
        with pytest.raises(TypeError):
            GRPOConfig(output_dir="/tmp/x", use_cpu=True, bf16=False, kl_adaptation_method="clip")
    finally:
        unsloth_adaptive_kl.patch()
    assert "kl_adaptation_method" in GRPOConfig.__dataclass_fields__


def test_a_missing_anchor_raises_naming_trl_and_its_version(monkeypatch):
    def _compute_loss(self, model, inputs):  # a "future TRL" whose loss no longer matches
        return 0

    with pytest.raises(unsloth_adaptive_kl.PatchError, match=rf"trl {re.escape(TRL_VERSION)}.*anchor"):
        rewrites = trl_backend.PLAN.select(trl_backend.owners()).rewrites
        trl_backend.rewrite_function(_compute_loss, [(r.anchor, r.replacement) for r in rewrites], library="trl")


def test_untested_trl_version_is_refused_unless_overridden(monkeypatch):
    monkeypatch.setattr(trl_backend, "_trl_supported", lambda v: False)
    unsloth_adaptive_kl.unpatch()
    try:
        with pytest.raises(unsloth_adaptive_kl.PatchError, match=f"supports trl {re.escape(versions.SUPPORTED['trl'].label)}"):
            unsloth_adaptive_kl.patch()
        assert not trl_backend.is_patched()
        monkeypatch.setenv("UNSLOTH_ADAPTIVE_KL_ALLOW_UNTESTED", "1")
        unsloth_adaptive_kl.patch()
        assert trl_backend.is_patched()
    finally:
        unsloth_adaptive_kl.unpatch()
        monkeypatch.undo()
        unsloth_adaptive_kl.patch()


# -- reliability, second round (issue 15) -------------------------------------------------------------
def _betas(trainer):
    return [h["adaptive_kl/current_beta"] for h in trainer.state.log_history if "adaptive_kl/current_beta" in h]


def test_logged_beta_is_the_last_steps_beta_not_the_window_mean(tiny_checkpoint, tmp_path):
    overrides = dict(kl_adaptation_method="dynamic", reward_threshold=-1.0, dynamic_beta_decay=0.5, max_steps=4, logging_steps=2, **SMALL_BATCH)
    trainer, logs = _run(tiny_checkpoint, tmp_path, **overrides)
    # steps use 0.04, 0.02, 0.01, 0.005: the log at step 2 shows 0.02 (not 0.03), at step 4 0.005 (not 0.0075)
    assert [h["step"] for h in logs] == [2, 4]
    assert [h["adaptive_kl/current_beta"] for h in logs] == [0.02, 0.005]
    assert [h["adaptive_kl/skipped_updates"] for h in logs] == [0.0, 0.0]


@pytest.mark.parametrize(
    "schedule, expected, generations",
    [
        # one generation batch feeds 4 optimizer steps: one decay per batch, not per step
        (dict(steps_per_generation=4), [0.04, 0.02, 0.02, 0.02, 0.02, 0.01], [0, 4]),
        # each generation batch is used for 2 optimizer steps (num_iterations=2)
        (dict(num_iterations=2), [0.04, 0.02, 0.02, 0.01, 0.01, 0.005], [0, 2, 4]),
        # steps_per_generation > gradient_accumulation_steps > 1: 2 optimizer steps per generation batch
        (dict(steps_per_generation=4, gradient_accumulation_steps=2, per_device_train_batch_size=2), [0.04, 0.02, 0.02, 0.01, 0.01, 0.005], [0, 2, 4]),
    ],
    ids=["steps_per_generation=4", "num_iterations=2", "spg=4,ga=2"],
)
def test_dynamic_decays_once_per_generation_batch(tiny_checkpoint, tmp_path, schedule, expected, generations):
    overrides = {**dict(kl_adaptation_method="dynamic", reward_threshold=-1.0, dynamic_beta_decay=0.5, max_steps=6), **SMALL_BATCH, **schedule}
    trainer = make_trainer(tiny_checkpoint, tmp_path, **overrides)
    seen = []  # the optimizer step (global_step before it) at which each new reward arrived
    original = trainer._adaptive_kl.observe_reward
    trainer._adaptive_kl.observe_reward = lambda r: (seen.append(trainer.state.global_step), original(r))
    trainer.train()
    assert seen == generations  # the schedule the expected series assumes
    assert _betas(trainer) == expected  # one decay per new reward; per optimizer step would be 0.04 * 0.5**k


def test_target_ignores_steps_whose_completions_are_all_masked(tiny_checkpoint, tmp_path):
    class AllTruncated(GRPOTrainer):  # as mask_truncated_completions=True does when every completion hits the limit
        def _generate_and_score_completions(self, *args, **kwargs):
            output = super()._generate_and_score_completions(*args, **kwargs)
            output["completion_mask"] = torch.zeros_like(output["completion_mask"])
            return output

    args = grpo_config(tmp_path, kl_adaptation_method="ziegler", kl_target=1.0, kl_horizon=8.0)
    trainer = AllTruncated(model=tiny_checkpoint, reward_funcs=[toy.format_reward], args=args, train_dataset=toy.prompt_dataset(64))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "adaptive_kl/current_beta" in h]
    assert len(logs) == 3 and all(missing(h.get("adaptive_kl/raw_kl")) for h in logs)  # no KL observed: missing, not 0
    assert _betas(trainer) == [0.04, 0.04, 0.04] and trainer.beta == 0.04  # read as KL = 0, β would fall by 0.9 per step


def test_a_nan_kl_leaves_beta_where_it_was_and_is_counted(tiny_checkpoint, tmp_path, caplog):
    class NaNReference(GRPOTrainer):  # the 3rd generation batch has NaN reference log-probs on one completion
        calls = 0

        def _generate_and_score_completions(self, *args, **kwargs):
            output = super()._generate_and_score_completions(*args, **kwargs)
            NaNReference.calls += 1
            if NaNReference.calls == 3:
                output["ref_per_token_logps"][0] = float("nan")
            return output

    args = grpo_config(tmp_path, kl_adaptation_method="ziegler", beta_min=0.0, kl_target=0.01, kl_horizon=40.0)
    trainer = NaNReference(model=tiny_checkpoint, reward_funcs=[toy.format_reward], args=args, train_dataset=toy.prompt_dataset(64))
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        trainer.train()
    logs = [h for h in trainer.state.log_history if "adaptive_kl/current_beta" in h]
    assert missing(logs[2].get("adaptive_kl/raw_kl"))  # the NaN step's KL (NaN) is logged as missing...
    assert trainer.beta == logs[2]["adaptive_kl/current_beta"] > 0  # ...and did not move β (was beta_min = 0)
    assert [h["adaptive_kl/skipped_updates"] for h in logs] == [0.0, 0.0, 1.0]
    assert "non-finite KL" in caplog.text


def test_a_dynamic_beta_whose_reward_never_passed_its_threshold_says_so_when_training_ends(tiny_checkpoint, tmp_path, caplog):
    """The README's `dynamic` on a task whose reward stays below reward_threshold trains as a fixed β: a warning says
    so, with the highest trailing reward, when train() returns (the fork's dynamic β never fired, silently)."""
    with caplog.at_level("INFO", logger="unsloth_adaptive_kl"):
        trainer, logs = _run(tiny_checkpoint, tmp_path, kl_adaptation_method="dynamic", reward_threshold=100.0, **SMALL_BATCH)
    rewards = [h["reward"] for h in logs]
    window = trainer.args.reward_window
    peak = max(sum(rewards[max(0, i + 1 - window):i + 1]) / len(rewards[max(0, i + 1 - window):i + 1]) for i in range(len(rewards)))
    (record,) = [r for r in caplog.records if " of this run" in r.getMessage()]
    assert record.levelname == "WARNING"
    assert record.getMessage() == (
        "unsloth_adaptive_kl: kl_adaptation_method='dynamic' never moved beta in the 3 optimizer steps of this run: every "
        f"step trained with beta 0.04, as a fixed beta would; its trailing mean reward (the last reward_window={window} "
        f"rewards) peaked at {peak:.4g}, never above reward_threshold=100: set reward_threshold to a reward your task "
        "reaches (adaptive_kl/current_beta logs the beta of each step)")


def test_a_kl_horizon_too_small_for_the_step_is_refused_when_the_trainer_is_created(tiny_checkpoint, tmp_path):
    # 4 completions per optimizer step: the factor 1 - 0.2 * 4 / 0.5 would be negative at the first low KL
    with pytest.raises(ValueError, match=r"kl_horizon=0\.5 .*4 completions per optimizer step.*allowed: kl_horizon > 0\.8"):
        make_trainer(tiny_checkpoint, tmp_path, kl_adaptation_method="ziegler", kl_horizon=0.5)


def test_the_trainer_logs_which_backend_computes_its_kl(tiny_checkpoint, tmp_path, caplog):
    from unsloth_adaptive_kl.backends.liger import AdaptiveFusedLinearGRPOLoss

    with caplog.at_level("INFO", logger="unsloth_adaptive_kl"):
        make_trainer(tiny_checkpoint, tmp_path, kl_adaptation_method="clip")
    assert "backend: TRL eager loss (GRPOTrainer._compute_loss)" in caplog.text
    caplog.clear()

    def with_loss_class():
        return GRPOTrainer(
            model=tiny_checkpoint, reward_funcs=[toy.format_reward], args=grpo_config(tmp_path), train_dataset=toy.prompt_dataset(8),
            loss_class=AdaptiveFusedLinearGRPOLoss,
        )

    if not versions.Supported("trl", versions.LOSS_CLASS_TRL, "", guarded=True).contains(TRL_VERSION):
        with pytest.raises(unsloth_adaptive_kl.PatchError, match=rf"trl\.kernels.*trl {re.escape(TRL_VERSION)} is installed"):
            with_loss_class()  # this TRL has no chunked log-prob kernel: the feature is not offered
        return
    with caplog.at_level("INFO", logger="unsloth_adaptive_kl"):
        with_loss_class()
    assert "backend: loss_class=unsloth_adaptive_kl.backends.liger.AdaptiveFusedLinearGRPOLoss" in caplog.text


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "luspo", "vespo"])
def test_a_loss_type_not_offered_with_the_installed_trl_is_refused_when_the_trainer_is_created(tiny_checkpoint, tmp_path, loss_type):
    if OFFERED.get(loss_type, "") is None:
        pytest.skip(f"loss_type {loss_type!r} is offered with trl {TRL_VERSION}")
    overrides = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
    with pytest.raises(ValueError, match=rf"loss_type='{loss_type}' is not offered with the installed trl {re.escape(TRL_VERSION)} \(.*\); allowed: grpo"):
        make_trainer(tiny_checkpoint, tmp_path, loss_type=loss_type, **overrides)


def test_a_misspelt_loss_type_set_after_the_config_was_checked_is_refused_as_a_typo_not_as_a_trl_version(tiny_checkpoint, tmp_path):
    # issue 39, item 5: before, "loss_type='dapoo' is not offered with the installed trl ... (a newer TRL has it)".
    args = grpo_config(tmp_path)
    args.loss_type = "dapoo"
    with pytest.raises(ValueError) as info:
        GRPOTrainer(model=tiny_checkpoint, reward_funcs=[toy.format_reward], args=args, train_dataset=toy.prompt_dataset(8))
    message = str(info.value)
    assert "loss_type='dapoo' is not valid: no TRL release has this loss type (did you mean 'dapo'?)" in message
    assert "newer TRL" not in message and "allowed with the installed trl" in message


@pytest.mark.parametrize("method", ["clip", "none"])
def test_unpatch_with_a_live_trainer_raises_or_warns_before_training(tiny_checkpoint, tmp_path, caplog, method):
    trainer = make_trainer(tiny_checkpoint, tmp_path, kl_adaptation_method=method, max_steps=1)
    unsloth_adaptive_kl.unpatch()
    try:
        if method != "none":
            with pytest.raises(unsloth_adaptive_kl.PatchError, match="unpatch\\(\\) was called.*'clip'.*patch\\(\\) again"):
                trainer.train()
        else:
            with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
                trainer.train()  # nothing to adapt: TRL's loss, with a warning
            assert "unpatch() was called" in caplog.text
            assert not any("adaptive_kl/raw_kl" in h for h in trainer.state.log_history)
    finally:
        unsloth_adaptive_kl.patch()


def test_a_trl_trainer_with_unsloth_imported_warns_that_it_runs_on_trls_loss(tiny_checkpoint, tmp_path, caplog, monkeypatch):
    # What a CPU machine shows: `import unsloth` succeeds but leaves trl.GRPOTrainer as TRL's own class.
    monkeypatch.setitem(sys.modules, "unsloth", types.ModuleType("unsloth"))
    with caplog.at_level("INFO", logger="unsloth_adaptive_kl"):
        make_trainer(tiny_checkpoint, tmp_path, kl_adaptation_method="clip")
    assert "backend: TRL eager loss" in caplog.text
    warning = [r for r in caplog.records if r.levelname == "WARNING" and "unsloth is imported" in r.getMessage()]
    assert len(warning) == 1 and "trains on TRL's eager loss, not Unsloth's fused one" in warning[0].getMessage()


# -- a shaping method registered outside the package ----------------------------------------------------
def test_a_method_registered_outside_the_package_changes_the_loss_and_halves_the_adapted_kl(trainer, tiny_checkpoint, tmp_path, monkeypatch, half_kl):
    beta = 0.3
    set_method(trainer, "half_kl", "dapo", kl_estimator="k3", beta=beta, use_bias_correction_kl=BIAS_CORRECTION)
    inputs = loss_inputs(trainer, seed=1)
    got, seen = kl_part_of_the_loss(trainer, monkeypatch, inputs)
    unshaped, _, _ = reference.kl_part(
        "none", seen["logp"], inputs, "dapo", beta=beta, estimator="k3", clip_threshold=1.0, kl_target=0.1, bias_correction=BIAS_CORRECTION
    )
    assert got == pytest.approx(0.5 * unshaped.item(), rel=2e-4, abs=1e-7) and abs(got - unshaped.item()) > 1e-4
    _, logs = _run(tiny_checkpoint, tmp_path, kl_adaptation_method="half_kl", max_steps=2, learning_rate=2e-2)
    assert len(logs) == 2 and logs[-1]["adaptive_kl/raw_kl"] > 0
    for h in logs:
        assert h["adaptive_kl/adapted_kl"] == pytest.approx(0.5 * h["adaptive_kl/raw_kl"], rel=1e-6)


# -- β has one owner: the controller -------------------------------------------------------------------
def test_beta_set_through_each_public_way_is_the_beta_the_loss_uses(tiny_checkpoint, tmp_path):
    """Config, ``trainer.beta = x``, the controller's update and a resumed controller state: each sets the
    one β (the controller's), and the loss's KL part is that β times the same KL."""
    trainer = make_trainer(tiny_checkpoint, tmp_path, beta=0.2, kl_adaptation_method="dynamic", reward_threshold=-1.0, dynamic_beta_decay=0.5)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    runtime, inputs = trainer._adaptive_kl, loss_inputs(trainer, seed=3)

    def loss():
        with torch.no_grad():
            return GRPOTrainer._compute_loss(trainer, trainer.model, inputs).double().item()

    assert trainer.beta == runtime.controller.beta == 0.2  # from the config
    with_config_beta = loss()
    trainer.beta = 0.0  # assignment: the controller's β
    assert runtime.controller.beta == 0.0
    policy_only = loss()
    trainer.beta = 1.0
    unit_kl = loss() - policy_only
    assert abs(unit_kl) > 1e-4
    assert with_config_beta - policy_only == pytest.approx(0.2 * unit_kl, rel=1e-6)
    trainer.beta = 0.2
    runtime.observe_reward(1.0)
    runtime.end_step(1)  # the controller's own update (the callback calls this after each optimizer step)
    assert trainer.beta == 0.1 and loss() - policy_only == pytest.approx(0.1 * unit_kl, rel=1e-6)
    saved = runtime.state_dict()
    saved["controller"]["beta"] = 0.05
    trainer.state.stateful_callbacks["AdaptiveKLCallback"] = {"args": {}, "attributes": {"adaptive_kl_state": saved}}
    trainer._load_callback_state()  # what resume_from_checkpoint runs
    assert trainer.beta == 0.05 and loss() - policy_only == pytest.approx(0.05 * unit_kl, rel=1e-6)
    with pytest.raises(ValueError, match="beta=-1.0 is not valid"):
        trainer.beta = -1.0


# -- gradient accumulation (issue 38) ----------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("method", reference.ACCUMULATION_METHODS)
def test_kl_part_of_the_loss_under_gradient_accumulation_matches_float64_reference(trainer, monkeypatch, loss_type, method):
    """With 3 accumulation steps (and 3 steps per generation) the KL part is divided as TRL divides its loss, for
    every method: length_normalized's term, added after TRL's aggregation, divided by the accumulation steps too."""
    beta, clip_threshold, kl_target, accumulation = 0.3, 0.4, 0.2, 3
    set_method(trainer, method, loss_type, kl_estimator="k3", beta=beta, beta_min=0.01, kl_clip_threshold=clip_threshold, kl_target=kl_target, use_bias_correction_kl=BIAS_CORRECTION)
    monkeypatch.setattr(trainer, "current_gradient_accumulation_steps", accumulation)
    monkeypatch.setattr(trainer.args, "steps_per_generation", accumulation)
    inputs = loss_inputs(trainer, seed=4)
    inputs["num_items_in_batch"] = inputs["num_items_in_batch"] * accumulation  # the generation batch's tokens
    got, seen = kl_part_of_the_loss(trainer, monkeypatch, inputs)
    expected, _, _ = reference.kl_part(
        method, seen["logp"], inputs, loss_type, beta=beta, estimator="k3", clip_threshold=clip_threshold, kl_target=kl_target,
        bias_correction=BIAS_CORRECTION, ga=accumulation, spg=accumulation,
    )
    assert got == pytest.approx(expected.item(), rel=2e-4, abs=1e-7)


def test_an_unreachable_kl_target_is_warned_about_in_a_real_run(tiny_checkpoint, tmp_path, caplog):
    # 4 completions a step, kl_horizon 1: a clipped update moves β by 1 + 0.2 * 4 = ×1.8, so two steps in a row
    # more than 20 % above a target no policy reaches (1e-12) double it: the warning must come at the second
    args = dict(kl_adaptation_method="ziegler", kl_target=1e-12, kl_horizon=1.0, beta_min=0.0, max_steps=4, learning_rate=2e-2)
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        trainer, logs = _run(tiny_checkpoint, tmp_path, **args)
    kls = [h["adaptive_kl/raw_kl"] for h in logs]
    above = [kl >= 1.2e-12 for kl in kls]
    first_pair = next((i for i in range(1, len(above)) if above[i] and above[i - 1]), None)
    assert first_pair is not None, f"no two steps in a row above the target ({kls}): the test proves nothing"
    warnings = [r.getMessage() for r in caplog.records if "ziegler: the KL has stayed" in r.getMessage()]
    above_warnings = [w for w in warnings if "% above kl_target=1e-12" in w]
    assert len(above_warnings) == 1, warnings
    assert f"for 2 updates in a row (optimizer steps {first_pair}-{first_pair + 1};" in above_warnings[0]
    betas = [*_betas(trainer), trainer.beta]  # each step's β, then the last update's: the update after a step
    for step in range(first_pair - 1, first_pair + 1):  # above the target moved β at the full rate, ×1.8
        assert betas[step + 1] == pytest.approx(betas[step] * 1.8, rel=1e-9)
