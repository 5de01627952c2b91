"""The base of every β controller (:class:`BetaController`, its settings :class:`ControllerConfig`, the check of the β
it holds) and the β-controller registry (:func:`register_controller`). The built-in controllers are each one module
(``dynamic_controller``, ``ziegler_controller``, ``schedule_controller``, ``reward_conditioned_controller``,
``target_controller``), registered by :mod:`unsloth_adaptive_kl.controllers`: read the registry through that module,
which has them all. Pure Python.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from .declarations import Parameter, check_parameter, checked_beta
from .registry import Registry

KIND = "β controller"
logger = logging.getLogger("unsloth_adaptive_kl")


def _finite(value) -> bool:
    if isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except TypeError:
        return False


class ControllerMismatchError(ValueError):
    """A β-controller state of another controller (``saved``, a name) than this one (``name``): the one check of
    a controller's name on load; ``AdaptiveKL`` turns it into the resume error naming both methods."""

    def __init__(self, saved, name: str):
        self.saved, self.name = saved, name
        super().__init__(f"cannot load β-controller state of {saved!r} into a {name!r} controller")

    def __reduce__(self):  # its arguments, not its message: it crosses processes (pickle) intact
        return type(self), (self.saved, self.name)


class ControllerConfig:
    """β and the value of every registered controller parameter (``config.<name>``), each checked against its
    declaration; a parameter not given takes its declared default. Immutable."""

    def __init__(self, beta, kl_monitor: bool = False, **values):
        object.__setattr__(self, "beta", float(checked_beta(beta)))
        object.__setattr__(self, "kl_monitor", bool(kl_monitor))  # the KL is computed (and the reference run) at β = 0 too
        declared = {p.name: p for p in controller_parameters()}
        unknown = sorted(set(values) - set(declared))
        if unknown:
            raise ValueError(f"unknown β-controller setting(s) {unknown}; allowed: the registered controllers' parameters {sorted(declared)}")
        for name, parameter in declared.items():
            value = values.get(name, parameter.default)
            if value is not None:
                value = check_parameter(parameter, value, bounds={"beta": self.beta})
                value = float(value) if parameter.type is float else value
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError(f"ControllerConfig is immutable (setting {name!r})")

    def __repr__(self) -> str:
        return f"ControllerConfig({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


class BetaController:
    """Base class of the β controllers: a constant β (used for "none" and for pure shaping).

    A controller registered with :func:`register_controller` overrides :meth:`update` (and sets
    ``adapts_beta = True``), and, if it keeps a history, :meth:`state_dict` / :meth:`checked_own_state`
    so that a resumed run goes on exactly; :meth:`observe_reward` gets each generation batch's mean reward.
    """

    name = "fixed"

    @classmethod
    def check_settings(cls, config: "ControllerConfig") -> None:
        """Refuse, when the config is validated, settings this controller cannot work with (ValueError naming them)."""

    def __init__(self, config: ControllerConfig):
        self.config = config
        self.beta = float(config.beta)
        self.skipped_updates = 0  # non-finite observations that were not used (see the module docstring)
        self._warned = False

    def skip(self, what: str, value) -> None:
        """Count a non-finite observation that must not move β; warn the first time."""
        self.skipped_updates += 1
        if not self._warned:
            self._warned = True
            logger.warning(
                "unsloth_adaptive_kl: the %s controller got a non-finite %s (%r) and left beta at %s; such observations "
                "are skipped and counted in adaptive_kl/skipped_updates (this warning is shown once)",
                self.name, what, value, self.beta,
            )

    def check_step_size(self, num_completions: int) -> None:
        """Refuse, before training, a configuration this many completions per optimizer step would break."""

    def observe_reward(self, reward: float) -> None:
        """Record the step's raw mean reward (gathered across processes). Ignored by default."""

    def update(self, *, global_step: int, kl: float | None, num_completions: int) -> float:
        """Advance to the β of the step that starts at ``global_step``; return it."""
        return self.beta

    #: Whether this controller moves β (False: β is the configured one at every step, as in stock TRL).
    adapts_beta = False

    def metrics(self) -> dict[str, float]:
        """What this controller logs after each update besides β and ``skipped_updates`` (name -> value)."""
        return {}

    def idle_reason(self) -> str | None:
        """Why β never moved, in words, where this controller can tell (said when a run ends with β where it began, and
        β was not 0: that case is said for every controller); None: no reason known."""
        return None

    def state_dict(self) -> dict:
        return {"name": self.name, "beta": self.beta, "skipped_updates": self.skipped_updates, "configured_beta": self.config.beta}

    def max_loaded_beta(self) -> float:
        """The largest β this controller's settings allow, for a β restored from a checkpoint."""
        return math.inf

    def min_loaded_beta(self) -> float:
        """The least β > 0 this controller's settings allow (its floor), for a β restored from a checkpoint."""
        return 0.0

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved, every part checked before any is restored (nothing is half-loaded).
        Another controller's state: :class:`ControllerMismatchError`; an invalid value: ValueError naming it."""
        if state.get("name") != self.name:
            raise ControllerMismatchError(state.get("name"), self.name)
        source = f"β-controller state of the {self.name!r} controller: "
        beta = checked_beta(state.get("beta"), source=source)
        skipped = state.get("skipped_updates", 0)  # absent in checkpoints written before it existed
        if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
            raise ValueError(f"β-controller state: skipped_updates={skipped!r} is not valid; allowed: an integer >= 0")
        configured = state.get("configured_beta")  # absent in checkpoints written before it existed
        if configured is not None:
            checked_beta(configured, "configured_beta", source=source)
        own = self.checked_own_state(state)
        restarted = self.adapts_beta and configured is not None and configured != float(self.config.beta)
        self.beta = self.resumed_beta(float(beta), configured)
        self.skipped_updates = skipped
        for name, value in (self.own_state_for_new_beta(own) if restarted else own).items():
            setattr(self, name, value)

    def checked_own_state(self, state: dict) -> dict:
        """A subclass's own part of ``state``, checked (ValueError otherwise), as attribute name -> value to restore."""
        return {}

    def own_state_for_new_beta(self, own: dict) -> dict:
        """What of ``own`` (:meth:`checked_own_state`'s) a controller restarted from a changed ``beta`` on resume keeps:
        all of it by default (a reward window means the same whatever β); a subclass drops what is in the old β's
        units."""
        return own

    def resume_at(self, global_step: int) -> None:
        """After a resume (restored or restarted), before optimizer step ``global_step`` (the index of the step about
        to start): what that step's schedule sets, so that it trains with it."""

    def resumed_beta(self, saved: float, configured: float | None) -> float:
        """The β a resumed run continues with, from the checkpoint's β and the β configured when it was saved.

        Without a controller, the configured β, as stock TRL (which saves no β): a ``beta`` changed on
        resume is used. With a controller: the checkpoint's β when ``beta`` is unchanged (the run goes on
        as if uninterrupted); the new ``beta`` when it was changed (the controller restarts from it and
        keeps the rest of its state). Either way one line says which."""
        new = float(self.config.beta)
        if not self.adapts_beta:
            if saved != new:
                logger.info("unsloth_adaptive_kl: resumed with the configured beta=%.6g (the checkpoint was trained with beta=%.6g)", new, saved)
            return new
        if configured is not None and configured != new:
            logger.warning(
                "unsloth_adaptive_kl: beta was changed on resume (the checkpoint was configured with beta=%.6g, this run with "
                "beta=%.6g): the %s controller restarts from beta=%.6g instead of the checkpoint's beta=%.6g, keeping the rest "
                "of its state", configured, new, self.name, new, saved,
            )
            return new
        low, high = self.min_loaded_beta(), self.max_loaded_beta()
        if saved == 0.0 and low > 0:
            logger.warning(
                "unsloth_adaptive_kl: the %s controller resumes from the checkpoint's beta=0, which is final (the trainer "
                "no longer computes the reference log-probs): the floor of this run, %.6g, is not applied", self.name, low,
            )
        elif saved != 0.0 and not low <= saved <= high:  # a setting that bounds β changed on resume (beta_min, a range)
            kept = min(max(saved, low), high)
            logger.warning(
                "unsloth_adaptive_kl: the checkpoint's beta=%.6g is outside what this run's settings allow the %s controller, "
                "[%.6g, %.6g] (a setting that bounds beta was changed on resume): it resumes from beta=%.6g", saved, self.name,
                low, high, kept,
            )
            return kept
        logger.info("unsloth_adaptive_kl: the %s controller resumes from the checkpoint's beta=%.6g", self.name, saved)
        return saved


class FixedBeta(BetaController):
    name = "fixed"


# -- the registry --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ControllerSpec:
    """A registered β controller: its class, the parameters it reads, one line for the docs' table."""

    name: str
    cls: type
    parameters: tuple[Parameter, ...]
    summary: str
    builtin: bool


#: Name -> :class:`ControllerSpec`; :func:`controller_names` gives them in alphabetical order.
CONTROLLERS = Registry(KIND, order=lambda spec: spec.name, method_names=True)


def within_floor_and_beta(config: "ControllerConfig", value: float) -> float:
    """``value`` (a β a controller computed) kept within [``config.beta_min``, ``config.beta``]: in floating point
    ``beta_min + (beta - beta_min) * share`` can land one ulp above the configured ``beta`` at ``share = 1``, a β that a
    resume then refuses as above the configured one (found by tests/test_fuzz.py)."""
    return min(max(value, float(config.beta_min)), float(config.beta))


def register_controller(name: str, *, parameters: tuple[Parameter, ...] = (), summary: str = "", _builtin: bool = False):
    """Class decorator: register the :class:`BetaController` subclass as the β controller ``name`` of
    ``kl_adaptation_method`` (alone, or joined with shaping methods: ``"name+clip"``).

    ``parameters``: its :class:`~unsloth_adaptive_kl.declarations.Parameter` s, read as ``self.config.<name>``
    (a parameter already declared, e.g. ``beta_min``, may be reused with the same declaration); a registered
    controller's are set in ``kl_shaping_kwargs``, a built-in's are ``GRPOConfig`` fields. ``summary``: one line
    for the docs' table (the docstring's first line when empty). Every process feeds the controller the same
    global statistics, so β is the same on every rank; its :meth:`~BetaController.state_dict` goes into the checkpoint.

    A class that overrides :meth:`~BetaController.update` moves β: unless it sets ``adapts_beta`` itself, it gets
    ``adapts_beta = True`` here, so that a resumed run goes on from the checkpoint's β (``adapts_beta = False``: the
    configured ``beta`` at every resume, as stock TRL). After every ``update()`` the trainer checks ``self.beta`` as it
    checks ``trainer.beta`` (a finite float >= 0) and that ``update()`` returned it; either fault is refused naming
    the controller.
    """

    def decorator(cls):
        if not (isinstance(cls, type) and issubclass(cls, BetaController)):
            raise ValueError(f"β controller {name!r}: {cls!r} is not valid; allowed: a subclass of unsloth_adaptive_kl.BetaController")
        CONTROLLERS.claim(name, tuple(parameters))
        cls.name = name
        if cls.update is not BetaController.update and not _declares_adapts_beta(cls):
            cls.adapts_beta = True  # it moves β: a resumed run goes on from the checkpoint's β (see BetaController)
        summary_line = summary or (cls.__doc__ or "").strip().split("\n")[0]
        CONTROLLERS.add(ControllerSpec(name, cls, tuple(parameters), summary_line, _builtin))
        return cls

    return decorator


def _declares_adapts_beta(cls) -> bool:
    """Whether ``cls`` (or a base of its own below :class:`BetaController`) sets ``adapts_beta`` itself."""
    return any("adapts_beta" in vars(base) for base in cls.__mro__ if base is not BetaController and issubclass(base, BetaController))


def check_controller_beta(controller: "BetaController", returned, *, when: str, before: float | None = None) -> float:
    """The β a controller holds after ``when`` (its ``update()``, ``resume_at()``), checked as ``trainer.beta`` is: a
    finite number >= 0 (a Python int or float: a tensor or a bool is refused), and ``returned`` (what ``update()``
    returned; ``self.beta`` for a call that returns nothing) equal to it. ValueError naming the controller otherwise.
    ``before``: β before the call; a β that leaves 0 is refused (β = 0 is final: the reference log-probs are no longer
    computed). Returns β as a float, which is also stored back (an int β becomes a float, as a checkpoint reads it)."""
    who = f"β controller {controller.name!r} ({type(controller).__qualname__}) {when}"
    beta = controller.beta
    try:
        checked_beta(beta, "self.beta")
    except ValueError as error:
        raise ValueError(f"{who}: {error} (a Python float, as the trainer and its checkpoint read it)") from None
    if returned is not beta and not (_finite(returned) and returned == beta):
        raise ValueError(
            f"{who}: it returned {returned!r} but left self.beta={beta!r}: the trainer trains with self.beta, so the returned "
            "β would be lost; allowed: set self.beta to the new β and return self.beta"
        )
    if before == 0.0 and beta != 0:
        raise ValueError(
            f"{who}: it moved beta from 0 to {beta!r}; allowed: beta stays 0 once it is 0 (the trainer no longer computes "
            "the reference log-probs a non-zero beta would multiply)"
        )
    controller.beta = float(beta)
    return controller.beta


def unregister_controller(name: str) -> None:
    """Remove a controller registered with :func:`register_controller` (built-ins cannot be removed)."""
    CONTROLLERS.remove(name)


def controller_names() -> tuple[str, ...]:
    """The registered β controllers, in alphabetical order (the same in every process)."""
    return CONTROLLERS.names()


def user_controller_names() -> tuple[str, ...]:
    return CONTROLLERS.user_names()


def controller_parameters(builtin: bool | None = None) -> tuple[Parameter, ...]:
    """Every registered controller parameter once, in controller order (``builtin``: only the built-ins' or only the users')."""
    return CONTROLLERS.parameters(builtin)


def make_controller(name: str, config: ControllerConfig) -> BetaController:
    """The controller ``name`` (``"fixed"``: none, β constant) with ``config``."""
    if name == FixedBeta.name:
        return FixedBeta(config)
    if name not in CONTROLLERS:
        raise ValueError(f"β controller {name!r} is unknown; allowed: {list(controller_names())}")
    return CONTROLLERS[name].cls(config)


# -- parameters several built-in controllers read (one declaration each) ---------------------------------
BETA_MIN = Parameter(
    "beta_min",
    default=0.0,
    check=lambda value: value >= 0,
    allowed="a number >= 0",
    at_most="beta",
    help="The floor of beta under the β controllers that read it (0 <= beta_min <= beta). At 0 (reached) the "
    "reference model and the KL are no longer computed.",
)
BETA_SCHEDULE_STEPS = Parameter(
    "beta_schedule_steps",
    type=int,
    default=1000,
    check=lambda value: value >= 0,
    allowed="an integer >= 0",
    help="'dynamic': from this optimizer step on (global_step >= beta_schedule_steps), beta = beta_min, whatever the "
    "reward (logged once); set it above max_steps for no cut-off (>= 0; 0: beta_min from the first step, warned). "
    "'schedule': the optimizer step at which beta reaches beta_min (>= 1; 0 is refused: it would be a fixed beta_min).",
)


#: The keys of :meth:`BetaController.state_dict` (a controller with no state of its own saves only these).
_BASE_STATE_KEYS = {"name", "beta", "skipped_updates", "configured_beta"}
