"""``reward_conditioned``: β a smooth increasing function of the step's mean reward, after FG-ExPO's
accuracy-conditioned KL scaling (arXiv 2605.11403). Pure Python."""

from __future__ import annotations

import math

from .controller_base import BETA_MIN, BetaController, ControllerConfig, _finite, within_floor_and_beta, register_controller
from .declarations import Parameter, finite_positive

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
        self.beta = within_floor_and_beta(cfg, cfg.beta_min + (cfg.beta - cfg.beta_min) / (1.0 + math.exp(-max(z, -700.0))))
        return self.beta

    def max_loaded_beta(self) -> float:
        return float(self.config.beta)

    def min_loaded_beta(self) -> float:
        return float(self.config.beta_min)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "reward": self.reward}

    def checked_own_state(self, state: dict) -> dict:
        reward = state.get("reward")
        if reward is not None and not _finite(reward):
            raise ValueError(f"β-controller state: reward={reward!r} is not valid; allowed: a finite number or null")
        return {"reward": None if reward is None else float(reward)}
