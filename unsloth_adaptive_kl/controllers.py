"""β controllers: how the KL coefficient changes from one optimizer step to the next, and their registry.

A controller is registered with :func:`register_controller`, which declares its name and its parameters
(:class:`~unsloth_adaptive_kl.declarations.Parameter`, the declaration shaping methods and estimators use)::

    @register_controller("halve")
    class Halve(BetaController):
        adapts_beta = True

        def update(self, *, global_step, kl, num_completions):
            self.beta *= 0.5  # β halves every optimizer step
            return self.beta

Everything that lists controllers or their parameters (``kl_adaptation_method``'s grammar, the
``GRPOConfig`` fields, the docs' tables, the tests) reads this registry. A controller reads its
parameters as ``self.config.<name>``.

A controller is plain Python: it holds β and whatever history it needs, is told the step's
global statistics once per optimizer step (:meth:`BetaController.update`), and round-trips its
state through :meth:`state_dict` / :meth:`load_state_dict` (JSON-serialisable, so it can live
in ``trainer_state.json``). Every process feeds it the same global statistics, so β is the
same on every rank.

β = 0 is absorbing: once a controller reaches 0 it stays there, because the trainer then stops
computing reference log-probs and a later non-zero β would have nothing to multiply.

β is always finite and >= 0, whatever the inputs: a non-finite observation (a NaN or ±inf KL or
reward) never moves it. It is skipped, counted in ``skipped_updates`` (logged as
``adaptive_kl/skipped_updates``) and warned about once per controller; a step with no valid
token is no observation at all and changes nothing. A state loaded from a checkpoint is checked.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass

from .declarations import (
    Parameter,
    check_parameter,
    checked_beta,
    claim_method_part,
    finite_positive,
    release_method_part,
)
from .shaping import KL_TARGET

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

    def state_dict(self) -> dict:
        return {"name": self.name, "beta": self.beta, "skipped_updates": self.skipped_updates, "configured_beta": self.config.beta}

    def max_loaded_beta(self) -> float:
        """The largest β a checkpoint may hold for this controller."""
        return math.inf

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
        self.beta = self.resumed_beta(float(beta), configured)
        self.skipped_updates = skipped
        for name, value in own.items():
            setattr(self, name, value)

    def checked_own_state(self, state: dict) -> dict:
        """A subclass's own part of ``state``, checked (ValueError otherwise), as attribute name -> value to restore."""
        return {}

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
                logger.info("unsloth_adaptive_kl: resumed with the configured beta=%s (the checkpoint was trained with beta=%s)", new, saved)
            return new
        if configured is not None and configured != new:
            logger.warning(
                "unsloth_adaptive_kl: beta was changed on resume (the checkpoint was configured with beta=%s, this run with "
                "beta=%s): the %s controller restarts from beta=%s instead of the checkpoint's beta=%s, keeping the rest "
                "of its state", configured, new, self.name, new, saved,
            )
            return new
        limit = self.max_loaded_beta()
        if saved > limit:
            raise ValueError(
                f"β-controller state of the {self.name!r} controller: beta={saved!r} is not valid; allowed: a finite "
                f"number >= 0 and <= the configured beta={limit}"
            )
        logger.info("unsloth_adaptive_kl: the %s controller resumes from the checkpoint's beta=%s", self.name, saved)
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


CONTROLLERS: dict[str, ControllerSpec] = {}


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
        claim_method_part(KIND, name, tuple(parameters))
        cls.name = name
        if cls.update is not BetaController.update and not _declares_adapts_beta(cls):
            cls.adapts_beta = True  # it moves β: a resumed run goes on from the checkpoint's β (see BetaController)
        summary_line = summary or (cls.__doc__ or "").strip().split("\n")[0]
        CONTROLLERS[name] = ControllerSpec(name, cls, tuple(parameters), summary_line, _builtin)
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
    spec = CONTROLLERS.get(name)
    if spec is None or spec.builtin:
        raise ValueError(f"β controller {name!r} is not a registered user controller; allowed: {list(user_controller_names())}")
    del CONTROLLERS[name]
    release_method_part(KIND, name)


def controller_names() -> tuple[str, ...]:
    """The registered β controllers, in alphabetical order (the same in every process)."""
    return tuple(sorted(CONTROLLERS))


def user_controller_names() -> tuple[str, ...]:
    return tuple(name for name in controller_names() if not CONTROLLERS[name].builtin)


def controller_parameters(builtin: bool | None = None) -> tuple[Parameter, ...]:
    """Every registered controller parameter once, in controller order (``builtin``: only the built-ins' or only the users')."""
    seen: dict[str, Parameter] = {}
    for name in controller_names():
        spec = CONTROLLERS[name]
        if builtin is None or spec.builtin == builtin:
            for parameter in spec.parameters:
                seen.setdefault(parameter.name, parameter)
    return tuple(seen.values())


def make_controller(name: str, config: ControllerConfig) -> BetaController:
    """The controller ``name`` (``"fixed"``: none, β constant) with ``config``."""
    if name == FixedBeta.name:
        return FixedBeta(config)
    if name not in CONTROLLERS:
        raise ValueError(f"β controller {name!r} is unknown; allowed: {list(controller_names())}")
    return CONTROLLERS[name].cls(config)


# -- the built-in controllers ----------------------------------------------------------------------------
BETA_MIN = Parameter(
    "beta_min",
    default=0.0,
    check=lambda value: value >= 0,
    allowed="a number >= 0",
    at_most="beta",
    help="The floor of beta under the β controllers that read it (0 <= beta_min <= beta). At 0 (reached) the "
    "reference model and the KL are no longer computed.",
)
DYNAMIC_BETA_DECAY = Parameter(
    "dynamic_beta_decay",
    default=0.9,
    check=lambda value: 0 < value <= 1,
    allowed="a number in (0, 1]",
    help="'dynamic': beta is multiplied by this (in (0, 1]) once per new generation batch's reward (at the end of "
    "the optimizer step that received it) while the trailing mean reward exceeds reward_threshold.",
)
REWARD_THRESHOLD = Parameter(
    "reward_threshold",
    default=0.8,
    help="'dynamic': the trailing mean of the raw reward (TRL's logged `reward`) above which beta decays.",
)
REWARD_WINDOW = Parameter(
    "reward_window",
    type=int,
    default=10,
    check=lambda value: value >= 1,
    allowed="an integer >= 1",
    help="'dynamic': how many of the most recent generation batches' mean rewards form the trailing mean (>= 1).",
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
KL_HORIZON = Parameter(
    "kl_horizon",
    default=10000.0,
    check=finite_positive,
    allowed="a number > 0",
    help="'ziegler': the horizon of Ziegler et al.'s controller, in completions: "
    "beta *= 1 + clip(kl / kl_target - 1, -0.2, 0.2) * n / kl_horizon (> 0).",
)


@register_controller(
    "dynamic",
    parameters=(BETA_MIN, DYNAMIC_BETA_DECAY, REWARD_THRESHOLD, REWARD_WINDOW, BETA_SCHEDULE_STEPS),
    summary="β decays by dynamic_beta_decay while the trailing mean reward exceeds reward_threshold; β = beta_min from "
    "beta_schedule_steps on.",
    _builtin=True,
)
class DynamicBeta(BetaController):
    """Decay β while the reward is high; drop to the floor after a fixed number of steps.

    At the end of each optimizer step, with ``r`` the mean of the last ``reward_window`` finite raw
    rewards (the ``reward`` TRL logs, one value per generation batch, already gathered across
    processes):

    * if a new reward arrived since the last decay and ``r > reward_threshold``:
      ``beta = max(beta_min, beta * dynamic_beta_decay)``; so β decays at most once per generation
      batch, however many optimizer steps reuse it (``steps_per_generation`` >
      ``gradient_accumulation_steps``, ``num_iterations`` > 1);
    * from ``global_step >= beta_schedule_steps`` (counted in optimizer steps): ``beta = beta_min``.

    The raw reward is used, not the advantages: after group normalisation those average ~0.
    A NaN reward (every reward function returned None) is no observation; ±inf is skipped and counted.
    """

    adapts_beta = True

    def __init__(self, config: ControllerConfig):
        super().__init__(config)
        self.rewards: deque[float] = deque(maxlen=config.reward_window)
        self.new_reward = False  # a reward arrived that no decay has used yet
        self.apply_schedule(0)  # beta_schedule_steps=0: β starts at its floor

    def apply_schedule(self, global_step: int) -> bool:
        """From optimizer step ``beta_schedule_steps`` on, β = ``beta_min``, whatever the reward did; said
        once (when it moves β). Returns whether the schedule applies at ``global_step``."""
        cfg = self.config
        if global_step < cfg.beta_schedule_steps:
            return False
        if self.beta != cfg.beta_min:
            reward = self.trailing_reward()
            logger.warning(
                "unsloth_adaptive_kl: dynamic: from optimizer step %d (beta_schedule_steps=%d) beta = beta_min = %s (it was "
                "%s), whatever the reward (trailing mean %s, reward_threshold %s)%s",
                global_step, cfg.beta_schedule_steps, cfg.beta_min, self.beta,
                "none yet" if reward is None else f"{reward:.4g}", cfg.reward_threshold,
                "" if cfg.beta_min != 0 else ": the KL term is off from now on (kl_monitor=True: the KL is still computed "
                "against the reference model and logged)" if cfg.kl_monitor else ": the KL term and the reference model are "
                "off from now on",
            )
        self.beta = float(cfg.beta_min)
        return True

    def resume_at(self, global_step: int) -> None:
        self.apply_schedule(global_step)  # a beta changed on resume past beta_schedule_steps: the floor at once

    def observe_reward(self, reward: float) -> None:
        if reward != reward:  # NaN: every reward of the batch was None (TRL logs NaN); no observation
            return
        if not _finite(reward):
            self.skip("reward", reward)
            return
        self.rewards.append(float(reward))
        self.new_reward = True

    def trailing_reward(self) -> float | None:
        return sum(self.rewards) / len(self.rewards) if self.rewards else None

    def update(self, *, global_step: int, kl: float | None, num_completions: int) -> float:
        cfg = self.config
        if self.beta == 0.0 or self.apply_schedule(global_step):
            return self.beta
        if not self.new_reward:  # no new reward since the last decay: the same observation is not counted twice
            return self.beta
        self.new_reward = False
        reward = self.trailing_reward()
        if reward is not None and reward > cfg.reward_threshold:
            self.beta = max(float(cfg.beta_min), self.beta * cfg.dynamic_beta_decay)
        return self.beta

    def max_loaded_beta(self) -> float:
        return float(self.config.beta)  # dynamic only ever lowers β

    def state_dict(self) -> dict:
        return {**super().state_dict(), "rewards": list(self.rewards), "new_reward": self.new_reward}

    def checked_own_state(self, state: dict) -> dict:
        rewards = state.get("rewards")
        if not isinstance(rewards, list) or not all(_finite(r) for r in rewards):
            raise ValueError(f"β-controller state: rewards={rewards!r} is not valid; allowed: a list of finite numbers")
        new_reward = state.get("new_reward", False)
        if not isinstance(new_reward, bool):
            raise ValueError(f"β-controller state: new_reward={new_reward!r} is not valid; allowed: true or false")
        return {"rewards": deque((float(r) for r in rewards), maxlen=self.config.reward_window), "new_reward": new_reward}


#: The keys of :meth:`BetaController.state_dict` (a controller with no state of its own saves only these).
_BASE_STATE_KEYS = {"name", "beta", "skipped_updates", "configured_beta"}


@dataclass
class _SaturationRun:
    """Consecutive target-controller updates whose error was clipped at the same bound."""

    direction: str  # "above" (error clipped at +0.2) or "below" (at -0.2)
    beta_at_start: float  # β before the run's first update
    first_step: int  # the optimizer step of the run's first update (``global_step``: the steps done by then)
    updates: int = 0
    factor: float = 1.0  # the product of the run's full-rate factors 1 ± 0.2 * n / kl_horizon


@register_controller(
    "ziegler",
    parameters=(BETA_MIN, KL_TARGET, KL_HORIZON),
    summary="Ziegler et al.'s controller, as verl and OpenRLHF ship it ('target' before issue 49): β × (1 + "
    "clip(kl / kl_target - 1, ±0.2) n / kl_horizon); warns once a direction when saturated.",
    _builtin=True,
)
class TargetKLBeta(BetaController):
    """The adaptive KL controller of Ziegler et al. 2019, "Fine-Tuning Language Models from
    Human Preferences" (arXiv:1909.08593, section 2.2), registered as ``ziegler``; it was this package's
    ``target`` until issue 49 (``target`` is now :class:`~unsloth_adaptive_kl.target_controller.HeldTargetKL`).
    A checkpoint written by the old ``target`` (its state named ``target``, without the new controller's keys)
    resumes under ``ziegler`` exactly (:meth:`load_state_dict`).

    Once per optimizer step, with ``kl`` the step's global token-weighted mean raw KL and ``n``
    the number of completions in the step (all processes)::

        e = clip(kl / kl_target - 1, -0.2, 0.2)
        beta = max(beta_min, beta * (1 + e * n / kl_horizon))

    ``kl=None`` (β is 0, or the step had no valid token) is no observation: β stays. A NaN or ±inf
    ``kl`` is skipped and counted; so is an update whose β would overflow to inf.
    ``kl_horizon > 0.2 * n`` keeps the factor positive (:meth:`check_step_size`).

    *Saturation* (a target β cannot reach) is warned about, once per direction: a run of consecutive updates
    whose error was clipped at the same bound (``kl / kl_target - 1 >= 0.2``: "above"; ``<= -0.2``: "below",
    β held at ``beta_min`` included, since β cannot fall there) is warned about at the update where the
    product of the run's full-rate factors ``1 ± 0.2 * n / kl_horizon`` (``n`` that update's own) first
    reaches 2 ("above") or falls to 1/2 ("below"): where β, at its full rate, would have doubled or halved.
    With a constant ``n`` that is update ``ceil(ln 2 / ln(1 + 0.2 n / kl_horizon))`` of the run ("above") or
    ``ceil(ln 2 / -ln(1 - 0.2 n / kl_horizon))`` ("below"). An update not clipped in the run's direction ends
    the run; a skipped update and ``kl=None`` neither count nor end it. The run is not checkpointed.
    """

    adapts_beta = True
    #: The clip of the error ``kl / kl_target - 1`` (Ziegler et al.'s ±0.2).
    error_bound = 0.2

    def __init__(self, config: ControllerConfig):
        super().__init__(config)
        self.saturation: _SaturationRun | None = None  # the current run of updates clipped at one bound
        self.saturation_warned: set[str] = set()  # the directions already warned about

    def resume_at(self, global_step: int) -> None:
        # the run is not in the checkpoint (its format stays as it was): after a resume it restarts from 0
        self.saturation = None

    def load_state_dict(self, state: dict) -> None:
        # A state named "target" with no key of its own beyond the base's was written by this controller under its
        # old name (before issue 49): the same controller, so it resumes here exactly.
        if state.get("name") == "target" and set(state) <= _BASE_STATE_KEYS:
            state = {**state, "name": self.name}
        super().load_state_dict(state)

    def check_step_size(self, num_completions: int) -> None:
        minimum = self.error_bound * num_completions
        if not self.config.kl_horizon > minimum:
            raise ValueError(
                f"kl_horizon={self.config.kl_horizon!r} is not valid for {num_completions} completions per optimizer "
                f"step: the target-KL update factor 1 - 0.2 * {num_completions} / kl_horizon would make beta "
                f"non-positive; allowed: kl_horizon > {minimum!r}"
            )

    def update(self, *, global_step: int, kl: float | None, num_completions: int) -> float:
        cfg = self.config
        if self.beta == 0.0 or kl is None:
            return self.beta
        if not _finite(kl):
            self.skip("KL", kl)
            return self.beta
        self.check_step_size(num_completions)
        bound = self.error_bound
        error = min(max(kl / cfg.kl_target - 1.0, -bound), bound)
        factor = 1.0 + error * num_completions / cfg.kl_horizon
        beta = max(float(cfg.beta_min), self.beta * factor)
        if not math.isfinite(beta):
            self.skip("β update", beta)
            return self.beta
        before, self.beta = self.beta, beta
        # clipped: the error is at a bound, so ``factor`` is that update's full-rate factor
        direction = "above" if error >= bound else "below" if error <= -bound else None
        self.track_saturation(direction, factor, kl, before, global_step)
        return self.beta

    def track_saturation(self, direction: str | None, factor: float, kl: float, beta_before: float, global_step: int) -> None:
        """Extend (or end) the run of updates clipped in ``direction`` (None: not clipped) by this update's
        full-rate ``factor``; warn, once per direction, when the run's product of factors reaches 2 or 1/2."""
        run = self.saturation
        if direction is None:
            self.saturation = None
            return
        if run is None or run.direction != direction:
            run = self.saturation = _SaturationRun(direction, beta_before, global_step)
        run.updates += 1
        run.factor *= factor
        reached = run.factor >= 2.0 if direction == "above" else run.factor <= 0.5
        if not reached or direction in self.saturation_warned:
            return
        self.saturation_warned.add(direction)
        cfg = self.config
        if direction == "above":
            meaning = (
                f"rose from {run.beta_at_start:.4g} to {self.beta:.4g}: the target may be below what any beta reaches "
                "on this task (docs/evidence.md §7 found the KL rising with beta past ~0.1-0.3); consider a "
                "higher kl_target or a fixed beta"
            )
        else:
            if self.beta == cfg.beta_min:  # β cannot fall: saturated all the same
                moved = f"went from {run.beta_at_start:.4g} to beta_min={cfg.beta_min}"
                then = "beta is held there; consider a lower kl_target or a fixed beta"
            else:
                moved = f"fell from {run.beta_at_start:.4g} to {self.beta:.4g}"
                then = f"beta will keep falling toward beta_min={cfg.beta_min}; consider a lower kl_target or a beta_min"
            meaning = f"{moved}: the target may be above the KL this run reaches; {then}"
        logger.warning(
            "unsloth_adaptive_kl: %s: the KL has stayed more than %d %% %s kl_target=%s for %d updates in a row "
            "(optimizer steps %d-%d; this step's KL: %.4g) while beta %s (shown once per direction)",
            self.name, round(100 * self.error_bound), direction, cfg.kl_target, run.updates, run.first_step, global_step, kl, meaning,
        )


BETA_SCHEDULE = Parameter(
    "beta_schedule",
    type=str,
    default="linear",
    check=lambda value: value in ("linear", "cosine"),
    allowed="'linear' or 'cosine'",
    help="'schedule': the shape of beta's way from beta (step 0) to beta_min (step beta_schedule_steps): 'linear' "
    "or 'cosine' (half a cosine period).",
)


@register_controller(
    "schedule",
    parameters=(BETA_MIN, BETA_SCHEDULE, BETA_SCHEDULE_STEPS),
    summary="β over optimizer steps, linear or cosine (beta_schedule) from beta at step 0 to beta_min at "
    "beta_schedule_steps, then beta_min; whatever the KL and the reward.",
    _builtin=True,
)
class ScheduledBeta(BetaController):
    """β as a function of the optimizer step alone: with ``t`` the step about to start and ``S = beta_schedule_steps``,
    ``x = min(t / S, 1)`` (1 when ``S = 0``)::

        beta_t = beta_min + (beta - beta_min) * (1 - x)                  # linear
        beta_t = beta_min + (beta - beta_min) * (1 + cos(pi * x)) / 2    # cosine

    A resumed run computes β from its step, as the uninterrupted run did.
    """

    adapts_beta = True

    @classmethod
    def check_settings(cls, config: ControllerConfig) -> None:
        if config.beta_schedule_steps == 0:
            off = " (beta_min=0: no KL term at all, while a reference model is still built)" if config.beta_min == 0 else ""
            raise ValueError(
                f"beta_schedule_steps=0 is not valid with the 'schedule' β controller: beta would be beta_min="
                f"{config.beta_min} from the first optimizer step, a fixed beta that no schedule moves{off}; allowed: an "
                "integer >= 1 (the optimizer step at which beta reaches beta_min), or a fixed beta (a method without "
                "'schedule') set to the β wanted"
            )

    def __init__(self, config: ControllerConfig):
        super().__init__(config)
        self.beta = self.scheduled_beta(0)

    def scheduled_beta(self, global_step: int) -> float:
        cfg = self.config
        done = min(global_step / cfg.beta_schedule_steps, 1.0) if cfg.beta_schedule_steps else 1.0
        left = 1.0 - done if cfg.beta_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
        return cfg.beta_min + (cfg.beta - cfg.beta_min) * left

    def update(self, *, global_step: int, kl: float | None, num_completions: int) -> float:
        if self.beta != 0.0:
            self.beta = self.scheduled_beta(global_step)
        return self.beta

    def resume_at(self, global_step: int) -> None:
        self.update(global_step=global_step, kl=None, num_completions=0)

    def max_loaded_beta(self) -> float:
        return float(self.config.beta)  # the schedule only lowers β


REWARD_BETA_MIDPOINT = Parameter(
    "reward_beta_midpoint",
    default=0.5,
    help="'reward_conditioned': the step's mean reward at which beta is halfway between beta_min and beta.",
)
REWARD_BETA_WIDTH = Parameter(
    "reward_beta_width",
    default=0.1,
    check=finite_positive,
    allowed="a number > 0",
    help="'reward_conditioned': how far, in reward, beta goes from near beta_min to near beta (the logistic's scale).",
)


@register_controller(
    "reward_conditioned",
    parameters=(BETA_MIN, REWARD_BETA_MIDPOINT, REWARD_BETA_WIDTH),
    summary="β a smooth increasing function of the step's mean reward, from beta_min (the model struggles: a looser "
    "KL) to beta (it succeeds: a tighter one), after FG-ExPO's accuracy-conditioned KL scaling (arXiv 2605.11403).",
    _builtin=True,
)
class RewardConditionedBeta(BetaController):
    """β from the step's mean reward ``r`` (each generation batch's, gathered across processes), after the
    Accuracy-Conditioned KL Scaling (AKL) of FG-ExPO (Lin et al. 2026, "FG-ExPO: Frontier-Guided
    Exploration-Prioritized Policy Optimization via Adaptive KL and Gaussian Curriculum", arXiv 2605.11403): the
    KL penalty a smooth nonlinear function of the batch's mean accuracy, relaxed while the model struggles and
    tightened once it succeeds (the opposite of ``dynamic``, which relaxes β when the reward is high). The paper's
    exact function could not be retrieved here (only its abstract); this one is a logistic::

        beta_t = beta_min + (beta - beta_min) / (1 + exp(-(r - reward_beta_midpoint) / reward_beta_width))

    β starts at ``beta`` and moves once per new reward; a NaN reward is no observation, ±inf is skipped.
    β stays above ``beta_min`` (so above 0 with the default ``beta_min = 0``: the logistic is positive, and its
    argument is floored at -700 so that it cannot underflow to a β of 0, which every controller treats as final).
    """

    adapts_beta = True

    def __init__(self, config: ControllerConfig):
        super().__init__(config)
        self.reward: float | None = None  # the last reward, not yet used by an update

    def observe_reward(self, reward: float) -> None:
        if reward != reward:  # NaN: every reward of the batch was None; no observation
            return
        if not math.isfinite(reward):
            self.skip("reward", reward)
            return
        self.reward = float(reward)

    def update(self, *, global_step: int, kl: float | None, num_completions: int) -> float:
        cfg = self.config
        if self.beta == 0.0 or self.reward is None:
            return self.beta
        z = (self.reward - cfg.reward_beta_midpoint) / cfg.reward_beta_width
        self.reward = None
        # z floored at -700: exp(700) is finite and β stays above beta_min, so above 0 (β = 0 would be final)
        self.beta = cfg.beta_min + (cfg.beta - cfg.beta_min) / (1.0 + math.exp(-max(z, -700.0)))
        return self.beta

    def max_loaded_beta(self) -> float:
        return float(self.config.beta)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "reward": self.reward}

    def checked_own_state(self, state: dict) -> dict:
        reward = state.get("reward")
        if reward is not None and not _finite(reward):
            raise ValueError(f"β-controller state: reward={reward!r} is not valid; allowed: a finite number or null")
        return {"reward": None if reward is None else float(reward)}
