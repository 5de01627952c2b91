"""The β callback every patched GRPO trainer gets: it updates β once per optimizer step, carries
the controller's state in checkpoints, and refuses to train on a loss ``unpatch()`` took away."""

from __future__ import annotations

import logging

from .. import metrics
from .._source_patch import PatchError

logger = logging.getLogger("unsloth_adaptive_kl")


# -- the checkpoint callback ---------------------------------------------------------------------------
def _callback_classes():
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState

    class AdaptiveKLCallback(TrainerCallback, ExportableState):
        """Updates β once per optimizer step and carries the controller state in checkpoints.

        The state goes into ``trainer_state.json`` (``stateful_callbacks``) through the Trainer's
        own mechanism; the patched ``_load_callback_state`` restores it on resume.
        """

        def __init__(self, runtime=None):
            self.runtime = runtime
            self._warned_unpatched = False

        def _check_still_patched(self) -> None:
            """After ``unpatch()`` the trainer's class runs the library's own loss: refuse to train on
            it when an adaptation was asked for; warn once when none was."""
            trainer = self.runtime.trainer
            if self.runtime.still_patched():
                return
            message = (
                f"unsloth_adaptive_kl.unpatch() was called after this {type(trainer).__qualname__} was created: it now "
                "computes the library's own loss, without the adaptive KL and without the adaptive_kl metrics"
            )
            runtime = self.runtime
            if not runtime.is_stock:
                raise PatchError(
                    f"{message}; kl_adaptation_method={trainer.args.kl_adaptation_method!r} with kl_estimator="
                    f"{trainer.args.kl_estimator!r} cannot be applied. Call unsloth_adaptive_kl.patch() again before "
                    "training it, or create a new trainer"
                )
            if not self._warned_unpatched:
                self._warned_unpatched = True
                logger.warning("%s (kl_adaptation_method='none', so training goes on)", message)

        def on_train_begin(self, args, state, control, **kwargs):
            self._check_still_patched()
            self.runtime.begin_training()

        def on_train_end(self, args, state, control, **kwargs):
            if not state.is_world_process_zero:  # every process has the same β: one line, the main process's
                return
            summary = self.runtime.course_summary()
            if summary is not None:
                logger.log(*summary)

        def on_step_begin(self, args, state, control, **kwargs):
            self._check_still_patched()

        def on_step_end(self, args, state, control, **kwargs):
            runtime = self.runtime
            runtime.end_step(state.global_step)  # the controller owns β; trainer.beta reads it
            # After the update, so the log written right after this step shows its skip.
            # and the controller's own (target's adaptive_kl/target_reachable), so TensorBoard shows when it acted.
            runtime.log_metrics(
                {metrics.SKIPPED_UPDATES: float(runtime.skipped_updates), metrics.RUNAWAY_ALARM: float(runtime.alarm.fired),
                 **runtime.controller.metrics()}, "train",
            )  # fmt: skip

        def state(self) -> dict:
            return {"args": {}, "attributes": {"adaptive_kl_state": self.runtime.state_dict()}}

    return AdaptiveKLCallback


AdaptiveKLCallback = None  # set by make_callback_class() when patching


def make_callback_class() -> None:
    """Define :data:`AdaptiveKLCallback` (it subclasses transformers' classes, imported only now)."""
    global AdaptiveKLCallback
    if AdaptiveKLCallback is None:
        AdaptiveKLCallback = _callback_classes()
