"""What one optimizer step of a run trained, read from its trainer after construction: Unsloth's GRPO
config defaults ``gradient_accumulation_steps`` to 2 and TRL's to 1, so the batch size passed in does
not say how many completions a step trains (docs/evidence/study26-beta-grid.md ran at twice the number it
printed). Every per-step quantity of the demo (``kl_horizon``) is sized from this."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StepBatch:
    """An optimizer step's batch as the trainer's arguments hold it."""

    per_device_train_batch_size: int  # completions per micro-batch and process
    gradient_accumulation_steps: int  # micro-batches per optimizer step
    num_processes: int
    generation_batch_size: int  # completions generated at once (all processes), every steps_per_generation micro-batches
    steps_per_generation: int
    num_generations: int  # completions per prompt

    @classmethod
    def of_args(cls, args, num_processes: int) -> StepBatch:
        """From a GRPOConfig after its own defaults and __post_init__ have run."""
        return cls(args.per_device_train_batch_size, args.gradient_accumulation_steps, num_processes,
                   args.generation_batch_size, args.steps_per_generation, args.num_generations)

    @classmethod
    def of_trainer(cls, trainer) -> StepBatch:
        return cls.of_args(trainer.args, trainer.accelerator.num_processes)

    @property
    def completions_per_step(self) -> int:
        """Completions one optimizer step trains, all processes: what the package's controllers count
        (``n`` in target's update) and check ``kl_horizon`` against."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.num_processes

    @property
    def prompts_per_step(self) -> int:
        return self.completions_per_step // self.num_generations

    def describe(self) -> str:
        return (f"{self.completions_per_step} completions per optimizer step ({self.prompts_per_step} prompts x "
                f"{self.num_generations}) = per_device_train_batch_size {self.per_device_train_batch_size} x "
                f"gradient_accumulation_steps {self.gradient_accumulation_steps} x {self.num_processes} process(es); "
                f"generation batch {self.generation_batch_size} every {self.steps_per_generation} micro-batch(es)")

    def fields(self) -> dict:
        """The numbers a metrics row records."""
        return {"completions_per_step": self.completions_per_step, **asdict(self)}
