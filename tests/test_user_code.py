"""User code (issue 39): a shaping method or estimator registered by a user is checked at least as strictly as
the estimators always were, and cannot change the raw KL; a non-finite KL is never hidden in the logs; the
shaping order refuses a non-finite ``order`` and breaks ties by name. Each test is the probe's plain script:
register a method as a user would, then use it through the core (the backends: tests/backends/test_user_code_in_trainers.py,
tests/backends/test_unsloth.py)."""

import math
from types import SimpleNamespace

import pytest
import torch

import unsloth_adaptive_kl
from unsloth_adaptive_kl import FIELDS, AdaptiveKL, metrics
from unsloth_adaptive_kl.estimators import register_estimator, unregister_estimator
from unsloth_adaptive_kl.method import parse_method
from unsloth_adaptive_kl.shaping import shape_per_token, shaping_names


def adaptive(method, estimator="k3", **fields):
    config = SimpleNamespace(**{**{f.name: f.default for f in FIELDS}, "beta": 0.1, "kl_adaptation_method": method, "kl_estimator": estimator})
    for name, value in fields.items():
        setattr(config, name, value)
    return AdaptiveKL(config)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(3, 4, generator=g) * 3).requires_grad_(True)
    ref = logp.detach() - torch.rand(3, 4, generator=g) * 2  # KL far above 1e-3 on every token
    mask = torch.ones(3, 4, dtype=torch.long)
    mask[2, 2:] = 0
    return logp, ref, mask


# -- item 1: a method that changes its input in place ----------------------------------------------------
def test_a_method_that_caps_its_input_in_place_is_refused_naming_it_when_the_term_is_built(user_shaping):
    user_shaping("cap_in_place", lambda kl: kl.clamp_(max=1e-3))
    with pytest.raises(ValueError, match=r"shaping method 'cap_in_place' changed its input in place.*kl\.clamp\("):
        adaptive("ziegler+cap_in_place")


def test_a_method_that_changes_its_input_in_place_at_run_time_is_refused_and_the_raw_kl_is_kept(user_shaping):
    """A mutation the check at creation cannot see (it happens only on a batch of three rows): refused at the first
    call that does it, eagerly; the raw KL the caller holds is what the estimator computed."""
    user_shaping("cap_three_rows", lambda kl: kl.clamp_(max=1e-3) if kl.shape[0] == 3 else kl.clamp(max=1e-3))
    state = adaptive("ziegler+cap_three_rows")
    logp, ref, mask = batch()
    with pytest.raises(ValueError, match="shaping method 'cap_three_rows' changed its input in place"):
        state.per_token(logp, ref, mask)
    kl = torch.rand(3, 4) + 1.0
    with pytest.raises(ValueError, match="'cap_three_rows' changed its input in place"):
        shape_per_token(kl, parse_method("cap_three_rows"), {})


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_inside_a_compiled_region_a_method_changing_its_input_gets_a_copy_and_the_raw_kl_is_kept(user_shaping, backend):
    """Unsloth's fused loss and the Liger module run the shaping inside torch.compile, where no version counter
    can be read: the method gets a copy there, so its in-place cap changes only the copy (the raw KL the loss
    logs stays the estimator's)."""
    user_shaping("cap_three_rows", lambda kl: kl.clamp_(max=1e-3) if kl.shape[0] == 3 else kl.clamp(max=1e-3))
    method = parse_method("cap_three_rows")

    def raw_and_shaped(kl):
        raw = kl * 1.0
        return raw, shape_per_token(raw, method, {})

    kl = torch.rand(3, 4) + 1.0
    raw, shaped = torch.compile(raw_and_shaped, fullgraph=True, backend=backend)(kl)
    assert torch.equal(raw, kl) and torch.equal(shaped, torch.full_like(kl, 1e-3))


# -- item 2: the output of a shaping method is checked ------------------------------------------------------
@pytest.mark.parametrize(
    "fn, what",
    [
        (lambda kl: kl.detach() * 0.5, "no gradient"),
        (lambda kl: (kl * 0.5).double(), "dtype torch.float64"),
        (lambda kl: (kl * 0.5)[:, :-1], r"shape \(2, 4\)"),
        (lambda kl: [0.5], "list"),
        (lambda kl: torch.where(kl > 1.0, torch.nan, kl), "NaN or inf"),
        (lambda kl: kl / (kl - kl), "NaN or inf"),
    ],
    ids=["detached", "float64", "shape", "not a tensor", "nan above 1", "nan everywhere"],
)
def test_a_faulty_method_is_refused_naming_it_and_what_was_wrong_when_the_term_is_built(user_shaping, fn, what):
    user_shaping("faulty", fn)
    with pytest.raises(ValueError, match=rf"shaping method 'faulty'.*{what}"):
        adaptive("clip+faulty")


def test_a_detached_or_float64_output_is_refused_at_the_first_call_that_returns_it(user_shaping):
    """Faults the check at creation cannot see (only on a batch of three rows) are refused at the first call."""
    user_shaping("detach_three_rows", lambda kl: kl.detach() if kl.shape[0] == 3 else kl * 1.0)
    user_shaping("float64_three_rows", lambda kl: kl.double() if kl.shape[0] == 3 else kl * 1.0)
    logp, ref, mask = batch()
    with pytest.raises(ValueError, match=r"shaping method 'detach_three_rows' returned a tensor with no gradient"):
        adaptive("detach_three_rows").per_token(logp, ref, mask)
    with pytest.raises(ValueError, match=r"shaping method 'float64_three_rows' returned dtype torch.float64.*torch.float32"):
        adaptive("float64_three_rows").per_token(logp, ref, mask)
    with torch.no_grad():  # no graph wanted (evaluation): a detached output is what every method returns there
        adaptive("detach_three_rows").per_token(logp, ref, mask)


def test_a_method_returning_nan_on_a_finite_kl_is_refused_by_name_at_the_metric_sync(user_shaping):
    """sqrt is NaN for the negative KLs of k1: the check at creation (KL >= 0, as every built-in estimator but k1
    gives) passes, the first micro-batch with a negative KL is refused, from the metric sums already read."""
    user_shaping("root", torch.sqrt)
    state = adaptive("root", "k1")
    logp, ref, mask = batch()
    raw, adapted = state.per_token(logp, ref + 1.0, mask)  # ref above logp somewhere: k1 < 0 there
    assert (raw[mask.bool()] < 0).any() and torch.isfinite(raw).all()
    with pytest.raises(ValueError, match=r"shaping method 'root' returned NaN or inf on valid tokens whose KL was finite \(\d+ of them\)"):
        state.record(raw, adapted, mask, training=True, beta=state.beta)


def test_a_nan_from_one_of_two_user_methods_names_both_in_order(user_shaping):
    user_shaping("root", torch.sqrt, order=60)
    user_shaping("halve", lambda kl: kl * 0.5, order=55)
    state = adaptive("root+halve", "k1")
    logp, ref, mask = batch()
    with pytest.raises(ValueError, match=r"one of the shaping methods 'halve', 'root' \(applied in this order\)"):
        state.record(*state.per_token(logp, ref + 1.0, mask), mask, training=True, beta=state.beta)


def test_a_nan_kl_from_nan_inputs_is_not_blamed_on_the_user_method_or_estimator(user_shaping, caplog):
    """NaN reference log-probs (the model's) keep their handling: not refused, skipped by the controller, counted."""
    user_shaping("halve", lambda kl: kl * 0.5)
    register_estimator("user_abs")(lambda logp, ref: (logp - ref).abs())
    try:
        state = adaptive("ziegler+halve", "user_abs", beta_min=0.0)
        logp, ref, mask = batch()
        ref[1, 0] = math.nan
        with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
            values = state.record(*state.per_token(logp, ref, mask), mask, training=True, beta=state.beta)
        assert math.isnan(values[metrics.RAW_KL]) and values[metrics.NONFINITE_KL_BATCHES] == 1.0
        assert state.end_step(1) == 0.1 and state.skipped_updates == 1
        assert "NaN or inf" in caplog.text and metrics.NONFINITE_KL_BATCHES in caplog.text
    finally:
        unregister_estimator("user_abs")


def test_a_user_estimator_returning_nan_on_finite_log_probs_is_still_refused_by_name():
    """NaN only on a batch of three rows: the check at creation passes, the first such call is refused."""
    register_estimator("nan_below_minus_one")(lambda logp, ref: torch.where(logp < -1.0, torch.nan, logp - ref) if logp.shape[0] == 3 else logp - ref)
    try:
        state = adaptive("none", "nan_below_minus_one")
        logp, ref, mask = batch()
        with pytest.raises(ValueError, match=r"KL estimator 'nan_below_minus_one' returned NaN or inf on valid tokens whose log-probs were finite \(\d+ of them\)"):
            state.per_token(logp, ref, mask)
    finally:
        unregister_estimator("nan_below_minus_one")


def test_a_user_estimator_that_is_faulty_on_every_input_is_refused_when_the_term_is_built():
    register_estimator("always_nan")(lambda logp, ref: (logp - ref) * torch.nan)
    try:
        with pytest.raises(ValueError, match="KL estimator 'always_nan' returned NaN or inf"):
            adaptive("none", "always_nan")
    finally:
        unregister_estimator("always_nan")


# -- item 3: a non-finite KL is counted, never averaged away ----------------------------------------------
def test_a_micro_batch_with_a_nan_kl_is_counted_and_raw_and_adapted_drop_it_together():
    state = adaptive("clip", kl_clip_threshold=0.05)
    logp, ref, mask = batch()
    clean = state.record(*state.per_token(logp, ref, mask), mask, training=True, beta=state.beta)
    assert clean[metrics.NONFINITE_KL_BATCHES] == 0.0 and math.isfinite(clean[metrics.RAW_KL])
    raw, adapted = state.per_token(logp, ref, mask)
    raw = raw.detach().clone()
    raw[0, 0] = math.inf  # the raw KL is inf on one token, the shaped (capped) one is finite: still one broken batch
    broken = state.record(raw, adapted, mask, training=True, beta=state.beta)
    assert broken[metrics.NONFINITE_KL_BATCHES] == 1.0 and math.isinf(broken[metrics.RAW_KL])
    assert math.isfinite(broken[metrics.ADAPTED_KL])  # the values stay what they are; the log leaves both out


# -- item 6: the order of shaping methods --------------------------------------------------------------------
@pytest.mark.parametrize("order", [math.nan, math.inf, -math.inf, "10", True, None])
def test_a_non_finite_or_non_numeric_order_is_refused_naming_it(order):
    with pytest.raises(ValueError, match=rf"shaping method 'bad_order': order={order!r} is not valid; allowed: a finite number"):
        unsloth_adaptive_kl.register_shaping("bad_order", order=order)(lambda kl: kl)
    assert "bad_order" not in shaping_names()


def test_methods_of_equal_order_apply_in_the_alphabetical_order_of_their_names(user_shaping):
    """Registered in the other order: the order is the names', not the registration's (so it is the same in every
    process, whatever order each imported its methods in)."""
    user_shaping("b_double", lambda kl: kl * 2.0, order=50)
    user_shaping("a_plus_one", lambda kl: kl + 1.0, order=50)
    assert parse_method("b_double+a_plus_one").shaping == ("a_plus_one", "b_double")
    kl = torch.tensor([1.0])
    assert shape_per_token(kl, parse_method("b_double+a_plus_one"), {}).item() == 4.0  # (1 + 1) * 2, not 1 * 2 + 1
    assert "alphabetical" in unsloth_adaptive_kl.register_shaping.__doc__


def test_every_user_code_check_is_documented_with_its_test():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "reliability.md").read_text()
    section = text.split("## User code: what is checked")[1].split("\n## ")[0]
    for name in [n for n in globals() if n.startswith("test_") and n != "test_every_user_code_check_is_documented_with_its_test"]:
        assert name in section, f"{name} is not named in docs/reliability.md, 'User code: what is checked'"

