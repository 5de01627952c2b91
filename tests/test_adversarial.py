"""Adversarial inputs for the KL math of every backend: NaN and ±inf on masked positions,
log-ratios of ±1e4 on valid ones, all-masked rows, zero-length completions, a batch of one.

Required everywhere: the loss and every gradient are finite, masked positions contribute exactly 0
(value and gradient), and results match a float64 reference written from the formulas, with the
clamps docs/reliability.md states (k3's log-ratio to [-20, 20] on every backend; the Unsloth
backend also keeps Unsloth's [-10, 10] on the corrected KL)."""

import types

import decimal
import math

import pytest
import torch

import reference
from unsloth_adaptive_kl import metrics
import toy
from unsloth_adaptive_kl.adaptation import AdaptiveKL
from unsloth_adaptive_kl.config import FIELDS
from unsloth_adaptive_kl.estimators import ESTIMATORS, builtin_estimator_names
from unsloth_adaptive_kl.shaping import length_normalized_term

BUILTINS = list(builtin_estimator_names())
#: Every built-in shaping method alone, and all of them joined.
SHAPINGS = ["none", *reference.BUILTIN_SHAPING, "+".join(reference.BUILTIN_SHAPING)]
GARBAGE = [float("nan"), float("inf"), float("-inf")]
NAN = float("nan")


def adaptive(method="none", estimator="k3", beta=0.1, **fields):
    values = {f.name: f.default for f in FIELDS}
    values.update(kl_adaptation_method=method, kl_estimator=estimator, kl_clip_threshold=0.5, kl_target=0.2)
    values.update(fields)
    return AdaptiveKL(types.SimpleNamespace(beta=beta, use_bias_correction_kl=True, **values))


def ragged_mask(lengths, width):
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()


BATCHES = {  # name: row lengths, width
    "ragged with an all-masked row": ([6, 3, 1, 0], 6),
    "batch of one": ([5], 5),
    "one all-masked row": ([0], 4),
    "zero-length completions": ([0, 0], 0),
}


def float64_kl(name, logp, ref, *, q=0.2, mask=None):
    """Per-token KL in float64 from the definitions, k3's log-ratio clamped to [-20, 20]."""
    r = ref.double() - logp.double()
    c = r.clamp(-20, 20)
    k3 = torch.exp(c) - c - 1
    if name == "bottom_q":
        valid = ref.double()[mask.bool()]
        count = max(1, math.floor(decimal.Decimal(str(q)) * valid.numel()))  # the seed's floor(q * N), at least 1
        threshold = valid.sort().values[count - 1] if valid.numel() else -float("inf")
        return torch.where(ref.double() <= threshold, k3 / q, torch.zeros_like(k3))
    # not a registry list: indexed by the name of each built-in (BUILTINS, from the registry): a new one fails here
    return {"k1": -r, "k2": 0.5 * r**2, "k3": k3, "abs": r.abs(), "k1+": -r, "k3+": k3}[name]


def float64_shaped(method, kl):
    return reference.shaped64(kl, method, 0.5, 0.2)


def kl_loss(state, raw, adapted, mask):
    """What a backend adds: β × the token sum of the adapted KL, or its length-normalised mean."""
    if state.length_normalized:
        return state.beta * length_normalized_term(adapted, mask, max(mask.shape[0], 1))
    return state.beta * torch.where(mask.bool(), adapted, 0.0).sum()


# -- the core: AdaptiveKL.per_token, metrics.local_kl_sums, length_normalized_term -----------------------
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("method", SHAPINGS)
@pytest.mark.parametrize("estimator", BUILTINS)
def test_core_ignores_nan_and_inf_on_masked_positions(estimator, method, batch):
    lengths, width = BATCHES[batch]
    mask = ragged_mask(lengths, width)
    g = torch.Generator().manual_seed(0)
    clean_logp = -torch.rand(len(lengths), width, generator=g) * 4 - 0.5
    clean_ref = -torch.rand(len(lengths), width, generator=g) * 4 - 0.5
    state = adaptive(method, estimator)
    results = []
    for garbage in [0.0, *GARBAGE]:  # 0.0: the clean run every other run must equal
        logp = torch.where(mask.bool(), clean_logp, garbage).requires_grad_(True)
        ref = torch.where(mask.bool(), clean_ref, -garbage)
        statistic = state.batch_statistic(ref, mask)
        raw, adapted = state.per_token(logp, ref, mask, coef=torch.ones_like(logp), statistic=statistic)
        loss = kl_loss(state, raw, adapted, mask)
        loss.backward()
        sums = metrics.local_kl_sums(raw, adapted, mask)
        for t in (raw, adapted, loss, logp.grad, sums):
            assert torch.isfinite(t).all(), (garbage, t)
        masked = ~mask.bool()
        assert (raw[masked] == 0).all() and (adapted[masked] == 0).all() and (logp.grad[masked] == 0).all()
        results.append((raw.detach(), adapted.detach(), loss.detach(), logp.grad, sums))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    raw64 = torch.where(mask.bool(), float64_kl(estimator, clean_logp, clean_ref, mask=mask), 0.0)
    torch.testing.assert_close(results[0][0].double(), raw64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0][1].double(), torch.where(mask.bool(), float64_shaped(method, raw64), 0.0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", SHAPINGS)
@pytest.mark.parametrize("estimator", BUILTINS)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_core_stays_finite_and_matches_float64_at_log_ratios_of_1e4(estimator, method, sign):
    mask = ragged_mask([4, 2], 4)
    logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.5, -0.2, 0.0, 0.0]])
    ref = logp.clone()
    ref[0, 1] += sign * 1e4  # r = ±1e4
    ref[1, 0] -= sign * 1e4
    ref[0, 3] += sign * 30.0  # just beyond the k3 bound
    state = adaptive(method, estimator, kl_bottom_q=0.5)
    leaf = logp.clone().requires_grad_(True)
    raw, adapted = state.per_token(leaf, ref, mask, statistic=state.batch_statistic(ref, mask))
    loss = kl_loss(state, raw, adapted, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(leaf.grad).all() and torch.isfinite(raw).all()
    # float64: value and gradient of the same formulas (k1+/k3+ take k2's gradient, straight through)
    leaf64 = logp.double().requires_grad_(True)
    raw64 = torch.where(mask.bool(), float64_kl(estimator, leaf64, ref.double(), q=0.5, mask=mask), 0.0)
    if estimator in ("k1+", "k3+"):
        k2 = 0.5 * (ref.double() - leaf64) ** 2
        raw64 = torch.where(mask.bool(), k2 - k2.detach() + raw64.detach(), 0.0)
    shaped64 = torch.where(mask.bool(), float64_shaped(method, raw64), 0.0)
    loss64 = kl_loss(state, raw64, shaped64, mask)
    loss64.backward()
    torch.testing.assert_close(raw.double(), raw64.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(loss.double(), loss64.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(leaf.grad.double(), leaf64.grad, rtol=1e-5, atol=1e-4)


def test_local_sums_of_an_empty_batch_are_zero_and_its_metrics_are_missing_not_zero():
    for lengths, width in ([[0, 0], 3], [[0], 0]):
        mask = ragged_mask(lengths, width)
        garbage = torch.full(mask.shape, NAN)
        everywhere = torch.ones(mask.shape, dtype=torch.bool)  # a user estimator NaN on every (masked) token
        sums = metrics.local_kl_sums(garbage, garbage, mask, count_shaping_faults=True, estimator_faults=everywhere)
        assert sums.tolist() == [0.0, 0.0, 0.0, 0.0, float(len(lengths)), 0.0, 0.0]  # the masked NaN does not leak, nor count
        for length_normalized in (True, False):
            values = metrics.metric_values(sums, length_normalized=length_normalized)
            # no valid token: no KL was observed; NaN is what the trainer's log() shows as missing (a 0 would
            # claim a KL of 0, the same mistake that made `target` lower β on such steps)
            assert set(values) == {metrics.RAW_KL, metrics.ADAPTED_KL} and all(math.isnan(v) for v in values.values())


def test_local_sums_match_float64_over_valid_tokens_only():
    mask = ragged_mask([5, 2, 0], 5)
    g = torch.Generator().manual_seed(3)
    raw, adapted = torch.randn(3, 5, generator=g), torch.rand(3, 5, generator=g)
    dirty_raw, dirty_adapted = raw.masked_fill(mask == 0, float("inf")), adapted.masked_fill(mask == 0, NAN)
    sums = metrics.local_kl_sums(dirty_raw, dirty_adapted, mask)
    m = mask.double()
    expected = [(raw.double() * m).sum(), (adapted.double() * m).sum(), m.sum(), ((adapted.double() * m).sum(-1) / m.sum(-1).clamp(min=1)).sum(), 3.0, 0.0, 0.0]
    torch.testing.assert_close(sums, torch.tensor([float(e) for e in expected], dtype=torch.float64))


def test_global_metrics_of_a_bf16_kl_are_exact_token_weighted_means():
    """Issue 24: under FSDP2's bf16 MixedPrecisionPolicy TRL's log-probs, hence the per-token KL, are bf16. The
    2-GPU run logged clip's adapted_kl as 0.0013684724506578948 where the global mean was 0.0013676693564967106:
    26 of 38 valid tokens clipped to bf16(0.002), summed in bf16 (8 significant bits). The metrics must be the
    float64 mean of the values, whatever their dtype; here through the KL term (bf16 log-probs, clip), on two
    shards of different lengths whose sums are added as the all-reduce adds them."""
    mask0, mask1 = ragged_mask([8, 8, 8, 8], 8), ragged_mask([0, 3, 3], 8)
    g = torch.Generator().manual_seed(24)
    state = adaptive("clip", "k3", kl_clip_threshold=0.002)
    values, totals = {"raw": [], "adapted": []}, 0
    for mask in (mask0, mask1):
        logp = (-torch.rand(mask.shape, generator=g) * 3).bfloat16()
        ref = (logp.float() + torch.randn(mask.shape, generator=g) * 0.1).bfloat16()
        raw, adapted = state.per_token(logp, ref, mask)
        assert adapted.dtype == torch.bfloat16
        valid = mask.bool()
        values["raw"] += raw[valid].double().tolist()
        values["adapted"] += adapted[valid].double().tolist()
        totals = totals + metrics.local_kl_sums(raw, adapted, mask)
    clipped = sum(v == torch.tensor(0.002, dtype=torch.bfloat16).item() for v in values["adapted"])
    assert 0 < clipped < len(values["adapted"]) == 38  # the case of the issue: some tokens at the cap, some below
    logged = metrics.metric_values(totals, length_normalized=False)
    for name, key in ((metrics.RAW_KL, "raw"), (metrics.ADAPTED_KL, "adapted")):
        assert logged[name] == pytest.approx(math.fsum(values[key]) / 38, rel=1e-12, abs=0)
    # the logged numbers of the issue: 26 tokens at bf16(0.002) and 12 at 0, over 38
    cap = torch.full((26,), 0.002, dtype=torch.bfloat16)
    adapted = torch.cat([cap, torch.zeros(12, dtype=torch.bfloat16)])[None]
    logged = metrics.metric_values(metrics.local_kl_sums(adapted, adapted, torch.ones_like(adapted)), length_normalized=False)
    assert logged[metrics.ADAPTED_KL] == pytest.approx(0.0013676693564967106, rel=1e-12, abs=0)


# -- TRL: the patched GRPOTrainer._compute_loss --------------------------------------------------------
@pytest.fixture(scope="module")
def trl_trainer(tiny_checkpoint, tmp_path_factory):
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("adv")), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=4,
        num_generations=4, max_completion_length=reference.MAX_COMPLETION, max_steps=1, beta=0.1, save_strategy="no", seed=0,
    )  # fmt: skip
    t = GRPOTrainer(model=tiny_checkpoint, reward_funcs=[toy.format_reward], args=args, train_dataset=toy.prompt_dataset(8))
    t.model.train()
    t.current_gradient_accumulation_steps = 1
    return t


def set_method(trainer, method, estimator, loss_type):
    from unsloth_adaptive_kl.backends import trl as trl_backend

    trainer.args.kl_adaptation_method, trainer.args.kl_estimator = method, estimator
    trainer.args.kl_clip_threshold, trainer.args.kl_target = 0.5, 0.2
    trainer.loss_type = trainer.args.loss_type = loss_type
    trainer._adaptive_kl = trl_backend.TRLAdaptiveKL(trainer)
    trainer.beta = trainer._adaptive_kl.beta


def trl_loss_and_grads(trainer, inputs, compute=None):
    from trl import GRPOTrainer

    trainer.model.zero_grad(set_to_none=True)
    loss = (compute or GRPOTrainer._compute_loss)(trainer, trainer.model, inputs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]


def trl_inputs(trainer, lengths=(6, 3, 1, 0), seed=0):
    inputs = reference.loss_inputs(trainer.model.config.vocab_size, seed=seed, batch=len(lengths), pad_token_id=trainer.processing_class.pad_token_id)
    mask = ragged_mask(list(lengths), reference.MAX_COMPLETION)
    inputs["completion_mask"] = mask
    inputs["completion_ids"] = inputs["completion_ids"].masked_fill(mask == 0, trainer.processing_class.pad_token_id)
    inputs["num_items_in_batch"] = mask.sum().float()
    return inputs


TRL_CASES = [("none", "k3", "dapo"), ("clip+sigmoid", "k3", "bnpo"), ("length_normalized", "k2", "dapo"), ("none", "abs", "grpo"), ("sigmoid", "k3+", "dr_grpo")]


@pytest.mark.parametrize("lengths", [(6, 3, 1, 0), (4,), (0, 0)], ids=["ragged", "batch of one", "all masked"])
@pytest.mark.parametrize("method, estimator, loss_type", TRL_CASES)
def test_trl_loss_ignores_nan_and_inf_reference_logps_on_padding(trl_trainer, method, estimator, loss_type, lengths):
    set_method(trl_trainer, method, estimator, loss_type)
    clean = trl_inputs(trl_trainer, lengths)
    torch.manual_seed(0)
    expected = trl_loss_and_grads(trl_trainer, clean)
    assert torch.isfinite(expected[0]) and all(torch.isfinite(g).all() for g in expected[1])
    for garbage in GARBAGE:
        dirty = dict(clean, ref_per_token_logps=clean["ref_per_token_logps"].masked_fill(clean["completion_mask"] == 0, garbage))
        torch.manual_seed(0)
        loss, grads = trl_loss_and_grads(trl_trainer, dirty)
        assert torch.equal(loss, expected[0]) and all(torch.equal(a, b) for a, b in zip(grads, expected[1])), garbage


def test_unpatched_trl_is_not_finite_there_which_is_the_trade_off(trl_trainer):
    from trl import GRPOTrainer

    from unsloth_adaptive_kl.backends import trl as trl_backend

    set_method(trl_trainer, "none", "k3", "dapo")
    clean = trl_inputs(trl_trainer)
    dirty = dict(clean, ref_per_token_logps=clean["ref_per_token_logps"].masked_fill(clean["completion_mask"] == 0, NAN))
    with torch.no_grad():
        assert torch.isnan(trl_backend.original(GRPOTrainer, "_compute_loss")(trl_trainer, trl_trainer.model, dirty))
        assert torch.isfinite(GRPOTrainer._compute_loss(trl_trainer, trl_trainer.model, dirty))


@pytest.mark.parametrize("method, estimator", [("none", "k3"), ("clip", "k3"), ("none", "k2"), ("sigmoid", "k1")])
def test_trl_loss_at_log_ratios_of_1e4_is_finite_and_matches_float64(trl_trainer, monkeypatch, method, estimator):
    """The policy's own log-probs are shifted by ∓1e4 on two valid tokens, so r = ref - logp = ±1e4 there;
    with no old log-probs TRL's importance ratio is 1, so only the KL sees the extreme."""
    set_method(trl_trainer, method, estimator, "bnpo")
    shift = torch.zeros(4, reference.MAX_COMPLETION)
    shift[0, 1], shift[1, 2] = -1e4, 1e4
    original = trl_trainer._get_per_token_logps_and_entropies
    seen = {}

    def shifted(*args, **kwargs):
        logps, entropies, *rest = original(*args, **kwargs)
        seen["logp"] = (logps + shift).detach()
        return (logps + shift, entropies, *rest)

    monkeypatch.setattr(trl_trainer, "_get_per_token_logps_and_entropies", shifted)
    inputs = trl_inputs(trl_trainer)
    del inputs["old_per_token_logps"]
    from trl import GRPOTrainer

    loss, grads = trl_loss_and_grads(trl_trainer, inputs)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    with torch.no_grad():
        trl_trainer.beta = 0.0
        policy_only = GRPOTrainer._compute_loss(trl_trainer, trl_trainer.model, inputs)
    mask = inputs["completion_mask"].bool()
    raw64 = torch.where(mask, float64_kl(estimator, seen["logp"], inputs["ref_per_token_logps"]), 0.0)
    expected = 0.1 * (float64_shaped(method, raw64) * mask).sum() / mask.sum()
    assert (loss.double() - policy_only.double()).item() == pytest.approx(expected.item(), rel=1e-5)


# -- Unsloth: the fused loss's KL lines, FusedKLInputs called with plain tensors ------------------------------
def unsloth_fused_kl(term, new, ref, old, mask, beta=0.1):
    """The KL lines of unsloth_zoo 2026.10.9's grpo_compute_loss as patched (padding zeroed first, as
    Unsloth does), then ``finish``: returns the loss's KL part and the statistics (Unsloth's kl, the sums, the tail)."""
    from unsloth_adaptive_kl.backends.unsloth import FusedKLInputs

    fused = FusedKLInputs(term, torch.tensor(beta), torch.tensor(float(max(mask.shape[0], 1))), None)
    keep = mask.bool()
    new, ref, old = torch.where(keep, new, 0.0), torch.where(keep, ref, 0.0), torch.where(keep, old, 0.0)
    kl_log_ratio = torch.clamp(ref - new, min=-20.0, max=20.0)
    kl_i = torch.expm1(kl_log_ratio) - kl_log_ratio
    kl_i, estimator_faults = fused.estimate(kl_i, new, ref, kl_log_ratio, mask)
    kl_i = kl_i * torch.exp(new - old)
    kl_i = torch.clamp(kl_i, min=-10.0, max=10.0)
    adapted = term.shape(kl_i)
    loss = torch.zeros(())
    if not term.length_normalized:
        loss = beta * (adapted * mask).sum() / mask.sum().clamp(min=1)
    return fused.finish(loss, torch.zeros(()), kl_i, adapted, mask, None, 1, estimator_faults=estimator_faults)


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("method", SHAPINGS)
@pytest.mark.parametrize("estimator", [name for name in BUILTINS if ESTIMATORS[name].batch_statistic is None])
def test_unsloth_fused_kl_is_finite_and_matches_float64_with_unsloths_clamps(estimator, method, batch):
    lengths, width = BATCHES[batch]
    mask = ragged_mask(lengths, width)
    g = torch.Generator().manual_seed(1)
    new = -torch.rand(len(lengths), width, generator=g) * 3
    ref, old = new - 2 * torch.rand(len(lengths), width, generator=g), new - 0.1
    if width >= 4:
        ref[0, 0], ref[0, 2] = new[0, 0] + 1e4, new[0, 2] - 1e4  # r = ±1e4 on valid tokens
    for garbage in GARBAGE:
        new, ref, old = (t.masked_fill(mask == 0, garbage) for t in (new, ref, old))
    fused = adaptive(method, estimator, kl_bottom_q=0.2).term  # clip 0.5, target 0.2
    leaf = new.clone().requires_grad_(True)
    loss, stats = unsloth_fused_kl(fused, leaf, ref, old, mask)
    loss.backward()
    kl_stats = stats[: 1 + metrics.NUM_SUMS]  # then the tail histogram, whose max/min are -inf/+inf for no token
    assert torch.isfinite(loss) and torch.isfinite(kl_stats).all() and torch.isfinite(leaf.grad).all()
    assert torch.isfinite(stats[: -2]).all() and bool(torch.isfinite(stats[-2:]).all()) == bool(mask.any())
    assert (leaf.grad[mask == 0] == 0).all()
    mask64 = mask.bool()
    raw64, shaped64 = reference.raw_and_shaped_kl(
        method, new.masked_fill(mask == 0, 0), ref.masked_fill(mask == 0, 0), old.masked_fill(mask == 0, 0), mask,
        estimator=estimator.rstrip("+"), clip_threshold=0.5, kl_target=0.2, unsloth_clamps=True,
    )  # fmt: skip
    if fused.length_normalized:
        expected = 0.1 * (shaped64.sum(-1) / mask64.sum(-1).clamp(min=1)).sum() / max(mask.shape[0], 1)
    else:
        expected = 0.1 * shaped64.sum() / mask64.sum().clamp(min=1)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(stats[1 + metrics.RAW_SUM], raw64.sum(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats[1 + metrics.TOKENS], mask64.sum().double())


# -- Liger: AdaptiveFusedLinearGRPOLoss ------------------------------------------------------------------
def liger_module(method="none", estimator="k3", loss_type="bnpo", beta=0.1):
    from unsloth_adaptive_kl.backends.liger import AdaptiveFusedLinearGRPOLoss

    return AdaptiveFusedLinearGRPOLoss(
        beta=beta, compiled=False, loss_type=loss_type, use_bias_correction_kl=True, max_completion_length=6,
        kl_adaptation_method=method, kl_estimator=estimator, kl_clip_threshold=0.5, kl_target=0.2,
    )  # fmt: skip


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("method, estimator", [("none", "k3"), ("clip+sigmoid", "k3"), ("length_normalized", "k2"), ("none", "k1+"), ("sigmoid", "bottom_q")])
def test_liger_forward_ignores_nan_and_inf_reference_logps_on_padding(method, estimator, batch):
    lengths, width = BATCHES[batch]
    mask = ragged_mask(lengths, width)
    g = torch.Generator().manual_seed(2)
    B, H, V = len(lengths), 8, 16
    hidden, weight = torch.randn(B, width, H, generator=g), torch.randn(V, H, generator=g) * 0.5
    ids, advantages = torch.randint(0, V, (B, width), generator=g), torch.randn(B, generator=g)
    clean_ref = -torch.rand(B, width, generator=g) * 3 - 1
    module = liger_module(method, estimator)
    results = []
    for garbage in [0.0, *GARBAGE]:
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss, liger_metrics = module(h, w, ids, mask, advantages, ref_per_token_logps=clean_ref.masked_fill(mask == 0, garbage))
        loss.backward()
        for t in (loss, h.grad, w.grad, *liger_metrics):
            assert torch.isfinite(t).all(), (garbage, t)
        assert (h.grad[mask == 0] == 0).all()
        results.append((loss.detach(), h.grad, w.grad))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@pytest.mark.parametrize("method, estimator", [("none", "k3"), ("clip", "k3"), ("none", "k2"), ("sigmoid", "abs")])
def test_liger_at_log_ratios_of_1e4_is_finite_and_matches_float64(method, estimator):
    mask = ragged_mask([4, 2], 4)
    logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.5, -0.2, 0.0, 0.0]])
    ref = logp.clone()
    ref[0, 1], ref[1, 0] = logp[0, 1] + 1e4, logp[1, 0] - 1e4
    module = liger_module(method, estimator)
    leaf = logp.clone().requires_grad_(True)
    with_kl = module.loss_from_logps(leaf, mask, torch.tensor([0.5, -1.0]), ref_per_token_logps=ref)
    with_kl.loss.backward()
    assert torch.isfinite(with_kl.loss) and torch.isfinite(leaf.grad).all() and torch.isfinite(with_kl.kl_mean)
    policy_only = module.loss_from_logps(logp, mask, torch.tensor([0.5, -1.0])).loss
    raw64 = torch.where(mask.bool(), float64_kl(estimator, logp, ref), 0.0)
    expected = 0.1 * (float64_shaped(method, raw64) * mask).sum() / mask.sum()
    assert (with_kl.loss.double() - policy_only.double()).item() == pytest.approx(expected.item(), rel=1e-5)


# -- user estimators ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda logp, ref: (logp - ref)[:, :-1], "shape"),
        (lambda logp, ref: (logp - ref).double(), "dtype"),
        (lambda logp, ref: torch.where(logp < -1.0, NAN, logp - ref), "NaN or inf on valid"),
        (lambda logp, ref: (logp - ref).detach(), "no gradient"),
    ],
)
def test_a_faulty_user_estimator_is_named_through_the_backend_entry_point(bad, message):
    from unsloth_adaptive_kl.estimators import register_estimator, unregister_estimator

    register_estimator("adversarial_user_kl")(bad)
    try:
        logp = torch.tensor([[-2.0, -0.5, -3.0]], requires_grad=True)
        with pytest.raises(ValueError, match=rf"KL estimator 'adversarial_user_kl'.*{message}"):
            state = adaptive("clip", "adversarial_user_kl")  # refused here already: the term checks it once when built
            state.per_token(logp, logp.detach() - 0.3, torch.ones(1, 3, dtype=torch.long))
    finally:
        unregister_estimator("adversarial_user_kl")


def test_a_user_estimator_may_return_nan_on_padding_which_is_zeroed():
    from unsloth_adaptive_kl.estimators import register_estimator, unregister_estimator

    register_estimator("adversarial_padding_nan")(lambda logp, ref: torch.log(-logp) * (logp - ref))  # NaN where logp = 0
    try:
        state = adaptive("none", "adversarial_padding_nan")
        mask = ragged_mask([2], 3)
        logp = torch.tensor([[-2.0, -0.5, float("nan")]], requires_grad=True)
        raw, _ = state.per_token(logp, torch.tensor([[-1.0, -1.0, 5.0]]), mask)
        raw.sum().backward()
        assert raw[0, 2] == 0 and logp.grad[0, 2] == 0 and torch.isfinite(logp.grad).all()
    finally:
        unregister_estimator("adversarial_padding_nan")
