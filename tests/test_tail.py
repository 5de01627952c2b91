"""The tail metrics (unsloth_adaptive_kl/tail.py) against exact float64 references computed by sorting
the raw per-token KL: the max exactly, the p99 and the top-1 % share within their documented bounds,
over shards (processes), micro-batches and a logging window."""

import math

import pytest
import torch

from unsloth_adaptive_kl import metrics, tail
from unsloth_adaptive_kl.adaptation import AdaptiveKL
from unsloth_adaptive_kl.config import DEFAULTS


def exact_tail(values: torch.Tensor) -> tuple[float, float, float]:
    """Float64 reference from the definitions: max; nearest-rank p99 (the ceil(0.99 n)-th smallest);
    the sum of the ceil(n / 100) (at least 1) largest over the sum of all."""
    v = values.double().flatten().sort().values
    n = v.numel()
    p99 = v[math.ceil(0.99 * n - 1e-9) - 1].item()
    k = max(1, math.ceil(n / 100 - 1e-12))
    total = v.sum().item()
    share = v[-k:].sum().item() / total if total > 0 else math.nan
    return v[-1].item(), p99, share


def statistics_of(values: torch.Tensor, mask: torch.Tensor | None = None) -> tail.TailStatistics:
    mask = torch.ones_like(values, dtype=torch.bool) if mask is None else mask
    local = tail.local_tail(values, mask)
    return tail.statistics(tail.TailTotals.from_reduced(tail.spread(local, 0, 1)))


def assert_within_bounds(got: tail.TailStatistics, values: torch.Tensor):
    maximum, p99, share = exact_tail(values)
    assert got.maximum == maximum
    assert got.p99_bounds[0] <= p99 <= got.p99_bounds[1], (got, p99)
    if abs(p99) < tail.LARGEST:
        assert abs(got.p99 - p99) <= tail.P99_RELATIVE_ERROR * abs(p99) + tail.ABSOLUTE_ERROR, (got.p99, p99)
    if math.isnan(share):
        assert math.isnan(got.top_share)
        return
    low, high = got.top_share_bounds
    assert low - 1e-12 <= share <= high + 1e-12, (got, share)
    if bool((values >= 0).all()) and values.max() < tail.LARGEST:
        k = tail.top_count(values.numel())
        total = values.double().sum().item()
        assert abs(got.top_share - share) <= tail.SHARE_RELATIVE_ERROR * share + k * tail.ABSOLUTE_ERROR / total + 1e-12


def test_the_documented_bounds_follow_from_the_edges():
    assert tail.EDGE_RATIO == pytest.approx(2 ** (1 / 8), rel=1e-12)
    assert tail.P99_RELATIVE_ERROR == pytest.approx(2 ** (1 / 16) - 1, rel=1e-9) and tail.P99_RELATIVE_ERROR < 0.045
    assert list(tail.EDGES) == sorted(tail.EDGES) and tail.NUM_BINS == len(tail.EDGES) + 1


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n", [1, 2, 99, 100, 101, 250, 4099])
def test_k3_like_kl_max_is_exact_and_p99_and_share_are_within_their_bounds(seed, n):
    g = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(n, generator=g, dtype=torch.float64) * (0.05 + seed)  # heavier tails with the seed
    kl = (torch.exp(log_ratio) - log_ratio - 1).float()  # k3, float32 as the trainers hold it
    assert_within_bounds(statistics_of(kl), kl)


@pytest.mark.parametrize("seed", range(4))
def test_a_signed_kl_is_handled_on_both_sides_of_zero(seed):
    g = torch.Generator().manual_seed(seed)
    k1 = torch.randn(997, generator=g) * 3 + (0.5 if seed % 2 else -0.5)  # k1 is negative as often as not
    k1[:5] = torch.tensor([0.0, -1e-9, 1e-9, -2e5, 3e5])
    assert_within_bounds(statistics_of(k1), k1)


def test_huge_values_in_the_overflow_bin_keep_an_exact_max_and_bounded_p99():
    kl = torch.cat([torch.full((50,), 3e13, dtype=torch.float64), torch.rand(50, generator=torch.Generator().manual_seed(0), dtype=torch.float64)])
    got = statistics_of(kl)
    assert got.maximum == 3e13 and got.p99_bounds[1] == 3e13 and got.p99_bounds[0] >= tail.LARGEST
    assert_within_bounds(got, kl)


def test_masked_and_nan_tokens_are_left_out_and_an_empty_shard_has_no_statistics():
    kl = torch.tensor([[0.1, 5.0, float("nan")], [0.3, float("inf"), 0.2]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    got = statistics_of(kl, mask)
    assert got.tokens == 4 and got.maximum == pytest.approx(5.0)
    assert_within_bounds(got, kl[mask.bool() & ~kl.isnan()])
    assert statistics_of(kl, torch.zeros_like(mask)) is None


def test_shards_and_micro_batches_sum_to_the_statistics_of_all_tokens():
    """Four processes, each three micro-batches of different shapes: the spread histograms summed over the
    processes (what the one sum-reduce does) and added over the micro-batches give the pooled tokens' statistics."""
    g = torch.Generator().manual_seed(3)
    world, window, everything = 4, None, []
    for micro_batch in range(3):
        reduced = 0
        for rank in range(world):
            t = 5 + 7 * rank + micro_batch
            log_ratio = torch.randn(2, t, generator=g) * (1 + rank)
            kl, mask = torch.exp(log_ratio) - log_ratio - 1, torch.rand(2, t, generator=g) > 0.2
            everything.append(kl[mask])
            reduced = reduced + tail.spread(tail.local_tail(kl, mask), rank, world)
        totals = tail.TailTotals.from_reduced(reduced)
        window = totals if window is None else window + totals
    assert_within_bounds(tail.statistics(window), torch.cat(everything))


def test_the_share_is_nan_when_the_kl_sum_is_not_positive():
    got = statistics_of(torch.tensor([-1.0, -2.0, 0.5]))
    assert got.maximum == 0.5 and math.isnan(got.top_share)


def test_local_metric_sums_carry_the_histogram_after_the_five_kl_sums():
    kl = torch.tensor([[0.5, 0.25], [0.125, 4.0]])
    sums = metrics.local_metric_sums(kl, kl, torch.ones(2, 2))
    assert sums.shape == (metrics.SUMS_SIZE,) and torch.equal(sums[: metrics.NUM_SUMS], metrics.local_kl_sums(kl, kl, torch.ones(2, 2)))
    assert torch.equal(sums[metrics.NUM_SUMS :], tail.local_tail(kl, torch.ones(2, 2)))


class _Config:
    def __init__(self, **fields):
        self.__dict__.update(DEFAULTS, beta=0.1, **fields)


def test_adaptive_kl_pools_the_window_until_restarted_and_logs_max_p99_share():
    runtime = AdaptiveKL(_Config())
    a, b = torch.tensor([[0.1, 0.2, 9.0]]), torch.tensor([[0.3, 0.05]])
    first = runtime.record(a, a, torch.ones_like(a), training=True, beta=0.1)
    second = runtime.record(b, b, torch.ones_like(b), training=True, beta=0.1)
    assert first[metrics.TOKEN_KL_MAX] == pytest.approx(9.0) and second[metrics.TOKEN_KL_MAX] == pytest.approx(9.0)
    pooled = torch.cat([a.flatten(), b.flatten()])
    maximum, p99, share = exact_tail(pooled)
    assert second[metrics.TOKEN_KL_P99] == pytest.approx(p99, rel=tail.P99_RELATIVE_ERROR)
    assert second[metrics.TOKEN_KL_TOP1PCT_SHARE] == pytest.approx(share, rel=tail.SHARE_RELATIVE_ERROR)
    runtime.restart_tail_window(True)
    third = runtime.record(b, b, torch.ones_like(b), training=True, beta=0.1)
    assert third[metrics.TOKEN_KL_MAX] == pytest.approx(0.3)
    assert runtime.end_step(1) == pytest.approx(0.1)  # the controller's step sums are the 5 KL sums, as before
