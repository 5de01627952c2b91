"""Shaping of the per-token KL term: the registry of methods, the built-in ones, and the grammar of
``kl_adaptation_method``.

Shaping acts on the per-token KL term that β multiplies, *before* the loss aggregates it, so it
changes the gradient, not only a logged number. A method is registered with
:func:`register_shaping`, which declares its name, where it applies in the order, its parameters
and whether it acts per token or on the aggregation::

    @register_shaping("half_kl")
    def half_kl(kl):
        return 0.5 * kl

Everything that lists methods or their parameters (the ``GRPOConfig`` fields, :class:`KLTerm`,
the Liger module's keyword arguments, the README's method table, the tests) reads this registry.

The order is fixed by each method's ``order``, whatever order the user writes the ``+``-joined
names in. The built-ins:

==================  =====  ============================================================================
method              order  what it does to the per-token KL ``kl_t`` (after the estimator and, with
                           ``use_bias_correction_kl``, the importance ratio)
==================  =====  ============================================================================
``clip``            10     hard cap ``min(kl_t, c)``, ``c = kl_clip_threshold``: no gradient above it
``soft_clip``       20     smooth cap ``c * tanh(kl_t / c)``, ``c = kl_clip_threshold``: below ``c``
                           always, about ``kl_t`` well below it, gradient ``1 - tanh^2`` -> 0 above it
``sigmoid``         30     ``sigmoid(kl_t - kl_target) * kl_t`` (the seed fork's formula): damps the
                           tokens whose KL is near or below ``kl_target`` (about ``kl_t / 2`` as
                           ``kl_t`` -> 0) and caps nothing (``-> kl_t`` for large ``kl_t``)
``length_normalized``  aggregation: each completion's KL counts as its per-token mean, whatever the
                           loss type: the KL part of the loss is ``beta * mean_i(mean_t kl_it)``
==================  =====  ============================================================================

A method registered without ``order`` applies at 50: after the built-in per-token methods.
At most one β controller (``dynamic`` or ``target``) may be joined with any shaping methods,
e.g. ``"dynamic+length_normalized"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

CONTROLLERS = ("dynamic", "target")
#: Where a method registered without ``order`` applies: after the built-in per-token methods.
DEFAULT_ORDER = 50


def _finite_positive(value) -> bool:
    return math.isfinite(value) and value > 0


@dataclass(frozen=True)
class Parameter:
    """A parameter of a shaping method.

    ``name`` is how the user sets it: a ``GRPOConfig`` field for the built-ins' parameters, a key of
    ``kl_shaping_kwargs`` for those of methods registered later (docs/methods.md, "Your own shaping method").
    ``keyword`` is the keyword the method's function receives it as (``name`` when None). ``check``
    returns whether a value (already of ``type``) is allowed; ``allowed`` says what is, in words.
    """

    name: str
    type: type = float
    default: object = None
    check: Callable[[object], bool] | None = None
    allowed: str = "a finite number"
    help: str = ""
    keyword: str | None = None

    @property
    def argument(self) -> str:
        return self.keyword or self.name


@dataclass(frozen=True)
class ShapingMethod:
    """A registered shaping method. ``per_token``: ``fn(kl, **parameters) -> shaped kl`` of the same
    shape; otherwise it acts on the aggregation (the built-in ``length_normalized`` only)."""

    name: str
    fn: Callable[..., torch.Tensor] | None
    order: float
    parameters: tuple[Parameter, ...]
    per_token: bool
    summary: str
    builtin: bool


SHAPING: dict[str, ShapingMethod] = {}


def register_shaping(
    name: str,
    *,
    order: float = DEFAULT_ORDER,
    parameters: tuple[Parameter, ...] = (),
    per_token: bool = True,
    summary: str = "",
    _builtin: bool = False,
):
    """Decorator: register the per-token shaping ``fn(kl, **parameters) -> shaped kl`` under ``name``.

    ``order``: where it applies among the methods joined with ``+`` (lower first; built-ins: clip 10,
    soft_clip 20, sigmoid 30). ``parameters``: its :class:`Parameter` s (a parameter already
    registered, e.g. ``kl_clip_threshold``, may be reused by naming it with the same declaration).
    ``summary``: one line for the method table (the docstring's first line when empty).
    """
    if not isinstance(name, str) or not name or "+" in name or name != name.strip() or name in ("none", *CONTROLLERS):
        raise ValueError(f"shaping method name {name!r} is not allowed: use a non-empty name without '+' or spaces, not 'none' or {list(CONTROLLERS)}")
    if name in SHAPING:
        raise ValueError(f"shaping method {name!r} is already registered")
    if not per_token and not _builtin:
        raise ValueError(f"shaping method {name!r}: only per-token methods can be registered (per_token=True)")
    known = {p.name: p for method in SHAPING.values() for p in method.parameters}
    for parameter in parameters:
        if parameter.name in known and known[parameter.name] != parameter:
            raise ValueError(f"shaping parameter {parameter.name!r} is already declared differently (by another method): reuse its declaration")

    def decorator(fn):
        summary_line = summary or (fn.__doc__ or "").strip().split("\n")[0]
        SHAPING[name] = ShapingMethod(name, fn, float(order), tuple(parameters), per_token, summary_line, _builtin)
        return fn

    return decorator


def unregister_shaping(name: str) -> None:
    """Remove a method registered with :func:`register_shaping` (built-ins cannot be removed)."""
    method = SHAPING.get(name)
    if method is None or method.builtin:
        raise ValueError(f"shaping method {name!r} is not a registered user method; allowed: {user_shaping_names()}")
    del SHAPING[name]


def shaping_names() -> tuple[str, ...]:
    """The registered shaping methods, in applied order (per-token first, then the aggregation)."""
    return tuple(m.name for m in sorted(SHAPING.values(), key=lambda m: (not m.per_token, m.order, m.name)))


def user_shaping_names() -> tuple[str, ...]:
    return tuple(name for name in shaping_names() if not SHAPING[name].builtin)


def method_names() -> tuple[str, ...]:
    """Every single name ``kl_adaptation_method`` takes: ``none``, the shaping methods, the controllers."""
    return ("none", *shaping_names(), *CONTROLLERS)


def shaping_parameters(builtin: bool | None = None) -> tuple[Parameter, ...]:
    """Every registered parameter once, in method order (``builtin``: only the built-ins' or only the users')."""
    seen: dict[str, Parameter] = {}
    for name in shaping_names():
        method = SHAPING[name]
        if builtin is None or method.builtin == builtin:
            for parameter in method.parameters:
                seen.setdefault(parameter.name, parameter)
    return tuple(seen.values())


@dataclass(frozen=True)
class Method:
    """A parsed ``kl_adaptation_method``: one β controller and the shaping steps, in applied order."""

    controller: str  # "fixed", "dynamic" or "target"
    shaping: tuple[str, ...]

    @property
    def length_normalized(self) -> bool:
        return "length_normalized" in self.shaping

    @property
    def per_token_steps(self) -> tuple[ShapingMethod, ...]:
        return tuple(SHAPING[name] for name in self.shaping if SHAPING[name].per_token)

    @property
    def parameters(self) -> tuple[Parameter, ...]:
        """The parameters of this method's shaping steps, each once."""
        seen = {p.name: p for step in self.shaping for p in SHAPING[step].parameters}
        return tuple(seen.values())

    @property
    def is_none(self) -> bool:
        return self.controller == "fixed" and not self.shaping


def parse_method(method: str) -> Method:
    """Parse ``"none"``, a single method, or a ``+``-joined composition; raise ValueError otherwise."""
    allowed = (
        f"one of {list(method_names())} or a '+'-joined combination of at most one of {list(CONTROLLERS)} and any of "
        f"{list(shaping_names())}"
    )
    if not isinstance(method, str) or not method.strip():
        raise ValueError(f"kl_adaptation_method={method!r} is not valid; allowed: {allowed}")
    parts = [p.strip() for p in method.split("+")]
    if parts == ["none"]:
        return Method("fixed", ())
    if "none" in parts:
        raise ValueError(f"kl_adaptation_method={method!r} joins 'none' (no adaptation) with other parts; allowed: 'none' alone, or the other parts without it")
    unknown = [p for p in parts if p not in method_names()]
    if unknown:
        raise ValueError(f"kl_adaptation_method={method!r} has unknown part(s) {unknown}; allowed: {allowed}")
    if len(set(parts)) != len(parts):
        raise ValueError(f"kl_adaptation_method={method!r} repeats a part; allowed: {allowed}")
    controllers = [p for p in parts if p in CONTROLLERS]
    if len(controllers) > 1:
        raise ValueError(f"kl_adaptation_method={method!r} names {len(controllers)} β controllers; allowed: {allowed}")
    shaping = tuple(name for name in shaping_names() if name in parts)
    return Method(controllers[0] if controllers else "fixed", shaping)


def format_method(method: Method) -> str:
    """The inverse of :func:`parse_method`: ``method`` as ``kl_adaptation_method`` writes it, canonically
    (the β controller first, then the shaping steps in applied order; ``"none"`` for no adaptation)."""
    return "+".join([*([method.controller] if method.controller != "fixed" else []), *method.shaping]) or "none"


def shape_per_token(kl: torch.Tensor, method: Method, parameters: dict[str, object]) -> torch.Tensor:
    """Apply the per-token shaping steps of ``method``, in order; ``parameters``: name -> value."""
    for step in method.per_token_steps:
        shaped = step.fn(kl, **{p.argument: parameters[p.name] for p in step.parameters})
        if not step.builtin and (not isinstance(shaped, torch.Tensor) or shaped.shape != kl.shape):
            got = tuple(shaped.shape) if isinstance(shaped, torch.Tensor) else type(shaped).__name__
            raise ValueError(f"shaping method {step.name!r} returned {got} for a KL of shape {tuple(kl.shape)}; allowed: a tensor of the same shape")
        kl = shaped
    return kl


# -- the built-in methods ------------------------------------------------------------------------------
CLIP_THRESHOLD = Parameter(
    "kl_clip_threshold",
    default=1.0,
    check=_finite_positive,
    allowed="a number > 0",
    help="'clip' and 'soft_clip': the cap c of the per-token KL term: min(kl, c), or c * tanh(kl / c) (> 0).",
    keyword="threshold",
)
KL_TARGET = Parameter(
    "kl_target",
    default=0.1,
    check=_finite_positive,
    allowed="a number > 0",
    help="'sigmoid': the centre of sigmoid(kl - kl_target) * kl, which damps tokens whose KL is near or below it "
    "and caps nothing; 'target': the KL the controller steers toward (> 0).",
    keyword="target",
)


@register_shaping("clip", order=10, parameters=(CLIP_THRESHOLD,), _builtin=True)
def clip(kl: torch.Tensor, threshold: float) -> torch.Tensor:
    """Hard cap ``min(kl_t, kl_clip_threshold)``: tokens above the cap get no KL gradient."""
    return torch.clamp(kl, max=threshold)


@register_shaping("soft_clip", order=20, parameters=(CLIP_THRESHOLD,), _builtin=True)
def soft_clip(kl: torch.Tensor, threshold: float) -> torch.Tensor:
    """Smooth cap ``c * tanh(kl_t / c)``, ``c = kl_clip_threshold``: below c, gradient -> 0 above it."""
    return threshold * torch.tanh(kl / threshold)


@register_shaping("sigmoid", order=30, parameters=(KL_TARGET,), _builtin=True)
def sigmoid(kl: torch.Tensor, target: float) -> torch.Tensor:
    """``sigmoid(kl_t - kl_target) * kl_t``: damps tokens with KL near or below kl_target; caps nothing."""
    return torch.sigmoid(kl - target) * kl


def sequence_mean(kl: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-completion masked mean over tokens, shape ``(B,)``; an all-masked row gives 0.

    Masked positions are zeroed with ``where`` (not a product) so NaN or inf there cannot leak.
    """
    valid = mask.bool()
    summed = torch.where(valid, kl, torch.zeros_like(kl)).sum(-1)
    return summed / valid.sum(-1).clamp(min=1).to(kl.dtype)


def length_normalized_term(kl: torch.Tensor, mask: torch.Tensor, num_completions: int | float | torch.Tensor) -> torch.Tensor:
    """The length-normalised KL term ``mean_i(mean_t kl_it)``, or this shard's share of it: the sum
    over these completions of each one's mean per-token KL, divided by ``num_completions``, the
    number of completions in the *whole* batch. Backends that see a batch in chunks add the chunks'
    shares, so the result does not depend on the chunk size.
    """
    return sequence_mean(kl, mask).sum() / num_completions


register_shaping(
    "length_normalized",
    per_token=False,
    summary="Each completion's KL counts as its per-token mean: beta * mean_i(mean_t kl_it), whatever the loss type.",
    _builtin=True,
)(length_normalized_term)
