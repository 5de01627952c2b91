"""Resume inside a generation batch: what the trainer wrappers of :mod:`._trainer` do so that a β
controller keeps the uninterrupted run's generation schedule (TRL saves neither its buffer of
generated completions nor its micro-step counter)."""

from __future__ import annotations

import logging

from .._source_patch import PatchError

logger = logging.getLogger("unsloth_adaptive_kl")


def resume_generation_schedule(trainer, runtime) -> None:
    """On resume with a β controller, keep the uninterrupted run's generation schedule.

    TRL saves neither its buffer of generated completions nor its micro-step counter ``_step``: a
    run resumed inside a generation batch (``steps_per_generation * num_iterations`` micro-steps)
    regenerates at once, and from then on generates at micro-steps counted from the resume, not
    from the start. The controller would see the regenerated batch's reward as a new one and every
    later reward at other steps than the uninterrupted run. So ``_step`` is set to the micro-step of
    the checkpoint (the next generations happen where the uninterrupted run has them), and the
    reward of the regenerated batch is not observed (the uninterrupted run observed that batch's
    reward before the checkpoint). The regenerated completions themselves differ: see docs/resume.md.
    Methods without a controller, and a controller started fresh (``restart_beta_controller``), keep
    TRL's own behaviour."""
    if not runtime.controller.adapts_beta or trainer.args.restart_beta_controller:
        return
    args = trainer.args
    if not all(hasattr(trainer, name) for name in ("_step", "num_iterations")):
        raise PatchError(
            f"{type(trainer).__qualname__} has no _step or num_iterations: the β controller cannot follow its generation "
            "schedule across a resume (an unsupported TRL or Unsloth version)"
        )
    micro_step = trainer.state.global_step * args.gradient_accumulation_steps
    trainer._step = micro_step
    trainer._adaptive_kl_regenerated_batch = micro_step % (args.steps_per_generation * trainer.num_iterations) != 0


def observe_generated_reward(trainer, reward: float) -> None:
    """Give the trainer's controller a new generation batch's reward, except the batch TRL regenerated
    after a resume inside a generation batch (see :func:`resume_generation_schedule`)."""
    runtime = trainer._adaptive_kl
    if getattr(trainer, "_adaptive_kl_regenerated_batch", False):
        trainer._adaptive_kl_regenerated_batch = False
        logger.info(
            "unsloth_adaptive_kl: resumed inside a generation batch: TRL regenerated its completions; their reward (%s) "
            "is not given to the %s controller, which saw that batch's reward before the checkpoint", reward, runtime.controller.name,
        )
        return
    runtime.observe_reward(reward)
