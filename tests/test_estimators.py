"""Each estimator against float64 formulas written from Schulman's definitions, values and gradients."""

import decimal
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unsloth_adaptive_kl import estimators
from unsloth_adaptive_kl.estimators import builtin_estimator_names, estimate_kl, get_estimator, register_estimator, unregister_estimator


def _pair(seed=0, shape=(3, 7), scale=1.5):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(shape, generator=g, dtype=torch.float64) * 4
    ref = logp + torch.randn(shape, generator=g, dtype=torch.float64) * scale
    return logp, ref


# Reference values and d/dlogp written from the definitions (x = log pi, y = log pi_ref, ratio = pi_ref/pi).
# not a registry list: read by the names of every built-in without a batch statistic (BUILTIN_PER_TOKEN, below)
REFERENCES = {
    "k1": (lambda x, y: math.log(math.exp(x) / math.exp(y)), lambda x, y: 1.0),
    "k2": (lambda x, y: 0.5 * math.log(math.exp(y) / math.exp(x)) ** 2, lambda x, y: x - y),
    "k3": (lambda x, y: math.exp(y) / math.exp(x) - math.log(math.exp(y) / math.exp(x)) - 1, lambda x, y: 1 - math.exp(y - x)),
    "abs": (lambda x, y: abs(x - y), lambda x, y: math.copysign(1.0, x - y)),
    "k1+": (lambda x, y: x - y, lambda x, y: x - y),
    "k3+": (lambda x, y: math.exp(y - x) - (y - x) - 1, lambda x, y: x - y),
}


#: Every built-in estimator that needs no batch statistic (bottom_q has tests of its own below), from the registry.
BUILTIN_PER_TOKEN = [name for name in builtin_estimator_names() if get_estimator(name).batch_statistic is None]


@pytest.mark.parametrize("name", BUILTIN_PER_TOKEN)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_estimator_matches_float64_definition_in_value_and_gradient(name, dtype):
    value_ref, grad_ref = REFERENCES[name]
    logp64, ref64 = _pair()
    logp = logp64.to(dtype).requires_grad_(True)
    out = estimate_kl(name, logp, ref64.to(dtype))
    out.sum().backward()
    flat = list(zip(logp.detach().double().flatten().tolist(), ref64.to(dtype).double().flatten().tolist()))
    expected = torch.tensor([value_ref(x, y) for x, y in flat], dtype=torch.float64).view_as(logp64)
    expected_grad = torch.tensor([grad_ref(x, y) for x, y in flat], dtype=torch.float64).view_as(logp64)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.detach().double(), expected, **tol)
    torch.testing.assert_close(logp.grad.double(), expected_grad, **tol)


def test_aliases_resolve_to_the_same_estimator():
    assert get_estimator("mse").name == "k2"
    assert get_estimator("squared").name == "k2"
    assert get_estimator("low_var_kl").name == "k3"


def test_squared_is_the_seed_formula_half_squared_difference():
    logp, ref = _pair(1)
    torch.testing.assert_close(estimate_kl("squared", logp, ref), 0.5 * (ref - logp) ** 2, rtol=0, atol=0)


def test_k3_is_bitwise_trl_form():
    logp, ref = _pair(2)
    logp, ref = logp.float(), ref.float()
    trl_form = torch.exp(ref - logp) - (ref - logp) - 1
    assert torch.equal(estimate_kl("k3", logp, ref), trl_form)


def seed_bottom_q_count(q, n):
    """The seed's count: floor(q * N) tokens, at least 1, with q taken as the decimal it is written as."""
    return max(1, math.floor(decimal.Decimal(str(q)) * n))


def _bottom_q_reference(logp, ref, mask, q):
    """Float64: k3/q on the valid tokens whose ref log-prob is among the lowest floor(q*N) (>= 1) valid ones."""
    valid = [(i, j) for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j]]
    ordered = sorted(valid, key=lambda ij: float(ref[ij]))
    k = seed_bottom_q_count(q, len(valid))
    threshold = float(ref[ordered[k - 1]])
    out = torch.zeros_like(logp, dtype=torch.float64)
    for i, j in valid:
        if float(ref[i, j]) <= threshold:
            x, y = float(logp[i, j]), float(ref[i, j])
            out[i, j] = (math.exp(y - x) - (y - x) - 1) / q
    return out


@pytest.mark.parametrize(("q", "n", "count"), [(0.2, 9, 1), (0.28, 25, 7), (0.57, 100, 57), (0.2, 10, 2), (0.01, 50, 1), (0.3, 10, 3), (1.0, 7, 7), (0.15, 20, 3)])
def test_bottom_q_selects_floor_q_n_tokens_at_least_one_whatever_float_rounding(q, n, count):
    assert seed_bottom_q_count(q, n) == count  # the reference itself, on the cases the issue names
    ref = -torch.arange(1, n + 1, dtype=torch.float64).flip(0).view(1, n)  # distinct values: no ties
    logp = ref - 0.5
    out = estimate_kl("bottom_q", logp, ref, mask=torch.ones(1, n, dtype=torch.bool), parameters={"kl_bottom_q": q})
    assert int((out != 0).sum()) == count
    assert estimators.bottom_q_count(q, n) == count


@pytest.mark.parametrize("q", [0.1, 0.2, 0.5, 1.0, 0.28, 0.3])
def test_bottom_q_uses_valid_tokens_only_and_scales_by_one_over_q(q):
    logp, ref = _pair(3, shape=(4, 9))
    mask = torch.ones(4, 9, dtype=torch.bool)
    mask[1, 5:] = False
    mask[3, 2:] = False
    ref_padded = ref.clone()
    ref_padded[~mask] = -1e4  # padding would dominate the percentile if it were counted
    out = estimate_kl("bottom_q", logp, ref_padded, mask=mask, parameters={"kl_bottom_q": q})
    expected = _bottom_q_reference(logp, ref_padded, mask, q)
    torch.testing.assert_close(torch.where(mask, out, torch.zeros_like(out)), expected)


def test_bottom_q_threshold_is_detached_and_batch_statistic_makes_chunks_agree():
    logp, ref = _pair(4, shape=(6, 5))
    mask = torch.ones(6, 5, dtype=torch.bool)
    ref = ref.requires_grad_(True)
    stat = estimators.bottom_q_threshold(ref, mask, q=0.3)
    assert not stat.requires_grad
    whole = estimate_kl("bottom_q", logp, ref, mask=mask, statistic=stat, parameters={"kl_bottom_q": 0.3})
    chunks = torch.cat([estimate_kl("bottom_q", logp[i : i + 2], ref[i : i + 2], mask=mask[i : i + 2], statistic=stat, parameters={"kl_bottom_q": 0.3}) for i in range(0, 6, 2)])
    assert torch.equal(whole, chunks)


def test_user_estimator_registers_by_decorator_and_is_usable():
    @register_estimator("test_cube", "test_cube_alias")
    def cube(logp, ref_logp):
        return (logp - ref_logp) ** 3

    try:
        logp, ref = _pair(5)
        torch.testing.assert_close(estimate_kl("test_cube_alias", logp, ref), (logp - ref) ** 3)
    finally:
        unregister_estimator("test_cube")
    with pytest.raises(ValueError, match="test_cube"):
        get_estimator("test_cube_alias")


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda logp, ref: (logp - ref).sum(-1), "shape"),
        (lambda logp, ref: (logp - ref).double(), "dtype"),
        (lambda logp, ref: (logp - ref) * float("nan"), "NaN"),
        (lambda logp, ref: (logp - ref).detach(), "no gradient"),
        (lambda logp, ref: [1.0], "returned list; allowed: a torch.Tensor"),
    ],
)
def test_faulty_user_estimator_fails_loudly_naming_it(bad, message):
    register_estimator("test_faulty")(bad)
    try:
        logp, ref = _pair(6)
        logp = logp.float().requires_grad_(True)
        with pytest.raises(ValueError, match=f"KL estimator 'test_faulty' .*{message}"):
            estimate_kl("test_faulty", logp, ref.float())
    finally:
        unregister_estimator("test_faulty")


def test_builtin_estimators_cannot_be_overwritten_or_removed():
    with pytest.raises(ValueError, match="already registered"):
        register_estimator("k3")(lambda a, b: a)
    with pytest.raises(ValueError, match="built in"):
        unregister_estimator("k1")


finite = st.floats(min_value=-30, max_value=0, allow_nan=False, width=64)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(finite, st.floats(-8, 8)), min_size=1, max_size=40))
def test_k3_and_k2_are_non_negative(pairs):
    logp = torch.tensor([p for p, _ in pairs], dtype=torch.float64)
    ref = logp + torch.tensor([d for _, d in pairs], dtype=torch.float64)
    # k3 is computed in TRL's form exp(r) - r - 1 (bit for bit with TRL), whose three float64 terms
    # can cancel to a few ulps below 0 (hypothesis found k3(0, 4.6e-10) = -1.1e-16): the bound is
    # non-negativity up to that rounding, a few ulps of the largest term.
    r = (ref - logp).clamp(-20, 20)
    rounding = 4 * torch.finfo(torch.float64).eps * (torch.exp(r) + r.abs() + 1)
    assert (estimate_kl("k3", logp, ref) >= -rounding).all()
    assert (estimate_kl("k2", logp, ref) >= 0).all()
    assert (estimate_kl("abs", logp, ref) >= 0).all()


@pytest.mark.parametrize(
    "ref, q, selected, inflation",
    [
        (torch.linspace(-3.0, -1.0, 6), 0.01, 1, 16.7),  # 6 tokens: q * N = 0.06, one token gets 100x
        (torch.full((32,), -2.0), 0.2, 32, 5.0),  # 32 tied reference log-probs: all are at the threshold
        (torch.full((32,), -2.0), 0.01, 32, 100.0),
    ],
)
def test_bottom_q_warns_once_when_few_or_tied_tokens_inflate_it(ref, q, selected, inflation, monkeypatch, caplog):
    # Before the fix these inflated the KL (the numbers: 16.7, 5.0, 100) without a word.
    monkeypatch.setattr(estimators, "_warned_bottom_q", False, raising=False)
    monkeypatch.setattr(estimators, "_pending_selection", None, raising=False)
    logp = ref - 0.3  # the same log-ratio everywhere: every token's k3 is the same
    mask = torch.ones(1, ref.numel(), dtype=torch.bool)
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        for _ in range(2):
            out = estimate_kl("bottom_q", logp[None], ref[None], mask=mask, parameters={"kl_bottom_q": q})
    k3_value = estimate_kl("k3", logp[None], ref[None])[0, 0].item()
    assert int((out > 0).sum()) == selected
    assert out.mean().item() / k3_value == pytest.approx(inflation, rel=0.01)  # the mean is inflated this much
    warnings = [r.getMessage() for r in caplog.records if "bottom_q selected" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once
    assert f"bottom_q selected {selected} of {ref.numel()} valid tokens" in warnings[0]
    assert f"is {inflation:.3g} times the mean k3 of the selected tokens" in warnings[0]
    assert ("tied" in warnings[0]) == (selected > 1)


def count_host_reads(monkeypatch) -> list[str]:
    """Record every read of a tensor's value into Python (what blocks on a GPU: item, int, float, bool, tolist)."""
    reads = []
    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _f=original, **k: (reads.append(_n), _f(self, *a, **k))[1])
    return reads


def test_bottom_q_threshold_reads_no_value_for_its_warning_and_warns_a_tie_at_the_next_call(monkeypatch, caplog):
    """The count of selected tokens was read with int() on every call, a second GPU sync beside the
    boolean indexing, only for the warning. Now it is read without a wait: a tie at the threshold
    warns at the next call, with the first call's numbers; a call without one warns never."""
    monkeypatch.setattr(estimators, "_warned_bottom_q", False, raising=False)
    monkeypatch.setattr(estimators, "_pending_selection", None, raising=False)
    distinct = torch.linspace(-5.0, -0.1, 100)[None]
    tied = torch.full((1, 32), -2.0)
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        for ref in (distinct, tied):  # each with nothing deferred before it: no read at all
            monkeypatch.setattr(estimators, "_pending_selection", None)
            with monkeypatch.context() as spy:
                reads = count_host_reads(spy)
                threshold = estimators.bottom_q_threshold(ref, torch.ones_like(ref, dtype=torch.bool), q=0.2)
            assert reads == []
            assert threshold.item() == ref.flatten().sort().values[estimators.bottom_q_count(0.2, ref.numel()) - 1].item()
        assert "bottom_q selected" not in caplog.text
        estimators.bottom_q_threshold(distinct, torch.ones_like(distinct, dtype=torch.bool), q=0.2)  # checks the tied call's count
    warnings = [r.getMessage() for r in caplog.records if "bottom_q selected" in r.getMessage()]
    assert len(warnings) == 1 and "bottom_q selected 32 of 32 valid tokens (tied" in warnings[0]


def test_bottom_q_on_enough_distinct_tokens_does_not_warn(monkeypatch, caplog):
    monkeypatch.setattr(estimators, "_warned_bottom_q", False, raising=False)
    monkeypatch.setattr(estimators, "_pending_selection", None, raising=False)
    ref = torch.linspace(-5.0, -0.1, 100)[None]
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        out = estimate_kl("bottom_q", ref - 0.3, ref, mask=torch.ones_like(ref, dtype=torch.bool), parameters={"kl_bottom_q": 0.2})
    assert int((out > 0).sum()) == 20 and "bottom_q selected" not in caplog.text


def test_bottom_q_keeps_a_deferred_count_whose_copy_has_not_finished_and_warns_from_it_later(monkeypatch, caplog):
    """A count whose copy is still in flight at the next call stays pending; that call's own count does not
    replace it (it was overwritten, so a tie could go unwarned for ever while the device stayed busy)."""

    class Event:
        done = False

        def query(self):
            return self.done

    event = Event()
    monkeypatch.setattr(estimators, "_warned_bottom_q", False, raising=False)
    monkeypatch.setattr(estimators, "_pending_selection", (torch.tensor(32), event, 32, 0.2), raising=False)  # a tie
    distinct = torch.linspace(-5.0, -0.1, 100)[None]
    mask = torch.ones_like(distinct, dtype=torch.bool)
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        for _ in range(2):
            estimators.bottom_q_threshold(distinct, mask, q=0.2)
            assert estimators._pending_selection[1] is event  # kept, not replaced by the distinct call's count
        assert "bottom_q selected" not in caplog.text
        event.done = True
        estimators.bottom_q_threshold(distinct, mask, q=0.2)
    warnings = [r.getMessage() for r in caplog.records if "bottom_q selected" in r.getMessage()]
    assert len(warnings) == 1 and "bottom_q selected 32 of 32 valid tokens (tied" in warnings[0]


# -- k3's log-ratio bound (issue 38: caught here, not only by the adversarial tests) -------------------------------
@pytest.mark.parametrize("name", ["k3", "k3+"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_k3_beyond_its_log_ratio_bound_takes_the_bounds_value_finite_with_no_gradient(name, dtype):
    """r = log pi_ref - log pi is clamped to [-20, 20]: beyond it k3 is exp(c) - c - 1 at c = ±20 (float64, from the
    definition), finite where exp(r) overflows float32 (r > 88.7), and gives logp no gradient; within it nothing changes."""
    bound = estimators.K3_LOG_RATIO_BOUND
    r = torch.tensor([-300.0, -25.0, -20.5, -19.5, 0.3, 19.5, 20.5, 25.0, 100.0], dtype=torch.float64)
    logp = torch.full_like(r, -40.0).to(dtype).requires_grad_(True)
    out = estimate_kl(name, logp, (logp.detach().double() + r).to(dtype))
    c = r.clamp(-bound, bound)
    torch.testing.assert_close(out.detach().double(), torch.exp(c) - c - 1, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(out).all()
    if name == "k3":  # k3+ takes k2's gradient by design
        out.sum().backward()
        beyond = r.abs() > bound
        assert (logp.grad[beyond] == 0).all() and (logp.grad[~beyond] != 0).all()


# -- found by mutation testing (docs/reliability.md, "Mutation testing") ---------------------------------------------
@pytest.mark.parametrize("bad", ["my+kl", "+kl", "my+X", ""])
def test_an_estimator_name_with_an_inner_plus_or_empty_is_refused_a_trailing_plus_is_not(bad):
    with pytest.raises(ValueError, match="is not allowed: use a non-empty name without inner '\\+'"):
        register_estimator(bad)(lambda logp, ref_logp: logp - ref_logp)
    assert bad not in estimators.ESTIMATORS
    register_estimator("test_k1+")(lambda logp, ref_logp: logp - ref_logp)  # a trailing '+', as k1+ and k3+
    unregister_estimator("test_k1+")


def test_a_user_estimator_with_a_batch_statistic_gets_it_computed_on_the_valid_tokens_with_its_parameters():
    from unsloth_adaptive_kl import Parameter

    seen = []

    def largest_ref(ref_logp, mask, *, margin):
        seen.append(margin)
        return ref_logp[mask.bool()].max() - margin

    margin = Parameter("test_margin", default=0.0, keyword="margin")

    @register_estimator("test_above_max", "test_above_max_alias", parameters=(margin,), batch_statistic=largest_ref)
    def above_max(logp, ref_logp, *, statistic, margin):
        return (ref_logp >= statistic).to(logp.dtype) + 0 * logp

    try:
        spec = get_estimator("test_above_max")
        assert spec.batch_statistic is largest_ref and not spec.builtin and spec.parameters == (margin,)
        ref = torch.tensor([[-1.0, -3.0], [-0.5, -2.0]])
        mask = torch.tensor([[1, 1], [0, 1]])  # -0.5 is masked: the largest valid is -1.0
        out = estimate_kl("test_above_max", torch.zeros(2, 2), ref, mask=mask, parameters={"test_margin": 1.5}, check=False)
        assert out.tolist() == [[1.0, 0.0], [0.0, 1.0]] and seen == [1.5]  # -2.0 >= -1.0 - 1.5
        assert estimate_kl("test_above_max", torch.zeros(2, 2), ref, mask=mask, check=False).tolist() == [[1.0, 0.0], [0.0, 0.0]]
    finally:
        unregister_estimator("test_above_max")
    from unsloth_adaptive_kl.declarations import DECLARED

    assert "test_margin" not in DECLARED  # its declaration went with it
    assert "test_above_max_alias" not in estimators.estimator_names()
    assert get_estimator("low_var_kl").name == "k3"  # the other estimators' aliases stay


def test_a_user_estimators_output_is_checked_for_nan_on_valid_tokens_only():
    """NaN where the mask is 0 is allowed (it is zeroed); on a valid token, or anywhere without a mask, it is refused."""
    register_estimator("test_nan_on_padding")(lambda logp, ref_logp: torch.where(ref_logp == 0, float("nan"), logp - ref_logp))
    try:
        ref = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
        mask = torch.tensor([[1, 1], [1, 0]])  # estimate_kl zeroes the masked reference: the estimator returns NaN there
        assert estimate_kl("test_nan_on_padding", torch.zeros(2, 2), ref, mask=mask)[1, 1] == 0
        with pytest.raises(ValueError, match="test_nan_on_padding.*NaN or inf"):
            estimate_kl("test_nan_on_padding", torch.zeros(2, 2), ref.masked_fill(mask == 0, 0.0))
    finally:
        unregister_estimator("test_nan_on_padding")
