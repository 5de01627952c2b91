"""What the three registries (estimators, shaping methods, β controllers) share: the declaration of a
setting (:class:`Parameter`) and its check, the one namespace of ``kl_adaptation_method``'s names, and
the check of what a registered user function returns.

A :class:`Parameter` is declared once, by the estimator, shaping method or controller that reads it; a
setting read by several (``kl_target``: the ``sigmoid`` shaping and the ``target`` controller; ``beta_min``:
every controller with a floor) is the same declaration, reused. A built-in's parameter is a ``GRPOConfig``
field; a parameter of a function registered later is a key of ``kl_shaping_kwargs``
(:mod:`unsloth_adaptive_kl.config` reads both from the registries). Pure torch.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable

import torch


def finite_positive(value) -> bool:
    return math.isfinite(value) and value > 0


#: The positive values float32 holds as normal numbers: a setting the per-token math divides or multiplies the KL by
#: must stay such a number in the KL's dtype (1e39 becomes inf and 1e-300 becomes 0 there).
FLOAT32_POSITIVE = (torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max)


def float32_positive(value) -> bool:
    return FLOAT32_POSITIVE[0] <= value <= FLOAT32_POSITIVE[1]


@dataclass(frozen=True)
class Parameter:
    """A setting of a registered estimator, shaping method or β controller.

    ``name`` is how the user sets it: a ``GRPOConfig`` field for the built-ins' parameters, a key of
    ``kl_shaping_kwargs`` for those of functions registered later (docs/methods.md). ``keyword`` is the
    keyword an estimator's or shaping method's function receives it as (``name`` when None); a controller
    reads it as ``self.config.<name>``. ``check`` returns whether a value (already of ``type``) is allowed;
    ``allowed`` says what is, in words. ``at_most``: another setting (``"beta"``) it may not exceed.
    """

    name: str
    type: type = float
    default: object = None
    check: Callable[[object], bool] | None = None
    allowed: str = "a finite number"
    help: str = ""
    keyword: str | None = None
    at_most: str | None = None

    @property
    def argument(self) -> str:
        return self.keyword or self.name


#: Every declared parameter by name, whichever registry declared it: one declaration per setting.
DECLARED: dict[str, Parameter] = {}
#: Which registries' functions read each declared parameter: name -> {(kind, function name)}.
_READERS: dict[str, set[tuple[str, str]]] = {}


def declare(kind: str, owner: str, parameters: tuple[Parameter, ...]) -> None:
    """Record that ``owner`` (a ``kind``: "KL estimator", "shaping method", "β controller") reads ``parameters``;
    ValueError, before anything is recorded, for a name already declared differently by another function."""
    for parameter in parameters:
        if not isinstance(parameter, Parameter):
            raise ValueError(f"{kind} {owner!r}: parameters must be unsloth_adaptive_kl.Parameter declarations, got {parameter!r}")
        known = DECLARED.get(parameter.name)
        if known is not None and known != parameter:
            readers = sorted(f"{k} {n!r}" for k, n in _READERS.get(parameter.name, ()))
            raise ValueError(
                f"parameter {parameter.name!r} of {kind} {owner!r} is already declared differently (by {', '.join(readers)}); "
                "allowed: reuse that declaration, or another name"
            )
    for parameter in parameters:
        DECLARED[parameter.name] = parameter
        _READERS.setdefault(parameter.name, set()).add((kind, owner))


def undeclare(kind: str, owner: str) -> None:
    """Forget what ``owner`` declared (its unregistration); a parameter no one else reads goes with it."""
    for name in [n for n, readers in _READERS.items() if (kind, owner) in readers]:
        _READERS[name].discard((kind, owner))
        if not _READERS[name]:
            del _READERS[name], DECLARED[name]


# -- the names of kl_adaptation_method: shaping methods and β controllers share one namespace -------------
#: ``"none"`` (no adaptation) and ``"fixed"`` (the β of no controller) are the grammar's own.
RESERVED_NAMES = ("none", "fixed")
METHOD_NAMES: dict[str, str] = {}  # name -> kind ("shaping method" or "β controller")


def claim_method_name(kind: str, name) -> None:
    """Reserve ``name`` for a ``kind`` of ``kl_adaptation_method`` part; ValueError naming what is allowed."""
    if not isinstance(name, str) or not name or "+" in name or name != name.strip() or " " in name or name in RESERVED_NAMES:
        raise ValueError(f"{kind} name {name!r} is not allowed: use a non-empty name without '+' or spaces, not one of {list(RESERVED_NAMES)}")
    if name in METHOD_NAMES:
        raise ValueError(f"{kind} {name!r} is already registered (as a {METHOD_NAMES[name]}); allowed: another name")
    METHOD_NAMES[name] = kind


def release_method_name(name: str) -> None:
    METHOD_NAMES.pop(name, None)


def claim_method_part(kind: str, name, parameters: tuple[Parameter, ...]) -> None:
    """Register ``name`` as a ``kind`` of ``kl_adaptation_method`` part reading ``parameters``: the name claimed and
    the parameters declared, or neither (ValueError from either check leaves nothing recorded)."""
    claim_method_name(kind, name)
    try:
        declare(kind, name, parameters)
    except ValueError:
        release_method_name(name)
        raise


def release_method_part(kind: str, name: str) -> None:
    """Undo :func:`claim_method_part` (an unregistration)."""
    release_method_name(name)
    undeclare(kind, name)


# -- checking a setting's value -------------------------------------------------------------------------
def yaml_hint(value) -> str:
    """The hint for a number that YAML left a string. PyYAML (YAML 1.1) reads exponent form as a float only
    with a dot in the mantissa and a sign in the exponent (``1.0e-3``, ``1.0e+3``): ``1e-3`` and ``1.0e3``
    stay strings. Only such a string gets the hint, with the spelling YAML reads as the same number."""
    if not isinstance(value, str):
        return ""
    mantissa, exponent_mark, exponent = value.strip().lower().partition("e")
    try:
        number = float(value)
    except ValueError:
        return ""
    signed = exponent[:1] in ("+", "-")
    if not exponent_mark or not math.isfinite(number) or ("." in mantissa and signed):
        return ""  # not exponent form, or a spelling YAML reads as a float: this string did not come from YAML
    written = f"{mantissa if '.' in mantissa else mantissa + '.0'}e{exponent if signed else '+' + exponent}"
    return (
        f" (it is the string {value!r}: YAML reads a number in exponent form as a string unless its mantissa has a "
        f"dot and its exponent a sign; write it as {written})"
    )


def number_hint(value) -> str:
    """The hint for a number of another type than Python's (``numpy.int64(5)``, ``numpy.float32(0.5)``): a config keeps
    what it is given, and such a value is not JSON (a checkpoint's or a logger's copy of the config would fail)."""
    if isinstance(value, (bool, int, float)) or not isinstance(value, numbers.Number):
        return ""
    return f" (it is a {type(value).__module__}.{type(value).__name__}: pass a Python number, int(value) or float(value))"


def checked_number(name: str, value, *, integer: bool = False, allowed: str | None = None):
    """``value`` if it is a Python int (``integer``) or an int or a finite float, not a bool; else ValueError naming
    ``name``, the value and what is ``allowed`` (by default "an integer" or "a finite number"), with a hint for a YAML
    string or a non-Python number."""
    ok_types = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_types) or (not integer and not math.isfinite(value)):
        kind = allowed or ("an integer" if integer else "a finite number")
        raise ValueError(f"{name}={value!r} is not valid; allowed: {kind}{yaml_hint(value)}{number_hint(value)}")
    return value


def checked_beta(value, name: str = "beta", *, source: str = ""):
    """``value`` if it is a valid β: a finite number >= 0 (an int or a float, not a bool). Otherwise
    ValueError naming ``name``, the value and what is allowed; ``source`` starts the message (where
    the value was read, e.g. a checkpoint's controller state). The one check of a β, wherever it enters."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{source}{name}={value!r} is not valid; allowed: a finite number >= 0{yaml_hint(value)}{number_hint(value)}")
    return value


def check_parameter(parameter: Parameter, value, *, label: str | None = None, bounds: dict | None = None):
    """``value`` checked against ``parameter``'s declaration (its type, ``check`` and ``at_most``, the bound read
    from ``bounds``, e.g. ``{"beta": 0.04}``); ValueError naming ``label`` (the parameter's name by default), the
    value and what is allowed."""
    label = label or parameter.name
    if parameter.type in (int, float):
        value = checked_number(label, value, integer=parameter.type is int, allowed=parameter.allowed)
    elif not isinstance(value, parameter.type):
        raise ValueError(f"{label}={value!r} is not valid; allowed: {parameter.allowed}")
    allowed = parameter.allowed
    ok = parameter.check is None or parameter.check(value)
    if parameter.at_most is not None and bounds is not None and parameter.at_most in bounds:
        limit = bounds[parameter.at_most]
        allowed = f"{allowed}, and <= {parameter.at_most}={limit!r}"
        ok = ok and value <= limit
    if not ok:
        raise ValueError(f"{label}={value!r} is not valid; allowed: {allowed}")
    return value


# -- a registered user function's output ------------------------------------------------------------------
def check_user_output(kind: str, name: str, out, like: torch.Tensor, *, source: torch.Tensor | None = None) -> None:
    """What a registered user function (a ``kind``: "KL estimator", "shaping method") must return: a tensor of
    ``like``'s shape and dtype, with a gradient when ``source`` (its differentiable input; ``like`` by default)
    has one. Metadata only (no value is read, nothing synchronises), so it runs on every call, inside compiled
    regions too; ValueError naming the function and what was wrong."""
    source = like if source is None else source
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"{kind} {name!r} returned {type(out).__name__}; allowed: a torch.Tensor of its input's shape {tuple(like.shape)}")
    if out.shape != like.shape:
        raise ValueError(f"{kind} {name!r} returned shape {tuple(out.shape)} for an input of shape {tuple(like.shape)}; allowed: a tensor of the same shape")
    if out.dtype != like.dtype:
        raise ValueError(f"{kind} {name!r} returned dtype {out.dtype} for an input of dtype {like.dtype}; allowed: the input's dtype")
    if torch.is_grad_enabled() and source.requires_grad and not out.requires_grad:
        raise ValueError(
            f"{kind} {name!r} returned a tensor with no gradient (detached from its input): the KL term would not "
            "train while the logs show a KL; allowed: a result computed from its input with differentiable operations"
        )
