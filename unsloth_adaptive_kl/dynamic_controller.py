"""``dynamic``: β decays while the trailing mean reward is high, and drops to ``beta_min`` after a fixed number of
optimizer steps (the seed project's controller). Pure Python."""

from __future__ import annotations

from collections import deque

from .controller_base import BETA_MIN, BETA_SCHEDULE_STEPS, BetaController, ControllerConfig, _finite, logger, register_controller
from .declarations import Parameter

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
        self.peak_reward: float | None = None  # the highest trailing mean reward seen by this process (idle_reason)
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
        trailing = self.trailing_reward()
        self.peak_reward = trailing if self.peak_reward is None else max(self.peak_reward, trailing)

    def idle_reason(self) -> str | None:
        cfg = self.config
        if self.peak_reward is None:
            return "no finite reward arrived"
        if self.peak_reward <= cfg.reward_threshold:
            return (f"its trailing mean reward (the last reward_window={cfg.reward_window} rewards) peaked at "
                    f"{self.peak_reward:.4g}, never above reward_threshold={cfg.reward_threshold:g}: set reward_threshold "
                    "to a reward your task reaches")
        return None

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

    def min_loaded_beta(self) -> float:
        return float(self.config.beta_min)

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
