"""The ``adaptive_kl/*`` metrics: names, local sums, and the global means made from them.

A backend computes :func:`local_kl_sums` on its shard of the batch, sums them across processes
(one ``reduce`` of one small tensor), and turns the totals into metric values with
:func:`metric_values`. Token-weighted means over all processes, like TRL's own ``kl``.
"""

from __future__ import annotations

import math

import torch

from .shaping import sequence_mean

RAW_KL = "adaptive_kl/raw_kl"
ADAPTED_KL = "adaptive_kl/adapted_kl"
CURRENT_BETA = "adaptive_kl/current_beta"
SKIPPED_UPDATES = "adaptive_kl/skipped_updates"
METRIC_NAMES = (RAW_KL, ADAPTED_KL, CURRENT_BETA, SKIPPED_UPDATES)
#: Logged as their latest value in the logging window, not averaged over it: the β of the window's
#: last step (an average of several steps' β is a β no step used) and a running count.
LATEST_VALUE_METRICS = (CURRENT_BETA, SKIPPED_UPDATES)

# Layout of the sums tensor.
RAW_SUM, ADAPTED_SUM, TOKENS, ADAPTED_SEQ_MEAN_SUM, COMPLETIONS = range(5)
NUM_SUMS = 5


def local_kl_sums(raw: torch.Tensor, adapted: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sums over this shard's valid tokens, as one float64 tensor of 5 values (see the layout above).

    ``where`` rather than a product keeps NaN or inf on masked positions out of the sums.
    """
    with torch.no_grad():
        valid = mask.bool()
        zero = torch.zeros((), dtype=raw.dtype, device=raw.device)
        return torch.stack(
            [
                torch.where(valid, raw, zero).sum().double(),
                torch.where(valid, adapted, zero).sum().double(),
                valid.sum().double(),
                sequence_mean(adapted.double(), mask).sum(),
                torch.ones_like(valid.sum(-1), dtype=torch.float64).sum(),  # rows (also when T = 0); no Python float, so it compiles
            ]
        )


def metric_values(totals: torch.Tensor, *, length_normalized: bool) -> dict[str, float]:
    """Global metric values from summed :func:`local_kl_sums`.

    ``adapted_kl`` is the value β multiplies: the token-weighted mean of the shaped KL, or, under
    ``length_normalized``, the mean over completions of each completion's mean shaped KL.
    """
    t = totals.tolist()
    if t[TOKENS] == 0:  # no valid token anywhere: no KL was observed (NaN, which the trainer logs as missing), not 0
        return {RAW_KL: math.nan, ADAPTED_KL: math.nan}
    tokens = t[TOKENS]
    adapted = t[ADAPTED_SEQ_MEAN_SUM] / max(t[COMPLETIONS], 1.0) if length_normalized else t[ADAPTED_SUM] / tokens
    return {RAW_KL: t[RAW_SUM] / tokens, ADAPTED_KL: adapted}
