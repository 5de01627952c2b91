"""Shaping of the per-token KL term: the registry of methods and the built-in ones.

Shaping acts on the per-token KL term that β multiplies, *before* the loss aggregates it, so it
changes the gradient, not only a logged number. A method is registered with
:func:`register_shaping`, which declares its name, where it applies in the order, its parameters
and whether it acts per token or on the aggregation::

    @register_shaping("half_kl")
    def half_kl(kl):
        return 0.5 * kl

Everything that lists methods or their parameters (the ``GRPOConfig`` fields, :class:`KLTerm`,
the Liger module's keyword arguments, the docs' method table, the tests) reads this registry. The
grammar of ``kl_adaptation_method`` that joins these with a β controller is :mod:`unsloth_adaptive_kl.method`.

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

A method registered without ``order`` applies at 50: after the built-in per-token methods. Methods
of equal ``order`` apply in the alphabetical order of their names (the same in every process).
At most one β controller (:mod:`unsloth_adaptive_kl.controllers`) may be joined with any shaping
methods, e.g. ``"dynamic+length_normalized"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .declarations import FLOAT32_POSITIVE, Parameter, check_user_output, finite_positive, float32_positive
from .registry import Registry

#: Where a method registered without ``order`` applies: after the built-in per-token methods.
DEFAULT_ORDER = 50
KIND = "shaping method"


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


#: Name -> :class:`ShapingMethod`; :func:`shaping_names` gives them in applied order.
SHAPING = Registry(KIND, order=lambda m: (not m.per_token, m.order, m.name), method_names=True)


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
    soft_clip 20, sigmoid 30), a finite number; methods of equal ``order`` apply in the alphabetical order
    of their names, so the order never depends on which process registered what first. ``parameters``:
    its :class:`~unsloth_adaptive_kl.declarations.Parameter` s (a parameter already declared, e.g.
    ``kl_clip_threshold``, by any registry, may be reused by naming it with the same declaration).
    ``summary``: one line for the method table (the docstring's first line when empty).

    ``fn`` is checked as user estimators are (:func:`~unsloth_adaptive_kl.declarations.check_user_output`): it must return a new tensor of its
    input's shape and dtype, connected to the graph when the input requires grad, finite wherever the KL is
    finite; it must not change its input in place. Refused by name when the KL term is built, at the call
    that breaks a rule, or, for NaN, at the metric sums of that micro-batch (docs/reliability.md).
    """
    if isinstance(order, bool) or not isinstance(order, (int, float)) or not math.isfinite(order):
        raise ValueError(f"shaping method {name!r}: order={order!r} is not valid; allowed: a finite number (built-ins: clip 10, soft_clip 20, sigmoid 30)")
    if not per_token and not _builtin:
        raise ValueError(f"shaping method {name!r}: only per-token methods can be registered (per_token=True)")
    SHAPING.claim(name, tuple(parameters))

    def decorator(fn):
        summary_line = summary or (fn.__doc__ or "").strip().split("\n")[0]
        SHAPING.add(ShapingMethod(name, fn, float(order), tuple(parameters), per_token, summary_line, _builtin))
        return fn

    return decorator


def unregister_shaping(name: str) -> None:
    """Remove a method registered with :func:`register_shaping` (built-ins cannot be removed)."""
    SHAPING.remove(name)


def shaping_names() -> tuple[str, ...]:
    """The registered shaping methods, in applied order (per-token first, then the aggregation)."""
    return SHAPING.names()


def user_shaping_names() -> tuple[str, ...]:
    return SHAPING.user_names()


def shaping_parameters(builtin: bool | None = None) -> tuple[Parameter, ...]:
    """Every registered parameter once, in method order (``builtin``: only the built-ins' or only the users')."""
    return SHAPING.parameters(builtin)


def shape_per_token(kl: torch.Tensor, method, parameters: dict[str, object]) -> torch.Tensor:
    """Apply the per-token shaping steps of ``method`` (a parsed :class:`~unsloth_adaptive_kl.method.Method`), in
    order; ``parameters``: name -> value.
    Registered (user) steps go through :func:`apply_user_step`; built-ins are trusted."""
    for step in method.per_token_steps:
        arguments = {p.argument: parameters[p.name] for p in step.parameters}
        kl = step.fn(kl, **arguments) if step.builtin else apply_user_step(step, kl, arguments)
    return kl


def apply_user_step(step: ShapingMethod, kl: torch.Tensor, arguments: dict[str, object]) -> torch.Tensor:
    """``step.fn(kl, **arguments)``, its output checked (:func:`~unsloth_adaptive_kl.declarations.check_user_output`), and a change of ``kl`` in place
    refused: the caller's ``kl`` is the raw KL that TRL's ``kl``, ``adaptive_kl/raw_kl`` and ``target`` read.

    Eagerly, the tensor's version counter tells (a host-side integer: nothing is copied or synchronised). Inside
    a compiled region (Unsloth's fused loss, the Liger module) there is no counter to read: the step gets a copy,
    which the compiler fuses into the step's own kernel, so an in-place change reaches the copy only.
    """
    if torch.compiler.is_compiling() or kl.is_inference():  # inference tensors have no version counter either
        shaped = step.fn(kl.clone(), **arguments)
    else:
        version = kl._version
        shaped = step.fn(kl, **arguments)
        if kl._version != version:
            raise ValueError(
                f"shaping method {step.name!r} changed its input in place (an in-place operation such as kl.clamp_()): "
                "that input is the raw KL the trainer logs and the target controller steers on; allowed: return a new "
                "tensor (kl.clamp(...), not kl.clamp_(...))"
            )
    check_user_output(KIND, step.name, shaped, kl)
    return shaped


#: The KL values :func:`check_user_steps` gives each registered step when the KL term is built: 0, the range
#: k3 takes in practice, and beyond Unsloth's cap of 10. Non-negative: only k1 gives a negative KL (a method
#: such as sqrt that is NaN there is refused at its first micro-batch instead, by the metric sums).
PROBE_KL = ((0.0, 1e-4, 0.01, 0.1, 0.5), (1.0, 2.0, 5.0, 10.0, 30.0))


def check_user_steps(method, parameters: dict[str, object]) -> None:
    """Run each registered step of ``method`` once on :data:`PROBE_KL` (eagerly, float32, with a gradient) and
    refuse it by name if it breaks a rule of :func:`apply_user_step`, changes its input's values in any other
    way, or returns NaN or inf for this finite KL. Called when the KL term is built, before any compiled region
    could hide the error in a compiler's message."""
    for step in method.per_token_steps:
        if step.builtin:
            continue
        kl = torch.tensor(PROBE_KL).requires_grad_(True)
        probe = kl * 1.0  # not a leaf, as in a loss: in-place operations are allowed on it
        before = probe.detach().clone()
        shaped = apply_user_step(step, probe, {p.argument: parameters[p.name] for p in step.parameters})
        if not torch.equal(probe.detach(), before):
            raise ValueError(f"shaping method {step.name!r} changed its input in place; allowed: return a new tensor, leave the input as it is")
        if not torch.isfinite(shaped).all():
            raise ValueError(
                f"shaping method {step.name!r} returned NaN or inf for a finite KL (checked on kl = {list(PROBE_KL)}): "
                f"got {shaped.detach().tolist()}; allowed: a finite value for every finite KL"
            )


def user_steps(method) -> tuple[str, ...]:
    """The registered (user) per-token steps of ``method``, in applied order."""
    return tuple(step.name for step in method.per_token_steps if not step.builtin)


# -- the built-in methods ------------------------------------------------------------------------------
CLIP_THRESHOLD = Parameter(
    "kl_clip_threshold",
    default=1.0,
    check=float32_positive,  # soft_clip divides by it: in float32, 1e39 is inf and 1e-300 is 0 (a NaN KL on every token)
    allowed=f"a number > 0 that float32 holds, from {FLOAT32_POSITIVE[0]:.4g} to {FLOAT32_POSITIVE[1]:.4g}",
    help="'clip' and 'soft_clip': the cap c of the per-token KL term: min(kl, c), or c * tanh(kl / c) (> 0).",
    keyword="threshold",
)
KL_TARGET = Parameter(
    "kl_target",
    default=0.1,
    check=finite_positive,
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
