"""``AdaptiveKL``: what a backend holds: the :class:`~unsloth_adaptive_kl.kl_term.KLTerm` (the
per-token math, immutable) and the β controller, and the per-step statistics that turn into β
updates and metrics.

Pure torch. A backend supplies a ``reduce`` (sum across processes) and a metrics sink.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from . import metrics, tail
from .config import build
from .controllers import BetaController, ControllerMismatchError, FixedBeta, check_controller_beta, make_controller
from .declarations import checked_beta
from .estimators import nonfinite_estimator_error
from .kl_pipeline import KLPlan, TokenKL, generation_edits, plan_kl, scores_reference
from .kl_term import KLTerm
from .method import format_method
from .runaway import RunawayAlarm

logger = logging.getLogger("unsloth_adaptive_kl")


class BetaCourse:
    """The β each optimizer step of one ``train()`` trained with, summed up as it goes (``AdaptiveKL.end_step`` adds
    each step): the first and last, the extremes, at how many steps it differed from the step before, and how many
    updates moved the controller's β (the last update's β trains no step of this run, but it shows the controller
    acted)."""

    def __init__(self):
        self.steps = self.changes = self.updates_that_moved = 0
        self.first = self.last = self.low = self.high = None

    def add(self, used: float, after: float) -> None:
        if self.steps and used != self.last:
            self.changes += 1
        self.first = used if self.first is None else self.first
        self.low = used if self.low is None else min(self.low, used)
        self.high = used if self.high is None else max(self.high, used)
        self.last = used
        self.steps += 1
        self.updates_that_moved += after != used


def _no_reduce(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class AdaptiveKL:
    """The adaptive-KL state of one trainer (or one loss module): ``term`` and ``controller``.

    ``config`` is any object with the adaptive-KL fields and ``beta`` (a ``GRPOConfig``).
    ``reduce`` sums a tensor across processes (``accelerator.reduce(t, "sum")``); identity by default.
    ``process_index`` / ``num_processes``: this process's rank and the world size (the tail metrics'
    max and min travel in one slot per process).
    """

    def __init__(self, config, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, *, process_index: int = 0, num_processes: int = 1):
        settings = build(config)  # the one validation of the config
        self.term: KLTerm = settings.term
        self.term.check_user_functions()
        self.controller: BetaController = make_controller(self.term.method.controller, settings.controller)
        check_controller_beta(self.controller, self.controller.beta, when="when it was created")
        self.reduce = reduce or _no_reduce
        self.process_index, self.num_processes = process_index, num_processes
        for name, value, why in settings.unread if process_index == 0 else ():  # said once, by the main process
            logger.warning("unsloth_adaptive_kl: %s=%r has no effect: %s", name, value, why)
        self.monitor = settings.monitor  # kl_monitor: the KL is computed and logged at β = 0 too
        self.monitor_every = settings.monitor_every  # ... on every monitor_every-th generation batch of training
        self.alarm = RunawayAlarm()  # fed each optimizer step with its KL and reward (end_step)
        self._step_sums: torch.Tensor | None = None
        self._tail_window: dict[bool, tail.TailTotals | None] = {True: None, False: None}  # by training
        self._warned_nonfinite = False
        self.course = BetaCourse()  # what β did over this train() (begin_training starts a new one)

    # -- the per-token math: the term's ---------------------------------------------------------
    @property
    def method(self):
        return self.term.method

    @property
    def estimator(self) -> str:
        return self.term.estimator

    @property
    def beta(self) -> float:
        """β: the controller's, the one place it lives (``trainer.beta`` and a loss module's ``beta`` read it here)."""
        return self.controller.beta

    @beta.setter
    def beta(self, value) -> None:
        """Set β by hand (``trainer.beta = x``, ``module.beta = x``; a number or a 0-dim tensor): the controller goes on from it."""
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        self.controller.beta = float(checked_beta(value))

    @property
    def length_normalized(self) -> bool:
        return self.term.length_normalized

    @property
    def is_stock(self) -> bool:
        return self.term.is_stock

    @property
    def kl_in_loss(self) -> bool:
        """Whether the loss carries β·KL (``kl_placement="loss"``); under "reward" the KL acts at scoring time only."""
        return self.term.placement == "loss"

    def batch_statistic(self, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        return self.term.batch_statistic(ref_logp, mask)

    def monitors_batch(self, index: int, *, training: bool = True) -> bool:
        """Whether ``kl_monitor`` runs the reference forward at β = 0 for generation batch ``index`` (0, 1, ... in
        training): every ``kl_monitor_every``-th, the first included; every evaluation batch. A function of the index
        alone, which every process computes from the same counters, so all ranks take the same decision."""
        return self.monitor and (not training or index % self.monitor_every == 0)

    def plan(self, ref_logps) -> KLPlan:
        """What this batch does with the KL (:func:`~unsloth_adaptive_kl.kl_pipeline.plan_kl`), from the controller's β
        and what its generation batch carries (``ref_logps``: the reference's log-probs, or None)."""
        return plan_kl(self.term, beta=self.beta, monitor=self.monitor, reference_scored=ref_logps is not None)

    @property
    def generation_edits(self) -> frozenset[str]:
        """The features that edit the library's generation for this run (:func:`~unsloth_adaptive_kl.kl_pipeline.generation_edits`)."""
        return generation_edits(self.term, monitor=self.monitor)

    def scores_reference(self, batch_index: Callable[[], int], *, training: bool) -> bool:
        """Whether the generation batch being made scores the reference: while β != 0, and at β = 0 under ``kl_monitor``
        on the batches :meth:`monitors_batch` selects (``batch_index()``: its index, read only then)."""
        return scores_reference(
            self.beta, monitor=self.monitor, monitored_batch=lambda: self.monitors_batch(batch_index() if training else 0, training=training)
        )

    def computes_kl_with(self, ref_logps) -> bool:
        """Whether this micro-batch computes the KL, from what its generation batch carries: while β != 0; at β = 0
        under ``kl_monitor`` when the reference forward ran for its generation batch (``ref_logps`` is not None)."""
        return self.plan(ref_logps).computes_kl

    def per_token(self, logp, ref_logp, mask, coef=None, statistic=None, estimator=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(raw, adapted)`` per-token KL: :meth:`KLTerm.per_token`. No branch on β here: compiled callers
        (the Liger module) would guard on its value and recompile at every new β."""
        return self.term.per_token(logp, ref_logp, mask, coef, statistic, estimator)

    # -- statistics, metrics and β -------------------------------------------------------------
    def record(self, raw: torch.Tensor | None, adapted: torch.Tensor | None, mask: torch.Tensor, *, training: bool, beta: float) -> dict[str, float]:
        """Reduce this micro-batch's KL sums across processes; return the metric values.

        In training, also accumulate the sums for this optimizer step's controller update.
        With ``raw is None`` (β is 0, no KL computed) only ``current_beta`` is reported and the
        KL metrics are NaN, which the trainer's logger shows as missing.
        """
        sums = None if raw is None else metrics.local_metric_sums(raw, adapted, mask, count_shaping_faults=bool(self.term.user_shaping_steps))
        return self.record_sums(sums, training=training, beta=beta)

    def record_kl(self, kl: TokenKL | None, *, training: bool) -> dict[str, float]:
        """:meth:`record` of a :class:`~unsloth_adaptive_kl.kl_pipeline.TokenKL` (over its ``kl_mask``), or of no KL."""
        if kl is None:
            return self.record_sums(None, training=training, beta=self.beta)
        return self.record(kl.raw, kl.adapted, kl.kl_mask, training=training, beta=kl.plan.beta)

    def record_sums(self, local_sums: torch.Tensor | None, *, training: bool, beta: float) -> dict[str, float]:
        """As :meth:`record`, from :func:`metrics.local_metric_sums` computed elsewhere (e.g. in a fused loss).

        One reduce and one read to the host per micro-batch (the one host sync of the metrics): the tail
        histogram rides in the same tensor, and the check of the user functions reads the same copy. A user
        estimator (counted by Unsloth's compiled loss, which calls it unchecked) or shaping step that made a finite
        KL NaN or inf is refused here, on every process alike (the totals are global), before the step's optimizer
        update."""
        totals = read = reduced_tail = None
        if local_sums is not None:
            spread_tail = tail.spread(local_sums[metrics.NUM_SUMS :], self.process_index, self.num_processes)
            totals = self.reduce(torch.cat([local_sums[: metrics.NUM_SUMS], spread_tail]))
            host = totals.cpu()
            read, reduced_tail = host[: metrics.NUM_SUMS].tolist(), host[metrics.NUM_SUMS :]
        if read is not None:
            self.refuse_user_faults(read[metrics.ESTIMATOR_FAULTS], read[metrics.SHAPING_FAULTS])
        if training and totals is not None and self.kl_in_loss:  # under "reward" the controller sees the scoring-time KL
            sums = totals[: metrics.NUM_SUMS]
            self._step_sums = sums if self._step_sums is None else self._step_sums + sums
        values = metrics.metric_values(read, length_normalized=self.length_normalized)
        if values.get(metrics.NONFINITE_KL_BATCHES) and not self._warned_nonfinite:
            self._warned_nonfinite = True
            logger.warning(
                "unsloth_adaptive_kl: a micro-batch's KL was NaN or inf on a valid token (raw_kl=%s, adapted_kl=%s; e.g. a NaN "
                "or inf log-prob from the model): it is left out of adaptive_kl/raw_kl and adaptive_kl/adapted_kl, and each "
                "logging window counts such micro-batches in %s (this warning is shown once)",
                values[metrics.RAW_KL], values[metrics.ADAPTED_KL], metrics.NONFINITE_KL_BATCHES,
            )
        if reduced_tail is not None:
            values.update(self._tail_values(reduced_tail, training))
        return {metrics.CURRENT_BETA: float(beta), **values}

    def _tail_values(self, reduced_tail: torch.Tensor, training: bool) -> dict[str, float]:
        """Add this micro-batch's histogram to the logging window's; the window's tail statistics (NaN: no token)."""
        totals = tail.TailTotals.from_reduced(reduced_tail)
        window = self._tail_window[training]
        window = self._tail_window[training] = totals if window is None else window + totals
        return metrics.tail_values(tail.statistics(window))

    def restart_tail_window(self, training: bool) -> None:
        """Start a new logging window for the tail metrics (the trainer's log flushed the last one)."""
        self._tail_window[training] = None

    def refuse_user_faults(self, estimator_tokens: float, shaping_tokens: float, *, when: str = "") -> None:
        """Raise ValueError naming the user estimator or shaping step(s) if the counts of tokens they made NaN or inf
        on finite inputs (:data:`metrics.ESTIMATOR_FAULTS`, :data:`metrics.SHAPING_FAULTS`, read on the host) are not 0.
        The estimator first: its NaN reaches the shaping as a non-finite KL, which no step is blamed for. ``when``:
        appended to the message (a check made after the call that had the fault)."""
        if estimator_tokens > 0:
            error = nonfinite_estimator_error(self.estimator, int(estimator_tokens))
        elif shaping_tokens > 0:
            error = self._shaping_fault(int(shaping_tokens))
        else:
            return
        raise ValueError(f"{error}{when}")

    def _shaping_fault(self, tokens: int) -> ValueError:
        names = self.term.user_shaping_steps
        who = f"shaping method {names[0]!r}" if len(names) == 1 else (
            f"one of the shaping methods {', '.join(map(repr, names))} (applied in this order)"
        )
        return ValueError(
            f"{who} returned NaN or inf on valid tokens whose KL was finite ({tokens} of them) in "
            f"kl_adaptation_method={self.method_text!r}: the bug is in that function; allowed: a finite value for every "
            "finite KL"
        )

    def observe_scoring_sums(self, local_sums: torch.Tensor) -> torch.Tensor:
        """Under ``kl_placement="reward"``: a generation batch's KL sums (:func:`metrics.local_kl_sums` at
        scoring time), reduced across processes and kept for this optimizer step's controller update.
        Returns the totals."""
        totals = self.reduce(local_sums)
        if self.term.user_shaping_steps:  # the estimator is checked where it ran (eagerly, at scoring time)
            self.refuse_user_faults(0, totals[metrics.SHAPING_FAULTS].item())
        self._step_sums = totals if self._step_sums is None else self._step_sums + totals
        return totals

    def observe_reward(self, reward: float) -> None:
        self.controller.observe_reward(reward)
        self.alarm.observe_reward(reward)

    def check_model(self, *, vocab_size: int | None) -> None:
        """Refuse settings that do not fit the model they train, when a trainer is attached (ValueError naming the
        field): ``vocab_size``, how many token ids the model can sample (None: unknown, not checked), against the KL
        term's token ids (:meth:`KLTerm.check_vocabulary`)."""
        self.term.check_vocabulary(vocab_size)

    def check_step_size(self, num_completions: int) -> None:
        """Refuse, when the trainer is created, a configuration that ``num_completions`` completions per
        optimizer step (all processes) would break at its first update (``target``'s ``kl_horizon``)."""
        self.controller.check_step_size(num_completions)

    @property
    def skipped_updates(self) -> int:
        return self.controller.skipped_updates

    def end_step(self, global_step: int) -> float:
        """Update β once per optimizer step; ``global_step`` is the index of the step about to start.

        A step with no valid token (every completion masked, e.g. all truncated under
        ``mask_truncated_completions``) has no KL: the controller gets ``kl=None``, not 0.
        """
        sums, self._step_sums = self._step_sums, None
        if sums is None or sums[metrics.TOKENS].item() == 0:
            kl = None
        else:
            kl = metrics.token_mean(sums[metrics.RAW_SUM].item(), sums[metrics.TOKENS].item())
        completions = 0 if sums is None else int(sums[metrics.COMPLETIONS].item())
        self.watch_runaway(global_step, kl)
        before = self.controller.beta
        returned = self.controller.update(global_step=global_step, kl=kl, num_completions=completions)
        beta = check_controller_beta(self.controller, returned, when=f"after update(global_step={global_step})", before=before)
        self.course.add(before, beta)
        return beta

    def begin_training(self) -> None:
        """A ``train()`` starts: the β course is counted from its first step."""
        self.course = BetaCourse()

    def course_summary(self) -> tuple[int, str] | None:
        """What β did over this ``train()``, for the one line logged when it ends (level, message): INFO with the β of
        the first and last steps and how often it changed; WARNING when a β controller never moved β (it trained as
        a fixed β would), with the controller's reason where it knows one. None for a fixed β, or before any step."""
        course, controller = self.course, self.controller
        if not controller.adapts_beta or course.steps == 0:
            return None
        steps = f"{course.steps} optimizer step{'s' if course.steps != 1 else ''} of this run"
        if course.changes == 0 and course.updates_that_moved == 0:
            # a β of 0 stays 0 under every controller that never moved it; otherwise the controller may know why
            low, high = controller.min_loaded_beta(), controller.max_loaded_beta()  # its settings' bounds on β
            reason = (f"beta is 0, which {controller.name} leaves at 0" if course.first == 0 else
                      f"its settings leave beta one value, {low:g} (e.g. beta_min = beta)" if low == high else controller.idle_reason())
            return logging.WARNING, (
                f"unsloth_adaptive_kl: kl_adaptation_method={self.method_text!r} never moved beta in the {steps}: every "
                f"step trained with beta {course.first:g}, as a fixed beta would" + (f"; {reason}" if reason else "")
                + f" ({metrics.CURRENT_BETA} logs the beta of each step)"
            )
        return logging.INFO, (
            f"unsloth_adaptive_kl: kl_adaptation_method={self.method_text!r}: beta {course.first:g} -> {course.last:g} "
            f"over the {steps} (the beta each step trained with; it changed at {course.changes} of them, lowest "
            f"{course.low:g}, highest {course.high:g})"
        )

    def watch_runaway(self, step: int, kl: float | None) -> None:
        """Feed the runaway alarm the step's KL (the loss's, the scoring-time KL under ``kl_placement="reward"``, or
        ``kl_monitor``'s at β = 0; None on a step without one); warn the one time it fires."""
        if not self.alarm.end_step(step, kl):
            return
        signal, rule = self.alarm.last, self.alarm.rule
        logger.warning(
            "unsloth_adaptive_kl: runaway alarm at step %d: at %d consecutive steps with a KL, its recent mean (the last %d "
            "steps, at least %d observed KLs) was >= %gx its median over the %d steps before (now %.1fx) while the mean "
            "reward fell (now from %.4g to %.4g); the policy may be running away from the reference (a larger beta, or a "
            "checkpoint from before this step). Logged as %s = 1 from this step on; this warning is shown once "
            "(docs/runaway.md)",
            step, rule.confirmations, rule.recent_steps, rule.min_recent_observations, rule.kl_ratio, rule.base_steps,
            signal.kl_ratio, signal.base_reward, signal.recent_reward, metrics.RUNAWAY_ALARM,
        )

    def state_dict(self) -> dict:
        return {"controller": self.controller.state_dict(), "kl_adaptation_method": self.method_text, "runaway_alarm": self.alarm.state_dict()}

    @property
    def method_text(self) -> str:
        """The method as ``kl_adaptation_method`` writes it (:func:`~unsloth_adaptive_kl.method.format_method`)."""
        return format_method(self.term.method)

    def load_state_dict(self, state: dict, *, restart: bool = False, global_step: int = 0) -> None:
        """Restore the controller from a checkpoint's state; ``restart`` (``restart_beta_controller``)
        keeps the fresh controller instead. ``global_step``: the optimizer step the resumed run starts at
        (its schedule applies from that step: ``dynamic`` past ``beta_schedule_steps`` is at ``beta_min``).

        A checkpoint of another β controller (e.g. trained with ``none``, resumed with ``dynamic``)
        cannot be restored: ValueError naming both methods and the option that starts it fresh."""
        saved = state["controller"]
        if "runaway_alarm" in state:  # the run's KL history, whatever the controller (absent in older checkpoints)
            self.alarm.load_state_dict(state["runaway_alarm"])
        if restart:
            logger.warning(
                "unsloth_adaptive_kl: restart_beta_controller=True: the %s controller starts fresh from beta=%s; the "
                "checkpoint's controller state (kl_adaptation_method=%r, beta=%s) is not restored",
                self.controller.name, self.controller.beta, state.get("kl_adaptation_method"), saved.get("beta"),
            )
        else:
            self._restore(state)
        self._resume_at(global_step)

    def _resume_at(self, global_step: int) -> None:
        """The controller's :meth:`~BetaController.resume_at` (the schedule at the resumed step), checked; a β it
        changes is said (the line before named the β the controller was restored or restarted with)."""
        before = self.controller.beta
        self.controller.resume_at(global_step)
        beta = check_controller_beta(self.controller, self.controller.beta, when=f"after resume_at({global_step})")
        if beta != before:
            logger.info(
                "unsloth_adaptive_kl: at optimizer step %d the %s controller's schedule sets beta=%.6g (from %.6g)",
                global_step, self.controller.name, beta, before,
            )

    def resume_without_state(self, *, restart: bool = False, global_step: int = 0) -> None:
        """Resume from a checkpoint that holds no adaptive-KL state: one a run without this package wrote (stock TRL or
        Unsloth), which trained with no β controller. It resumes as the checkpoint of method ``none`` it is
        (:meth:`load_state_dict`: a controller is refused unless ``restart`` starts it fresh at ``global_step``)."""
        logger.info("unsloth_adaptive_kl: the checkpoint holds no adaptive-KL state (a run without unsloth_adaptive_kl "
                    "wrote it, with no β controller): it resumes as a checkpoint of kl_adaptation_method='none'")
        beta = float(self.controller.config.beta)
        saved = {"name": FixedBeta.name, "beta": beta, "configured_beta": beta}
        self.load_state_dict({"kl_adaptation_method": "none", "controller": saved}, restart=restart, global_step=global_step)

    def _restore(self, state: dict) -> None:
        """The checkpoint's controller state into this controller; another controller's: the resume error."""
        try:
            self.controller.load_state_dict(state["controller"])
        except ControllerMismatchError as error:
            method = state.get("kl_adaptation_method")  # absent in checkpoints written before it was saved
            before = f"kl_adaptation_method={method!r}" if method is not None else "a method"
            raise ValueError(
                f"cannot resume: the checkpoint was trained with {before} ({_controller_words(error.saved)}) and this "
                f"run has kl_adaptation_method={self.method_text!r} ({_controller_words(error.name)}); one β "
                f"controller's state cannot be restored into another. Allowed: set restart_beta_controller=True to start "
                f"the new controller fresh from beta={self.controller.beta} (the checkpoint's controller state is then not "
                "restored), or resume with a method of the checkpoint's controller"
            ) from None


def _controller_words(name) -> str:
    return "no β controller" if name == "fixed" else f"the {name!r} β controller"
