"""The ``adaptive_kl/*`` metrics: names, local sums, and the global means made from them.

A backend computes :func:`local_kl_sums` on its shard of the batch, sums them across processes
(one ``reduce`` of one small tensor), and turns the totals into metric values with
:func:`metric_values`. Token-weighted means over all processes, like TRL's own ``kl``; the tail of
the raw KL (max, p99, top-1 % share) rides in the same tensor as a histogram (:mod:`.tail`).
"""

from __future__ import annotations

import math

import torch

from . import tail
from .shaping import sequence_mean

RAW_KL = "adaptive_kl/raw_kl"
ADAPTED_KL = "adaptive_kl/adapted_kl"
CURRENT_BETA = "adaptive_kl/current_beta"
SKIPPED_UPDATES = "adaptive_kl/skipped_updates"
#: How many micro-batches of the logging window had a NaN or inf KL on a valid token (raw or adapted): they
#: are left out of both ``raw_kl`` and ``adapted_kl`` (TRL's ``log()`` drops a NaN from a window's mean), so
#: the window says how many, and the first one is warned about.
NONFINITE_KL_BATCHES = "adaptive_kl/nonfinite_kl_batches"
TOKEN_KL_MAX = "adaptive_kl/token_kl_max"
TOKEN_KL_P99 = "adaptive_kl/token_kl_p99"
TOKEN_KL_TOP1PCT_SHARE = "adaptive_kl/token_kl_top1pct_share"
#: 0 until the runaway alarm (:mod:`.runaway`) fires, 1 from the step it fired at on (logged every optimizer step).
RUNAWAY_ALARM = "adaptive_kl/runaway_alarm"
#: Logged by the ``target`` controller only: 1 while its kl_target is held or may still be, 0 from the update at
#: which it declared the target unreachable (the KL above it did not fall while a risen β was held; docs/methods.md).
TARGET_REACHABLE = "adaptive_kl/target_reachable"
METRIC_NAMES = (
    RAW_KL, ADAPTED_KL, CURRENT_BETA, SKIPPED_UPDATES, NONFINITE_KL_BATCHES, TOKEN_KL_MAX, TOKEN_KL_P99, TOKEN_KL_TOP1PCT_SHARE,
    RUNAWAY_ALARM,
)  # fmt: skip
#: Statistics of every token of the logging window pooled (over its micro-batches, steps and processes),
#: logged as their latest value: the max over the window, the p99 and top-1 % share of the window's tokens.
WINDOW_TAIL_METRICS = (TOKEN_KL_MAX, TOKEN_KL_P99, TOKEN_KL_TOP1PCT_SHARE)
#: Under ``kl_placement="reward"``: the mean over the generation batch's completions (all processes) of
#: β · (each completion's KL) subtracted from its reward; logged once per generation batch.
KL_PENALTY = "adaptive_kl/kl_penalty"
#: Under ``kl_placement="reward"``, summed over the logging window: completions whose penalty was NaN or inf (each
#: treated as unscored), and groups whose penalties spread wider than their task rewards (the KL orders them).
NONFINITE_PENALTIES = "adaptive_kl/nonfinite_penalties"
KL_DOMINATED_GROUPS = "adaptive_kl/kl_dominated_groups"
#: ... and groups whose task rewards were all equal and whose penalties differed (the KL alone sets their advantages).
KL_ONLY_GROUPS = "adaptive_kl/kl_only_groups"
#: Logged as their latest value in the logging window, not averaged over it: the β of the window's
#: last step (an average of several steps' β is a β no step used), a running count, the alarm's state and the
#: controller's reachability flag.
LATEST_VALUE_METRICS = (CURRENT_BETA, SKIPPED_UPDATES, RUNAWAY_ALARM, TARGET_REACHABLE)
#: Summed over the logging window (a count per window), not averaged.
WINDOW_SUM_METRICS = (NONFINITE_KL_BATCHES, NONFINITE_PENALTIES, KL_DOMINATED_GROUPS, KL_ONLY_GROUPS)

# Layout of the sums tensor.
RAW_SUM, ADAPTED_SUM, TOKENS, ADAPTED_SEQ_MEAN_SUM, COMPLETIONS, SHAPING_FAULTS, ESTIMATOR_FAULTS = range(7)
NUM_SUMS = 7
#: Length of :func:`local_metric_sums`: the sums, then this shard's :func:`tail.local_tail`.
SUMS_SIZE = NUM_SUMS + tail.LOCAL_SIZE


def local_metric_sums(
    raw: torch.Tensor,
    adapted: torch.Tensor,
    mask: torch.Tensor,
    tail_edges: torch.Tensor | None = None,
    *,
    count_shaping_faults: bool = False,
    estimator_faults: torch.Tensor | None = None,
) -> torch.Tensor:
    """What a backend reduces once per micro-batch: :func:`local_kl_sums`, then the histogram of the raw
    KL for the tail metrics (:func:`tail.local_tail`; ``tail_edges``: its edges on the device)."""
    sums = local_kl_sums(raw, adapted, mask, count_shaping_faults=count_shaping_faults, estimator_faults=estimator_faults)
    return torch.cat([sums, tail.local_tail(raw, mask, tail_edges)])


def local_kl_sums(
    raw: torch.Tensor, adapted: torch.Tensor, mask: torch.Tensor, *, count_shaping_faults: bool = False, estimator_faults: torch.Tensor | None = None
) -> torch.Tensor:
    """Sums over this shard's valid tokens, as one float64 tensor of 7 values (see the layout above).

    The values are summed in float64, whatever their dtype: a bf16 KL (TRL's log-probs under FSDP2's
    bf16 ``MixedPrecisionPolicy``) summed in bf16 is rounded to 8 significant bits, which made the
    logged ``adapted_kl`` of ``clip`` 5.9e-4 off the global mean (issue 24).
    ``where`` rather than a product keeps NaN or inf on masked positions out of the sums.

    ``count_shaping_faults`` (a method with a registered, user, shaping step): ``SHAPING_FAULTS`` counts the
    valid tokens whose raw KL is finite and adapted KL is not. The built-in steps keep a finite KL finite, so
    those are a user step's fault. Counted here, it is read with the sums (no host sync of its own); 0 otherwise.

    ``estimator_faults`` (a user estimator called unchecked, inside Unsloth's compiled loss): where the
    estimator's output was NaN or inf on finite inputs (:meth:`~unsloth_adaptive_kl.kl_term.KLTerm.estimator_faults`,
    bool, ``raw``'s shape); ``ESTIMATOR_FAULTS`` counts its valid tokens, read the same way; 0 when None.
    """
    with torch.no_grad():
        valid = mask.bool()
        zero = torch.zeros((), dtype=torch.float64, device=raw.device)
        faults = shaping_faults(raw, adapted, valid) if count_shaping_faults else zero
        blamed_estimator = zero if estimator_faults is None else (valid & estimator_faults.reshape(valid.shape)).sum().double()
        return torch.stack(
            [
                torch.where(valid, raw.double(), zero).sum(),
                torch.where(valid, adapted.double(), zero).sum(),
                valid.sum().double(),
                sequence_mean(adapted.double(), mask).sum(),
                torch.ones_like(valid.sum(-1), dtype=torch.float64).sum(),  # rows (also when T = 0); no Python float, so it compiles
                faults,
                blamed_estimator,
            ]
        )


def shaping_faults(raw: torch.Tensor, adapted: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """How many ``valid`` tokens (bool) have a finite raw KL and a NaN or inf shaped one: a user shaping step's
    fault (the built-in steps keep a finite KL finite). A float64 0-dim tensor; nothing is read to the host."""
    return (valid & torch.isfinite(raw) & ~torch.isfinite(adapted)).sum().double()


def token_mean(total: float, tokens: float) -> float:
    """A token-weighted mean from a sum and a token count (both already summed over processes);
    NaN when there is no token: no value was observed (the trainer logs NaN as missing), not 0."""
    return math.nan if tokens == 0 else total / tokens


def global_token_mean(local_mean: torch.Tensor, mask: torch.Tensor, reduce) -> float:
    """A local masked mean made global across processes, token-weighted (TRL's ``global_masked_mean``),
    for a metric the loss reports only as a local mean (Liger's clip ratio, its own ``kl_mean``);
    ``reduce`` sums a tensor across processes."""
    tokens = mask.sum().float()
    return _clamped_mean(reduce(torch.stack([local_mean.float() * tokens.clamp(min=1.0), tokens])))


def global_masked_mean(values: torch.Tensor, mask: torch.Tensor, reduce) -> float:
    """TRL's ``global_masked_mean`` of a per-token tensor, as stock TRL logs its ``kl``: the masked sum
    over all processes over the token count (0 with no token; NaN where a valid value is NaN)."""
    return _clamped_mean(reduce(torch.stack([(values * mask).sum().float(), mask.sum().float()])))


def _clamped_mean(totals: torch.Tensor) -> float:
    """``totals[0] / max(totals[1], 1)``: 0 with no token, as TRL's own metrics."""
    return (totals[0] / totals[1].clamp(min=1.0)).item()


def metric_values(totals: torch.Tensor | list[float] | None, *, length_normalized: bool) -> dict[str, float]:
    """Global metric values from summed :func:`local_kl_sums` (a tensor, or its ``tolist()``); NaN for both
    when ``totals`` is None (β is 0: no KL was computed) or no token was valid.

    ``adapted_kl`` is the value β multiplies: the token-weighted mean of the shaped KL, or, under
    ``length_normalized``, the mean over completions of each completion's mean shaped KL. Where a token
    was valid, :data:`NONFINITE_KL_BATCHES` is 1 when either mean is NaN or inf, else 0.
    """
    if totals is None:
        return {RAW_KL: math.nan, ADAPTED_KL: math.nan}
    t = totals.tolist() if isinstance(totals, torch.Tensor) else totals
    tokens = t[TOKENS]
    if length_normalized:
        adapted = math.nan if tokens == 0 else t[ADAPTED_SEQ_MEAN_SUM] / max(t[COMPLETIONS], 1.0)
    else:
        adapted = token_mean(t[ADAPTED_SUM], tokens)
    values = {RAW_KL: token_mean(t[RAW_SUM], tokens), ADAPTED_KL: adapted}
    if tokens == 0:
        return values
    return {**values, NONFINITE_KL_BATCHES: float(not (math.isfinite(values[RAW_KL]) and math.isfinite(adapted)))}


def tail_values(statistics: "tail.TailStatistics | None") -> dict[str, float]:
    """The three tail metrics from :func:`tail.statistics` (NaN each when no token was observed)."""
    if statistics is None:
        return {name: math.nan for name in WINDOW_TAIL_METRICS}
    return {TOKEN_KL_MAX: statistics.maximum, TOKEN_KL_P99: statistics.p99, TOKEN_KL_TOP1PCT_SHARE: statistics.top_share}
