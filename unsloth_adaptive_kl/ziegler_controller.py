"""``ziegler``: the adaptive KL controller of Ziegler et al. 2019, as verl and OpenRLHF ship it (this package's
``target`` before issue 49), with the warning of a saturated run. Pure Python."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .controller_base import _BASE_STATE_KEYS, BETA_MIN, BetaController, ControllerConfig, _finite, logger, register_controller
from .declarations import Parameter, finite_positive
from .shaping import KL_TARGET

KL_HORIZON = Parameter(
    "kl_horizon",
    default=10000.0,
    check=finite_positive,
    allowed="a number > 0",
    help="'ziegler': the horizon of Ziegler et al.'s controller, in completions: "
    "beta *= 1 + clip(kl / kl_target - 1, -0.2, 0.2) * n / kl_horizon (> 0).",
)


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

    def min_loaded_beta(self) -> float:
        return float(self.config.beta_min)

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
