"""``KLTerm``: the per-token KL term β multiplies, as one immutable object every backend calls.

It holds the settings of the term (the parsed method, the estimator's name, the values of the
parameters of the estimator and of the shaping methods) and nothing that changes during training, so a
compiled region (Unsloth's fused loss, the Liger module's ``torch.compile``) can take it as a
constant. The order of the math is fixed: estimator, × importance ratio, the per-token shaping
methods in their registered order (:mod:`unsloth_adaptive_kl.shaping`); length normalisation acts
at aggregation (:meth:`KLTerm.length_normalized_loss`).
Pure torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .estimators import check_user_estimator, estimate_kl, get_estimator, nonfinite_on_finite_inputs
from .method import Method
from .shaping import check_user_steps, length_normalized_term, sequence_mean, shape_per_token, user_steps


#: Under ``kl_placement="reward"`` each token's KL (after the shaping) enters its completion's penalty clamped to
#: [-10, 10]: verl's clamp of k3's value (``kl_penalty``, ``low_var_kl``), here for every estimator, since in the reward
#: one token's KL lands in the advantages of its whole group (docs/kl-placement.md, "How large a penalty can be").
REWARD_KL_BOUND = 10.0


@dataclass(frozen=True)
class KLTerm:
    """The per-token KL term: its settings, already checked (``config.build`` makes one from a ``GRPOConfig``)."""

    method: Method
    estimator: str
    #: The estimator's parameters, ``((name, value), ...)`` (``bottom_q``: ``kl_bottom_q``): a constant for compilation.
    estimator_parameters: tuple[tuple[str, object], ...] = ()
    #: The method's shaping parameters, ``((name, value), ...)``: hashable, a constant for compilation.
    shaping_parameters: tuple[tuple[str, object], ...] = ()
    #: ``kl_exclude_token_ids``: the token ids whose positions get no KL term (sorted; a constant for compilation).
    exclude_token_ids: tuple[int, ...] = ()
    #: ``kl_placement``: "loss" (β·KL in the loss) or "reward" (β·KL subtracted from each reward at scoring time).
    placement: str = "loss"

    def check_user_functions(self) -> None:
        """Run the registered (user) estimator and shaping steps of this term once, eagerly, on a small batch, and
        refuse by name one that breaks a rule (:func:`~unsloth_adaptive_kl.estimators.check_user_estimator`,
        :func:`~unsloth_adaptive_kl.shaping.check_user_steps`). Built-ins are not run."""
        check_user_estimator(self.estimator, dict(self.estimator_parameters))
        check_user_steps(self.method, dict(self.shaping_parameters))

    @property
    def user_shaping_steps(self) -> tuple[str, ...]:
        """The registered (user) per-token shaping steps, in applied order: the metric sums count the tokens they
        made non-finite (:func:`~unsloth_adaptive_kl.metrics.local_kl_sums`)."""
        return user_steps(self.method)

    @property
    def length_normalized(self) -> bool:
        return self.method.length_normalized

    @property
    def is_stock(self) -> bool:
        """Method ``none`` with the ``k3`` estimator: the library's own KL term, unadapted."""
        return self.method.is_none and self.estimator == "k3"

    def batch_statistic(self, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """The estimator's batch-level statistic (e.g. bottom_q's threshold), or None. Call it on the
        whole batch before any chunking."""
        spec = get_estimator(self.estimator)
        if spec.batch_statistic is None:
            return None
        return spec.batch_statistic(ref_logp, mask, **spec.arguments(dict(self.estimator_parameters)))

    def estimate(self, logp, ref_logp, mask, statistic=None, *, check: bool = True) -> torch.Tensor:
        """The configured estimator per token (0 on masked positions); ``check=False`` inside a compiled region."""
        return estimate_kl(self.estimator, logp, ref_logp, mask=mask, statistic=statistic, parameters=dict(self.estimator_parameters), check=check)

    def estimator_faults(self, kl: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor | None:
        """Where the configured estimator's output ``kl`` (called with ``check=False``) is NaN or inf on finite log-probs
        (bool), for the metric sums to count (:data:`~unsloth_adaptive_kl.metrics.ESTIMATOR_FAULTS`); None for a built-in
        estimator (trusted: no operation is added)."""
        if get_estimator(self.estimator).builtin:
            return None
        return nonfinite_on_finite_inputs(kl, logp, ref_logp)

    def check_vocabulary(self, vocab_size: int | None) -> None:
        """Refuse ``kl_exclude_token_ids`` that do not fit a vocabulary of ``vocab_size`` tokens (None: unknown, not
        checked): an id outside it excludes nothing (a typo, another tokenizer's id), and a list that excludes every
        token leaves no KL term at all. ValueError naming the field, the ids and what is allowed."""
        if vocab_size is None or not self.exclude_token_ids:
            return
        outside = [i for i in self.exclude_token_ids if i >= vocab_size]
        if outside:
            raise ValueError(
                f"kl_exclude_token_ids={list(self.exclude_token_ids)} is not valid: {outside} are outside the model's "
                f"vocabulary of {vocab_size} tokens, so they would exclude nothing; allowed: ids from 0 to {vocab_size - 1} "
                "(check each id against the tokenizer: convert_tokens_to_ids of a token it lacks gives <unk>'s id or None)"
            )
        if len(self.exclude_token_ids) >= vocab_size:
            raise ValueError(
                f"kl_exclude_token_ids lists all {vocab_size} tokens of the model's vocabulary: no token would have a KL "
                "term; allowed: a list of some tokens (EOS, chat-template tokens), or beta=0 for no KL term"
            )

    @property
    def narrows_mask(self) -> bool:
        """Whether the KL's mask (:meth:`kl_mask`) can leave out positions of the loss's mask (``kl_exclude_token_ids``):
        then a metric over the KL's mask is not the library's own mean over the loss's."""
        return bool(self.exclude_token_ids)

    def excluded(self, token_ids: torch.Tensor) -> torch.Tensor | None:
        """Where ``token_ids`` is one of :attr:`exclude_token_ids` (bool, same shape); None when none is excluded.
        One comparison per excluded id: no tensor is made from the list, so no copy to the device and no
        graph input (the list is short: EOS, chat-template tokens)."""
        if not self.exclude_token_ids:
            return None
        hit = token_ids == self.exclude_token_ids[0]
        for token_id in self.exclude_token_ids[1:]:
            hit = hit | (token_ids == token_id)
        return hit

    def kl_mask(self, mask: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """The positions the KL term applies to: ``mask`` without the excluded tokens' (``mask`` itself when none is)."""
        excluded = self.excluded(token_ids)
        return mask if excluded is None else torch.where(excluded, torch.zeros_like(mask), mask)

    def without_excluded(self, kl: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """``kl`` with 0 at the excluded tokens' positions (``kl`` itself when none is)."""
        excluded = self.excluded(token_ids)
        return kl if excluded is None else torch.where(excluded, 0.0, kl)

    def shape(self, kl: torch.Tensor) -> torch.Tensor:
        """The per-token shaping steps of the method, in their order."""
        return shape_per_token(kl, self.method, dict(self.shaping_parameters))

    def per_token(
        self,
        logp: torch.Tensor,
        ref_logp: torch.Tensor,
        mask: torch.Tensor,
        coef: torch.Tensor | None = None,
        statistic: torch.Tensor | None = None,
        estimator: Callable[..., torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(raw, adapted)`` per-token KL.

        ``raw`` is the estimator times ``coef`` (the importance ratio when the backend applies
        ``use_bias_correction_kl``); ``adapted`` is ``raw`` after the per-token shaping. ``estimator``
        (``fn(logp, ref_logp, *, mask, statistic)``) replaces the configured one, e.g. a loss
        module's overridden KL function.
        """
        if estimator is None:
            raw = self.estimate(logp, ref_logp, mask, statistic)
        else:
            raw = estimator(logp, ref_logp, mask=mask, statistic=statistic)
        if coef is not None:
            raw = raw * coef
        adapted = self.shape(raw)
        if self.exclude_token_ids:  # ``mask`` is then kl_mask's: an excluded token has no KL term (shape(0) may not be 0)
            valid = mask.bool()
            raw, adapted = torch.where(valid, raw, 0.0), torch.where(valid, adapted, 0.0)
        return raw, adapted

    @staticmethod
    def length_normalized_loss(adapted, mask, *, beta, num_completions, accumulation=1) -> torch.Tensor:
        """The KL part of the loss under ``length_normalized``, for this shard (or chunk):
        ``beta * mean_i(mean_t adapted_it) / accumulation`` over ``num_completions`` completions.

        ``accumulation`` is the gradient-accumulation divisor the backend applies to its own loss
        (1 where the backend divides the whole loss afterwards)."""
        return beta * length_normalized_term(adapted, mask, num_completions) / accumulation

    def reward_penalty(self, adapted: torch.Tensor, mask: torch.Tensor, *, beta: float) -> torch.Tensor:
        """The amount ``kl_placement="reward"`` subtracts from each completion's reward, ``(B,)`` float64,
        detached: ``beta * sum_t c(adapted_t)`` over its valid tokens, or under ``length_normalized``
        ``beta * mean_t c(adapted_t)`` (0 for a completion with no valid token), with ``c`` the clamp to
        ±:data:`REWARD_KL_BOUND` of a finite value (NaN and inf stay: the caller counts such a penalty)."""
        with torch.no_grad():
            adapted = adapted.double()
            adapted = torch.where(torch.isfinite(adapted), adapted.clamp(-REWARD_KL_BOUND, REWARD_KL_BOUND), adapted)
            adapted = torch.where(mask.bool(), adapted, 0.0)
            per_completion = sequence_mean(adapted, mask) if self.length_normalized else adapted.sum(-1)
            return beta * per_completion


def kl_dominated_groups(rewards: torch.Tensor, penalty: torch.Tensor, num_generations: int) -> tuple[int, tuple[float, float]]:
    """How many groups of ``num_generations`` completions have a spread (max - min) of finite penalties larger than the
    spread of their task rewards (``rewards``, NaN: unscored, left out of both), among groups whose rewards differ (a
    group of equal rewards has no task signal to lose); and, for the group with the largest ratio, its two spreads."""
    reward_spread, penalty_spread = _group_spreads(rewards, penalty, num_generations)
    dominated = (reward_spread > 0) & (penalty_spread > reward_spread)
    if not dominated.any():
        return 0, (0.0, 0.0)
    ratio = torch.where(dominated, penalty_spread / reward_spread, -1.0)
    worst = int(ratio.argmax())
    return int(dominated.sum()), (penalty_spread[worst].item(), reward_spread[worst].item())


def kl_only_groups(rewards: torch.Tensor, penalty: torch.Tensor, num_generations: int) -> int:
    """How many groups of ``num_generations`` completions have equal task rewards (two or more scored, NaN left out)
    and finite penalties that differ: stock GRPO gives such a group advantage 0, while with the penalty in the reward
    the KL alone sets its advantages (which the group's standard deviation scales to unit size, whatever β)."""
    reward_spread, penalty_spread = _group_spreads(rewards, penalty, num_generations)
    return int(((reward_spread == 0) & (penalty_spread > 0)).sum())  # a penalty spread > 0 has two or more scored


def _group_spreads(rewards: torch.Tensor, penalty: torch.Tensor, num_generations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's spread (max - min) of task rewards and of penalties, over the same completions: those with a
    reward (NaN: unscored) and a finite penalty."""
    scored = ~torch.isnan(rewards) & torch.isfinite(penalty)
    r = torch.where(scored, rewards.double(), torch.nan).reshape(-1, num_generations)
    p = torch.where(scored, penalty.double(), torch.nan).reshape(-1, num_generations)
    return _nan_spread(r), _nan_spread(p)


def _nan_spread(x: torch.Tensor) -> torch.Tensor:
    """max - min over the last dimension, NaN left out (0 for a row with fewer than two values)."""
    kept = ~torch.isnan(x)
    high = torch.where(kept, x, -torch.inf).amax(-1)
    low = torch.where(kept, x, torch.inf).amin(-1)
    return torch.where(kept.sum(-1) >= 2, high - low, 0.0)
