"""``target``: a β controller that holds the KL at ``kl_target`` where some β can, and says so where none can.

Designed past Ziegler et al.'s controller (kept as ``ziegler``, :class:`~unsloth_adaptive_kl.controllers.TargetKLBeta`)
from the two ways that one failed in study 33 (docs/evidence.md §7; the design and every default come from the CPU
simulator of docs/simulator.md, fitted to that study's streams):

1. *Wind-up against a KL that grows.* At a fixed β a run's KL grows over training, so an early KL below the target is
   not yet evidence that β is too high; Ziegler's controller lowered β at its full rate for as long as the KL stayed
   low, far below the β that later held the target, and the runs ran away before β climbed back.
2. *A target no β reaches.* Raising β did not lower the KL below ~0.025, and the controller raised β at its full rate
   to the end (2-39 × its start), costing reward.

The update, once per optimizer step (``t`` = updates so far, the KL an exponential mean ``m`` of the step's global
token-weighted raw KL with weight :attr:`HeldTargetKL.smoothing`)::

    e_t   = clip(ln(m_t / kl_target), -1, 1)               # error in log units; > 0: the KL is above the target
    d_t   = target_gain * e_t                               # integral action on ln β (the velocity form)
    d_t   = clip(d_t, ln target_max_fall, ln target_max_rise)   # rises faster than falls
    d_t   = max(d_t, 0) while t <= target_warmup_steps      # the KL of a run grows: no fall in the warm-up
    ln β  = clip(ln β + d_t, ln lower, ln upper)            # lower = max(beta_min, beta / target_beta_range),
                                                            # upper = beta * target_beta_range

*Anti-wind-up*: a run of updates pushing β one way (an *episode*: the error's sign unchanged, outside the ±ln 1.25
band) starts at an anchor β. Once β would move past ``response_factor`` (2) × the anchor, or β already sits at the
bound of its range that way (the range's end, or the cap set when a target is declared unreachable, below), it stops
moving further that way (it is *frozen*): pushing harder before the KL has answered would only wind up. Above the
target, after ``target_patience`` frozen updates the raw KL's mean over them is compared with the smoothed KL when the
freeze began: 20 % lower, the KL responded and a new episode starts from the current β (β may rise ×2 again). Below
the target nothing counts as a response (a KL that rises while β falls may be the run's own growth, study 33's
failure): β falls at most ×1/2 until the KL is back within the band or above it.

*An unreachable target*: if, above the target, the KL has not responded after ``target_patience`` frozen updates, the
target is declared unreachable: one warning names the least smoothed KL seen above the target and the β it was seen
at, β returns to that β and never rises above it again, and ``adaptive_kl/target_reachable`` (logged every step) goes
from 1 to 0. The test cannot tell a KL that no longer answers β from one still growing with training: on study 51's
real model (docs/evidence/study51-real-model.md) it declared a target, in 4 of 5 seeds from β0 0.01, while the KL
grew, and the least KL above the target was the first one, so β went back to where the rise began. A KL below the
target with β stopped (×1/2 or at its floor) is not declared unreachable (the KL of a run grows; the floor bounds the
fall); after ``target_patience`` such updates one warning says that β has stopped and where (study 51, from β0 1: β
stayed at half its start for the last 45 of 100 steps with the KL 30 times below the target).

*Design 2* (issue 49, study 49's Amendment 1): a push that the range's bound blocks counts as frozen. Design 1 froze
only after a ×2 move from the anchor, so an episode anchored within ×2 of the range's top (a KL that wandered into the
band and out again while β sat at its top) could never freeze: on the GPU, with a target below every KL the run
reached, β sat at 5 × β0 from updates 39-68 to 200 with the smoothed KL up to 5-20 × the target, never declared
(:attr:`freeze_at_bounds`; False is design 1, kept for the study's replays).

All of it is deterministic in the global statistics every process is given, so β is the same on every rank, and the
whole state round-trips through :meth:`state_dict` (a resumed run continues the same β series).
"""

from __future__ import annotations

import logging
import math

from .controller_base import BETA_MIN, BetaController, ControllerConfig, _finite, register_controller
from .declarations import Parameter, finite_positive
from .metrics import TARGET_REACHABLE
from .shaping import KL_TARGET

logger = logging.getLogger("unsloth_adaptive_kl")

TARGET_BETA_RANGE = Parameter(
    "target_beta_range",
    default=5.0,
    check=lambda value: math.isfinite(value) and value >= 1,
    allowed="a number >= 1",
    help="'target': beta stays within [max(beta_min, beta / target_beta_range), beta * target_beta_range] "
    "(a factor >= 1; 1 holds beta fixed).",
)
TARGET_WARMUP_STEPS = Parameter(
    "target_warmup_steps",
    type=int,
    default=20,
    check=lambda value: value >= 0,
    allowed="an integer >= 0",
    help="'target': for this many first updates beta may rise but not fall (a run's KL grows from ~0, so an early "
    "KL below kl_target is not yet a sign that beta is too high) (>= 0).",
)
TARGET_GAIN = Parameter(
    "target_gain",
    default=0.2,
    check=finite_positive,
    allowed="a number > 0",
    help="'target': ln(beta) moves by target_gain * clip(ln(smoothed KL / kl_target), -1, 1) per update, within the "
    "rise and fall limits (> 0).",
)
TARGET_MAX_RISE = Parameter(
    "target_max_rise",
    default=1.1,
    check=lambda value: math.isfinite(value) and value > 1,
    allowed="a number > 1",
    help="'target': the most beta is multiplied by in one update (> 1).",
)
TARGET_MAX_FALL = Parameter(
    "target_max_fall",
    default=0.98,
    check=lambda value: 0 < value < 1,
    allowed="a number in (0, 1)",
    help="'target': the least beta is multiplied by in one update (in (0, 1)); falls slower than rises, since a "
    "runaway costs more than a slack KL.",
)
TARGET_PATIENCE = Parameter(
    "target_patience",
    type=int,
    default=10,
    check=lambda value: value >= 1,
    allowed="an integer >= 1",
    help="'target': after this many updates with beta stopped: above kl_target, a KL that has not fallen by a fifth "
    "declares the target unreachable (warned once, adaptive_kl/target_reachable = 0, beta capped at the beta of the "
    "least KL seen above it); below it, one warning that beta has stopped (>= 1).",
)
TARGET_PARAMETERS = (BETA_MIN, KL_TARGET, TARGET_BETA_RANGE, TARGET_WARMUP_STEPS, TARGET_GAIN, TARGET_MAX_RISE,
                     TARGET_MAX_FALL, TARGET_PATIENCE)

# The state's own keys (a checkpoint of today's ``target`` has them all; one of Ziegler's, written under the name
# ``target`` before this controller existed, has none).
_STATE_KEYS = ("updates", "kl_mean", "episode", "ceiling", "reachable", "least_kl", "least_kl_beta")


@register_controller(
    "target",
    parameters=TARGET_PARAMETERS,
    summary="Steers ln β by the smoothed KL's log error toward kl_target, rising faster than falling, within "
    "target_beta_range of beta; warns of a target it deems unreachable and caps β (adaptive_kl/target_reachable 0). "
    "GPU: held in 3/15 runs (study 49), 0/10 (study 51).",
    _builtin=True,
)
class HeldTargetKL(BetaController):
    """See the module docstring for the update; the constants below are the simulator's (docs/simulator.md)."""

    adapts_beta = True
    #: Weight of the newest KL in the exponential mean the error is computed from (the step KL's noise is ~±50 %).
    smoothing = 0.2
    #: The error ``ln(m / kl_target)`` is clipped to ±this, so one wild step moves β by at most ``target_gain``.
    error_bound = 1.0
    #: Inside ±ln(band) of the target the KL counts as held: no episode runs there.
    band = 1.25
    #: How far β may move from an episode's anchor before the KL must have responded.
    response_factor = 2.0
    #: The KL responded when its mean over the frozen updates × this is at most the smoothed KL when they began.
    response = 1.25
    #: A push the range's bound (or the cap) blocks counts as frozen, as one past ×response_factor does (design 2).
    freeze_at_bounds = True

    def __init__(self, config: ControllerConfig):
        super().__init__(config)
        self.updates = 0
        self.last_kl = 0.0  # this update's KL (not state: set before it is read)
        self.kl_mean: float | None = None
        # the current episode: [direction (+1 raise / -1 lower), anchor β, smoothed KL when the freeze began (None
        # before), frozen updates, the sum of their raw KL]
        self.episode: list | None = None
        self.ceiling: float | None = None  # set once the target was declared unreachable
        self.reachable = True
        self.least_kl: float | None = None  # least smoothed KL while the KL was above the target, and its β
        self.least_kl_beta: float | None = None
        self.stop_warned = False  # the stop below the target said (once a run; not state: a resumed run may say it again)

    # -- bounds ---------------------------------------------------------------------------------------
    def lower(self) -> float:
        cfg = self.config
        return max(float(cfg.beta_min), cfg.beta / cfg.target_beta_range)

    def upper(self) -> float:
        upper = self.config.beta * self.config.target_beta_range
        # the cap of an unreachable target, never below the range (a resume may have changed the range since it was set)
        return upper if self.ceiling is None else min(upper, max(self.ceiling, self.lower()))

    def max_loaded_beta(self) -> float:
        return self.config.beta * self.config.target_beta_range

    def min_loaded_beta(self) -> float:
        return self.lower()

    # -- the update -----------------------------------------------------------------------------------
    def update(self, *, global_step: int, kl: float | None, num_completions: int) -> float:
        cfg = self.config
        if self.beta == 0.0 or kl is None:
            return self.beta
        if not _finite(kl):
            self.skip("KL", kl)
            return self.beta
        kl = max(float(kl), 0.0)  # an estimator that can go negative (k1): its mean below 0 is a KL of ~0
        self.updates += 1
        self.last_kl = kl
        self.kl_mean = kl if self.kl_mean is None else self.kl_mean + self.smoothing * (kl - self.kl_mean)
        error = self.log_error()
        step = min(max(cfg.target_gain * error, math.log(cfg.target_max_fall)), math.log(cfg.target_max_rise))
        if self.updates <= cfg.target_warmup_steps:
            step = max(step, 0.0)
        step = self.anti_wind_up(step, error, global_step)
        beta = min(max(self.beta * math.exp(step), self.lower()), self.upper())
        self.beta = beta
        return self.beta

    def log_error(self) -> float:
        """``clip(ln(smoothed KL / kl_target), ±error_bound)``; a smoothed KL of 0 is the bound below."""
        if self.kl_mean <= 0:
            return -self.error_bound
        return min(max(math.log(self.kl_mean / self.config.kl_target), -self.error_bound), self.error_bound)

    def anti_wind_up(self, step: float, error: float, global_step: int) -> float:
        """This update's log step after the episode's check: 0 in a direction where the KL has not responded."""
        if abs(error) <= math.log(self.band):
            self.episode = None  # held: no push to watch
            return step
        direction = 1 if error > 0 else -1
        if direction > 0 and (self.least_kl is None or self.kl_mean < self.least_kl):
            self.least_kl, self.least_kl_beta = self.kl_mean, self.beta
        if self.episode is None or self.episode[0] != direction:
            self.episode = [direction, self.beta, None, 0, 0.0]  # direction, anchor β, reference KL, frozen, their KL sum
            return step
        at_bound = self.freeze_at_bounds and (self.beta >= self.upper() if direction > 0 else self.beta <= self.lower())
        if not at_bound and direction * (math.log(self.beta / self.episode[1]) + step) < math.log(self.response_factor):
            return step
        # β has moved ×2 from the anchor, or sits at its bound: go no further that way until the KL responds
        if self.episode[2] is None:
            self.episode[2] = self.kl_mean  # the smoothed KL when the freeze began
        self.episode[3] += 1
        self.episode[4] += self.last_kl
        if direction < 0 and self.episode[3] >= self.config.target_patience and not self.stop_warned:
            self.warn_stopped_below(global_step)
        if direction > 0 and self.episode[3] >= self.config.target_patience:
            # the raw KL's mean over the frozen updates 20 % below the smoothed KL when they began: it responded
            if self.episode[4] / self.episode[3] * self.response <= self.episode[2]:
                self.episode = [direction, self.beta, None, 0, 0.0]
                return step
            if self.reachable:
                self.declare_unreachable(global_step)
        return min(step, 0.0) if direction > 0 else max(step, 0.0)

    def warn_stopped_below(self, global_step: int) -> None:
        """Says (once a run) that β has stopped falling with the KL still below the target: at half the β where the
        fall began, or at the range's lower bound. β stays there until the KL rises (study 51: from β0 1, for the
        last 45 of 100 steps, with the KL 30 times below the target, and nothing said)."""
        cfg = self.config
        where = (f"its lower bound ({self.lower():.4g}: beta / target_beta_range, or beta_min)" if self.beta <= self.lower()
                 else f"half the beta where this fall began ({self.episode[1]:.4g})")
        self.stop_warned = True
        logger.warning(
            "unsloth_adaptive_kl: target: the KL has stayed below kl_target=%s (smoothed %.4g) for %d updates with beta "
            "stopped at %.4g, %s, at optimizer step %d: below the target, target lowers beta no further until the KL "
            "rises (a run's KL grows with training). If it does not rise, the target is above the KL this run reaches "
            "near this beta: a lower kl_target, a lower beta or a fixed beta (shown once)",
            cfg.kl_target, self.kl_mean, self.episode[3], self.beta, where, global_step,
        )

    def declare_unreachable(self, global_step: int) -> None:
        cfg = self.config
        self.reachable = False
        self.ceiling = max(self.least_kl_beta, self.lower())
        logger.warning(
            "unsloth_adaptive_kl: target: kl_target=%s is not reachable in this run: the KL stayed above it while beta "
            "rose to %.4g, and did not fall by a fifth over %d updates with beta held there. Its least smoothed value "
            "above the target was %.4g, at beta=%.4g. Beta is capped at %.4g from optimizer step %d on "
            "(adaptive_kl/target_reachable = 0). A KL still growing with training looks the same to this test; then "
            "consider a higher kl_target, a wider target_beta_range or a fixed beta (shown once)",
            cfg.kl_target, self.beta, self.episode[3], self.least_kl, self.least_kl_beta, self.ceiling, global_step,
        )
        self.beta = min(self.beta, self.ceiling)

    def metrics(self) -> dict[str, float]:
        """What this controller logs each step besides β."""
        return {TARGET_REACHABLE: 1.0 if self.reachable else 0.0}

    def idle_reason(self) -> str | None:
        cfg = self.config
        if self.kl_mean is None:
            return "no step had a KL to steer on"
        if self.kl_mean < cfg.kl_target and self.updates <= cfg.target_warmup_steps:
            return (f"its smoothed KL ({self.kl_mean:.4g}) stayed below kl_target={cfg.kl_target:g}, and in its first "
                    f"target_warmup_steps={cfg.target_warmup_steps} updates target may raise beta but not lower it")
        if self.kl_mean < cfg.kl_target and self.beta <= self.lower():
            return (f"its smoothed KL ({self.kl_mean:.4g}) was below kl_target={cfg.kl_target:g} with beta at its lower "
                    f"bound ({self.lower():g}: beta / target_beta_range, or beta_min)")
        return None

    # -- checkpoint -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            **super().state_dict(),
            "updates": self.updates, "kl_mean": self.kl_mean, "episode": None if self.episode is None else list(self.episode),
            "ceiling": self.ceiling, "reachable": self.reachable, "least_kl": self.least_kl, "least_kl_beta": self.least_kl_beta,
        }

    def own_state_for_new_beta(self, own: dict) -> dict:
        """Restarted from a changed ``beta``: the episode (its anchor β) and an unreachable target's cap (a β, with the
        least KL's β) were set in the old β's units, outside the new range perhaps: they start afresh, the target
        reachable again. The smoothed KL and the update count are kept."""
        if own["episode"] is not None or own["ceiling"] is not None:
            logger.info(
                "unsloth_adaptive_kl: target: beta was changed on resume: its current episode and the cap of an unreachable "
                "target, set in the old beta's units, start afresh; its smoothed KL (%s) is kept", own["kl_mean"],
            )
        return {**own, "episode": None, "ceiling": None, "reachable": True, "least_kl": None, "least_kl_beta": None}

    def checked_own_state(self, state: dict) -> dict:
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(
                "β-controller state of the 'target' controller has no " + ", ".join(missing) + ": it was written by "
                "'target' before issue 49, which was Ziegler et al.'s controller, now named 'ziegler'. Allowed: "
                "resume it with kl_adaptation_method='ziegler' (with the same shaping methods) to continue that "
                "controller exactly, or set restart_beta_controller=True to start the new 'target' fresh"
            )

        def number(key, positive=False, optional=True):
            value = state[key]
            if value is None and optional:
                return None
            if not _finite(value) or value < 0 or (positive and value <= 0):
                raise ValueError(f"β-controller state: {key}={value!r} is not valid; allowed: a finite number >= 0"
                                 + (" (> 0)" if positive else "") + (" or null" if optional else ""))
            return float(value)

        updates = state["updates"]
        if isinstance(updates, bool) or not isinstance(updates, int) or updates < 0:
            raise ValueError(f"β-controller state: updates={updates!r} is not valid; allowed: an integer >= 0")
        reachable = state["reachable"]
        if not isinstance(reachable, bool):
            raise ValueError(f"β-controller state: reachable={reachable!r} is not valid; allowed: true or false")
        episode = state["episode"]
        if episode is not None:
            ok = (isinstance(episode, list) and len(episode) == 5 and episode[0] in (1, -1) and _finite(episode[1])
                  and episode[1] > 0 and (episode[2] is None or (_finite(episode[2]) and episode[2] >= 0))
                  and isinstance(episode[3], int) and not isinstance(episode[3], bool) and episode[3] >= 0
                  and _finite(episode[4]) and episode[4] >= 0)
            if not ok:
                raise ValueError(f"β-controller state: episode={episode!r} is not valid; allowed: null or "
                                 "[1 or -1, beta > 0, KL >= 0 or null, frozen updates >= 0, KL sum >= 0]")
            episode = [int(episode[0]), float(episode[1]), None if episode[2] is None else float(episode[2]),
                       int(episode[3]), float(episode[4])]
        return {
            "updates": updates, "kl_mean": number("kl_mean"), "episode": episode, "ceiling": number("ceiling", positive=True),
            "reachable": reachable, "least_kl": number("least_kl"), "least_kl_beta": number("least_kl_beta", positive=True),
        }
