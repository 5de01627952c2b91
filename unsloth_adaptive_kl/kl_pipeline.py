"""The KL pipeline: from the policy's and the reference's log-probs to what the loss, the reward and the metrics
take, with every feature decided here, once.

One micro-batch (or one generation batch, for the reward)::

    exclusions (KLTerm.kl_mask)  ->  estimator, × importance ratio, shaping (KLTerm.per_token)
      ->  the loss: β·adapted per token, before the library aggregates (TokenKL.per_token_loss),
          or the length-normalised term after aggregation (TokenKL.after_aggregation, after_aggregation_term)
      or  the reward: each completion's penalty (scoring_kl, kl_placement="reward")
      ->  the metric sums (metrics.local_metric_sums, metrics.local_kl_sums)

Which of these a batch does is one :class:`KLPlan`, made by :func:`plan_kl` from β, the placement, ``kl_monitor``
and whether its generation batch scored the reference. A backend is an adapter: it takes the tensors out of its
library, calls these functions, and adds back what they return; it reads neither the placement, nor ``kl_monitor``,
nor ``length_normalized``. Pure torch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from . import metrics
from .kl_term import KLTerm


@dataclass(frozen=True)
class KLPlan:
    """What one batch does with the KL, decided once (:func:`plan_kl`).

    ``computes_kl``: the KL is computed (β != 0, or at β = 0 on a batch ``kl_monitor`` watches). ``beta``: the
    controller's β now. ``in_loss``: the placement puts β·KL in the loss (``kl_placement="loss"``; under "reward" it
    is subtracted from the rewards at scoring time). ``per_token``: the form of the loss term, per token before the
    library's aggregation, or (``length_normalized``) one term after it; a constant of the KL term. ``grad_switch``:
    the KL may be computed while β is 0 (``kl_monitor``), so a compiled loss keeps it out of the gradient with a tensor
    flag rather than a new graph."""

    computes_kl: bool
    beta: float
    in_loss: bool
    per_token: bool
    grad_switch: bool

    @property
    def loss_beta(self) -> float:
        """The weight of the KL in the loss: β, or 0.0 where the placement puts the KL in the reward."""
        return self.beta if self.in_loss else 0.0

    @property
    def with_grad(self) -> bool:
        """Whether the KL has a gradient (β != 0); at β = 0 (``kl_monitor``) it reaches the metrics only."""
        return self.beta != 0.0

    @property
    def enters_loss(self) -> bool:
        return self.computes_kl and self.loss_beta != 0.0

    @property
    def adds_per_token(self) -> bool:
        """β·adapted enters the per-token loss, which the library aggregates."""
        return self.enters_loss and self.per_token

    @property
    def adds_after_aggregation(self) -> bool:
        """The length-normalised term is added to the aggregated loss."""
        return self.enters_loss and not self.per_token

    @property
    def feeds_controller(self) -> bool:
        """Whether the loss's KL sums feed the β controller (under "reward" the scoring-time sums do)."""
        return self.in_loss

    @property
    def penalizes_reward(self) -> bool:
        """Whether each completion's reward loses β·KL at scoring time (not at β = 0: a monitored batch is watched only)."""
        return self.computes_kl and not self.in_loss and self.beta != 0.0


def plan_kl(term: KLTerm, *, beta: float, monitor: bool, reference_scored: bool) -> KLPlan:
    """The plan of one batch: ``beta`` the controller's β, ``monitor`` ``kl_monitor``, ``reference_scored`` whether the
    batch carries the reference's log-probs (at β = 0 only a batch ``kl_monitor`` watched has them)."""
    beta = float(beta)
    return KLPlan(
        computes_kl=beta != 0.0 or (monitor and reference_scored),
        beta=beta,
        in_loss=term.placement == "loss",
        per_token=not is_after_aggregation(term),
        grad_switch=monitor,
    )


#: The features that edit the library's generation (``_generate_and_score_completions``), by the names errors use:
#: kl_monitor's reference forward at β = 0, and the reward placement's penalty at scoring time.
KL_MONITOR = "kl_monitor"
REWARD_PENALTY = "kl_placement='reward'"


def generation_edits(term: KLTerm, *, monitor: bool) -> frozenset[str]:
    """Which features of the generation a run needs (:data:`KL_MONITOR`, :data:`REWARD_PENALTY`): decided here, once,
    from ``kl_monitor`` and the placement; the backends install, check and run the edits these name."""
    return frozenset(name for name, on in ((KL_MONITOR, monitor), (REWARD_PENALTY, term.placement == "reward")) if on)


def scores_reference(plan_beta: float, *, monitor: bool, monitored_batch: Callable[[], bool]) -> bool:
    """Whether a generation batch scores the reference (its log-probs feed the KL): while β != 0, and at β = 0 under
    ``kl_monitor`` on the batches ``monitored_batch()`` selects (called only then)."""
    return plan_beta != 0.0 or (monitor and monitored_batch())


@dataclass(frozen=True)
class TokenKL:
    """The per-token KL of one micro-batch and what it adds to an eager loss (:func:`token_kl` makes it).

    ``raw``: the estimator (× importance ratio), for the library's own ``kl`` metric; ``adapted``: after the shaping;
    ``mask``: the loss's; ``kl_mask``: ``mask`` without the ``kl_exclude_token_ids`` positions."""

    plan: KLPlan
    raw: torch.Tensor
    adapted: torch.Tensor
    mask: torch.Tensor
    kl_mask: torch.Tensor

    def per_token_loss(self, per_token_loss: torch.Tensor) -> torch.Tensor:
        """``per_token_loss`` with β·adapted added where the plan puts the KL there (the library's own line's form)."""
        if not self.plan.adds_per_token:
            return per_token_loss
        return per_token_loss + self.plan.loss_beta * self.adapted

    def after_aggregation(self, loss: torch.Tensor, *, accumulation: Callable[[], float]) -> torch.Tensor:
        """``loss`` (aggregated) with the length-normalised term added where the plan puts it there; ``accumulation()``:
        the divisor the library applies to its own loss (read only then)."""
        if not self.plan.adds_after_aggregation:
            return loss
        return loss + KLTerm.length_normalized_loss(
            self.adapted, self.kl_mask, beta=self.plan.loss_beta, num_completions=self.mask.shape[0], accumulation=accumulation()
        )


def kl_positions(term: KLTerm, mask, token_ids, *, needs: str = ""):
    """The pipeline's first step, which every loss runs (eager and compiled): the positions the KL term applies to,
    ``mask`` without the ``kl_exclude_token_ids`` positions (:meth:`KLTerm.kl_mask`; ``mask`` itself when none is
    excluded). ``token_ids``: the completion tokens, shaped as ``mask``. Only Python constants decide, so inside a
    compiled loss it adds no graph break and no recompile. Without exclusions ``token_ids`` is not read (None allowed);
    with them, None or another shape is refused (ValueError, ``needs`` saying how the caller passes them)."""
    if term.exclude_token_ids:
        _check_token_ids(term, token_ids, tuple(mask.shape), needs)
    return mask if token_ids is None else term.kl_mask(mask, token_ids)


def _check_token_ids(term: KLTerm, token_ids, shape: tuple | None, needs: str) -> None:
    """The exclusion step's one refusal: ``kl_exclude_token_ids`` set and ``token_ids`` missing (or, where ``shape`` is
    given, shaped otherwise): ValueError naming the field, what it needs and ``needs`` (how the caller passes them)."""
    if token_ids is not None and (shape is None or tuple(token_ids.shape) == shape):
        return
    got = None if token_ids is None else tuple(token_ids.shape)
    shaped = f", shaped as the mask {shape}" if shape is not None else ""
    raise ValueError(f"kl_exclude_token_ids={list(term.exclude_token_ids)} needs the completion tokens{shaped}; got {got}{needs}")


def kl_keep(term: KLTerm, token_ids, *, needs: str = ""):
    """Where the KL term applies apart from the mask (bool, shaped as ``token_ids``), or None where everywhere: the
    exclusion step as a factor, for a loss that multiplies its masks (the Liger module). None or not, a constant of
    the term, so a compiled loss taking it as an input compiles once. ``token_ids`` None is refused where they are
    read (ValueError, ``needs`` saying how the caller passes them)."""
    if not term.exclude_token_ids:
        return None
    _check_token_ids(term, token_ids, None, needs)
    return ~term.excluded(token_ids)


def adapted_in_graph(term: KLTerm, raw, token_ids):
    """``(raw, adapted)`` of a compiled loss that masks afterwards (Unsloth's fused loss): the shaping of ``raw``
    (:meth:`KLTerm.shape`), then both without the ``kl_exclude_token_ids`` positions' KL
    (:meth:`KLTerm.without_excluded`; unchanged when none is). ``token_ids``: the completion tokens, reshaped to
    ``raw``'s shape. Python constants only: no graph break, no recompile."""
    adapted = term.shape(raw)
    token_ids = token_ids.reshape(raw.shape)
    return term.without_excluded(raw, token_ids), term.without_excluded(adapted, token_ids)


def token_kl(term: KLTerm, plan: KLPlan, logp, ref_logp, mask, token_ids, coef=None, statistic=None, estimator=None) -> TokenKL | None:
    """The per-token KL of an eager loss, or None where the plan computes none: the exclusions, then
    :meth:`KLTerm.per_token`. At β = 0 (``kl_monitor``) without an autograd graph: the KL reaches only the metrics."""
    if not plan.computes_kl:
        return None
    kl_mask = kl_positions(term, mask, token_ids)
    with contextlib.nullcontext() if plan.with_grad else torch.no_grad():
        raw, adapted = term.per_token(logp, ref_logp, kl_mask, coef, statistic, estimator)
    return TokenKL(plan, raw, adapted, mask, kl_mask)


def after_aggregation_term(term: KLTerm, adapted, kl_mask, *, beta, num_completions, accumulation=1):
    """The loss term added after aggregation (:meth:`KLTerm.length_normalized_loss`), or None where the term's form is
    per token. The form is a constant of the term, so a compiled loss (Unsloth's fused loss, the Liger module) guards
    on it once; ``beta`` (a tensor there, 0 under ``kl_placement="reward"``) weighs it."""
    if not is_after_aggregation(term):
        return None
    return KLTerm.length_normalized_loss(adapted, kl_mask, beta=beta, num_completions=num_completions, accumulation=accumulation)


def is_after_aggregation(term: KLTerm) -> bool:
    """The form of the loss term, a constant of the KL term: one term after aggregation (``length_normalized``)."""
    return term.length_normalized


def loss_term(term: KLTerm, adapted, kl_tokens, *, beta, num_completions, aggregate: Callable[[torch.Tensor], torch.Tensor]):
    """The KL part of a loss that aggregates it itself (the Liger module): the length-normalised term, or
    ``beta * aggregate(adapted)`` with the loss type's aggregation. ``beta`` is a tensor inside a compiled loss."""
    after = after_aggregation_term(term, adapted, kl_tokens, beta=beta, num_completions=num_completions)
    return after if after is not None else beta * aggregate(adapted)


@dataclass(frozen=True)
class ScoringKL:
    """The KL of a generation batch at scoring time: ``sums`` (:func:`metrics.local_kl_sums`, None where not
    observed), ``penalty`` (each completion's, ``(B,)`` float64; None where the rewards stay the library's), and the
    adapted KL and mask the penalty came from."""

    sums: torch.Tensor | None
    penalty: torch.Tensor | None
    adapted: torch.Tensor
    kl_mask: torch.Tensor


def scoring_kl(term: KLTerm, plan: KLPlan, logp, ref_logp, mask, token_ids, *, observed: bool) -> ScoringKL | None:
    """``kl_placement="reward"``: the KL at scoring time (exclusions, estimator, shaping, without a graph), its sums
    for the controller where ``observed`` (a training batch seen for the first time), and the completions' penalties
    (:meth:`KLTerm.reward_penalty`) where the plan penalises the reward. None where the plan computes no KL."""
    if not plan.computes_kl:
        return None
    kl_mask = kl_positions(term, mask, token_ids, needs=" (the sampled token ids at scoring time, kl_placement='reward')")
    with torch.no_grad():
        raw, adapted = term.per_token(logp, ref_logp, kl_mask, None, term.batch_statistic(ref_logp, kl_mask))
        sums = metrics.local_kl_sums(raw, adapted, kl_mask, count_shaping_faults=bool(term.user_shaping_steps)) if observed else None
        penalty = term.reward_penalty(adapted, kl_mask, beta=plan.beta) if plan.penalizes_reward else None
    return ScoringKL(sums, penalty, adapted, kl_mask)


__all__ = [
    "KL_MONITOR", "REWARD_PENALTY", "generation_edits", "scores_reference", "KLPlan", "ScoringKL", "TokenKL", "adapted_in_graph", "after_aggregation_term", "is_after_aggregation", "kl_keep", "kl_positions", "loss_term", "plan_kl", "scoring_kl",
    "token_kl",
]  # fmt: skip
