"""SmolLM2-135M-Instruct on the GPU machine (issue 50): the task probe, GRPO runs on the Unsloth backend with
their step times, the two KL numbers and the template tokens' share of the KL. Not study data.

Run through scripts/gpu/verify.sh (stages smollm2-join, smollm2-probe, smollm2-runs); docs/real-model.md
records the commands and outputs. Subcommands:

    probe OUT                 the task's step-0 record for each candidate variant (docs/real-model.md's
                              pre-registered rule picks one); writes OUT/smollm2-probe.{md,json}
    train OUT NAME [fields]   one GRPO run on the Unsloth backend (LoRA r 16, bf16) of the chosen task;
                              writes OUT/NAME.json (every log entry, and the per-micro-batch KL capture)
    runs OUT                  one run alone, then 8 at once (subprocesses sharing the GPU); writes
                              OUT/smollm2-runs.{md,json}
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

# (style, low, high) in the order the pre-registered rule tries them (docs/real-model.md, "The task").
VARIANTS = [("explain", 1, 9), ("explain", 1, 20), ("explain", 10, 99), ("short", 1, 9), ("short", 10, 99)]
# Held-out prompts: seed 1 in the first probe, seed 2 in Amendment 1's (docs/real-model.md); training: seed 0.
HELD_OUT_SEED, TRAIN_SEED = int(os.environ.get("SMOLLM2_PROBE_SEED", "2")), 0
PROBE_PROMPTS, PROBE_SAMPLES, MAX_NEW_TOKENS = 128, 4, 256
SPECIAL_IDS = (0, 1, 2)  # <|endoftext|>, <|im_start|>, <|im_end|>


def quantiles(values, qs=(0.1, 0.25, 0.5, 0.75, 0.9)):
    ordered = sorted(values)
    return {f"q{int(q * 100)}": ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in qs}


def prompt_interval(correct: list[bool], per_prompt: int, z: float = 1.96) -> tuple[float, float]:
    """A 95 % interval of the accuracy with the prompts as the sampled unit (a prompt's completions are not
    independent draws): the mean of the per-prompt accuracies ± z · their standard deviation / √prompts."""
    means = [statistics.fmean(correct[i:i + per_prompt]) for i in range(0, len(correct), per_prompt)]
    mean, half = statistics.fmean(means), z * statistics.stdev(means) / len(means) ** 0.5
    return (mean - half, mean + half)


def meets_rule(accuracy: float, interval: tuple[float, float], median_length: float) -> bool:
    """Amendment 1's rule (docs/real-model.md): the issue's entry interval [0.1, 0.8] holds for the accuracy and
    for its 95 % interval, and the median length is at least 50 tokens."""
    return 0.1 <= interval[0] and interval[1] <= 0.8 and 0.1 <= accuracy <= 0.8 and median_length >= 50


def probe(out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unsloth_adaptive_kl import smollm2

    path = smollm2.smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.padding_side != "left":
        raise SystemExit(f"{path}: the tokenizer pads on the {tokenizer.padding_side}; generation needs left padding")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    eos = tokenizer.eos_token_id
    results = []
    for style, low, high in VARIANTS:
        problems = smollm2.addition_problems(PROBE_PROMPTS, seed=HELD_OUT_SEED, low=low, high=high, style=style)
        texts = [tokenizer.apply_chat_template(p["prompt"], add_generation_prompt=True, tokenize=False) for p in problems]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to("cuda")
        record = {"style": style, "low": low, "high": high}
        for mode, kwargs in (("sampled", dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, num_return_sequences=PROBE_SAMPLES)),
                             ("greedy", dict(do_sample=False))):
            torch.manual_seed(0)
            start = time.perf_counter()
            with torch.no_grad():
                generated = model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos, pad_token_id=eos, **kwargs)
            seconds = time.perf_counter() - start
            completions = generated[:, batch["input_ids"].shape[1]:]
            repeat = PROBE_SAMPLES if mode == "sampled" else 1
            lengths, truncated, correct = [], 0, []
            for i, row in enumerate(completions.tolist()):
                n = row.index(eos) + 1 if eos in row else len(row)
                truncated += eos not in row
                lengths.append(n)
                text = tokenizer.decode(row[:n], skip_special_tokens=True)
                correct.append(smollm2.extract_answer(text) == problems[i // repeat]["answer"])
            record[mode] = {
                "completions": len(correct), "accuracy": sum(correct) / len(correct), "truncated_share": truncated / len(correct),
                "length_mean": statistics.fmean(lengths), **{f"length_{k}": v for k, v in quantiles(lengths).items()},
                "seconds": round(seconds, 1), "accuracy_95": prompt_interval(correct, repeat),
                "examples": [tokenizer.decode(completions[j][: lengths[j]], skip_special_tokens=False) for j in range(2)],
            }
        s = record["sampled"]
        record["meets_rule"] = meets_rule(s["accuracy"], s["accuracy_95"], s["length_q50"])
        results.append(record)
        print(json.dumps({k: v for k, v in record.items() if k not in ("sampled", "greedy")}), "sampled:",
              {k: v for k, v in s.items() if k != "examples"}, "greedy acc:", record["greedy"]["accuracy"], flush=True)
    chosen = next((r for r in results if r["meets_rule"]), None)
    report = {"variants": results, "chosen": None if chosen is None else {k: chosen[k] for k in ("style", "low", "high")},
              "prompts": PROBE_PROMPTS, "samples": PROBE_SAMPLES, "max_new_tokens": MAX_NEW_TOKENS, "seed": HELD_OUT_SEED}
    with open(os.path.join(out, "smollm2-probe.json"), "w") as f:
        json.dump(report, f, indent=1)
    lines = [f"held-out seed {HELD_OUT_SEED}", "", "| style | operands | sampled accuracy (95 %) | greedy accuracy | length q10/q50/q90 | truncated | rule |", "|---|---|---|---|---|---|---|"]
    for r in results:
        s = r["sampled"]
        lo, hi = s["accuracy_95"]
        lines.append(f"| {r['style']} | {r['low']}-{r['high']} | {s['accuracy']:.3f} ({lo:.3f}-{hi:.3f}) | {r['greedy']['accuracy']:.3f} | "
                     f"{s['length_q10']}/{s['length_q50']}/{s['length_q90']} | {s['truncated_share']:.3f} | {'yes' if r['meets_rule'] else 'no'} |")
    lines.append(f"\nchosen: {report['chosen']}")
    with open(os.path.join(out, "smollm2-probe.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def chosen_task(out: str) -> dict:
    """The task the probe chose (its record from this call's OUT, or kept in /tmp/smollm2 by an earlier call)."""
    for path in (os.path.join(out, "smollm2-probe.json"), "/tmp/smollm2/smollm2-probe.json"):
        if os.path.exists(path):
            chosen = json.load(open(path))["chosen"]
            if chosen:
                return chosen
    raise SystemExit("no task chosen: run the probe first (verify.sh stage smollm2-probe)")


class KLCapture:
    """Wraps the Unsloth backend's ``FusedKLInputs.finish`` (run eagerly: UNSLOTH_COMPILE_DISABLE=1) to keep, per
    micro-batch, the per-token raw KL, the mask and the token ids the fused loss gave it."""

    def __init__(self):
        from unsloth_adaptive_kl.backends import unsloth as backend

        self.batches = []
        original = backend.FusedKLInputs.finish

        def finish(inputs, loss, unsloth_mean_kl, raw, adapted, mask, rs_keep, accumulation, token_ids=None, estimator_faults=None):
            if raw is not None:
                self.batches.append({"unsloth_kl": float(unsloth_mean_kl), "raw": raw.detach().float().cpu().reshape(mask.shape),
                                     "mask": mask.detach().float().cpu(),
                                     "ids": None if token_ids is None else token_ids.detach().cpu().reshape(mask.shape)})
            return original(inputs, loss, unsloth_mean_kl, raw, adapted, mask, rs_keep, accumulation, token_ids, estimator_faults)

        backend.FusedKLInputs.finish = finish

    def summary(self) -> list[dict]:
        import torch

        rows = []
        for b in self.batches:
            raw, mask = b["raw"], b["mask"]
            tokens = mask.sum(1)
            row = {"unsloth_kl": b["unsloth_kl"], "token_weighted": float((raw * mask).sum() / mask.sum().clamp(min=1)),
                   "per_sequence": float(((raw * mask).sum(1) / tokens.clamp(min=1)).mean()), "tokens": int(mask.sum())}
            ids = b["ids"]
            if ids is not None:
                special = torch.zeros_like(mask, dtype=torch.bool)
                for i in SPECIAL_IDS:
                    special |= ids == i
                kept = mask * (~special).float()
                total = float((raw * mask).sum())
                row.update({"special_tokens": int((mask * special.float()).sum()),
                            "special_share_of_kl_sum": float((raw * mask * special.float()).sum()) / total if total else None,
                            "token_weighted_without_special": float((raw * kept).sum() / kept.sum().clamp(min=1))})
                flat = (raw * mask)[mask.bool()]
                if flat.numel():
                    top = max(1, int(0.01 * flat.numel()))
                    row["top1pct_share"] = float(flat.abs().sort(descending=True).values[:top].sum() / flat.abs().sum().clamp(min=1e-30))
            rows.append(row)
        return rows


def train(out: str, name: str, fields: dict) -> None:
    import unsloth  # noqa: F401  (first, as Unsloth asks)
    import torch
    from unsloth import FastLanguageModel

    import unsloth_adaptive_kl  # noqa: F401
    from trl import GRPOConfig, GRPOTrainer
    from unsloth_adaptive_kl import smollm2

    task = chosen_task(out)
    steps = int(fields.pop("steps", 8))
    capture = bool(fields.pop("capture", False))
    model, tokenizer = FastLanguageModel.from_pretrained(smollm2.smollm2_dir(), max_seq_length=512, load_in_4bit=False, dtype=torch.bfloat16)
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, random_state=0, use_gradient_checkpointing="unsloth",
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    args = GRPOConfig(
        output_dir=f"/tmp/smollm2-{name}", report_to="none", per_device_train_batch_size=64, num_generations=8,
        gradient_accumulation_steps=1, max_completion_length=MAX_NEW_TOKENS, max_steps=steps, logging_steps=1,
        learning_rate=float(fields.pop("learning_rate", 2e-5)), warmup_steps=0, save_strategy="no", bf16=True, seed=0,
        temperature=1.0, beta=float(fields.pop("beta", 0.04)), **fields,
    )
    dataset = smollm2.addition_dataset(4096, seed=TRAIN_SEED, **task)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[smollm2.correct_answer_reward], args=args, train_dataset=dataset)
    kl = KLCapture() if capture else None
    start = time.perf_counter()
    trainer.train()
    record = {"name": name, "task": task, "fields": {k: str(v) for k, v in fields.items()}, "steps": steps,
              "wall_s": time.perf_counter() - start, "log": trainer.state.log_history,
              "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    if kl is not None:
        record["kl_capture"] = kl.summary()
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(record, f, indent=1, default=str)
    for h in trainer.state.log_history:
        if "adaptive_kl/current_beta" in h:
            print(name, {k: h.get(k) for k in ("step", "reward", "kl", "adaptive_kl/raw_kl", "adaptive_kl/current_beta",
                                                "completions/mean_length", "step_time", "adaptive_kl/token_kl_top1pct_share")}, flush=True)


# The runs of `runs`: name -> fields of `train`. The first runs alone, then the other eight at once. Each runs
# Unsloth as users do (its compiled loss) except "kl-capture", which runs eagerly (UNSLOTH_COMPILE_DISABLE=1) so that
# KLCapture can copy the per-token KL out of the loss; its step time is not a user's.
RUNS = {
    "alone-none": dict(kl_adaptation_method="none"),
    "none": dict(kl_adaptation_method="none"),
    "target": dict(kl_adaptation_method="target", kl_target=0.01),
    "dynamic": dict(kl_adaptation_method="dynamic", reward_threshold=0.5),
    "clip": dict(kl_adaptation_method="clip", kl_clip_threshold=0.05),
    "length_normalized": dict(kl_adaptation_method="length_normalized"),
    "beta0-monitor": dict(kl_adaptation_method="none", beta=0.0, kl_monitor=True),
    "exclude-template": dict(kl_adaptation_method="none", kl_exclude_token_ids=list(SPECIAL_IDS)),
    "kl-capture": dict(kl_adaptation_method="none", capture=True),
}


def launch(out: str, name: str, steps: int) -> subprocess.Popen:
    fields = RUNS[name]
    env = {**os.environ, "UNSLOTH_GRPO_SEQ_PACKING": "0"}
    if fields.get("capture"):
        env["UNSLOTH_COMPILE_DISABLE"] = "1"
    log = open(os.path.join("/tmp", f"smollm2-{name}.log"), "w")
    return subprocess.Popen([sys.executable, __file__, "train", out, name, json.dumps({**fields, "steps": steps})],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def runs(out: str, steps: int = 8) -> None:
    phases = {"alone": ["alone-none"], "eight": [n for n in RUNS if n != "alone-none"]}
    timing = {}
    for phase, names in phases.items():
        start = time.perf_counter()
        procs = {name: launch(out, name, steps) for name in names}
        codes = {name: p.wait() for name, p in procs.items()}
        timing[phase] = {"wall_s": time.perf_counter() - start, "exit": codes}
        print(phase, timing[phase], flush=True)
        for name, code in codes.items():
            if code:
                print(open(f"/tmp/smollm2-{name}.log").read()[-3000:], flush=True)
    rows = []
    for name in RUNS:
        path = os.path.join(out, f"{name}.json")
        if not os.path.exists(path):
            continue
        record = json.load(open(path))
        steps_log = [h for h in record["log"] if "adaptive_kl/current_beta" in h]
        times = [h["step_time"] for h in steps_log if "step_time" in h]
        rows.append({"name": name, "step_time_median_after_first": statistics.median(times[1:]) if len(times) > 1 else None,
                     "step_time_first": times[0] if times else None, "steps": len(steps_log)})
    with open(os.path.join(out, "smollm2-runs.json"), "w") as f:
        json.dump({"timing": timing, "rows": rows}, f, indent=1)
    print(json.dumps(rows, indent=1), flush=True)


if __name__ == "__main__":
    command, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    if command == "probe":
        probe(out)
    elif command == "train":
        train(out, sys.argv[3], json.loads(sys.argv[4]) if len(sys.argv) > 4 else {})
    elif command == "runs":
        runs(out, int(sys.argv[3]) if len(sys.argv) > 3 else 8)
    else:
        raise SystemExit(f"unknown command {command!r}; allowed: probe, train, runs")
