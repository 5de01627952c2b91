"""Issue 36 on the TRL backend and the Liger module (Unsloth's: test_unsloth.py): the tail metrics as a
trainer logs them, ``kl_monitor`` (the KL logged at β = 0, the loss exactly stock TRL's β = 0 loss) and
``kl_exclude_token_ids`` (no KL term at those tokens, in the loss and the metrics; the policy term untouched),
against float64 references and against stock TRL."""

import math

import pytest
import reference
import torch
from test_tail import exact_tail
from test_trl import _capture_logps, grpo_config, loss_and_grads, loss_inputs, loss_test_trainer, make_trainer, set_method

import unsloth_adaptive_kl  # noqa: F401  (patches TRL)
from unsloth_adaptive_kl import metrics, tail
from unsloth_adaptive_kl.config import build
import toy
from unsloth_adaptive_kl.backends import trl as trl_backend
from unsloth_adaptive_kl.backends.liger import AdaptiveFusedLinearGRPOLoss
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

BIAS_CORRECTION = "use_bias_correction_kl" in GRPOConfig.__dataclass_fields__


@pytest.fixture(scope="module")
def trainer(tiny_checkpoint, tmp_path_factory):
    return loss_test_trainer(tiny_checkpoint, tmp_path_factory.mktemp("diagnostics"))


def assert_tail(logged: dict, valid_raw: torch.Tensor):
    """The three tail metrics against the float64 references sorted from ``valid_raw`` (max to float32 rounding)."""
    maximum, p99, share = exact_tail(valid_raw)
    assert logged[metrics.TOKEN_KL_MAX] == pytest.approx(maximum, rel=1e-6)
    assert abs(logged[metrics.TOKEN_KL_P99] - p99) <= tail.P99_RELATIVE_ERROR * abs(p99) * 1.0001 + tail.ABSOLUTE_ERROR
    assert abs(logged[metrics.TOKEN_KL_TOP1PCT_SHARE] - share) <= tail.SHARE_RELATIVE_ERROR * share * 1.0001 + 1e-6


def excluded_tokens(inputs, count=2):
    """Token ids that occur at valid positions of ``inputs`` (the first ``count`` of the first row), and where they occur."""
    ids = sorted(set(inputs["completion_ids"][0, :count].tolist()))
    where = torch.zeros_like(inputs["completion_mask"], dtype=torch.bool)
    for i in ids:
        where |= inputs["completion_ids"] == i
    return ids, where & inputs["completion_mask"].bool()


# -- the tail metrics ---------------------------------------------------------------------------------------
class NewWindow(TrainerCallback):
    def __init__(self, windows):
        self.windows = windows

    def on_log(self, *args, **kwargs):
        self.windows.append([])


def test_trl_logs_the_tail_of_each_logging_windows_tokens_pooled(tiny_checkpoint, tmp_path):
    """Two steps per log: token_kl_max is the max over both steps' tokens (not the mean of the two maxima, as
    TRL would average a list), p99 and the share those of the window's tokens pooled."""
    trainer = make_trainer(tiny_checkpoint, tmp_path, max_steps=4, logging_steps=2, learning_rate=2e-2)
    windows, original = [[]], trainer._adaptive_kl.record

    def record(raw, adapted, mask, *, training, beta):
        windows[-1].append(raw.detach().double()[mask.bool()])
        return original(raw, adapted, mask, training=training, beta=beta)

    trainer._adaptive_kl.record = record
    trainer.add_callback(NewWindow(windows))
    trainer.train()
    logs = [h for h in trainer.state.log_history if metrics.TOKEN_KL_MAX in h]
    assert len(logs) == 2 and all(len(w) == 2 for w in windows[:2])
    for logged, window in zip(logs, windows):
        assert_tail(logged, torch.cat(window))
    maxima = [float(t.max()) for t in windows[1]]
    assert maxima[0] != maxima[1]  # so the mean of the two would not be their max


def test_trl_tail_metrics_match_float64_on_the_same_logps(trainer, monkeypatch):
    set_method(trainer, "clip", "dapo", kl_estimator="k3", beta=0.25, kl_clip_threshold=0.3, use_bias_correction_kl=BIAS_CORRECTION)
    inputs = loss_inputs(trainer, seed=4)
    seen = _capture_logps(trainer, monkeypatch)
    trainer._metrics["train"].clear()
    with torch.no_grad():
        GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    _, raw, _ = reference.kl_part("clip", seen["logp"], inputs, "dapo", beta=0.25, estimator="k3", clip_threshold=0.3, kl_target=0.1, bias_correction=BIAS_CORRECTION)
    logged = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    assert_tail(logged, raw[inputs["completion_mask"].bool()])


# -- kl_exclude_token_ids --------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_type, method", [("dapo", "none"), ("grpo", "clip"), ("dapo", "sigmoid+length_normalized"), ("bnpo", "soft_clip")])
def test_trl_excluded_tokens_leave_the_kl_term_and_metrics_and_not_the_policy_term(trainer, monkeypatch, loss_type, method):
    fields = dict(kl_estimator="k3", beta=0.3, kl_clip_threshold=0.2, kl_target=0.1, use_bias_correction_kl=BIAS_CORRECTION)
    inputs = loss_inputs(trainer, seed=3)
    ids, excluded = excluded_tokens(inputs)
    results = {}
    for exclude in (None, ids):
        set_method(trainer, method, loss_type, kl_exclude_token_ids=exclude, **fields)
        seen = _capture_logps(trainer, monkeypatch)
        trainer._metrics["train"].clear()
        with torch.no_grad():
            with_kl = GRPOTrainer._compute_loss(trainer, trainer.model, inputs).double()
            logged = {name: list(values) for name, values in trainer._metrics["train"].items()}
            trainer.beta = 0.0
            policy = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
        results[exclude is None] = (with_kl - policy.double(), policy, logged, seen["logp"])
    (kl_part, policy, logged, logp), (kl_part_all, policy_all, _, _) = results[False], results[True]
    assert torch.equal(policy, policy_all)  # the policy term is untouched
    expected, raw, shaped = reference.kl_part(
        method, logp, inputs, loss_type, beta=0.3, estimator="k3", clip_threshold=0.2, kl_target=0.1, bias_correction=BIAS_CORRECTION, excluded=excluded
    )  # fmt: skip
    assert kl_part.item() == pytest.approx(expected.item(), rel=2e-4, abs=1e-7)
    assert abs(kl_part.item() - kl_part_all.item()) > 1e-5  # the exclusion reached the loss
    kl_mask = inputs["completion_mask"].bool() & ~excluded
    assert logged[metrics.RAW_KL] == [pytest.approx((raw.sum() / kl_mask.sum()).item(), rel=1e-5)]
    assert_tail({name: values[-1] for name, values in logged.items()}, raw[kl_mask])


@pytest.mark.parametrize("value", [[-1], [1.5], "5", 5, [True], [3, "4"], {1: 2}])
def test_kl_exclude_token_ids_refuses_anything_but_a_list_of_non_negative_ints(tmp_path, value):
    with pytest.raises(ValueError, match=r"kl_exclude_token_ids=.*is not valid; allowed: a list of non-negative integer token ids") as error:
        grpo_config(tmp_path, kl_exclude_token_ids=value)
    assert repr(value) in str(error.value)


def test_kl_exclude_token_ids_accepts_a_list_a_tuple_or_none(tmp_path):
    for value, kept in (([7, 2, 7], (2, 7)), ((0,), (0,)), (None, ()), ([], ())):
        config = grpo_config(tmp_path, kl_exclude_token_ids=value)
        assert build(config).term.exclude_token_ids == kept


def test_liger_module_excluded_tokens_leave_the_kl_term_only():
    """The Liger module (eager and its whole-batch path): the KL part of the loss is β times the float64 KL with the
    excluded positions at 0, aggregated as dapo; at β = 0 the loss is the same with or without the exclusion."""
    from test_liger import liger_kwargs, make_batch, module_logps

    batch = make_batch(seed=5)
    ids = sorted(set(batch["selected_token_ids"][0, :2].tolist()))
    excluded = torch.isin(batch["selected_token_ids"], torch.tensor(ids))
    modules = {
        exclude is None: AdaptiveFusedLinearGRPOLoss(**liger_kwargs("dapo", beta=0.3, compiled=False), kl_exclude_token_ids=exclude, fused_head=False)
        for exclude in (None, ids)
    }  # fmt: skip
    logps = module_logps(modules[True], batch)
    parts, policies = {}, {}
    for every_token, module in modules.items():
        with torch.no_grad():
            terms = module.loss_and_kl(**batch)
            module.beta = 0.0
            policies[every_token] = module.loss_and_kl(**batch).loss
            module.beta = 0.3
        parts[every_token] = terms.loss.double() - policies[every_token].double()
        if not every_token:
            assert torch.equal(terms.kl_mask.bool(), batch["attention_mask"].bool() & ~excluded)
            assert bool((terms.raw_kl[excluded] == 0).all()) and bool((terms.adapted_kl[excluded] == 0).all())
    assert torch.equal(policies[True], policies[False])
    mask = batch["attention_mask"].bool()
    r = batch["ref_per_token_logps"].double() - logps.double()
    k3 = torch.where(mask & ~excluded, torch.exp(r) - r - 1, 0.0)
    assert parts[False].item() == pytest.approx((0.3 * k3.sum() / mask.sum()).item(), rel=1e-5, abs=1e-8)
    assert abs(parts[False].item() - parts[True].item()) > 1e-6


def test_liger_loss_class_logs_tail_metrics_and_excludes_tokens_from_them(tiny_checkpoint, tmp_path):
    from test_liger import configure, loss_inputs as liger_inputs, make_trainer as make_liger_trainer

    trainer = make_liger_trainer(tiny_checkpoint, tmp_path)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = liger_inputs(trainer, seed=6)
    ids, excluded = excluded_tokens(inputs)
    configure(trainer, "dapo", "none", beta=0.2, kl_estimator="k3", use_bias_correction_kl=False, kl_exclude_token_ids=ids)
    seen = {}
    record = trainer._adaptive_kl.record

    def spy(raw, adapted, mask, **kwargs):
        seen.update(raw=raw.double(), mask=mask.bool())
        return record(raw, adapted, mask, **kwargs)

    trainer._adaptive_kl.record = spy
    trainer._metrics["train"].clear()
    with torch.no_grad():
        GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    assert torch.equal(seen["mask"], inputs["completion_mask"].bool() & ~excluded)
    logged = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    kept = seen["raw"][seen["mask"]]
    assert logged[metrics.RAW_KL] == pytest.approx(kept.mean().item(), rel=1e-6)
    assert_tail(logged, kept)


# -- kl_monitor --------------------------------------------------------------------------------------------
def test_kl_monitor_at_beta_zero_keeps_stock_trls_loss_and_gradients_and_logs_the_kl(tiny_checkpoint, tmp_path):
    trainer = make_trainer(tiny_checkpoint, tmp_path, beta=0.0, kl_monitor=True)
    assert trainer.args.beta == 0.0 and trainer.beta == 0.0 and trainer.__dict__["beta"] == 0.0
    assert trainer.ref_model is not None  # TRL makes no reference model at beta = 0 on its own
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = loss_inputs(trainer, seed=7)
    original = trl_backend.original(GRPOTrainer, "_compute_loss")
    torch.manual_seed(0)
    loss, grads = loss_and_grads(trainer, inputs)
    logged = {name: list(values) for name, values in trainer._metrics["train"].items()}
    trainer._metrics["train"].clear()
    torch.manual_seed(0)
    stock_loss, stock_grads = loss_and_grads(trainer, {k: v for k, v in inputs.items() if k != "ref_per_token_logps"}, original)
    assert torch.equal(loss, stock_loss) and len(grads) == len(stock_grads) > 0
    assert all(torch.equal(a, b) for a, b in zip(grads, stock_grads))
    stock_logged = {name: list(values) for name, values in trainer._metrics["train"].items()}
    assert "kl" not in stock_logged and metrics.RAW_KL not in stock_logged  # what kl_monitor adds
    mask = inputs["completion_mask"].bool()
    _, raw, _ = reference.kl_part("none", _policy_logps(trainer, inputs), inputs, "dapo", beta=0.0, estimator="k3", clip_threshold=1, kl_target=1, bias_correction=BIAS_CORRECTION)
    assert logged[metrics.RAW_KL] == [pytest.approx((raw.sum() / mask.sum()).item(), rel=1e-5)]
    assert logged["kl"] == logged[metrics.RAW_KL] and logged[metrics.CURRENT_BETA] == [0.0]
    assert_tail({name: values[-1] for name, values in logged.items()}, raw[mask])


def _policy_logps(trainer, inputs):
    """The per-token log-probs TRL's loss computes for ``inputs`` (its own method, no grad)."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        return trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention, inputs["completion_ids"].size(1))[0]


@pytest.mark.parametrize("start_beta", [0.0, 0.04])
def test_kl_monitor_runs_the_reference_forward_and_logs_the_kl_at_beta_zero_in_training(tiny_checkpoint, tmp_path, start_beta):
    """beta = 0 from the start, or reached by the dynamic controller after 2 steps: every step's reference forward
    runs and the KL is logged (adaptive_kl/* and TRL's kl), with β 0 where it is 0."""
    overrides = dict(beta=start_beta, kl_monitor=True, kl_monitor_every=1, max_steps=4, learning_rate=2e-2)
    if start_beta:
        overrides.update(kl_adaptation_method="dynamic", reward_threshold=100.0, beta_min=0.0, beta_schedule_steps=2)
    trainer = make_trainer(tiny_checkpoint, tmp_path, **overrides)
    ref_calls = []
    trainer.ref_model.register_forward_hook(lambda *a: ref_calls.append(trainer.state.global_step))
    trainer.train()
    logs = [h for h in trainer.state.log_history if metrics.CURRENT_BETA in h]
    assert [h[metrics.CURRENT_BETA] for h in logs] == ([0.0] * 4 if start_beta == 0 else [0.04, 0.04, 0.0, 0.0])
    assert sorted(set(ref_calls)) == [0, 1, 2, 3]
    for h in logs:
        assert math.isfinite(h[metrics.RAW_KL]) and h["kl"] == pytest.approx(h[metrics.RAW_KL], rel=1e-6)
        assert h[metrics.TOKEN_KL_MAX] >= h[metrics.TOKEN_KL_P99] >= 0
    assert logs[-1][metrics.RAW_KL] > 0  # the policy moved from the reference, and the log shows it


def _monitored_run(checkpoint, folder, **overrides):
    """A 4-step run at beta = 0 under kl_monitor: its logs (one per step) and the steps whose reference forward ran."""
    trainer = make_trainer(checkpoint, folder, beta=0.0, kl_monitor=True, max_steps=4, learning_rate=2e-2, **overrides)
    ref_calls = []
    trainer.ref_model.register_forward_hook(lambda *a: ref_calls.append(trainer.state.global_step))
    trainer.train()
    return [h for h in trainer.state.log_history if metrics.CURRENT_BETA in h], sorted(set(ref_calls))


@pytest.mark.parametrize("accumulation", [1, 2])
def test_sampled_kl_monitor_skips_the_reference_forward_between_its_batches_and_logs_the_full_monitors_kl_on_them(
    tiny_checkpoint, tmp_path, accumulation
):
    """kl_monitor_every=2, one generation batch an optimizer step (gradient_accumulation_steps 1, or 2 with
    steps_per_generation 2): the reference forward runs for batches 0 and 2 only, and steps 1 and 3 log exactly the
    KL the full monitor (kl_monitor_every=1) logged there: both runs train on stock TRL's beta = 0 loss, so they are the
    same run. Steps 2 and 4 log no KL (neither adaptive_kl/* nor TRL's kl), only beta."""
    batch = dict(per_device_train_batch_size=4 // accumulation, gradient_accumulation_steps=accumulation)
    full, full_calls = _monitored_run(tiny_checkpoint, tmp_path / "full", kl_monitor_every=1, **batch)
    sampled, sampled_calls = _monitored_run(tiny_checkpoint, tmp_path / "sampled", kl_monitor_every=2, **batch)
    assert full_calls == [0, 1, 2, 3] and sampled_calls == [0, 2]
    assert [metrics.RAW_KL in h for h in sampled] == [True, False, True, False]
    assert ["kl" in h for h in sampled] == [True, False, True, False]
    for step in (0, 2):
        for name in ("kl", metrics.RAW_KL, metrics.ADAPTED_KL, metrics.TOKEN_KL_MAX):
            assert sampled[step][name] == full[step][name], (step, name)
    assert [h["reward"] for h in sampled] == [h["reward"] for h in full]  # the same training
    assert all(h[metrics.CURRENT_BETA] == 0.0 for h in sampled)
    assert [h[metrics.RUNAWAY_ALARM] for h in sampled] == [0.0] * 4  # logged every step; 4 steps cannot be judged


def test_kl_monitor_every_is_validated(tmp_path):
    assert grpo_config(tmp_path, beta=0.0, kl_monitor=True).kl_monitor_every == 16  # the default: one batch in 16
    for bad in (0, -3, 2.0, True, "4"):
        with pytest.raises(ValueError, match=rf"kl_monitor_every={bad!r} is not valid; allowed: an integer >= 1"):
            grpo_config(tmp_path, beta=0.0, kl_monitor=True, kl_monitor_every=bad)
    with pytest.raises(ValueError, match=r"kl_monitor_every=4 is not valid with kl_monitor=False.*allowed: kl_monitor=True"):
        grpo_config(tmp_path, beta=0.0, kl_monitor_every=4)


def test_kl_monitor_is_validated_and_refused_where_it_cannot_act(tiny_checkpoint, tmp_path):
    with pytest.raises(ValueError, match=r"kl_monitor='yes' is not valid; allowed: true or false"):
        grpo_config(tmp_path, kl_monitor="yes")
    grpo_config(tmp_path, beta=0.0, kl_monitor=True, kl_estimator="k1")  # the estimator acts on the logged KL
    with pytest.raises(ValueError, match="kl_estimator='k1' is not valid with beta=0.0"):
        grpo_config(tmp_path, beta=0.0, kl_estimator="k1")
    with pytest.raises(ValueError, match=r"loss_class=\.\.\.\) does not support kl_monitor=True"):
        GRPOTrainer(
            model=tiny_checkpoint, reward_funcs=[lambda completions, **k: [0.0] * len(completions)], args=grpo_config(tmp_path, kl_monitor=True),
            train_dataset=toy.prompt_dataset(8), loss_class=AdaptiveFusedLinearGRPOLoss,
        )  # fmt: skip


def test_the_rewritten_generation_calls_no_zero_argument_super():
    """A function compiled from its source outside its class has no __class__ cell."""
    import inspect

    rewritten = trl_backend.PLAN.build(trl_backend.owners())["GRPOTrainer._generate_and_score_completions"]
    source = inspect.getsource(rewritten.__code__)
    assert "super()" not in source and source.count("super(GRPOTrainer, self)") == 2 and "self._adaptive_kl.runs_reference()" in source
