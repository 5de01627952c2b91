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
from dataclasses import dataclass
from typing import Callable

import torch

from .declarations import Parameter, check_user_output, declare, undeclare

Estimator = Callable[..., torch.Tensor]
logger = logging.getLogger("unsloth_adaptive_kl")


@dataclass(frozen=True)
class EstimatorSpec:
    """A registered estimator.

    ``batch_statistic`` (optional) computes, from the whole batch and *before* any chunking,
    ``batch_statistic(ref_logp, mask, **parameters)``, a detached tensor that the estimator receives as its
    ``statistic`` keyword. The result then does not depend on how a backend splits the batch into chunks.
    ``parameters``: the settings it reads, each passed by its keyword.
    """

    name: str
    fn: Estimator
    builtin: bool = False
    batch_statistic: Callable[..., torch.Tensor] | None = None
    parameters: tuple[Parameter, ...] = ()
    summary: str = ""

    def arguments(self, values: dict | None) -> dict:
        """The keyword arguments of its declared parameters, from ``values`` (name -> value; defaults for the rest)."""
        values = values or {}
        return {p.argument: values.get(p.name, p.default) for p in self.parameters}


ESTIMATORS: dict[str, EstimatorSpec] = {}
_ALIASES: dict[str, str] = {}


KIND = "KL estimator"


def register_estimator(name: str, *aliases: str, parameters: tuple[Parameter, ...] = (), batch_statistic=None, summary: str = "", _builtin: bool = False):
    """Decorator: register ``fn(logp, ref_logp, **parameters) -> per-token KL`` under ``name`` (and aliases).

    ``parameters``: its :class:`~unsloth_adaptive_kl.declarations.Parameter` s, passed by keyword (a built-in's
    are ``GRPOConfig`` fields, a registered one's are set in ``kl_shaping_kwargs``). ``batch_statistic``: see
    :class:`EstimatorSpec`. ``summary``: one line for the docs' table (the docstring's first line when empty)."""

    def decorator(fn: Estimator) -> Estimator:
        for key in (name, *aliases):
            if key in ESTIMATORS or key in _ALIASES:
                raise ValueError(f"KL estimator {key!r} is already registered")
            if "+" in key.rstrip("+") or not key:
                raise ValueError(f"KL estimator name {key!r} is not allowed: use a non-empty name without inner '+'")
        declare(KIND, name, tuple(parameters))
        summary_line = summary or (fn.__doc__ or "").strip().split("\n")[0]
        ESTIMATORS[name] = EstimatorSpec(name, fn, _builtin, batch_statistic, tuple(parameters), summary_line)
        for alias in aliases:
            _ALIASES[alias] = name
        return fn

    return decorator


def unregister_estimator(name: str) -> None:
    """Remove a user-registered estimator and its aliases (built-ins cannot be removed)."""
    spec = get_estimator(name)
    if spec.builtin:
        raise ValueError(f"KL estimator {name!r} is built in and cannot be unregistered")
    del ESTIMATORS[spec.name]
    undeclare(KIND, spec.name)
    for alias in [a for a, target in _ALIASES.items() if target == spec.name]:
        del _ALIASES[alias]


def estimator_names() -> list[str]:
    return sorted([*ESTIMATORS, *_ALIASES])


def estimator_aliases(name: str) -> tuple[str, ...]:
    """The other names of the estimator ``name``."""
    return tuple(sorted(alias for alias, target in _ALIASES.items() if target == name))


def builtin_estimator_names() -> tuple[str, ...]:
    """The built-in estimators, each by its name (no alias), in registration order."""
    return tuple(name for name, spec in ESTIMATORS.items() if spec.builtin)


def estimator_parameters(builtin: bool | None = None) -> tuple[Parameter, ...]:
    """Every registered estimator parameter once (``builtin``: only the built-ins' or only the users')."""
    seen: dict[str, Parameter] = {}
    for spec in ESTIMATORS.values():
        if builtin is None or spec.builtin == builtin:
            for parameter in spec.parameters:
                seen.setdefault(parameter.name, parameter)
    return tuple(seen.values())


def get_estimator(name: str) -> EstimatorSpec:
    key = _ALIASES.get(name, name)
    if key not in ESTIMATORS:
        raise ValueError(f"kl_estimator={name!r} is not a registered KL estimator; allowed: {estimator_names()}")
    return ESTIMATORS[key]


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


def estimate_kl(
    name: str,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    statistic: torch.Tensor | None = None,
    parameters: dict | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Run the estimator ``name``; user-registered estimators are checked and fail loudly.

    ``parameters``: the values of its declared parameters, by name (``{"kl_bottom_q": 0.3}``); defaults for the
    rest. ``statistic``: its batch statistic, computed here from ``mask`` when not given.
    ``check=False`` skips the checks of a user estimator (they synchronise with the device and break a
    ``torch.compile(fullgraph=True)`` region); the fused backends check once, eagerly, at setup.
    """
    spec = get_estimator(name)
    if mask is not None:
        # Padding may hold anything, NaN and inf included: the estimator sees 0 there and its output
        # is zeroed there (below), so neither the value nor the gradient can carry it.
        valid = mask.bool()
        ref_logp = torch.where(valid, ref_logp, 0.0)
        if spec.name != "k3":
            # Not for k3: a node between logp and TRL's two subtractions would change the order in
            # which autograd sums logp's gradient, and TRL's loss would no longer be reproduced bit for
            # bit. k3's log-ratio clamp does the same job: its backward is 0 wherever r is NaN or ±inf.
            logp = torch.where(valid, logp, 0.0)
    arguments = spec.arguments(parameters)
    missing = [p.name for p in spec.parameters if arguments[p.argument] is None]
    if missing:
        raise ValueError(f"KL estimator {spec.name!r} needs a value for {missing}; allowed: parameters={{name: value}}")
    if spec.batch_statistic is not None:
        if statistic is None:
            if mask is None:
                raise ValueError(f"KL estimator {spec.name!r} needs the completion mask for its batch statistic")
            statistic = spec.batch_statistic(ref_logp, mask, **arguments)
        arguments["statistic"] = statistic
    out = spec.fn(logp, ref_logp, **arguments)
    if check and not spec.builtin:
        _check_user_output(spec.name, out, logp, ref_logp, mask)
    return out if mask is None else torch.where(valid, out, 0.0)


def _check_user_output(name: str, out, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor | None) -> None:
    """A user estimator's output: what :func:`~unsloth_adaptive_kl.declarations.check_user_output` requires of any
    registered function (``logp``'s shape and dtype, a gradient when ``logp`` has one), and finite on every valid
    token whose log-probs are finite. A NaN or inf log-prob (the model's) is not the estimator's fault: its KL goes
    on to the metrics, which count it (``adaptive_kl/nonfinite_kl_batches``). One host sync, the finiteness test's
    (TRL's eager loss and the Liger module; Unsloth's compiled loss passes ``check=False``)."""
    check_user_output(KIND, name, out, logp)
    with torch.no_grad():
        blamed = nonfinite_on_finite_inputs(out, logp, ref_logp)
        if mask is not None:
            blamed &= mask.bool()
        count = int(blamed.sum())
    if count:
        raise nonfinite_estimator_error(name, count)


def nonfinite_on_finite_inputs(out: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Where an estimator's output is NaN or inf although both its log-probs are finite (bool): its own fault.
    Elementwise only (no value is read), so it also runs inside a compiled region."""
    return torch.isfinite(logp) & torch.isfinite(ref_logp) & ~torch.isfinite(out)


def nonfinite_estimator_error(name: str, count: int) -> ValueError:
    """The error for ``count`` valid tokens where the user estimator ``name`` was NaN or inf on finite log-probs."""
    return ValueError(
        f"KL estimator {name!r} returned NaN or inf on valid tokens whose log-probs were finite ({count} of them): the "
        "bug is in the estimator; allowed: a finite value wherever logp and ref_logp are finite"
    )


def check_user_estimator(name: str, parameters: dict | None = None) -> None:
    """Run a registered (user) estimator once, eagerly, on a small float32 batch with a gradient (log-probs in
    [-3, 0], reference log-probs around them), with every check of :func:`estimate_kl`: refused by name when the
    KL term is built, also on backends that call it with ``check=False`` inside a compiled region (Unsloth)."""
    if get_estimator(name).builtin:
        return
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(2, 5, generator=g) * 3).requires_grad_(True)
    ref_logp = logp.detach() + torch.randn(2, 5, generator=g)
    estimate_kl(name, logp, ref_logp, mask=torch.ones(2, 5, dtype=torch.bool), parameters=parameters)
