"""One training run, in its own process (``--worker SPEC``): the backend's trainer with this package's
patch, the policy with its LoRA, the task, and a callback writing one JSON line per step."""

from __future__ import annotations

import json
import time

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


def step_logger(metrics_path: str, spec: dict):
    """A callback writing one JSON line per logged step (with its wall time) and a progress line."""
    from transformers import TrainerCallback

    class StepLogger(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds = time.perf_counter() - self.started

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "reward" not in logs:  # the end-of-training summary
                return
            row = {"tag": spec["tag"], "method": spec["method"], "seed": spec["seed"], "step": state.global_step,
                   "step_time": self.seconds, "beta0": spec["settings"]["beta"], "planned_steps": spec["settings"]["steps"],
                   "kl_target": spec["settings"]["kl_target"]}
            row.update({k: v for k, v in logs.items() if isinstance(v, (int, float)) or v is None})
            line = json.dumps(row) + "\n"
            for path in filter(None, [metrics_path, spec.get("stream")]):
                with open(path, "a") as f:  # one short append per line: concurrent runs may share the stream
                    f.write(line)
            print(f"step {state.global_step}: reward {row['reward']:.3f} length {row['completions/mean_length']:.1f} "
                  f"beta {row['adaptive_kl/current_beta']:.4g} ({self.seconds:.2f} s)", flush=True)

    return StepLogger()


def train_one(spec_path: str) -> None:
    """Train one (method, seed) and append its per-step metrics to the run's metrics file."""
    with open(spec_path) as f:
        spec = json.load(f)
    import torch

    cuda = torch.cuda.is_available()
    GRPOConfig, GRPOTrainer = import_trainer(spec["backend"], cuda)
    settings = Settings(**spec["settings"])
    model, tokenizer, peft_config = load_policy(spec, cuda)
    dataset, rewards = task(spec)
    config = GRPOConfig(
        output_dir=spec["run_dir"], seed=spec["seed"], use_cpu=not cuda, bf16=cuda, report_to="none",
        save_strategy="no", disable_tqdm=True, logging_steps=1, max_steps=settings.steps,
        per_device_train_batch_size=settings.prompts_per_step * settings.num_generations,
        num_generations=settings.num_generations, max_completion_length=settings.max_completion_length,
        temperature=settings.temperature, learning_rate=settings.learning_rate, lr_scheduler_type="constant",
        warmup_steps=0, loss_type=settings.loss_type, beta=settings.beta, kl_adaptation_method=spec["method"],
        **method_fields(settings),
    )
    trainer = GRPOTrainer(model=model, reward_funcs=rewards, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config)
    trainer.add_callback(step_logger(spec["metrics_path"], spec))
    print(f"{spec['method']} seed {spec['seed']}: {type(trainer).__module__}.{type(trainer).__name__}", flush=True)
    trainer.train()
