"""Behaviours of the TRL backend's rewritten loss and of the Liger module that the backends' other fast tests left
unchecked: each test here fails on one or more mutants that survived ``scripts/mutation_backends.py`` (issue 38;
docs/mutation-survivors.md names them) and passes on the code. The Unsloth ones are in test_unsloth_lines.py,
whose worker builds the rewritten fused loss."""

import math

import pytest
import torch
from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
from test_liger import B, T, kl_part, liger_kwargs, make_batch, module_logps, run_module
from test_trl import BIAS_CORRECTION, _capture_logps, kl_part_of_the_loss, loss_inputs, make_trainer, set_method
from trl import GRPOTrainer

import reference
import unsloth_adaptive_kl
from unsloth_adaptive_kl.backends.liger import AdaptiveFusedLinearGRPOLoss, selected_token_logps


# -- TRL: the evaluation loss ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trl_trainer(tiny_checkpoint, tmp_path_factory):
    trainer = make_trainer(tiny_checkpoint, tmp_path_factory.mktemp("trl-eval"))
    trainer.current_gradient_accumulation_steps = 1  # set by TRL's training loop, which these tests do not run
    return trainer


def test_trl_evaluation_loss_logs_its_kl_under_eval_feeds_no_controller_and_is_not_divided_by_accumulation(trl_trainer, monkeypatch):
    """TRL computes the evaluation loss with the model in eval mode: no accumulation (TRL divides nothing in eval), the
    metrics under ``eval``, and the KL of evaluation batches is not the training KL a controller steers on. The
    rewritten loss passes that mode on (a replacement passing "train" fails here)."""
    trainer, beta, accumulation = trl_trainer, 0.3, 3
    method = "length_normalized"  # the term this package adds after TRL's aggregation, so divided by this package
    set_method(trainer, method, "dapo", kl_estimator="k3", beta=beta, use_bias_correction_kl=BIAS_CORRECTION)
    monkeypatch.setattr(trainer, "current_gradient_accumulation_steps", accumulation)
    monkeypatch.setattr(trainer.args, "steps_per_generation", accumulation)
    inputs = loss_inputs(trainer, seed=7)
    for logged in trainer._metrics.values():
        logged.clear()
    trainer.model.eval()
    try:
        seen = _capture_logps(trainer, monkeypatch)
        with torch.no_grad():
            GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
        assert trainer._adaptive_kl._step_sums is None  # nothing reached the controller's step statistic
        logged = {name: list(values) for name, values in trainer._metrics["eval"].items()}
        got, _ = kl_part_of_the_loss(trainer, monkeypatch, inputs)
    finally:
        trainer.model.train()
    expected, raw, shaped = reference.kl_part(method, seen["logp"], inputs, "dapo", beta=beta, estimator="k3", clip_threshold=0.4, kl_target=0.2, bias_correction=BIAS_CORRECTION)
    raw_mean, adapted_mean = reference.metric_reference(method, raw, shaped, inputs["completion_mask"])
    assert logged[unsloth_adaptive_kl.RAW_KL] == [pytest.approx(raw_mean, rel=1e-5)]
    assert logged[unsloth_adaptive_kl.ADAPTED_KL] == [pytest.approx(adapted_mean, rel=1e-5)]
    assert not trainer._metrics["train"].get(unsloth_adaptive_kl.RAW_KL)
    assert got == pytest.approx(expected.item(), rel=2e-4, abs=1e-7)  # eval: not divided by the accumulation steps
    assert abs(expected.item() / accumulation - expected.item()) > 1e-4


# -- Liger: the KL values the module returns ------------------------------------------------------------------------------
def test_the_liger_modules_kl_metric_is_the_unshaped_kl_under_a_shaping_method():
    """The module's ``kl`` metric is Liger's: the mean raw KL over the valid tokens, not the clipped one β multiplies."""
    batch = make_batch(seed=8)
    module = AdaptiveFusedLinearGRPOLoss(**liger_kwargs("dapo", beta=0.3, compiled=False), kl_adaptation_method="clip", kl_clip_threshold=0.3)
    logp, ref, mask = module_logps(module, batch).double(), batch["ref_per_token_logps"].double(), batch["attention_mask"].bool()
    r = ref - logp
    k3 = torch.exp(r) - r - 1
    raw_mean, clipped_mean = k3[mask].mean().item(), k3[mask].clamp(max=0.3).mean().item()
    with torch.no_grad():
        _, (kl_metric, _) = module(**batch)
    assert kl_metric.item() == pytest.approx(raw_mean, rel=1e-5)
    assert raw_mean - clipped_mean > 1e-3  # the clip acted: the two means differ


def test_the_liger_modules_kl_values_are_detached_and_its_loss_is_not():
    """``LossTerms``' raw and adapted KL and the kl metric carry no graph (documented in LossTerms: a metric holding the
    graph keeps the step's activations alive); the loss does."""
    batch = make_batch(seed=9)
    module = AdaptiveFusedLinearGRPOLoss(**liger_kwargs("dapo", beta=0.3, compiled=False), kl_adaptation_method="clip", kl_clip_threshold=0.3)
    logps = module_logps(module, batch).requires_grad_(True)
    terms = module.loss_from_logps(logps, batch["attention_mask"], batch["advantages"], ref_per_token_logps=batch["ref_per_token_logps"])
    assert terms.loss.requires_grad
    assert not terms.raw_kl.requires_grad and not terms.adapted_kl.requires_grad and not terms.kl_mean.requires_grad


def test_liger_module_returns_the_raw_and_the_adapted_kl_each_in_its_own_field():
    """``LossTerms.raw_kl`` is the unshaped per-token KL (what TRL's kl metric and adaptive_kl/raw_kl read under
    ``loss_class=``), ``adapted_kl`` the clipped one β multiplies, both 0 on padding."""
    batch = make_batch(seed=12)
    module = AdaptiveFusedLinearGRPOLoss(**liger_kwargs("dapo", beta=0.3, compiled=False), kl_adaptation_method="clip", kl_clip_threshold=0.3)
    logps = module_logps(module, batch)
    mask = batch["attention_mask"].bool()
    r = batch["ref_per_token_logps"].double() - logps.double()
    k3 = torch.where(mask, torch.exp(r) - r - 1, 0.0)
    with torch.no_grad():
        terms = module.loss_from_logps(logps, batch["attention_mask"], batch["advantages"], ref_per_token_logps=batch["ref_per_token_logps"])
    torch.testing.assert_close(terms.raw_kl.double(), k3, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(terms.adapted_kl.double(), k3.clamp(max=0.3), rtol=1e-5, atol=1e-7)
    assert bool((k3 > 0.3 + 1e-3).any())  # the clip acted on some token


@pytest.mark.parametrize("method", ["none", "length_normalized"])
def test_liger_module_excluded_tokens_leave_the_kl_term_its_token_count_and_the_metrics_mask(method):
    """``kl_exclude_token_ids`` on the module: the KL part is the float64 one with the excluded tokens at 0 (under
    length_normalized, each completion's mean over the tokens that have a KL), and ``LossTerms.kl_mask`` is the valid
    tokens that are not excluded. (tests/backends/test_kl_diagnostics.py has dapo with method none and the policy.)"""
    beta = 0.3
    batch = make_batch(seed=13)
    ids = sorted(set(batch["selected_token_ids"][0, :2].tolist()))
    excluded = torch.isin(batch["selected_token_ids"], torch.tensor(ids))
    module = AdaptiveFusedLinearGRPOLoss(**liger_kwargs("dapo", beta=beta, compiled=False), kl_adaptation_method=method, kl_exclude_token_ids=ids)
    logps = module_logps(module, batch)
    mask = batch["attention_mask"].bool()
    has_kl = mask & ~excluded
    r = batch["ref_per_token_logps"].double() - logps.double()
    k3 = torch.where(has_kl, torch.exp(r) - r - 1, 0.0)
    if method == "length_normalized":
        expected = beta * (k3.sum(-1) / has_kl.sum(-1).clamp(min=1)).mean()
    else:
        expected = beta * k3.sum() / mask.sum()
    arguments = dict(ref_per_token_logps=batch["ref_per_token_logps"], selected_token_ids=batch["selected_token_ids"])
    with torch.no_grad():
        terms = module.loss_from_logps(logps, batch["attention_mask"], batch["advantages"], **arguments)
        module.beta = 0.0
        policy = module.loss_from_logps(logps, batch["attention_mask"], batch["advantages"], **arguments).loss
    assert 0 < int((mask & excluded).sum()) < int(mask.sum())
    assert torch.equal(terms.kl_mask, has_kl.to(terms.kl_mask.dtype))
    assert (terms.loss.double() - policy.double()).item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-8)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "luspo"])
def test_liger_micro_batch_without_a_valid_token_returns_liger_s_own_zero_kl_metric(loss_type):
    """No valid token (every completion truncated and masked): the kl metric is 0 as in Liger's own module, not 0/0."""
    batch = make_batch(seed=10)
    batch["attention_mask"] = torch.zeros_like(batch["attention_mask"])
    kwargs = liger_kwargs(loss_type, compiled=False)
    ours = run_module(AdaptiveFusedLinearGRPOLoss(**kwargs), batch)
    theirs = run_module(LigerFusedLinearGRPOLoss(**kwargs), batch)
    assert ours[1][0].item() == theirs[1][0].item() == 0.0
    assert ours[0].item() == theirs[0].item()


def test_liger_luspo_bottom_q_takes_its_threshold_from_the_valid_tokens_although_the_kl_covers_padding():
    """Liger's luspo weighs padded positions (the module docstring), so its KL is taken there too; ``bottom_q``'s
    threshold stays the batch statistic of the valid tokens (padding's reference log-probs are not the model's)."""
    q, beta = 0.3, 0.3
    batch = make_batch(seed=11)
    mask = batch["attention_mask"].bool()
    padded = (~mask).sum().item()
    batch["ref_per_token_logps"][~mask] = -6.0 - 0.1 * torch.arange(padded, dtype=torch.float32)  # below every valid one
    module = AdaptiveFusedLinearGRPOLoss(**liger_kwargs("luspo", beta=beta, compiled=False), kl_estimator="bottom_q", kl_bottom_q=q)
    logp = selected_token_logps(batch["_input"], batch["lin_weight"], batch["bias"], batch["selected_token_ids"], None, module.temperature)
    logp, ref = logp.detach().double(), batch["ref_per_token_logps"].double()
    r = ref - logp
    k3 = torch.exp(r) - r - 1

    def luspo_kl_part(selected):  # Liger's luspo: (l * L_i).sum() / (B * T), over every position
        kl = torch.where(selected, k3 / q, torch.zeros_like(k3))
        return beta * (kl * mask.sum(-1, keepdim=True)).sum() / (B * T)

    def threshold(values):  # the seed's floor(q * N)-th smallest, at least the first
        return values.kthvalue(max(1, math.floor(q * values.numel()))).values

    expected = luspo_kl_part(ref <= threshold(ref[mask]))
    over_every_position = luspo_kl_part(ref <= threshold(ref.flatten()))
    assert abs(expected.item() - over_every_position.item()) > 1e-3  # the test can tell the two apart
    assert kl_part(module, batch).item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
