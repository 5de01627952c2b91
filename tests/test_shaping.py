"""Shaping against float64 formulas, the method grammar, the registry, and hypothesis properties."""

import math
import pathlib
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
import unsloth_adaptive_kl
from unsloth_adaptive_kl.controllers import controller_names
from unsloth_adaptive_kl.method import Method, format_method, method_names, parse_method
from unsloth_adaptive_kl.shaping import (
    SHAPING,
    Parameter,
    clip,
    length_normalized_term,
    register_shaping,
    sequence_mean,
    shape_per_token,
    shaping_names,
    sigmoid,
    soft_clip,
    unregister_shaping,
)


def test_clip_value_and_gradient_match_definition():
    kl = torch.tensor([0.0, 0.5, 1.0, 1.5, 3.0], dtype=torch.float64, requires_grad=True)
    out = clip(kl, 1.0)
    out.sum().backward()
    assert out.tolist() == [min(v, 1.0) for v in [0.0, 0.5, 1.0, 1.5, 3.0]]
    assert kl.grad.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]  # no KL gradient above the cap


def test_sigmoid_value_and_gradient_match_definition():
    values = [0.0, 0.05, 0.1, 0.7, 4.0]
    kl = torch.tensor(values, dtype=torch.float64, requires_grad=True)
    target = 0.1
    out = sigmoid(kl, target)
    out.sum().backward()
    s = [1 / (1 + math.exp(-(v - target))) for v in values]
    assert out.tolist() == pytest.approx([si * v for si, v in zip(s, values)], rel=1e-12)
    # d/dk [s(k - t) k] = s + k s (1 - s)
    assert kl.grad.tolist() == pytest.approx([si + v * si * (1 - si) for si, v in zip(s, values)], rel=1e-12)


def test_sequence_mean_and_length_normalized_sum_match_definition():
    kl = torch.tensor([[1.0, 2.0, 3.0, float("nan")], [4.0, float("inf"), 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert sequence_mean(kl, mask).tolist() == [2.0, 4.0, 0.0]
    assert length_normalized_term(kl, mask, 1).item() == 6.0


@pytest.mark.parametrize(
    "text, expected",
    [
        ("none", Method("fixed", ())),
        ("clip", Method("fixed", ("clip",))),
        ("dynamic", Method("dynamic", ())),
        ("target", Method("target", ())),
        ("length_normalized+dynamic", Method("dynamic", ("length_normalized",))),
        ("sigmoid+clip+target", Method("target", ("clip", "sigmoid"))),
        (" dynamic + clip ", Method("dynamic", ("clip",))),
    ],
)
def test_parse_method_accepts_compositions_in_fixed_order(text, expected):
    assert parse_method(text) == expected


@pytest.mark.parametrize(
    "text, canonical",
    [
        ("none", "none"),
        (" none ", "none"),
        ("clip", "clip"),
        ("target", "target"),
        ("length_normalized+dynamic", "dynamic+length_normalized"),
        ("sigmoid+clip+target", "target+clip+sigmoid"),
        (" dynamic + clip ", "dynamic+clip"),
        ("length_normalized+sigmoid+soft_clip+clip", "clip+soft_clip+sigmoid+length_normalized"),
    ],
)
def test_format_method_writes_the_canonical_text_of_a_parsed_method(text, canonical):
    assert format_method(parse_method(text)) == canonical


def test_format_method_is_the_inverse_of_parse_method_for_every_registered_method_and_combinations(half_kl):
    shaping = [name for name in method_names() if name != "none" and name not in controller_names()]
    assert "half_kl" in shaping and "clip" in shaping  # a registered method is covered, as the built-ins
    methods = [Method("fixed", ())] + [parse_method(name) for name in method_names()]
    methods += [Method(controller, (name,)) for controller in ("fixed", *controller_names()) for name in shaping]
    methods += [Method("dynamic", tuple(shaping_names())), Method("target", ("clip", "half_kl", "length_normalized"))]
    for method in methods:
        assert parse_method(format_method(method)) == method, method
    assert format_method(Method("target", ("clip", "half_kl", "length_normalized"))) == "target+clip+half_kl+length_normalized"


@pytest.mark.parametrize("text", ["", "bogus", "dynamic+target", "clip+clip", "none+clip", "clip+", 3])
def test_parse_method_rejects_bad_methods_naming_the_field(text):
    with pytest.raises(ValueError, match="kl_adaptation_method"):
        parse_method(text)


def test_shape_per_token_applies_clip_then_soft_clip_then_sigmoid():
    kl = torch.tensor([0.2, 2.0, 9.0], dtype=torch.float64)
    values = {"kl_clip_threshold": 1.0, "kl_target": 0.5}
    got = shape_per_token(kl, parse_method("sigmoid+clip"), values)
    assert torch.equal(got, sigmoid(clip(kl, 1.0), 0.5))
    assert torch.equal(shape_per_token(kl, parse_method("sigmoid+soft_clip+clip"), values), sigmoid(soft_clip(clip(kl, 1.0), 1.0), 0.5))
    assert torch.equal(shape_per_token(kl, parse_method("none"), values), kl)


def test_soft_clip_value_and_gradient_match_definition_and_it_is_a_cap():
    values = [0.0, 0.01, 0.5, 1.0, 2.0, 20.0]
    kl = torch.tensor(values, dtype=torch.float64, requires_grad=True)
    out = soft_clip(kl, 1.0)
    out.sum().backward()
    assert out.tolist() == pytest.approx([math.tanh(v) for v in values], rel=1e-12, abs=0)
    assert kl.grad.tolist() == pytest.approx([1 - math.tanh(v) ** 2 for v in values], rel=1e-12, abs=1e-300)
    assert out.max().item() <= 1.0 and kl.grad[-1].item() < 1e-16  # bounded by the cap; no gradient far above it
    assert out[1].item() == pytest.approx(0.01, rel=1e-4)  # low-KL tokens are left nearly as they are


def test_sigmoid_damps_low_kl_tokens_and_caps_nothing():
    """The seed's formula, as documented (issue 23.3): kl_target 0.1, kl 0.01 -> 0.0048, kl 2 -> 1.74, kl 20 -> 20."""
    kl = torch.tensor([0.01, 2.0, 20.0], dtype=torch.float64, requires_grad=True)
    out = sigmoid(kl, 0.1)
    out.sum().backward()
    assert out.tolist() == pytest.approx([0.0048, 1.74, 20.0], abs=5e-3)
    assert kl.grad.tolist() == pytest.approx([0.48, 1.10, 1.0], abs=5e-3)  # the gradient is not damped at high KL


def test_every_builtin_has_a_float64_reference_that_the_package_matches():
    kl = torch.linspace(-0.5, 30.0, 97, dtype=torch.float64)
    builtin = [name for name in shaping_names() if SHAPING[name].builtin and SHAPING[name].per_token]
    assert set(builtin) == set(reference.SHAPING64), "a built-in method without a float64 reference in tests/reference.py"
    for name in builtin:
        got = shape_per_token(kl, parse_method(name), {"kl_clip_threshold": 0.7, "kl_target": 0.3})
        torch.testing.assert_close(got, reference.shaped64(kl, name, 0.7, 0.3), rtol=1e-12, atol=1e-14)


# -- the registry ------------------------------------------------------------------------------------------
def test_a_registered_method_joins_the_grammar_in_its_order_with_its_parameters(half_kl):
    assert "half_kl" in method_names() and shaping_names().index("half_kl") > shaping_names().index("sigmoid")
    assert parse_method("half_kl+clip+dynamic") == Method("dynamic", ("clip", "half_kl"))
    kl = torch.tensor([0.5, 3.0], dtype=torch.float64)
    assert torch.equal(shape_per_token(kl, parse_method("half_kl+clip"), {"kl_clip_threshold": 1.0}), torch.tensor([0.25, 0.5], dtype=torch.float64))

    @register_shaping("first", order=0, parameters=(Parameter("first_scale", default=2.0, check=lambda v: v > 0, allowed="a number > 0", keyword="scale"),))
    def first(kl, scale):
        return kl * scale

    try:
        method = parse_method("clip+first")
        assert method.shaping == ("first", "clip") and [p.name for p in method.parameters] == ["first_scale", "kl_clip_threshold"]
        assert torch.equal(shape_per_token(kl, method, {"first_scale": 3.0, "kl_clip_threshold": 2.0}), torch.tensor([1.5, 2.0], dtype=torch.float64))
    finally:
        unregister_shaping("first")
    assert "first" not in method_names()


@pytest.mark.parametrize("name", ["clip", "none", "dynamic", "a+b", "", " x"])
def test_register_shaping_refuses_taken_or_malformed_names(name):
    with pytest.raises(ValueError, match="shaping method"):
        register_shaping(name)(lambda kl: kl)


def test_register_shaping_refuses_a_parameter_declared_differently_and_builtins_cannot_be_removed():
    with pytest.raises(ValueError, match="kl_clip_threshold"):
        register_shaping("mine", parameters=(Parameter("kl_clip_threshold", default=5.0),))(lambda kl, kl_clip_threshold: kl)
    with pytest.raises(ValueError, match="only per-token"):
        register_shaping("mine", per_token=False)(lambda kl: kl)
    with pytest.raises(ValueError, match="not a registered user method"):
        unregister_shaping("clip")
    assert "mine" not in SHAPING


def test_a_method_returning_another_shape_is_refused_naming_it():
    @register_shaping("bad_shape")
    def bad_shape(kl):
        return kl.sum()

    try:
        with pytest.raises(ValueError, match="shaping method 'bad_shape' returned"):
            shape_per_token(torch.ones(2, 3), parse_method("bad_shape"), {})
    finally:
        unregister_shaping("bad_shape")


def test_the_readme_method_table_lists_every_builtin_method_with_its_parameters():
    text = (pathlib.Path(unsloth_adaptive_kl.__file__).parent.parent / "README.md").read_text()
    table = text.split("<!-- shaping-table -->")[1]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \|([^|]*)\|", table, re.M)}
    builtin = [name for name in shaping_names() if SHAPING[name].builtin]
    assert list(rows) == builtin, "README's shaping table (between the <!-- shaping-table --> markers) is out of date"
    for name in builtin:
        assert [f"`{p.name}`" for p in SHAPING[name].parameters] == re.findall(r"`\w+`", rows[name]), name


nonneg = st.floats(min_value=0, max_value=1e4, allow_nan=False)
anyfloat = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(anyfloat, min_size=1, max_size=50), st.floats(min_value=1e-3, max_value=100))
def test_clip_never_exceeds_threshold(values, threshold):
    assert (clip(torch.tensor(values, dtype=torch.float64), threshold) <= threshold).all()


@settings(max_examples=200, deadline=None)
@given(st.lists(nonneg, min_size=1, max_size=50), st.floats(min_value=1e-3, max_value=100))
def test_sigmoid_never_exceeds_raw_for_non_negative_kl(values, target):
    kl = torch.tensor(values, dtype=torch.float64)
    assert (sigmoid(kl, target) <= kl).all()


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.lists(nonneg, min_size=6, max_size=6), min_size=1, max_size=5),
    st.lists(st.integers(0, 6), min_size=5, max_size=5),
    st.integers(1, 5),
)
def test_length_normalized_is_invariant_to_padding_with_masked_tokens(rows, lengths, pad):
    kl = torch.tensor(rows, dtype=torch.float64)
    mask = torch.zeros_like(kl, dtype=torch.bool)
    for i in range(kl.shape[0]):
        mask[i, : lengths[i]] = True
    padded_kl = torch.cat([kl, torch.full((kl.shape[0], pad), 123.0, dtype=torch.float64)], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(kl.shape[0], pad, dtype=torch.bool)], dim=1)
    assert length_normalized_term(padded_kl, padded_mask, 1).item() == pytest.approx(length_normalized_term(kl, mask, 1).item(), rel=1e-12, abs=0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(anyfloat, min_size=4, max_size=4), min_size=1, max_size=4), st.data())
def test_masked_tokens_contribute_exactly_zero(rows, data):
    kl = torch.tensor(rows, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=4, max_size=4), min_size=len(rows), max_size=len(rows))))
    poisoned = torch.where(mask, kl, torch.full_like(kl, float("nan")))
    total = length_normalized_term(poisoned, mask, 1)
    total.backward()
    assert math.isfinite(total.item())
    assert (kl.grad[~mask] == 0).all()


def test_user_shaping_names_lists_only_the_methods_registered_outside_the_package(half_kl):
    from unsloth_adaptive_kl.shaping import user_shaping_names

    assert user_shaping_names() == ("half_kl",)
