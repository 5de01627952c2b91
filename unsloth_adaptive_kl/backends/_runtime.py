"""The adaptive-KL runtime of one GRPO trainer (:class:`TrainerAdaptiveKL`): its KL term and β controller
(:class:`~unsloth_adaptive_kl.adaptation.AdaptiveKL`), reduced across the trainer's processes, the trainer's metrics as
the sink, and the reward placement as a component it has. A backend (``trl.py``, ``unsloth.py``) subclasses it with
the hooks its rewritten loss calls (``backends/hooks.py``)."""

from __future__ import annotations

import contextlib
import logging
import sys

from .. import metrics
from .._source_patch import PatchError
from ..adaptation import AdaptiveKL
from ..kl_pipeline import KL_MONITOR
from ._patched_classes import trainer_is_patched
from .reward_placement import RewardPlacement

logger = logging.getLogger("unsloth_adaptive_kl")


class _WhenNothingElseLogs(logging.Filter):
    """Let the package's own stderr handler print a record only while the root logger has no handler
    (an application that configured logging, or pytest, gets the record there, exactly once)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not logging.getLogger().handlers


def _default_handler() -> None:
    """The one line per trainer that names its backend is INFO: show it by default, as transformers
    shows its own messages. Silence it with ``logging.getLogger("unsloth_adaptive_kl").setLevel("WARNING")``."""
    if any(getattr(h, "_unsloth_adaptive_kl", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(_WhenNothingElseLogs())
    handler._unsloth_adaptive_kl = True
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


_default_handler()


class TrainerAdaptiveKL(AdaptiveKL):
    """The :class:`AdaptiveKL` of one GRPO trainer: its KL term and β controller, reduced across the
    trainer's processes, with the trainer's metrics as the sink. A backend subclasses it."""

    #: A trainer created before ``import unsloth_adaptive_kl`` runs the library's own functions
    #: (True), or gets this runtime for method ``none`` (False: its loss is rewritten in place).
    stock_when_unattached = True

    def __init__(self, trainer):
        accelerator = trainer.accelerator
        if not getattr(trainer.args, "should_log", True):  # a replica process: as transformers' own logger there, only
            # log_level_replica and above (WARNING by default); each INFO line is said once, by the process that logs
            logger.setLevel(max(logger.getEffectiveLevel(), trainer.args.get_process_log_level()))
        super().__init__(
            trainer.args, reduce=lambda t: accelerator.reduce(t, reduction="sum"),
            process_index=accelerator.process_index, num_processes=accelerator.num_processes,
        )  # fmt: skip
        self.trainer = trainer
        #: kl_placement="reward": the component that applies it at scoring time (its calls below hand over to it).
        self.reward_placement = RewardPlacement(self)
        if KL_MONITOR in self.generation_edits:  # the library's __init__ stored the β it was shown (building)
            trainer.__dict__["beta"] = float(trainer.args.beta)
        #: Micro-batches whose loss went through the patched loss (each reports its metrics once):
        #: how a subclass's override of the loss is seen to reach it (:func:`_guard_loss_path`).
        self.losses_reported = 0

    def record_sums(self, local_sums, *, training: bool, beta: float) -> dict[str, float]:
        # The trainer's log() empties its metrics: no tail metric there means the last window was logged
        # (Unsloth pools its rollout metrics over the window the same way).
        if metrics.TOKEN_KL_MAX not in self.trainer._metrics["train" if training else "eval"]:
            self.restart_tail_window(training)
        return super().record_sums(local_sums, training=training, beta=beta)

    def describe(self) -> str:
        """Which loss computes this trainer's KL, in words (logged once when the trainer is created)."""
        raise NotImplementedError

    # -- the reward placement: the hooks the rewritten generation calls (backends/hooks.GenerationHooks) -----------
    def check_placement(self) -> None:
        """Refuse, when the trainer is created, a reward placement this trainer cannot apply."""
        self.reward_placement.check_placement()

    def scoring_penalty(self, ref_logps, old_logps, mask, policy_logps, mode, left_pad=None, *, completion_ids=None):
        """Each local completion's KL penalty (:meth:`RewardPlacement.scoring_penalty`)."""
        return self.reward_placement.scoring_penalty(ref_logps, old_logps, mask, policy_logps, mode, left_pad, completion_ids=completion_ids)

    def penalized_rewards(self, rewards, local_penalty, mode, num_generations=None):
        """The gathered rewards less every completion's penalty (:meth:`RewardPlacement.penalized_rewards`)."""
        return self.reward_placement.penalized_rewards(rewards, local_penalty, mode, num_generations)

    def generation_index(self) -> int:
        """The index (0, 1, ...) of the training generation batch being generated: the micro-step over TRL's generation
        period (``steps_per_generation * num_iterations`` micro-steps). The micro-step is counted from the optimizer step
        (``state.global_step``, which a checkpoint restores) plus TRL's ``_step`` within it, the same on every process."""
        trainer = self.trainer
        if not all(hasattr(trainer, name) for name in ("_step", "num_iterations")):
            raise PatchError(
                f"{type(trainer).__qualname__} has no _step or num_iterations: kl_monitor_every cannot count its generation "
                "batches (an unsupported TRL or Unsloth version)"
            )
        accumulation = trainer.args.gradient_accumulation_steps
        micro_step = trainer.state.global_step * accumulation + trainer._step % accumulation
        return micro_step // (trainer.args.steps_per_generation * trainer.num_iterations)

    def runs_reference(self) -> bool:
        """Whether the generation now running scores the reference (the rewritten generation asks): while β != 0, and
        at β = 0 under ``kl_monitor`` on the batches :meth:`AdaptiveKL.monitors_batch` selects."""
        return self.scores_reference(self.generation_index, training=self.trainer.model.training)

    @classmethod
    @contextlib.contextmanager
    def building(cls, config):
        """The context the library's ``__init__`` runs in (``config``: its args). kl_monitor with beta = 0: TRL's
        ``__init__`` (and Unsloth's, generated from it) makes the reference (a model, or under PEFT the frozen "ref"
        copy of a pretrained adapter) only when ``args.beta != 0``, so it is shown β = 1.0 while it builds the
        trainer; the config's β is put back before anything trains (and before attach reads it)."""
        monitored = getattr(config, "kl_monitor", False) is True and getattr(config, "beta", None) == 0
        if not monitored:
            yield
            return
        configured, config.beta = config.beta, 1.0
        try:
            yield
        finally:
            config.beta = configured

    def log_library_kl(self, values: dict[str, float], raw, mask, mode: str) -> None:
        """Log the library's own ``kl`` where it does not (β = 0 under kl_monitor): its global masked mean of the
        raw KL over ``mask``, which is ``values``' raw_kl unless that is NaN (TRL logs 0 for no token) or the KL's
        mask is narrower than ``mask`` (``KLTerm.narrows_mask``: TRL's mean counts the positions left out, at 0)."""
        kl = values[metrics.RAW_KL]
        if kl != kl or self.term.narrows_mask:
            kl = metrics.global_masked_mean(raw, mask, self.reduce)
        self.trainer._metrics[mode]["kl"].append(kl)

    def still_patched(self) -> bool:
        """Whether the trainer's class is still patched (false after ``unpatch()``)."""
        return trainer_is_patched(self.trainer)

    def after_attach(self, loss_class) -> None:
        """A backend's last check once the trainer is set up."""

    def log_metrics(self, values: dict[str, float], mode: str) -> dict[str, float]:
        """Hand the adaptive_kl/* values to the trainer's metrics, which its ``log()`` averages over the
        logging window: the KL values are appended (one per micro-batch); ``current_beta`` and
        ``skipped_updates`` keep only their latest value, so the log shows the β of the window's last
        step and the running count, never an average of them; ``nonfinite_kl_batches`` is summed over the
        window. A KL value that was not observed (NaN: β is 0, or no valid token) is not appended: TRL's
        ``log()`` would turn a window of only NaN into ``None``, which TensorBoard and other loggers refuse
        with a warning at every logged step. A micro-batch whose raw or adapted KL is NaN or inf appends
        neither (both means stay over the same micro-batches) and is counted in ``nonfinite_kl_batches``.
        The tail metrics (``metrics.WINDOW_TAIL_METRICS``) are statistics of the window's tokens pooled so
        far (NaN tokens left out): each keeps its latest value, so the log shows the whole window's."""
        self.losses_reported += 1
        window = self.trainer._metrics[mode]
        left_out = values.get(metrics.NONFINITE_KL_BATCHES, 0.0) > 0
        for name, value in values.items():
            if name in metrics.LATEST_VALUE_METRICS:
                window[name][:] = [value]
            elif name in metrics.WINDOW_SUM_METRICS:
                window[name][:] = [sum(window[name]) + value]
            elif name in metrics.WINDOW_TAIL_METRICS:
                if value == value:
                    window[name][:] = [value]
            elif not (value != value or left_out):
                window[name].append(value)
        return values

