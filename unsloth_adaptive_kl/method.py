"""The grammar of ``kl_adaptation_method``: ``"none"``, one registered name, or a ``+``-joined combination of at
most one β controller (:mod:`unsloth_adaptive_kl.controllers`) and any shaping methods
(:mod:`unsloth_adaptive_kl.shaping`). It sits above both registries and reads them: a name registered with
``register_shaping`` or ``register_controller`` is a part of the grammar from then on. Pure torch (through them).
"""

from __future__ import annotations

from dataclasses import dataclass

from .controllers import CONTROLLERS, controller_names
from .declarations import Parameter
from .shaping import SHAPING, ShapingMethod, shaping_names

#: The β controller of a method that names none: β stays the configured one.
NO_CONTROLLER = "fixed"


def method_names() -> tuple[str, ...]:
    """Every single name ``kl_adaptation_method`` takes: ``none``, the shaping methods, the β controllers."""
    return ("none", *shaping_names(), *controller_names())


@dataclass(frozen=True)
class Method:
    """A parsed ``kl_adaptation_method``: one β controller (``"fixed"`` for none) and the shaping steps, in applied order."""

    controller: str
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
    def controller_parameters(self) -> tuple[Parameter, ...]:
        """The parameters of this method's β controller (none without one)."""
        return CONTROLLERS[self.controller].parameters if self.controller in CONTROLLERS else ()

    @property
    def is_none(self) -> bool:
        return self.controller == NO_CONTROLLER and not self.shaping


def parse_method(method: str) -> Method:
    """Parse ``"none"``, a single method, or a ``+``-joined composition; raise ValueError otherwise."""
    allowed = (
        f"one of {list(method_names())} or a '+'-joined combination of at most one of {list(controller_names())} and any "
        f"of {list(shaping_names())}"
    )
    if not isinstance(method, str) or not method.strip():
        raise ValueError(f"kl_adaptation_method={method!r} is not valid; allowed: {allowed}")
    parts = [p.strip() for p in method.split("+")]
    if parts == ["none"]:
        return Method(NO_CONTROLLER, ())
    if "none" in parts:
        raise ValueError(f"kl_adaptation_method={method!r} joins 'none' (no adaptation) with other parts; allowed: 'none' alone, or the other parts without it")
    unknown = [p for p in parts if p not in method_names()]
    if unknown:
        import difflib

        names = {name.lower(): name for name in method_names()}
        close = [names[m[0]] for p in unknown if (m := difflib.get_close_matches(p.lower(), names, n=1, cutoff=0.75))]
        hint = f" (did you mean {' and '.join(repr(c) for c in close)}?)" if len(close) == len(unknown) else ""
        raise ValueError(f"kl_adaptation_method={method!r} has unknown part(s) {unknown}{hint}; allowed: {allowed}")
    if len(set(parts)) != len(parts):
        raise ValueError(f"kl_adaptation_method={method!r} repeats a part; allowed: {allowed}")
    controllers = [p for p in parts if p in CONTROLLERS]
    if len(controllers) > 1:
        raise ValueError(f"kl_adaptation_method={method!r} names {len(controllers)} β controllers; allowed: {allowed}")
    shaping = tuple(name for name in shaping_names() if name in parts)
    return Method(controllers[0] if controllers else NO_CONTROLLER, shaping)


def format_method(method: Method) -> str:
    """The inverse of :func:`parse_method`: ``method`` as ``kl_adaptation_method`` writes it, canonically
    (the β controller first, then the shaping steps in applied order; ``"none"`` for no adaptation)."""
    return "+".join([*([method.controller] if method.controller != NO_CONTROLLER else []), *method.shaping]) or "none"
