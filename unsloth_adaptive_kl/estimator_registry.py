"""The KL-estimator registry: :func:`register_estimator` and the queries every module reads, and the one call of an
estimator, :func:`estimate_kl`, with the checks of a registered (user) one. The built-in estimators are registered in
:mod:`unsloth_adaptive_kl.estimators` (import that module, not this one, to see them). Pure torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .declarations import Parameter, check_user_output
from .registry import Registry

Estimator = Callable[..., torch.Tensor]
KIND = "KL estimator"


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



def _check_estimator_name(key: str) -> None:
    if "+" in key.rstrip("+") or not key:
        raise ValueError(f"KL estimator name {key!r} is not allowed: use a non-empty name without inner '+'")


#: Name -> :class:`EstimatorSpec`, in registration order; aliases resolve through :func:`get_estimator`.
ESTIMATORS = Registry(KIND, check_name=_check_estimator_name)


def register_estimator(name: str, *aliases: str, parameters: tuple[Parameter, ...] = (), batch_statistic=None, summary: str = "", _builtin: bool = False):
    """Decorator: register ``fn(logp, ref_logp, **parameters) -> per-token KL`` under ``name`` (and aliases).

    ``parameters``: its :class:`~unsloth_adaptive_kl.declarations.Parameter` s, passed by keyword (a built-in's
    are ``GRPOConfig`` fields, a registered one's are set in ``kl_shaping_kwargs``). ``batch_statistic``: see
    :class:`EstimatorSpec`. ``summary``: one line for the docs' table (the docstring's first line when empty)."""

    def decorator(fn: Estimator) -> Estimator:
        ESTIMATORS.claim(name, tuple(parameters), aliases)
        summary_line = summary or (fn.__doc__ or "").strip().split("\n")[0]
        ESTIMATORS.add(EstimatorSpec(name, fn, _builtin, batch_statistic, tuple(parameters), summary_line), aliases)
        return fn

    return decorator


def unregister_estimator(name: str) -> None:
    """Remove a user-registered estimator and its aliases (built-ins cannot be removed)."""
    if get_estimator(name).builtin:  # an unknown name: get_estimator's error, which lists the names
        raise ValueError(f"KL estimator {name!r} is built in and cannot be unregistered")
    ESTIMATORS.remove(name)


def estimator_names() -> list[str]:
    return sorted([*ESTIMATORS, *ESTIMATORS.all_aliases()])


def estimator_aliases(name: str) -> tuple[str, ...]:
    """The other names of the estimator ``name``."""
    return ESTIMATORS.aliases(name)


def builtin_estimator_names() -> tuple[str, ...]:
    """The built-in estimators, each by its name (no alias), in registration order."""
    return ESTIMATORS.builtin_names()


def estimator_parameters(builtin: bool | None = None) -> tuple[Parameter, ...]:
    """Every registered estimator parameter once (``builtin``: only the built-ins' or only the users')."""
    return ESTIMATORS.parameters(builtin)


def get_estimator(name: str) -> EstimatorSpec:
    spec = ESTIMATORS.resolve(name) if isinstance(name, str) else None  # a list or a dict is no name (nor hashable)
    if spec is None:
        raise ValueError(f"kl_estimator={name!r} is not a registered KL estimator; allowed: {estimator_names()}")
    return spec


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
