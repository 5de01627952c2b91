"""Shaping against float64 formulas, the method grammar, and hypothesis properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unsloth_adaptive_kl.shaping import Method, clip, length_normalized_term, parse_method, sequence_mean, shape_per_token, sigmoid


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


@pytest.mark.parametrize("text", ["", "bogus", "dynamic+target", "clip+clip", "none+clip", "clip+", 3])
def test_parse_method_rejects_bad_methods_naming_the_field(text):
    with pytest.raises(ValueError, match="kl_adaptation_method"):
        parse_method(text)


def test_shape_per_token_applies_clip_before_sigmoid():
    kl = torch.tensor([0.2, 2.0, 9.0], dtype=torch.float64)
    got = shape_per_token(kl, parse_method("sigmoid+clip"), clip_threshold=1.0, target=0.5)
    assert torch.equal(got, sigmoid(clip(kl, 1.0), 0.5))
    assert torch.equal(shape_per_token(kl, parse_method("none"), clip_threshold=1.0, target=0.5), kl)


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
