"""One training run, in its own process (``--worker SPEC``): the backend's trainer with this package's
patch, the policy with its LoRA, the task, and a callback writing one JSON line per step."""

from __future__ import annotations

import json
import os
import statistics
import time
import uuid

from .batch import StepBatch
from .settings import Settings, method_fields
from .tasks import task


def import_trainer(backend: str, cuda: bool):
    """GRPOConfig and GRPOTrainer of the backend, with this package's patch applied."""
    if backend == "unsloth":
        import unsloth  # noqa: F401  (first: it rebinds TRL's GRPO classes to its generated trainer)

        if not cuda:  # Unsloth patches no RL trainer without a GPU; this private entry point does
            from unsloth.models.rl import _patch_trl_rl_trainers

            _patch_trl_rl_trainers("grpo_trainer")
    import unsloth_adaptive_kl  # noqa: F401
    from trl import GRPOConfig, GRPOTrainer

    return GRPOConfig, GRPOTrainer


def load_policy(spec: dict, cuda: bool):
    """(model, tokenizer, peft_config) for the trainer: Unsloth's FastLanguageModel with its LoRA on a
    GPU; otherwise the checkpoint's path and a peft LoraConfig, which TRL applies."""
    settings = Settings(**spec["settings"])
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    if spec["backend"] == "unsloth" and cuda:
        from unsloth import FastLanguageModel

        model, tokenizer = FastLanguageModel.from_pretrained(
            model_name=spec["model"], max_seq_length=spec["max_seq_length"], load_in_4bit=False, dtype=None
        )
        model = FastLanguageModel.get_peft_model(
            model, r=settings.lora_rank, lora_alpha=settings.lora_rank, target_modules=modules,
            use_gradient_checkpointing=False, random_state=spec["seed"],
        )
        return model, tokenizer, None
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"])
    if spec["backend"] == "unsloth":  # what FastLanguageModel adds; on CPU only, for tests of the plumbing
        model.for_training = model.for_inference = lambda *a, **k: None
    return model, tokenizer, LoraConfig(r=settings.lora_rank, lora_alpha=settings.lora_rank, target_modules=modules,
                                        task_type="CAUSAL_LM")


def synchronised_timer(fn, cuda: bool, record):
    """``fn`` wrapped so that each call's wall seconds (ended by a CUDA synchronisation on a GPU, so the time is
    the work's, not its launch's) are passed to ``record``."""
    import torch

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if cuda:
                torch.cuda.synchronize()
            record(time.perf_counter() - started)

    return timed


class GenerationClock:
    """Wall seconds the trainer spends in its policy's ``generate`` (the rollouts), read once per step.

    It wraps ``generate`` on the model instance the trainer generates with (Unsloth's RL context reads the
    instance attribute and restores it after each call, so the wrapper stays in place)."""

    def __init__(self, model, cuda: bool):
        self.seconds, self.calls = 0.0, 0
        self.model = model
        model.generate = synchronised_timer(model.generate, cuda, self._add)

    def _add(self, seconds: float) -> None:
        self.seconds += seconds
        self.calls += 1

    def take(self) -> tuple[float, int]:
        """(seconds, calls) since the last take."""
        taken = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return taken

    def decode_graphs(self) -> dict:
        """Unsloth's CUDA-graph decode counters (captures, replays, eager steps; totals since the start), summed
        over the modules that hold them, and why it was disabled if it was; {} where the model has none (TRL,
        the CPU, an Unsloth without graph decode)."""
        states = [m.__dict__["_unsloth_decode_graphs"] for m in self.model.modules() if "_unsloth_decode_graphs" in m.__dict__]
        if not states:
            return {}
        return {"decode_graph_captures": sum(s.captures for s in states), "decode_graph_replays": sum(s.replays for s in states),
                "decode_graph_eager_steps": sum(s.eager_steps for s in states),
                "decode_graph_disabled": next((str(s.disabled) for s in states if s.disabled is not None), None)}


class CompletionLengths:
    """The length of every completion the trainer generates, read once per step for its median (TRL logs only the
    mean, min and max of a step's lengths; a mean hides a split between short and truncated completions).

    It wraps the trainer's ``_generate`` on the instance (TRL's, and Unsloth's generated trainer, which calls
    ``self._generate(prompts)`` from TRL's source), counts each completion as TRL counts it for
    ``completions/mean_length`` (its tokens, end of sequence included; only the model's tokens where a tool mask
    is returned) and gathers the lengths over processes as TRL does, so the median is of the same completions."""

    def __init__(self, trainer):
        generate = getattr(trainer, "_generate", None)
        if generate is None:
            import trl

            raise RuntimeError(f"{type(trainer).__name__} (TRL {trl.__version__}) has no _generate: the demo cannot "
                               "record the completions' median length")
        self.lengths: list[int] = []

        def recorded(*args, **kwargs):
            out = generate(*args, **kwargs)
            self._add(trainer, completion_ids=out[1], tool_mask=out[2])
            return out

        trainer._generate = recorded

    def _add(self, trainer, completion_ids, tool_mask) -> None:
        import torch

        lengths = [sum(mask) for mask in tool_mask] if tool_mask is not None else [len(ids) for ids in completion_ids]
        gathered = trainer.accelerator.gather(torch.tensor(lengths, device=trainer.accelerator.device))
        self.lengths += [int(n) for n in gathered.tolist()]

    def take(self) -> float | None:
        """The median length of the completions generated since the last take (None if there were none)."""
        taken, self.lengths = self.lengths, []
        return float(statistics.median(taken)) if taken else None


def compiled_graphs() -> int | None:
    """torch.compile's graphs made in this process so far (None before dynamo is imported): a count that grows
    during training means recompiles (a changing shape or a Python value baked into a graph)."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    return None if utils is None else int(utils.counters["stats"]["unique_graphs"])


def step_logger(metrics_path: str, spec: dict, trained: dict, clock: GenerationClock | None = None,
                lengths: CompletionLengths | None = None):
    """A callback writing one JSON line per logged step (with its wall time, given ``clock`` the part of it spent
    generating, and given ``lengths`` the median completion length as ``completions/median_length``) and a
    progress line."""
    from transformers import TrainerCallback

    class StepLogger(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()
            if clock is not None:
                clock.take()
            if lengths is not None:
                lengths.take()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds = time.perf_counter() - self.started
            self.generation = clock.take() if clock is not None else (None, None)
            self.median_length = lengths.take() if lengths is not None else None

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "reward" not in logs:  # the end-of-training summary
                return
            row = {"tag": spec["tag"], "method": spec["method"], "seed": spec["seed"], "step": state.global_step,
                   "step_time": self.seconds, "beta0": spec["settings"]["beta"], "planned_steps": spec["settings"]["steps"],
                   "kl_target": spec["settings"]["kl_target"], **trained}
            if clock is not None:
                row["generation_time"], row["generate_calls"] = self.generation
                row.update(clock.decode_graphs())
            row["compiled_graphs"] = compiled_graphs()
            if lengths is not None:
                row["completions/median_length"] = self.median_length
            row.update({k: v for k, v in logs.items() if isinstance(v, (int, float)) or v is None})
            line = json.dumps(row) + "\n"
            for path in filter(None, [metrics_path, spec.get("stream")]):
                with open(path, "a") as f:  # one short append per line: concurrent runs may share the stream
                    f.write(line)
            print(f"step {state.global_step}: reward {row['reward']:.3f} length {row['completions/mean_length']:.1f} "
                  f"beta {row['adaptive_kl/current_beta']:.4g} ({self.seconds:.2f} s)", flush=True)

    return StepLogger()


# The trainer arguments that decide what a step does, beside the batch (StepBatch): each run prints and saves
# them as its trainer holds them. Unsloth's config defaults several of them unlike TRL's (optim adamw_8bit,
# weight_decay 0.001, warmup_steps 0.1, seed 3407, lr_scheduler_type linear; with loss_type "dapo" also
# mask_truncated_completions True and epsilon_high 0.28): the demo passes them all.
TRAINING_FIELDS = ("learning_rate", "lr_scheduler_type", "warmup_steps", "optim", "weight_decay", "max_grad_norm", "seed",
                   "temperature", "top_k", "top_p", "loss_type", "beta", "epsilon", "epsilon_high", "scale_rewards", "num_iterations",
                   "importance_sampling_level", "mask_truncated_completions", "max_completion_length", "bf16")


def trained_args(trainer) -> dict:
    return {name: getattr(trainer.args, name, None) for name in TRAINING_FIELDS}


def build_trainer(spec: dict, cuda: bool):
    """(trainer, what its optimizer step trains). ``kl_horizon`` is sized from the completions per step that
    the backend's own config makes of the settings (Unsloth's and TRL's defaults differ), and the trainer
    must train that number: a trainer that trains another raises before any step."""
    GRPOConfig, GRPOTrainer = import_trainer(spec["backend"], cuda)
    settings = Settings(**spec["settings"])
    model, tokenizer, peft_config = load_policy(spec, cuda)
    dataset, rewards = task(spec)
    common = dict(
        output_dir=spec["run_dir"], seed=spec["seed"], use_cpu=not cuda, bf16=cuda, report_to="none",
        save_strategy="no", disable_tqdm=True, logging_steps=1, max_steps=settings.steps,
        per_device_train_batch_size=settings.per_device_train_batch_size,
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        num_generations=settings.num_generations, max_completion_length=settings.max_completion_length,
        temperature=settings.temperature, learning_rate=settings.learning_rate, lr_scheduler_type=settings.lr_schedule,
        warmup_steps=0, loss_type=settings.loss_type, beta=settings.beta, optim=settings.optim,
        weight_decay=settings.weight_decay, mask_truncated_completions=settings.mask_truncated_completions,
        epsilon_high=settings.epsilon_high,
    )
    probe = GRPOConfig(**common)  # what the backend's config class makes of these arguments
    planned = StepBatch.of_args(probe, probe.world_size)
    monitor = dict(kl_monitor=True, kl_monitor_every=1) if settings.kl_monitor else {}  # the KL of every step, also at β = 0
    config = GRPOConfig(**common, kl_adaptation_method=spec["method"], **monitor,
                        **method_fields(settings, completions_per_step=planned.completions_per_step))
    trainer = GRPOTrainer(model=model, reward_funcs=rewards, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config)
    trained = StepBatch.of_trainer(trainer)
    if trained.completions_per_step != planned.completions_per_step:
        raise RuntimeError(f"the trainer trains {trained.describe()}, but kl_horizon was sized for "
                           f"{planned.describe()}")
    return trainer, trained


def model_record(trainer, spec: dict) -> dict:
    """What the run trains, as its trainer holds it: the model's name in the settings, the directory it was loaded
    from, its parameters (all, and those the optimizer trains: the LoRA's), its vocabulary, and the tokens that end
    and pad a completion (the tokenizer's, and the ids TRL's generation stops at; Unsloth may replace a pad
    token that equals the eos)."""
    tokenizer, parameters = trainer.processing_class, list(trainer.model.parameters())
    return {"model": spec["settings"]["model"], "model_path": spec["model"], "parameters": sum(p.numel() for p in parameters),
            "trainable_parameters": sum(p.numel() for p in parameters if p.requires_grad), "vocab_size": len(tokenizer),
            "eos_token": tokenizer.eos_token, "eos_token_id": tokenizer.eos_token_id, "pad_token": tokenizer.pad_token,
            "pad_token_id": tokenizer.pad_token_id, "padding_side": tokenizer.padding_side,
            "generation_eos_token_ids": list(getattr(trainer, "eos_token_ids", None) or [])}


def train_one(spec_path: str) -> None:
    """Train one (method, seed) and append its per-step metrics to the run's metrics file."""
    with open(spec_path) as f:
        spec = json.load(f)
    import torch

    cuda = torch.cuda.is_available()
    trainer, trained = build_trainer(spec, cuda)
    # copy: this process's id in every row, so that a run started again is a second draw, not a continuation
    # (docs/evidence/study33-long-task.md; analysis.read_copies)
    # kl_placement and kl_estimator as the trainer holds them: the study's (d) compares runs that differ in them
    model = model_record(trainer, spec)
    recorded = {**trained.fields(), "kl_horizon": trainer.args.kl_horizon, "kl_placement": trainer.args.kl_placement,
                "kl_estimator": trainer.args.kl_estimator, "model": model["model"], "copy": uuid.uuid4().hex[:12]}
    # a run's other options (--runs ...:sched=, :monitor=, :NAME=), as its trainer holds them, only where given: the rows
    # of every run before them are unchanged (its learning rate is in every row already, as the trainer logs it)
    settings = Settings(**spec["settings"])
    if settings.lr_schedule != Settings.lr_schedule:
        recorded["lr_scheduler_type"] = str(getattr(trainer.args.lr_scheduler_type, "value", trainer.args.lr_scheduler_type))
    if settings.kl_monitor:
        recorded["kl_monitor"] = trainer.args.kl_monitor
    if settings.controller_params:
        recorded["controller_params"] = {name: getattr(trainer.args, name) for name, _ in settings.controller_params}
    clock = GenerationClock(trainer.model, cuda)
    trainer.add_callback(step_logger(spec["metrics_path"], spec, recorded, clock, CompletionLengths(trainer)))
    print(f"{spec['method']} seed {spec['seed']}: {type(trainer).__module__}.{type(trainer).__name__}", flush=True)
    print(f"trained: {trained.describe()}; kl_horizon {trainer.args.kl_horizon:g}", flush=True)
    print(f"trainer arguments: {json.dumps(trained_args(trainer))}", flush=True)
    print(f"model: {model['model']} from {model['model_path']}: {model['parameters']} parameters ({model['trainable_parameters']} "
          f"trained), vocabulary {model['vocab_size']}; eos {model['eos_token']!r} ({model['eos_token_id']}), generation "
          f"stops at {model['generation_eos_token_ids']}; pad {model['pad_token']!r} ({model['pad_token_id']}, "
          f"{model['padding_side']})", flush=True)
    with open(os.path.join(spec["run_dir"], "trained.json"), "w") as f:
        json.dump({**recorded, "args": trained_args(trainer), "trainer": type(trainer).__name__, **model}, f, indent=1)
    if trained.completions_per_step != settings.prompts_per_step * settings.num_generations:
        print(f"NOTE: the settings ask for {settings.prompts_per_step} prompts x {settings.num_generations} per optimizer "
              f"step; the trainer trains {trained.completions_per_step} completions", flush=True)
    trainer.train()
