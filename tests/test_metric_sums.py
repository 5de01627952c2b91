"""The metric sums' edge cases that tests/test_metrics.py leaves open (found by mutation testing, docs/reliability.md):
the shaping-fault count of a user step against its definition, the sums on the KL's own device, one token and one
completion (a mean over one is that value, not half of it), the values as Python floats, and a micro-batch whose
adapted KL alone is not finite."""

import math

import pytest
import torch

from unsloth_adaptive_kl import metrics, tail

INF, NAN = math.inf, math.nan


def test_the_shaping_fault_count_is_the_valid_tokens_with_a_finite_raw_and_a_non_finite_adapted_kl():
    raw = torch.tensor([[0.5, 1.0, NAN, 2.0], [INF, 0.3, 0.2, 0.1]])
    adapted = torch.tensor([[NAN, INF, NAN, 2.0], [NAN, -INF, 0.2, NAN]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    # valid, raw finite, adapted not: (0,0), (0,1), (1,1); (0,2) has a NaN raw KL, (1,0) an inf one, (1,3) is masked
    expected = sum(
        bool(mask[i, j]) and math.isfinite(raw[i, j].item()) and not math.isfinite(adapted[i, j].item())
        for i in range(2) for j in range(4)
    )  # fmt: skip
    assert expected == 3
    counted = metrics.local_kl_sums(raw, adapted, mask, count_shaping_faults=True)
    assert counted[metrics.SHAPING_FAULTS].item() == expected
    # without a user step the slot is 0 whatever the values (the count is asked for, never assumed)
    assert metrics.local_kl_sums(raw, adapted, mask)[metrics.SHAPING_FAULTS].item() == 0.0
    # local_metric_sums passes the flag on and appends the tail histogram of the raw KL
    full = metrics.local_metric_sums(raw, adapted, mask, count_shaping_faults=True)
    assert full.shape == (metrics.SUMS_SIZE,)
    torch.testing.assert_close(full[: metrics.NUM_SUMS], counted, rtol=0, atol=0, equal_nan=True)  # the raw sum is NaN here
    assert metrics.local_metric_sums(raw, adapted, mask)[metrics.SHAPING_FAULTS].item() == 0.0
    assert torch.equal(full[metrics.NUM_SUMS :], tail.local_tail(raw, mask))


def test_the_sums_stay_on_the_kls_device():
    """No tensor of the sums is made on the default device: on a GPU a CPU zero in the stack fails (here: meta)."""
    raw = torch.rand(2, 3, device="meta")
    mask = torch.ones(2, 3, dtype=torch.bool, device="meta")
    for faults in (False, True):
        sums = metrics.local_kl_sums(raw, raw, mask, count_shaping_faults=faults)
        assert sums.device.type == "meta" and sums.shape == (metrics.NUM_SUMS,) and sums.dtype == torch.float64


def test_a_mean_over_one_token_or_one_completion_is_that_value():
    one = torch.tensor([[0.0, 3.0, 0.0]])
    mask = torch.tensor([[0, 1, 0]])
    identity = lambda local: local  # noqa: E731  (one process)
    assert metrics.global_masked_mean(one, mask, identity) == 3.0
    assert metrics.global_token_mean(torch.tensor(3.0), mask, identity) == 3.0
    sums = metrics.local_kl_sums(one, 0.5 * one, mask)
    assert metrics.metric_values(sums, length_normalized=True)[metrics.ADAPTED_KL] == 1.5  # one completion's mean
    assert metrics.metric_values(sums, length_normalized=False)[metrics.ADAPTED_KL] == 1.5


@pytest.mark.parametrize("as_list", [False, True])
def test_metric_values_are_python_floats_and_a_non_finite_adapted_kl_alone_counts_the_micro_batch(as_list):
    raw = torch.tensor([[0.5, 1.5], [2.0, 1.0]])
    mask = torch.ones(2, 2)
    for adapted, nonfinite in ((raw.clamp(max=1.0), 0.0), (torch.tensor([[0.5, NAN], [1.0, 1.0]]), 1.0)):
        sums = metrics.local_kl_sums(raw, adapted, mask)
        values = metrics.metric_values(sums.tolist() if as_list else sums, length_normalized=False)
        assert all(type(v) is float for v in values.values()), values  # logged as numbers, never as tensors
        assert values[metrics.RAW_KL] == 1.25 and values[metrics.NONFINITE_KL_BATCHES] == nonfinite
