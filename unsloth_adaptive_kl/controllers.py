"""β controllers: how the KL coefficient changes from one optimizer step to the next.

A controller is plain Python: it holds β and whatever history it needs, is told the step's
global statistics once per optimizer step (:meth:`BetaController.update`), and round-trips its
state through :meth:`state_dict` / :meth:`load_state_dict` (JSON-serialisable, so it can live
in ``trainer_state.json``). Every process feeds it the same global statistics, so β is the
same on every rank.

β = 0 is absorbing: once a controller reaches 0 it stays there, because the trainer then stops
computing reference log-probs and a later non-zero β would have nothing to multiply.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class ControllerConfig:
    beta: float
    beta_min: float = 0.0
    dynamic_beta_decay: float = 0.9
    reward_threshold: float = 0.8
    reward_window: int = 10
    beta_schedule_steps: int = 1000
    kl_target: float = 0.1
    kl_horizon: float = 10000.0


class BetaController:
    """Base class: a constant β (used for "none" and for pure shaping)."""

    name = "fixed"

    def __init__(self, config: ControllerConfig):
        self.config = config
        self.beta = float(config.beta)

    def observe_reward(self, reward: float) -> None:
        """Record the step's raw mean reward (gathered across processes). Ignored by default."""

    def update(self, *, global_step: int, kl: float | None, num_completions: int) -> float:
        """Advance to the β of the step that starts at ``global_step``; return it."""
        return self.beta

    def state_dict(self) -> dict:
        return {"name": self.name, "beta": self.beta}

    def load_state_dict(self, state: dict) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"cannot load β-controller state of {state.get('name')!r} into a {self.name!r} controller")
        self.beta = float(state["beta"])


class FixedBeta(BetaController):
    name = "fixed"


class DynamicBeta(BetaController):
    """Decay β while the reward is high; drop to the floor after a fixed number of steps.

    Once per optimizer step, with ``r`` the mean of the last ``reward_window`` raw rewards (the
    ``reward`` TRL logs, one value per generation batch, already gathered across processes):

    * if ``r > reward_threshold``: ``beta = max(beta_min, beta * dynamic_beta_decay)``;
    * from ``global_step >= beta_schedule_steps``: ``beta = beta_min``.

    The raw reward is used, not the advantages: after group normalisation those average ~0.
    """

    name = "dynamic"

    def __init__(self, config: ControllerConfig):
        super().__init__(config)
        self.rewards: deque[float] = deque(maxlen=config.reward_window)
        if config.beta_schedule_steps == 0:
            self.beta = float(config.beta_min)

    def observe_reward(self, reward: float) -> None:
        if reward == reward:  # a batch whose every reward was None logs NaN: keep it out of the mean
            self.rewards.append(float(reward))

    def trailing_reward(self) -> float | None:
        return sum(self.rewards) / len(self.rewards) if self.rewards else None

    def update(self, *, global_step: int, kl: float | None, num_completions: int) -> float:
        cfg = self.config
        if self.beta == 0.0:
            return self.beta
        if global_step >= cfg.beta_schedule_steps:
            self.beta = float(cfg.beta_min)
            return self.beta
        reward = self.trailing_reward()
        if reward is not None and reward > cfg.reward_threshold:
            self.beta = max(float(cfg.beta_min), self.beta * cfg.dynamic_beta_decay)
        return self.beta

    def state_dict(self) -> dict:
        return {**super().state_dict(), "rewards": list(self.rewards)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.rewards = deque((float(r) for r in state["rewards"]), maxlen=self.config.reward_window)


class TargetKLBeta(BetaController):
    """The adaptive KL controller of Ziegler et al. 2019, "Fine-Tuning Language Models from
    Human Preferences" (arXiv:1909.08593, section 2.2).

    Once per optimizer step, with ``kl`` the step's global token-weighted mean raw KL and ``n``
    the number of completions in the step (all processes)::

        e = clip(kl / kl_target - 1, -0.2, 0.2)
        beta = max(beta_min, beta * (1 + e * n / kl_horizon))
    """

    name = "target"

    def update(self, *, global_step: int, kl: float | None, num_completions: int) -> float:
        cfg = self.config
        if self.beta == 0.0 or kl is None:
            return self.beta
        error = min(max(kl / cfg.kl_target - 1.0, -0.2), 0.2)
        factor = 1.0 + error * num_completions / cfg.kl_horizon
        if factor <= 0.0:
            raise ValueError(
                f"kl_horizon={cfg.kl_horizon} is too small for {num_completions} completions per step: "
                f"the target-KL update factor {factor} would make beta non-positive; use kl_horizon > "
                f"{0.2 * num_completions}"
            )
        self.beta = max(float(cfg.beta_min), self.beta * factor)
        return self.beta


CONTROLLER_CLASSES: dict[str, type[BetaController]] = {
    cls.name: cls for cls in (FixedBeta, DynamicBeta, TargetKLBeta)
}


def make_controller(name: str, config: ControllerConfig) -> BetaController:
    if name not in CONTROLLER_CLASSES:
        raise ValueError(f"β controller {name!r} is unknown; allowed: {sorted(CONTROLLER_CLASSES)}")
    return CONTROLLER_CLASSES[name](config)
