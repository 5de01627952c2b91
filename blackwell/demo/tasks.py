"""What a run trains on: the offline task (synthetic sums, a tiny Llama warm-started on them) or a
GSM8K-shaped hub data set and model (not reachable offline; small on purpose)."""

from __future__ import annotations

import math
import os
import time

from .settings import TASKS, Settings

HUB_HELP = (
    "This machine may have no access to the Hugging Face hub: run without --model/--dataset for the offline "
    "task, or download the model/data set elsewhere and pass its local path."
)


def task(spec: dict):
    """(train data set, reward functions) of the run's task."""
    from unsloth_adaptive_kl import toy

    if spec["dataset"] is None:
        from datasets import Dataset

        rows = toy.sum_problems(4096, seed=spec["seed"], **TASKS[spec["settings"]["task"]])
        data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
        return data, [toy.scratchpad_format_reward, toy.scratchpad_correctness_reward]
    return hub_dataset(spec["dataset"]), [hub_format_reward, hub_correctness_reward]


# -- the Hugging Face hub path (not reachable offline; small on purpose) -----------------------------
HUB_PROMPT = "{question}\nThink step by step, then give the final answer on its own line as: #### <number>\n"


def hub_dataset(name: str):
    """A GSM8K-shaped data set (``question``, ``answer`` ending in ``#### N``) as prompts and answers.
    ``name`` may carry a config: ``openai/gsm8k:main``."""
    from datasets import load_dataset

    path, _, config = name.partition(":")
    try:
        data = load_dataset(path, config or None, split="train")
    except Exception as e:
        raise SystemExit(f"Could not load the data set {name!r}: {type(e).__name__}: {e}\n{HUB_HELP}") from e
    if not {"question", "answer"} <= set(data.column_names):
        raise SystemExit(f"{name!r} has columns {data.column_names}; the demo needs GSM8K's 'question' and 'answer'.")
    return data.map(lambda r: {"prompt": HUB_PROMPT.format(question=r["question"]),
                               "answer": r["answer"].split("####")[-1].strip().replace(",", "")},
                    remove_columns=data.column_names)


def _final_number(completion: str) -> str | None:
    tail = completion.rsplit("####", 1)
    if len(tail) != 2:
        return None
    words = tail[1].strip().replace(",", "").split()
    return words[0].rstrip(".") if words else None


def hub_format_reward(completions, **kwargs) -> list[float]:
    """0.5 when the completion ends its reasoning with ``#### <answer>``."""
    return [0.5 if _final_number(c) is not None else 0.0 for c in completions]


def hub_correctness_reward(completions, answer, **kwargs) -> list[float]:
    """0.5 when the number after the last ``####`` equals the reference answer."""
    return [0.5 if _final_number(c) == a else 0.0 for c, a in zip(completions, answer)]


def fetch_hub_model(name: str) -> str:
    """Download (or find in the cache) a hub model before the runs start; fail clearly if offline."""
    if os.path.isdir(name):
        return name
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name)
    except Exception as e:
        raise SystemExit(f"Could not get the model {name!r}: {type(e).__name__}: {e}\n{HUB_HELP}") from e


# -- the starting model ------------------------------------------------------------------------------
def starting_model(args, settings: Settings, seed: int, device: str) -> str:
    """The checkpoint every method of this seed starts from."""
    from unsloth_adaptive_kl import toy

    if args.model:
        return fetch_hub_model(args.model)
    path = os.path.join(args.output_dir, "checkpoints", f"seed{seed}")
    started = time.perf_counter()
    if settings.task == "easy":  # the original task: toy's own builder, unchanged
        built = toy.build_scratchpad_checkpoint(path, seed=seed, hidden_size=settings.hidden_size, layers=settings.layers,
                                                warm_start_steps=settings.warm_start_steps, device=device,
                                                lr=settings.warm_start_lr)
    else:
        built = build_task_checkpoint(path, settings, seed, device)
    print(f"seed {seed}: tiny Llama ({settings.hidden_size}x{settings.layers}) warm-started for "
          f"{settings.warm_start_steps} steps on the {settings.task} task, final loss {built['warm_start_loss']:.3f} "
          f"({time.perf_counter() - started:.0f} s)", flush=True)
    return path


def build_task_checkpoint(path: str, settings: Settings, seed: int, device: str) -> dict:
    """As ``toy.build_scratchpad_checkpoint``, for any task of TASKS: the three solution styles in
    equal parts, batch 64, ``settings.warm_start_steps`` steps."""
    import random

    import torch

    from unsloth_adaptive_kl import toy

    tokenizer = toy.build_scratchpad_tokenizer()
    model = toy.build_model(tokenizer, hidden_size=settings.hidden_size, layers=settings.layers, seed=seed).to(device)
    rng = random.Random(seed + 1)
    rows = toy.sum_problems(settings.warm_start_steps * 64, seed=seed + 1, **TASKS[settings.task])
    texts = [r["prompt"] + toy.worked_solution(r["terms"], rng.randrange(3)) + tokenizer.eos_token for r in rows]
    loss = toy.supervised_warm_start(model, tokenizer, texts, batch_size=64, lr=settings.warm_start_lr) if settings.warm_start_steps else math.nan
    model.to("cpu").save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    return {"path": path, "warm_start_loss": loss}
