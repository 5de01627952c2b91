"""``schedule``: β as a function of the optimizer step alone, linear or cosine from ``beta`` to ``beta_min``. Pure
Python."""

from __future__ import annotations

import math

from .controller_base import (
    BETA_MIN,
    BETA_SCHEDULE_STEPS,
    BetaController,
    ControllerConfig,
    within_floor_and_beta,
    register_controller,
)
from .declarations import Parameter

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
        return within_floor_and_beta(cfg, cfg.beta_min + (cfg.beta - cfg.beta_min) * left)

    def update(self, *, global_step: int, kl: float | None, num_completions: int) -> float:
        if self.beta != 0.0:
            self.beta = self.scheduled_beta(global_step)
        return self.beta

    def resume_at(self, global_step: int) -> None:
        self.update(global_step=global_step, kl=None, num_completions=0)

    def max_loaded_beta(self) -> float:
        return float(self.config.beta)  # the schedule only lowers β

    def min_loaded_beta(self) -> float:
        return float(self.config.beta_min)
