"""Per-token KL estimators and their registry.

Every estimator takes the per-token log-probabilities of the sampled tokens under the policy
(``logp``) and under the reference model (``ref_logp``), both shaped ``(B, T)``, and returns a
per-token estimate of ``KL(policy || reference)`` of the same shape. Tokens are sampled from
the policy, so with ``r = ref_logp - logp`` (log of ``pi_ref / pi``):

==========  ======================================  =========================================
name        value                                   notes
==========  ======================================  =========================================
``k1``      ``-r = logp - ref_logp``                unbiased, high variance, can be negative
``k2``      ``r**2 / 2``                            biased, low variance, always >= 0
``k3``      ``exp(r) - r - 1``                      unbiased, low variance, always >= 0
``abs``     ``|r|``                                 biased, always >= 0
``k1+``     value of k1, gradient of k2             straight-through (see :func:`k1_plus`)
``k3+``     value of k3, gradient of k2             straight-through
``bottom_q``  k3 on the lowest-q reference tokens    needs a batch statistic (see below)
==========  ======================================  =========================================

Source for k1/k2/k3: John Schulman, "Approximating KL Divergence" (2020),
http://joschu.net/blog/kl-approx.html. ``k3`` is written exactly as TRL's GRPO trainer
writes it, ``exp(ref - logp) - (ref - logp) - 1``, so that swapping it in is bit-identical.

Register your own with :func:`register_estimator`, declaring its parameters as shaping methods and
β controllers do (:class:`~unsloth_adaptive_kl.declarations.Parameter`)::

    @register_estimator("my_kl", parameters=(Parameter("kl_power", default=1.5, keyword="power"),))
    def my_kl(logp, ref_logp, *, power):
        return (logp - ref_logp).abs() ** power

Every estimator is called the same way: ``fn(logp, ref_logp, **parameters)``, its declared parameters by
keyword, and ``statistic=`` besides for one with a batch statistic (``bottom_q``: its ``q`` is the declared
parameter ``kl_bottom_q``).

Estimators registered by users are checked once when the KL term is built and on every eager call
(shape, dtype, gradient, and finiteness on valid tokens whose log-probs are finite); built-in ones
are trusted.
"""

from __future__ import annotations

import logging

import torch

from .declarations import Parameter
from .estimator_registry import (  # noqa: F401  the registry's names, as this module has always offered them
    ESTIMATORS,
    KIND,
    Estimator,
    EstimatorSpec,
    builtin_estimator_names,
    check_user_estimator,
    estimate_kl,
    estimator_aliases,
    estimator_names,
    estimator_parameters,
    get_estimator,
    nonfinite_estimator_error,
    nonfinite_on_finite_inputs,
    register_estimator,
    unregister_estimator,
)

logger = logging.getLogger("unsloth_adaptive_kl")


@register_estimator("k1", _builtin=True)
def k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log(pi / pi_ref): the naive unbiased estimator (Schulman 2020)."""
    return logp - ref_logp


@register_estimator("k2", "mse", "squared", _builtin=True)
def k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * (log pi_ref - log pi)^2 (Schulman 2020).

    Also the "squared" variant of the seed project: ``0.5 * (ref - logp)^2``.
    """
    return 0.5 * (ref_logp - logp) ** 2


K3_LOG_RATIO_BOUND = 20.0


@register_estimator("k3", "low_var_kl", _builtin=True)
def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(r) - r - 1 with r = log pi_ref - log pi (Schulman 2020), r clamped to [-20, 20].

    Written in TRL's form, ``exp(ref - logp) - (ref - logp) - 1``, so that it reproduces TRL's GRPO
    loss bit for bit wherever ``|r| <= 20``. The clamp (verl's and Unsloth's bound on the log-ratio)
    keeps ``exp`` finite: unclamped, ``r > 88.7`` overflows float32 to inf. Beyond the bound the value
    is that of ``r = ±20`` and the gradient is 0. verl and Unsloth also clamp the value to [-10, 10];
    that is not done here (it would change TRL's loss for every token with ``r > 2.6``).
    """
    bound = K3_LOG_RATIO_BOUND
    return torch.exp((ref_logp - logp).clamp(-bound, bound)) - (ref_logp - logp).clamp(-bound, bound) - 1


@register_estimator("abs", _builtin=True)
def abs_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """|log pi - log pi_ref|: the absolute log-ratio, a biased non-negative KL proxy."""
    return (logp - ref_logp).abs()


def _straight_through_k2(value: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    surrogate = k2(logp, ref_logp)
    return surrogate - surrogate.detach() + value.detach()


@register_estimator("k1+", _builtin=True)
def k1_plus(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Forward value of k1, gradient of k2 (straight-through), as in verl's ``kl_penalty("k1+")``.

    Why: used as a per-token *loss* on samples from pi, k2's gradient is
    ``E_pi[(log pi - log pi_ref) grad log pi]`` summed over the tokens: the per-state part of the reverse KL's
    gradient (not all of it: docs/kl-gradients.md), whereas k1's gradient ``E_pi[grad log pi]`` is 0 in
    expectation. The straight-through form keeps the reported value of the chosen estimator and takes the gradient
    of k2, with the importance-ratio correction off (under TRL's ``use_bias_correction_kl=True`` the ratio's own
    gradient is added: docs/estimators.md).
    """
    return _straight_through_k2(k1(logp, ref_logp), logp, ref_logp)


@register_estimator("k3+", _builtin=True)
def k3_plus(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Forward value of k3, gradient of k2 (straight-through); see :func:`k1_plus` for why."""
    return _straight_through_k2(k3(logp, ref_logp), logp, ref_logp)


def bottom_q_threshold(ref_logp: torch.Tensor, mask: torch.Tensor, *, q: float) -> torch.Tensor:
    """The :func:`bottom_q_count`-th smallest reference log-prob over the valid tokens of the batch the
    backend gives it (detached): the tokens at or below it get the KL.

    That batch is one loss call's: on TRL's and Unsloth's loss a micro-batch of one process, on the
    Liger module the batch of its forward call; never the whole generation batch nor all processes.
    Where it selects a fraction of the valid tokens other than ``q`` (too few tokens, ``q * N < 1``,
    or tied reference log-probs at the threshold), the 1/q scale no longer keeps the mean on k3's
    scale: :func:`warn_bottom_q_selection` says so, once.

    One host sync: the number of valid tokens (boolean indexing), which sets k. The count of selected
    tokens for the warning adds none: where the warning is certain from the counts alone (``q * N`` too
    small) it is read then, once per process; otherwise it is copied without waiting and checked at the
    next call, after that call's own sync (a tie at the threshold is warned one call late)."""
    valid = ref_logp.detach()[mask.bool()]
    _check_pending_selection()  # the previous call's count: finished by the sync above
    if valid.numel() == 0:
        return torch.tensor(float("-inf"), dtype=ref_logp.dtype, device=ref_logp.device)
    # torch.quantile refuses inputs above 2**24 elements, kthvalue does not.
    count = bottom_q_count(q, valid.numel())
    threshold = valid.kthvalue(count).values
    if not _warned_bottom_q:
        selected = (valid <= threshold).sum()
        if bottom_q_inflation(count, valid.numel(), q) >= BOTTOM_Q_INFLATION_WARNING:  # warns whatever the ties
            warn_bottom_q_selection(int(selected), valid.numel(), q)
        else:
            _defer_selection(selected, valid.numel(), q)
    return threshold


#: Selected fraction / q beyond which :func:`warn_bottom_q_selection` warns.
BOTTOM_Q_INFLATION_WARNING = 1.5
_warned_bottom_q = False
#: The last call's selected count not yet checked: ``(count on the host, CUDA event of its copy or None, N, q)``.
_pending_selection = None


def _defer_selection(selected: torch.Tensor, num_tokens: int, q: float) -> None:
    """Copy ``selected`` to the host without waiting; :func:`_check_pending_selection` reads it later. A count
    not yet checked is kept (the new one is dropped), so that no count goes unchecked for ever."""
    global _pending_selection
    if _pending_selection is not None:
        return
    done = None
    if selected.is_cuda:
        stream = torch.cuda.current_stream(selected.device)  # the copy's stream (not the current device's)
        selected = selected.to("cpu", non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    _pending_selection = (selected, done, num_tokens, q)


def _check_pending_selection() -> None:
    """Warn from the deferred count once its copy has finished (never waits for it)."""
    global _pending_selection
    if _pending_selection is None:
        return
    selected, done, num_tokens, q = _pending_selection
    if done is not None and not done.query():
        return
    _pending_selection = None
    warn_bottom_q_selection(int(selected), num_tokens, q)


def bottom_q_inflation(selected: int, num_tokens: int, q: float) -> float:
    """How many times the mean of ``bottom_q`` over the batch exceeds the mean k3 of its selected tokens:
    ``selected / (q * num_tokens)`` (1 when exactly a fraction q is selected)."""
    return selected / (q * num_tokens)


def warn_bottom_q_selection(selected: int, num_tokens: int, q: float) -> None:
    """Warn once per process when ``bottom_q`` selects far more than a fraction ``q`` of the valid tokens."""
    global _warned_bottom_q
    inflation = bottom_q_inflation(selected, num_tokens, q)
    if _warned_bottom_q or inflation < BOTTOM_Q_INFLATION_WARNING:
        return
    _warned_bottom_q = True
    why = "tied reference log-probs at the threshold" if selected > bottom_q_count(q, num_tokens) else f"q * N = {q * num_tokens:.3g} < 1"
    logger.warning(
        "unsloth_adaptive_kl: bottom_q selected %d of %d valid tokens (%s) where kl_bottom_q=%s asks for a fraction %s: "
        "scaled by 1/q, the batch's KL is %.3g times the mean k3 of the selected tokens, not on k3's scale. The threshold "
        "is taken per loss call (a micro-batch of one process): use more tokens per micro-batch or a larger kl_bottom_q "
        "(warned once)", selected, num_tokens, why, q, q, inflation,
    )


def bottom_q_count(q: float, num_tokens: int) -> int:
    """How many of ``num_tokens`` valid tokens ``bottom_q`` selects: ``floor(q * N)``, at least 1.

    The seed project's variant 1. The product is taken on ``q`` as written in decimal (its shortest
    repr, ``0.28``), exactly: ``0.28 * 25`` is 7, not ``7.000000000000001`` (nor ``0.57 * 100``
    ``56.99999999999999``), so a whole product is never moved by float rounding.
    """
    mantissa, _, exponent = repr(float(q)).partition("e")  # q = digits / 10**scale, exactly
    whole, _, decimals = mantissa.partition(".")
    digits, scale = int(whole + decimals), len(decimals) - int(exponent or 0)
    count = digits * num_tokens // 10**scale if scale >= 0 else digits * num_tokens * 10**-scale
    return max(1, min(num_tokens, count))


def bottom_q(logp: torch.Tensor, ref_logp: torch.Tensor, *, statistic: torch.Tensor, q: float) -> torch.Tensor:
    """k3 on the tokens whose reference log-prob lies in the lowest ``q`` fraction, scaled by 1/q.

    The seed project's variant 1. ``statistic`` is :func:`bottom_q_threshold` of the batch of the loss
    call (valid tokens only, detached), so the result does not depend on chunking within it. Dividing
    by ``q`` keeps the batch mean on the scale of the selected tokens' mean k3 only where a fraction q
    of the tokens is selected; with few or tied tokens it is inflated (warned once, see
    :func:`warn_bottom_q_selection`).
    """
    selected = ref_logp <= statistic.to(ref_logp.dtype)
    return torch.where(selected, k3(logp, ref_logp) / q, torch.zeros_like(logp))


#: The smallest ``kl_bottom_q``: ``bottom_q`` scales the selected tokens' KL by 1 / q, at most 100x.
MIN_BOTTOM_Q = 0.01
BOTTOM_Q = Parameter(
    "kl_bottom_q",
    default=0.2,
    check=lambda q: MIN_BOTTOM_Q <= q <= 1,
    allowed=f"a number in [{MIN_BOTTOM_Q}, 1] (bottom_q scales the KL by 1 / q)",
    help="'bottom_q' estimator: the fraction [0.01, 1] of valid tokens, lowest reference log-prob first, that get "
    "the KL (scaled by 1 / kl_bottom_q, so at most 100x).",
    keyword="q",
)
register_estimator(
    "bottom_q",
    parameters=(BOTTOM_Q,),
    batch_statistic=bottom_q_threshold,
    summary="k3 on the valid tokens whose reference log-prob lies in the lowest kl_bottom_q fraction, scaled by 1 / kl_bottom_q.",
    _builtin=True,
)(bottom_q)
