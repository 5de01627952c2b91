"""``KLTerm`` as the backends call it, against float64 references (tests/reference.py): found by a complete mutmut
run of ``kl_term`` (docs/reliability.md, "Mutation testing"), whose fast tests never passed an importance ratio, a
loss module's own estimator, a chunk's batch statistic or excluded tokens to ``per_token``, nor read what
``config.build`` keeps in the term (it was ``KLTerm.from_config``)."""

from types import SimpleNamespace

import pytest
import reference
import torch

from unsloth_adaptive_kl import FIELDS
from unsloth_adaptive_kl.estimators import builtin_estimator_names, estimate_kl, get_estimator
from unsloth_adaptive_kl.config import build
from unsloth_adaptive_kl.shaping import SHAPING, length_normalized_term, shaping_names

CLIP, KL_TARGET = 0.3, 0.2


def _term(**fields):
    config = {f.name: f.default for f in FIELDS}
    config.update({"beta": 0.1, "kl_estimator": "k3", "kl_clip_threshold": CLIP, "kl_target": KL_TARGET, **fields})
    return build(SimpleNamespace(**config)).term


def _batch(seed=0, rows=3, tokens=6):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, tokens, generator=g) * 2 - 0.2
    ref = logp + torch.rand(rows, tokens, generator=g) * 1.6 - 0.8
    old = logp + torch.rand(rows, tokens, generator=g) * 0.4 - 0.2
    mask = torch.ones(rows, tokens, dtype=torch.long)
    mask[0, 4:] = 0
    mask[2, 1:] = 0
    ref = torch.where(mask.bool(), ref, torch.nan)  # padding may hold anything
    return logp, ref, old, mask


@pytest.mark.parametrize("method", ["none", *(m for m in shaping_names() if SHAPING[m].builtin and SHAPING[m].per_token)])
@pytest.mark.parametrize("estimator", [e for e in builtin_estimator_names() if e in reference.RAW64])
def test_per_token_is_the_estimator_times_the_importance_ratio_then_shaped_and_zero_on_padding(method, estimator):
    term = _term(kl_adaptation_method=method, kl_estimator=estimator)
    logp, ref, old, mask = _batch()
    raw64, shaped64 = reference.raw_and_shaped_kl(method, logp, ref, old, mask, estimator=estimator, clip_threshold=CLIP,
                                                  kl_target=KL_TARGET, bias_correction=True)  # fmt: skip
    raw, adapted = term.per_token(logp, ref, mask, coef=torch.exp(logp - old))
    torch.testing.assert_close(raw.double(), raw64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(adapted.double(), shaped64, rtol=1e-5, atol=1e-6)
    plain, _ = term.per_token(logp, ref, mask)  # no ratio: the estimator alone
    raw64, _ = reference.raw_and_shaped_kl(method, logp, ref, old, mask, estimator=estimator, clip_threshold=CLIP,
                                           kl_target=KL_TARGET, bias_correction=False)  # fmt: skip
    torch.testing.assert_close(plain.double(), raw64, rtol=1e-5, atol=1e-6)


def test_a_loss_modules_own_estimator_gets_the_log_probs_the_mask_and_the_statistic_in_place_of_the_configured_one():
    term = _term(kl_adaptation_method="clip")
    logp, ref, _, mask = _batch(1)
    statistic = torch.tensor(0.25)
    seen = {}

    def own(lp, rp, *, mask, statistic):
        seen.update(logp=lp, ref=rp, mask=mask, statistic=statistic)
        return torch.where(mask.bool(), (rp - lp) ** 2, 0.0) + statistic

    raw, adapted = term.per_token(logp, ref, mask, statistic=statistic, estimator=own)
    assert seen["logp"] is logp and seen["ref"] is ref and seen["mask"] is mask and seen["statistic"] is statistic
    expected = torch.where(mask.bool(), (ref - logp) ** 2, 0.0) + 0.25
    torch.testing.assert_close(raw, expected)
    torch.testing.assert_close(adapted, expected.clamp(max=CLIP))


def test_a_chunk_uses_the_batch_statistic_it_is_given_and_the_configured_bottom_q():
    term = _term(kl_estimator="bottom_q", kl_bottom_q=0.3)
    logp, ref, _, mask = _batch(2, rows=4, tokens=8)
    whole = term.batch_statistic(ref, mask)  # on the whole batch, before chunking
    chunk = slice(0, 2)
    chunk_own = get_estimator("bottom_q").batch_statistic(torch.where(mask[chunk].bool(), ref[chunk], 0.0), mask[chunk], q=0.3)
    assert not torch.equal(whole, chunk_own)  # the case tells: the chunk's own threshold differs
    raw, _ = term.per_token(logp[chunk], ref[chunk], mask[chunk], statistic=whole)
    expected = estimate_kl("bottom_q", logp[chunk], ref[chunk], mask=mask[chunk], statistic=whole, parameters={"kl_bottom_q": 0.3})
    assert torch.equal(raw, expected)
    other_q = estimate_kl("bottom_q", logp[chunk], ref[chunk], mask=mask[chunk], statistic=whole, parameters={"kl_bottom_q": 0.5})
    assert not torch.equal(raw, other_q)  # bottom_q reaches the estimator


def test_a_user_estimators_nan_on_valid_tokens_is_refused_in_per_token():
    from unsloth_adaptive_kl import register_estimator, unregister_estimator

    @register_estimator("nan_on_large_ratio")
    def nan_on_large_ratio(logp, ref):  # finite on the check at creation's inputs, NaN on these
        r = ref - logp
        return torch.where(r.abs() > 0.7, torch.nan, r * r)

    try:
        term = _term(kl_estimator="nan_on_large_ratio")
        logp = torch.zeros(1, 3)
        ref = torch.tensor([[0.1, 0.75, 0.2]])
        with pytest.raises(ValueError, match="nan_on_large_ratio"):
            term.per_token(logp, ref, torch.ones(1, 3))
    finally:
        unregister_estimator("nan_on_large_ratio")


def test_with_excluded_tokens_both_kls_are_zero_off_the_kl_mask_whatever_the_shaping_makes_of_zero(user_shaping):
    plus_half = user_shaping("plus_half", lambda kl: kl + 0.5)  # shape(0) = 0.5
    term = _term(kl_adaptation_method=plus_half, kl_exclude_token_ids=[3])
    logp, ref, old, mask = _batch(3)
    ids = torch.tensor([[3, 1, 2, 3, 0, 0], [1, 3, 1, 1, 2, 2], [2, 0, 0, 0, 0, 0]])
    kl_mask = term.kl_mask(mask, ids)
    coef = torch.exp(logp - old)
    raw, adapted = term.per_token(logp, ref, kl_mask, coef=coef)
    raw64, _ = reference.raw_and_shaped_kl("none", logp, ref, old, kl_mask, estimator="k3", clip_threshold=CLIP,
                                           kl_target=KL_TARGET, bias_correction=True)  # fmt: skip
    valid = kl_mask.bool()
    torch.testing.assert_close(raw.double(), raw64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(adapted.double(), torch.where(valid, raw64 + 0.5, 0.0), rtol=1e-5, atol=1e-6)
    assert (raw[~valid] == 0).all() and (adapted[~valid] == 0).all() and (~valid & mask.bool()).any()


def test_the_built_term_keeps_the_placement_and_the_bottom_q():
    assert _term(kl_placement="reward").placement == "reward" and _term().placement == "loss"
    assert dict(_term(kl_estimator="bottom_q", kl_bottom_q=0.35).estimator_parameters) == {"kl_bottom_q": 0.35}


def test_the_length_normalized_loss_divides_by_the_accumulation_steps_only_when_given():
    term = _term(kl_adaptation_method="length_normalized")
    adapted = torch.rand(3, 4, generator=torch.Generator().manual_seed(4))
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    base = 0.2 * length_normalized_term(adapted, mask, 3)
    assert torch.equal(term.length_normalized_loss(adapted, mask, beta=0.2, num_completions=3), base)
    torch.testing.assert_close(term.length_normalized_loss(adapted, mask, beta=0.2, num_completions=3, accumulation=4), base / 4)


def test_the_check_at_creation_runs_user_code_with_the_configured_bottom_q_and_shaping_parameters(user_shaping):
    """``check_user_functions`` gives a user estimator with a batch statistic the configured ``kl_bottom_q`` and a
    user shaping step its configured parameter (without them the check itself fails: the term could not be built)."""
    from unsloth_adaptive_kl import register_estimator, unregister_estimator
    from unsloth_adaptive_kl.shaping import SHAPING

    seen = {}

    def above_quantile(ref, mask, *, q):
        seen["statistic_q"] = q
        return torch.quantile(ref[mask.bool()], q)

    # it declares bottom_q's own parameter (the field kl_bottom_q, passed as q)
    @register_estimator("k2_above_quantile", parameters=get_estimator("bottom_q").parameters, batch_statistic=above_quantile)
    def k2_above_quantile(logp, ref, *, statistic, q):
        seen["q"] = q
        return torch.where(ref > statistic, 0.5 * (ref - logp) ** 2, 0.0)

    def capped(kl, threshold):
        seen["threshold"] = threshold
        return kl.clamp(max=threshold)

    try:
        capped_name = user_shaping("capped_by_the_clip_threshold", capped, parameters=SHAPING["clip"].parameters)
        _term(kl_estimator="k2_above_quantile", kl_bottom_q=0.3, kl_adaptation_method=capped_name, kl_clip_threshold=0.7).check_user_functions()
        assert seen == {"statistic_q": 0.3, "q": 0.3, "threshold": 0.7}
    finally:
        unregister_estimator("k2_above_quantile")


def test_estimate_without_the_check_leaves_a_user_estimators_nan_to_the_caller():
    """``check=False`` (inside a compiled region, where a check would break the graph) runs no check; the default
    checks (test_a_user_estimators_nan_on_valid_tokens_is_refused_in_per_token)."""
    from unsloth_adaptive_kl import register_estimator, unregister_estimator

    @register_estimator("nan_on_large_ratio_unchecked")
    def nan_on_large_ratio(logp, ref):
        r = ref - logp
        return torch.where(r.abs() > 0.7, torch.nan, r * r)

    try:
        term = _term(kl_estimator="nan_on_large_ratio_unchecked")
        out = term.estimate(torch.zeros(1, 3), torch.tensor([[0.1, 0.75, 0.2]]), torch.ones(1, 3), check=False)
        assert out[0, 1].isnan() and out[0, 0].item() == pytest.approx(0.01)
        with pytest.raises(ValueError, match="nan_on_large_ratio_unchecked"):
            term.estimate(torch.zeros(1, 3), torch.tensor([[0.1, 0.75, 0.2]]), torch.ones(1, 3))
    finally:
        unregister_estimator("nan_on_large_ratio_unchecked")
