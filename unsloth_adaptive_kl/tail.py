"""The tail of the per-token raw KL: its max, its 99th percentile and the share of the KL sum its
top 1 % of tokens carry, global over processes and micro-batches.

A percentile of tokens spread over processes and micro-batches cannot be summed; a histogram can.
So each shard puts its valid tokens' raw KL into a fixed histogram (a count and a sum per bin), which
rides in the one sum-reduce of :mod:`unsloth_adaptive_kl.metrics` (no second collective, no second
host sync), with the shard's exact max and min in a slot of its own (a sum over processes of slots
that are 0 except one's own is a gather). The host adds these totals over a logging window and reads
the statistics off them with bounds from the bin edges:

* ``token_kl_max`` is exact.
* ``token_kl_p99`` is the nearest-rank 99th percentile (the ``ceil(0.99 n)``-th smallest of n
  tokens), within ``P99_RELATIVE_ERROR * |p99| + ABSOLUTE_ERROR`` of the exact value while
  ``|p99| < LARGEST`` (:func:`statistics` returns the bin's bounds too).
* ``token_kl_top1pct_share`` is ``sum of the k = max(1, ceil(n / 100)) largest values / sum of all``,
  within ``SHARE_RELATIVE_ERROR * |part of the top k in the boundary bin| / total + k * ABSOLUTE_ERROR / total``
  (at most ``SHARE_RELATIVE_ERROR * share + ...`` when the KL is non-negative, as k2, k3 and abs are);
  ``k / n`` when every token's KL is 0 (the share of k of n equal values: the policy still is the reference, as
  at the first step), NaN when the sum is otherwise not positive (a signed estimator such as k1 can make it so),
  and above 1 when negative values are part of the sum.

The bins are log-spaced by ``2 ** (1 / 8)`` on each side of 0 between ``SMALLEST`` and ``LARGEST``,
with one bin ``[-SMALLEST, SMALLEST)`` around 0 and one beyond each end. NaN tokens are left out of
all three (the mean ``raw_kl`` shows them). Pure torch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

BINS_PER_OCTAVE = 8
SMALLEST, LARGEST = 2.0**-20, 2.0**40
_POSITIVE = tuple(2.0 ** (k / BINS_PER_OCTAVE) for k in range(-20 * BINS_PER_OCTAVE, 40 * BINS_PER_OCTAVE + 1))
#: The bin edges, ascending: bin ``i`` is ``[EDGES[i - 1], EDGES[i])`` (``-inf`` / ``+inf`` past the ends).
EDGES: tuple[float, ...] = tuple(-e for e in reversed(_POSITIVE)) + _POSITIVE
NUM_BINS = len(EDGES) + 1
#: The largest ratio of two neighbouring positive edges (2 ** (1/8), as the floats came out).
EDGE_RATIO = max(b / a for a, b in zip(_POSITIVE, _POSITIVE[1:]))
#: ``|p99 estimate - p99| <= P99_RELATIVE_ERROR * |p99| + ABSOLUTE_ERROR`` (the geometric middle of a bin
#: is within sqrt(ratio) - 1 of any value in it; the bin around 0 is ABSOLUTE_ERROR wide on each side).
P99_RELATIVE_ERROR = math.sqrt(EDGE_RATIO) - 1.0
SHARE_RELATIVE_ERROR = (EDGE_RATIO - 1.0) / 2.0
ABSOLUTE_ERROR = SMALLEST
#: Length of a shard's :func:`local_tail`: counts, sums, then the shard's max and min.
LOCAL_SIZE = 2 * NUM_BINS + 2

_EDGES_ON: dict[torch.device, torch.Tensor] = {}


def edges_on(device) -> torch.Tensor:
    """:data:`EDGES` as a float64 tensor on ``device``, made once per device (no copy per micro-batch)."""
    device = torch.device(device)
    if device not in _EDGES_ON:
        _EDGES_ON[device] = torch.tensor(EDGES, dtype=torch.float64, device=device)
    return _EDGES_ON[device]


def local_tail(raw: torch.Tensor, mask: torch.Tensor, edges: torch.Tensor | None = None) -> torch.Tensor:
    """This shard's histogram of the raw KL of its valid, non-NaN tokens: ``[counts, sums, max, min]``
    (float64, :data:`LOCAL_SIZE`); max ``-inf`` and min ``+inf`` when it has none. ``edges``:
    :func:`edges_on` the device (a compiled region takes it as an input)."""
    with torch.no_grad():
        edges = edges_on(raw.device) if edges is None else edges
        values = raw.double()
        keep = mask.bool() & ~torch.isnan(values)
        kept = torch.where(keep, values, 0.0).reshape(-1)
        bins = torch.bucketize(kept, edges, right=True)
        weights = torch.stack([keep.reshape(-1).double(), kept], dim=1)
        histogram = torch.zeros(NUM_BINS, 2, dtype=torch.float64, device=raw.device).index_add_(0, bins, weights)
        keep = keep.reshape(-1)
        inf = torch.full((1,), math.inf, dtype=torch.float64, device=raw.device)
        maximum = torch.cat([torch.where(keep, kept, -math.inf), -inf]).amax()  # the extra -inf: no token, no error
        minimum = torch.cat([torch.where(keep, kept, math.inf), inf]).amin()
        return torch.cat([histogram[:, 0], histogram[:, 1], maximum.reshape(1), minimum.reshape(1)])


def spread(local: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """``local`` (:func:`local_tail`) with its max and min each moved to slot ``rank`` of ``world`` slots
    (0 elsewhere), so that a sum over the processes carries every process's max and min exactly."""
    slots = torch.arange(world, device=local.device) == rank
    return torch.cat([local[: 2 * NUM_BINS], torch.where(slots, local[-2], 0.0), torch.where(slots, local[-1], 0.0)])


class TailTotals(NamedTuple):
    """A histogram summed over processes (and, on the host, over a logging window)."""

    counts: torch.Tensor
    sums: torch.Tensor
    maximum: float
    minimum: float

    @classmethod
    def from_reduced(cls, reduced: torch.Tensor) -> "TailTotals":
        """From the sum over processes of :func:`spread` tensors (on the host)."""
        world = (reduced.numel() - 2 * NUM_BINS) // 2
        slots = reduced[2 * NUM_BINS :]
        return cls(reduced[:NUM_BINS], reduced[NUM_BINS : 2 * NUM_BINS], slots[:world].max().item(), slots[world:].min().item())

    def __add__(self, other: "TailTotals") -> "TailTotals":  # type: ignore[override]
        return TailTotals(self.counts + other.counts, self.sums + other.sums, max(self.maximum, other.maximum), min(self.minimum, other.minimum))


class TailStatistics(NamedTuple):
    """What :func:`statistics` reads off a :class:`TailTotals`: each estimate with the bounds the exact value lies in."""

    tokens: int
    maximum: float
    p99: float
    p99_bounds: tuple[float, float]
    top_share: float
    top_share_bounds: tuple[float, float]


def _bin_bounds(index: int, totals: TailTotals) -> tuple[float, float]:
    """The closed interval bin ``index``'s values lie in: its edges, narrowed by the exact max and min."""
    low = EDGES[index - 1] if index > 0 else -math.inf
    high = EDGES[index] if index < len(EDGES) else math.inf
    return max(low, totals.minimum), min(high, totals.maximum)


def _middle(low: float, high: float) -> float:
    """The point of ``[low, high]`` with the smallest worst relative error: the geometric middle on one side of 0."""
    if low > 0:
        return math.sqrt(low) * math.sqrt(high)
    if high < 0:
        return -math.sqrt(-low) * math.sqrt(-high)
    return min(max(0.0, low), high)


def p99_rank(tokens: int) -> int:
    """The 1-based ascending rank of the nearest-rank 99th percentile of ``tokens`` values."""
    return -(-99 * tokens // 100)


def top_count(tokens: int) -> int:
    """How many tokens are the top 1 %: ``ceil(tokens / 100)``, at least one."""
    return max(1, -(-tokens // 100))


def statistics(totals: TailTotals) -> TailStatistics | None:
    """The max, p99 and top-1 % share of the tokens in ``totals`` (None when there is none)."""
    counts, sums = totals.counts.double().cpu(), totals.sums.double().cpu()
    tokens = int(counts.sum().item())
    if tokens == 0:
        return None
    ascending = counts.cumsum(0)
    index = int(torch.searchsorted(ascending, torch.tensor([float(p99_rank(tokens))], dtype=torch.float64)).item())
    p99_low, p99_high = _bin_bounds(index, totals)

    k = top_count(tokens)
    descending = counts.flip(0).cumsum(0)
    boundary = NUM_BINS - 1 - int(torch.searchsorted(descending, torch.tensor([float(k)], dtype=torch.float64)).item())
    above = sums[boundary + 1 :].sum().item()
    count, total_in_bin = counts[boundary].item(), sums[boundary].item()
    m = k - (counts[boundary + 1 :].sum().item())  # how many of the boundary bin's values are in the top k
    if m == count:
        part_low = part_high = total_in_bin
    else:
        low, high = _bin_bounds(boundary, totals)
        part_low = m * total_in_bin / count  # the top m of a bin average at least the bin's mean
        part_high = min(m * high, total_in_bin - (count - m) * low)
    total = sums.sum().item()
    if total > 0 and math.isfinite(total):
        share_bounds = ((above + part_low) / total, (above + part_high) / total)
        share = (share_bounds[0] + share_bounds[1]) / 2
    elif totals.maximum == 0 and totals.minimum == 0:  # every token's KL is 0: equal values, so the top k carry k / n
        share_bounds = (k / tokens, k / tokens)
        share = k / tokens
    else:
        share_bounds, share = (math.nan, math.nan), math.nan
    return TailStatistics(tokens, totals.maximum, _middle(p99_low, p99_high), (p99_low, p99_high), share, share_bounds)
