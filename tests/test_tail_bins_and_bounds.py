"""The tail histogram's layout and bounds at the places the random tests of tests/test_tail.py do not reach: values
on a bin edge, the two lowest bins, a negative p99, the bin around 0, a KL of exactly 0, a process with no token,
logging windows past 2 ** 24 tokens, and a boundary bin whose values the histogram pins. References: the documented
bin layout (``bisect`` over :data:`tail.EDGES`), float64 sorts of the values, and exact values derived by hand."""

import bisect
import math
from fractions import Fraction

import pytest
import torch

from unsloth_adaptive_kl import tail


def statistics_of(values: torch.Tensor) -> tail.TailStatistics:
    values = values.double()
    local = tail.local_tail(values, torch.ones_like(values, dtype=torch.bool))
    return tail.statistics(tail.TailTotals.from_reduced(tail.spread(local, 0, 1)))


def exact_p99(values: torch.Tensor) -> float:
    """The ceil(0.99 n)-th smallest value, the rank in exact arithmetic."""
    v = values.double().flatten().sort().values
    return v[math.ceil(Fraction(99 * v.numel(), 100)) - 1].item()


def assert_p99_within_the_documented_error(got: tail.TailStatistics, p99: float):
    assert got.p99_bounds[0] <= p99 <= got.p99_bounds[1], (got.p99_bounds, p99)
    assert abs(got.p99 - p99) <= tail.P99_RELATIVE_ERROR * abs(p99) + tail.ABSOLUTE_ERROR, (got.p99, p99)


def bin_of(value: float) -> int:
    """The documented layout: bin i is [EDGES[i - 1], EDGES[i]), so a value's bin is the number of edges <= it."""
    return bisect.bisect_right(tail.EDGES, value)


def test_the_edges_are_float64_on_the_device_asked_for_and_made_once_per_device(monkeypatch):
    """The meta device stands in for a GPU here: the edges must be made there, not on the CPU."""
    monkeypatch.setattr(tail, "_EDGES_ON", {})
    on_cpu = tail.edges_on("cpu")
    assert on_cpu.dtype == torch.float64 and on_cpu.tolist() == list(tail.EDGES)
    assert tail.edges_on(torch.device("cpu")) is on_cpu
    on_meta = tail.edges_on("meta")
    assert on_meta.device.type == "meta" and on_meta.dtype == torch.float64 and on_meta.shape == (len(tail.EDGES),)


def test_the_histogram_and_the_max_min_slots_stay_on_the_kls_device():
    kl = torch.rand(2, 3, device="meta")
    local = tail.local_tail(kl, torch.ones(2, 3, dtype=torch.bool, device="meta"))
    assert local.device.type == "meta" and local.shape == (tail.LOCAL_SIZE,) and local.dtype == torch.float64
    spread = tail.spread(local, 1, 3)
    assert spread.device.type == "meta" and spread.shape == (2 * tail.NUM_BINS + 6,)


def test_a_value_on_a_bin_edge_falls_in_the_bin_that_edge_opens():
    values = [0.0, 1.0, -1.0, 2.0**0.125, tail.SMALLEST, -tail.SMALLEST, tail.LARGEST, -tail.LARGEST, -2 * tail.LARGEST]
    assert {1.0, -1.0, tail.SMALLEST, -tail.SMALLEST, tail.LARGEST, -tail.LARGEST} <= set(tail.EDGES)
    local = tail.local_tail(torch.tensor(values, dtype=torch.float64), torch.ones(len(values), dtype=torch.bool))
    expected = torch.zeros(tail.NUM_BINS, dtype=torch.float64)
    for value in values:
        expected[bin_of(value)] += 1
    assert torch.equal(local[: tail.NUM_BINS], expected)
    assert bin_of(tail.LARGEST) == tail.NUM_BINS - 1 and bin_of(-2 * tail.LARGEST) == 0


def test_a_p99_in_the_two_lowest_bins_keeps_its_bounds_and_error():
    """Below -LARGEST (the bin that reaches to -inf) the bounds are the exact min and max; in the next bin up, with a
    token below it, the bin's own lower edge bounds the p99, so the documented error holds (|p99| < LARGEST)."""
    far_below = torch.tensor([-3e13, -5e13, -4e13], dtype=torch.float64)
    got = statistics_of(far_below)
    assert got.p99_bounds == (-5e13, -3e13) and got.p99_bounds[0] <= got.p99 <= got.p99_bounds[1]
    assert got.p99_bounds[0] <= exact_p99(far_below) <= got.p99_bounds[1]

    second_bin = torch.tensor([-1e13] + [-1.05e12] * 99, dtype=torch.float64)
    assert bin_of(-1e13) == 0 and bin_of(-1.05e12) == 1 and abs(-1.05e12) < tail.LARGEST
    got = statistics_of(second_bin)
    assert got.p99_bounds == (tail.EDGES[0], -1.05e12)
    assert_p99_within_the_documented_error(got, exact_p99(second_bin))


def test_a_negative_p99_is_within_the_documented_error():
    """k1 can be negative on most tokens: the p99 is then negative, off the bin around 0."""
    k1 = -torch.linspace(0.5, 3.0, 200, dtype=torch.float64)
    p99 = exact_p99(k1)
    assert p99 < -tail.SMALLEST
    assert_p99_within_the_documented_error(statistics_of(k1), p99)


@pytest.mark.parametrize("lowest", [0.0, -0.3])
def test_a_p99_in_the_bin_around_zero_reads_as_zero(lowest):
    """Mostly exact zeros (tokens the policy and the reference agree on) and one large KL: the p99 is 0, and the bin
    [-SMALLEST, SMALLEST) around 0 reads as 0, whichever side of 0 its values reach."""
    kl = torch.tensor([lowest] + [0.0] * 99 + [0.5], dtype=torch.float64)
    assert exact_p99(kl) == 0.0
    got = statistics_of(kl)
    assert got.p99 == 0.0 and got.p99_bounds[0] <= 0.0 <= got.p99_bounds[1]


def test_a_kl_of_exactly_zero_everywhere_gives_p99_plus_zero_and_the_share_of_equal_values():
    """The first step (policy == reference): every token's KL is 0. The p99 is logged as 0.0, not -0.0, and the top
    share is that of the top k of n equal values, k / n (issue 52: it was NaN, so the metric was absent)."""
    got = statistics_of(torch.zeros(64))
    assert got.maximum == 0.0 and got.p99 == 0.0 and math.copysign(1.0, got.p99) == 1.0
    assert got.top_share == 1 / 64 and got.top_share_bounds == (1 / 64, 1 / 64)


def test_the_reduced_slots_carry_every_processs_exact_max_and_min_when_one_process_has_no_token():
    """Three processes, the middle one with every token masked (max -inf, min +inf in its slots): the totals keep
    the exact max and min of the tokens the other two hold."""
    g = torch.Generator().manual_seed(0)
    kls = [torch.rand(2, 5, generator=g, dtype=torch.float64) + 0.25 for _ in range(3)]
    masks = [torch.ones(2, 5, dtype=torch.bool), torch.zeros(2, 5, dtype=torch.bool), torch.ones(2, 5, dtype=torch.bool)]
    reduced = sum(tail.spread(tail.local_tail(kl, mask), rank, 3) for rank, (kl, mask) in enumerate(zip(kls, masks)))
    totals = tail.TailTotals.from_reduced(reduced)
    valid = torch.cat([kls[0].flatten(), kls[2].flatten()])
    assert totals.maximum == valid.max().item() and totals.minimum == valid.min().item()
    assert tail.statistics(totals).maximum == valid.max().item()


def test_p99_rank_is_the_integer_nearest_rank():
    for tokens in (1, 2, 99, 100, 101, 250, 4099, 16946683):
        rank = tail.p99_rank(tokens)
        assert isinstance(rank, int) and rank == math.ceil(Fraction(99 * tokens, 100))


def hand_made_totals(counts_at: dict[float, int]) -> tail.TailTotals:
    """The totals of ``count`` tokens of each value (a window too large to hold as tokens)."""
    counts = torch.zeros(tail.NUM_BINS, dtype=torch.float64)
    sums = torch.zeros(tail.NUM_BINS, dtype=torch.float64)
    for value, count in counts_at.items():
        counts[bin_of(value)] += count
        sums[bin_of(value)] += count * value
    return tail.TailTotals(counts, sums, max(counts_at), min(counts_at))


def test_a_window_past_2_to_the_24_tokens_finds_the_p99_and_top_1pct_bins_exactly():
    """A logging window of many steps over many processes can hold more than 2 ** 24 tokens, where float32 can no
    longer count one by one: the rank 2 ** 24 + 1 must not be read as 2 ** 24."""
    rank = 2**24 + 1
    tokens = 16946683
    assert math.ceil(Fraction(99 * tokens, 100)) == rank
    got = tail.statistics(hand_made_totals({1.0: rank - 1, 1.5: 1, 3.0: tokens - rank}))
    assert got.tokens == tokens and got.p99_bounds[0] <= 1.5 <= got.p99_bounds[1]  # the rank-th smallest is the 1.5

    k = 2**24 + 1
    tokens = 100 * 2**24 + 1
    assert max(1, math.ceil(Fraction(tokens, 100))) == k
    got = tail.statistics(hand_made_totals({3.0: k - 1, 2.0: 1, 1.0: tokens - k}))
    total = 3.0 * (k - 1) + 2.0 + (tokens - k)
    share = (3.0 * (k - 1) + 2.0) / total  # the k largest: every 3.0 and the one 2.0
    assert got.top_share_bounds[0] <= share * (1 + 1e-12) and share * (1 - 1e-12) <= got.top_share_bounds[1]
    assert got.top_share == pytest.approx(share, rel=1e-12)


def test_the_top_share_is_exact_when_the_histogram_pins_the_boundary_bins_top_values():
    """31 tokens in the bin [1, 2 ** (1/8)) summing to 31 are all exactly 1.0 (none can be below the edge 1.0), so
    the top 30 of them sum to 30 and the share is known exactly: the bounds close on it."""
    kl = torch.tensor([5.0] + [1.0] * 31 + [0.1] * 3068, dtype=torch.float64)
    assert tail.top_count(kl.numel()) == 31 and bin_of(5.0) > bin_of(1.0) > bin_of(0.1)
    share = 35.0 / kl.sum().item()  # the 5.0 and 30 of the 1.0s
    got = statistics_of(kl)
    assert got.top_share_bounds == pytest.approx((share, share), rel=1e-12) and got.top_share == pytest.approx(share, rel=1e-12)


def test_the_top_share_is_within_the_documented_error_of_the_boundary_bins_part():
    """n = 200, k = 2: the 10.0 and the largest of ten 1.04s. The error bound is SHARE_RELATIVE_ERROR times the part
    of the top k in the boundary bin (one 1.04) over the total, plus k * ABSOLUTE_ERROR / total."""
    kl = torch.tensor([10.0] + [1.04] * 10 + [0.1] * 189, dtype=torch.float64)
    total = kl.sum().item()
    share = (10.0 + 1.04) / total
    got = statistics_of(kl)
    assert got.top_share_bounds[0] - 1e-12 <= share <= got.top_share_bounds[1] + 1e-12
    assert abs(got.top_share - share) <= tail.SHARE_RELATIVE_ERROR * 1.04 / total + 2 * tail.ABSOLUTE_ERROR / total
