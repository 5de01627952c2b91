"""β controllers: how the KL coefficient changes from one optimizer step to the next.

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

from .config import DEFAULTS, checked_beta

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


@dataclass(frozen=True)
class ControllerConfig:
    beta: float
    beta_min: float = DEFAULTS["beta_min"]
    dynamic_beta_decay: float = DEFAULTS["dynamic_beta_decay"]
    reward_threshold: float = DEFAULTS["reward_threshold"]
    reward_window: int = DEFAULTS["reward_window"]
    beta_schedule_steps: int = DEFAULTS["beta_schedule_steps"]
    kl_target: float = DEFAULTS["kl_target"]
    kl_horizon: float = DEFAULTS["kl_horizon"]

    @classmethod
    def from_config(cls, config) -> "ControllerConfig":
        """From any object with ``beta`` and the controller fields (a ``GRPOConfig``)."""
        return cls(
            beta=float(config.beta),
            beta_min=float(config.beta_min),
            dynamic_beta_decay=float(config.dynamic_beta_decay),
            reward_threshold=float(config.reward_threshold),
            reward_window=int(config.reward_window),
            beta_schedule_steps=int(config.beta_schedule_steps),
            kl_target=float(config.kl_target),
            kl_horizon=float(config.kl_horizon),
        )

    def __post_init__(self):
        checked_beta(self.beta)
        if not (_finite(self.beta_min) and 0 <= self.beta_min <= self.beta):
            raise ValueError(f"beta_min={self.beta_min!r} is not valid; allowed: a number in [0, beta={self.beta!r}]")


class BetaController:
    """Base class: a constant β (used for "none" and for pure shaping)."""

    name = "fixed"

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

    name = "dynamic"
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
                ": the KL term and the reference model are off from now on" if cfg.beta_min == 0 else "",
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


class TargetKLBeta(BetaController):
    """The adaptive KL controller of Ziegler et al. 2019, "Fine-Tuning Language Models from
    Human Preferences" (arXiv:1909.08593, section 2.2).

    Once per optimizer step, with ``kl`` the step's global token-weighted mean raw KL and ``n``
    the number of completions in the step (all processes)::

        e = clip(kl / kl_target - 1, -0.2, 0.2)
        beta = max(beta_min, beta * (1 + e * n / kl_horizon))

    ``kl=None`` (β is 0, or the step had no valid token) is no observation: β stays. A NaN or ±inf
    ``kl`` is skipped and counted; so is an update whose β would overflow to inf.
    ``kl_horizon > 0.2 * n`` keeps the factor positive (:meth:`check_step_size`).
    """

    name = "target"
    adapts_beta = True

    def check_step_size(self, num_completions: int) -> None:
        minimum = 0.2 * num_completions
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
        error = min(max(kl / cfg.kl_target - 1.0, -0.2), 0.2)
        beta = max(float(cfg.beta_min), self.beta * (1.0 + error * num_completions / cfg.kl_horizon))
        if not math.isfinite(beta):
            self.skip("β update", beta)
            return self.beta
        self.beta = beta
        return self.beta


CONTROLLER_CLASSES: dict[str, type[BetaController]] = {
    cls.name: cls for cls in (FixedBeta, DynamicBeta, TargetKLBeta)
}


def make_controller(name: str, config: ControllerConfig) -> BetaController:
    if name not in CONTROLLER_CLASSES:
        raise ValueError(f"β controller {name!r} is unknown; allowed: {sorted(CONTROLLER_CLASSES)}")
    return CONTROLLER_CLASSES[name](config)
