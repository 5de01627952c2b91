"""The adaptive_kl/* metrics' cross-process means, against the sums written out by hand (a fake two-process reduce)."""

import math

import pytest
import torch

from unsloth_adaptive_kl import metrics


def _two_processes(other: torch.Tensor):
    """``reduce`` of a run with a second process that contributes ``other``."""
    return lambda local: local + other.to(local.dtype)


def test_global_masked_mean_is_the_token_weighted_mean_over_every_process_as_trls():
    values = torch.tensor([[1.0, 2.0, 99.0], [4.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # this process: sum 7 over 3 tokens; the other: sum 5 over 2 tokens
    assert metrics.global_masked_mean(values, mask, _two_processes(torch.tensor([5.0, 2.0]))) == pytest.approx(12.0 / 5)
    assert metrics.global_masked_mean(values, torch.zeros_like(mask), _two_processes(torch.tensor([0.0, 0.0]))) == 0.0  # no token: 0


def test_global_token_mean_weights_each_process_local_mean_by_its_tokens():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])  # 4 tokens, local mean 0.5
    other = torch.tensor([3.0 * 6, 6.0])  # 6 tokens of mean 3
    assert metrics.global_token_mean(torch.tensor(0.5), mask, _two_processes(other)) == pytest.approx((0.5 * 4 + 18.0) / 10)
    empty = torch.zeros_like(mask)
    assert metrics.global_token_mean(torch.tensor(0.0), empty, _two_processes(torch.zeros(2))) == 0.0  # no token anywhere: 0, as TRL


def test_metric_values_are_nan_without_tokens_and_means_otherwise():
    assert all(math.isnan(v) for v in metrics.metric_values(None, length_normalized=False).values())
    raw = torch.tensor([[0.5, 1.5, 7.0], [2.0, 7.0, 7.0]])
    adapted = raw.clamp(max=1.0)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    sums = metrics.local_kl_sums(raw, adapted, mask)
    assert sums.tolist() == [4.0, 2.5, 3.0, (0.5 + 1.0) / 2 + 1.0, 2.0, 0.0, 0.0]  # last two: tokens user functions made non-finite
    finite = {metrics.NONFINITE_KL_BATCHES: 0.0}
    assert metrics.metric_values(sums, length_normalized=False) == {metrics.RAW_KL: 4.0 / 3, metrics.ADAPTED_KL: 2.5 / 3, **finite}
    assert metrics.metric_values(sums, length_normalized=True) == {metrics.RAW_KL: 4.0 / 3, metrics.ADAPTED_KL: 1.75 / 2, **finite}
    empty = metrics.local_kl_sums(raw, adapted, torch.zeros_like(mask))
    assert all(math.isnan(v) for v in metrics.metric_values(empty, length_normalized=True).values())


def test_the_fault_slots_count_the_valid_tokens_a_user_shaping_step_or_estimator_made_non_finite():
    """SHAPING_FAULTS: valid tokens with a finite raw KL and a non-finite adapted one (only when asked: a built-in
    method cannot make them). ESTIMATOR_FAULTS: the valid tokens of the estimator's fault map (Unsloth's compiled
    loss, where the estimator runs unchecked). Masked positions never count."""
    nan, inf = math.nan, math.inf
    raw = torch.tensor([[0.5, nan, 7.0], [2.0, 1.0, 3.0]])
    adapted = torch.tensor([[inf, nan, nan], [nan, 1.0, nan]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    estimator_faults = torch.tensor([[False, True, False], [False, True, True]])
    sums = metrics.local_kl_sums(raw, adapted, mask, count_shaping_faults=True, estimator_faults=estimator_faults)
    assert sums[metrics.SHAPING_FAULTS].item() == 3.0  # (0,0) inf, (0,2) and (1,0) NaN; not (0,1): its raw was NaN; not (1,2): masked
    assert sums[metrics.ESTIMATOR_FAULTS].item() == 2.0  # (0,1) and (1,1); not (1,2): masked
    unasked = metrics.local_kl_sums(raw, adapted, mask)
    assert unasked[metrics.SHAPING_FAULTS].item() == 0.0 and unasked[metrics.ESTIMATOR_FAULTS].item() == 0.0
    assert metrics.local_metric_sums(raw, adapted, mask, estimator_faults=estimator_faults)[metrics.ESTIMATOR_FAULTS].item() == 2.0
