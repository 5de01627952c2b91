"""Issue 33's warm-start learning-rate scan (docs/evidence/study33-long-task.md, Amendment 2): not study data.

The probe's warm start (learning rate 1e-3) stopped at the loss of a model that copies nothing from the prompt;
this scan warm-starts seed 0 of the long task once for each candidate learning rate, all at once on one GPU
(separate processes), exactly as the study's demo does (`demo.tasks.build_task_checkpoint`, deterministic
mode), and records for each:
  - the warm-start record the demo writes (time, tokens a second, loss curve, weights' sha256) and at step 0
    on 256 held-out prompts at temperature 1 (`demo.tasks.evaluate_start`): accuracy, reward, length quantiles;
  - the held-out loss by token role (prompt, copy, carry, sum, answer, mark: `toy.column_token_roles`) against
    two levels computed from the task alone (`loss_levels`): a perfect model, and one that copies nothing
    from the prompt;
  - the loss every 100 steps, as it goes (warmscan-progress.jsonl), so a cut call still says how far each got.
Writes to --out: warmscan-progress.jsonl, warmscan-lrX.json (one per candidate, when it ends), warmscan.md and
warmscan.json (the candidates in the pre-registered order, the entry conditions and the rule's choice).

    python research/gpu/study33_warmscan.py --out "$OUT" --lrs 3e-4,1e-4     # GPU, the study's model
    python research/gpu/study33_warmscan.py --out DIR --lrs 3e-3,1e-3 --tiny  # CPU, a tiny model, 3 steps: the plumbing
    python research/gpu/study33_warmscan.py --levels                          # the two loss levels (CPU, seconds)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "research"))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))  # toy.py

SEED = 0
LIMIT_S = 420  # every candidate ends within this or is stopped (a 600 s call, less ~2 min of start-up and the summary)
TINY = dict(hidden_size=32, layers=2, heads=4, warm_start_steps=3, max_completion_length=40)
ENTRY = {"median_length_min": 100, "accuracy": (0.1, 0.8)}  # section 7's entry conditions read from one start


def settings_for(lr: float, tiny: bool):
    from harness.settings import TASK_DEFAULTS, Settings

    settings = replace(Settings(), task="long", **TASK_DEFAULTS["long"])
    return replace(settings, warm_start_lr=lr, **(TINY if tiny else {}))


# -- what a model can reach on this task, from the task alone --------------------------------------------
def column_total_entropy(terms: int) -> float:
    """Entropy (nats) of the sum of ``terms`` independent uniform digits: a column total a model cannot read."""
    p = [1.0]
    for _ in range(terms):
        q = [0.0] * (len(p) + 9)
        for i, a in enumerate(p):
            for d in range(10):
                q[i + d] += a / 10
        p = q
    return -sum(a * math.log(a) for a in p if a > 0)


def loss_levels(rows: list[dict], styles: list[int], parts: tuple) -> dict:
    """The warm start's loss (nats a token, over prompt and completion tokens alike, as
    ``toy.supervised_warm_start`` averages it) of two models, on these texts:
      perfect: every term uniform on 0..99,999,999 (ln 1e8 a term), 4 or 5 terms (ln 2), the style drawn
        from ``parts`` (its entropy); every other token certain;
      no_copy: also ln 10 for each digit copied from the prompt (style 2) and each answer digit, and the
        entropy of a column total for each column of style 1 (its digits are not written); totals of
        written digits, carries and marks certain.
    Also the tokens a text has: prompt, completion (end of sequence included), and each role's count."""
    import toy

    style_entropy = -sum(w * math.log(w) for w in parts if w > 0)
    tokens = prompt_tokens = 0
    perfect = no_copy = 0.0
    roles: dict[str, int] = {}
    for row, style in zip(rows, styles):
        terms = row["terms"]
        role_list = toy.column_token_roles(terms, style)
        base = len(terms) * math.log(1e8) + math.log(2) + style_entropy
        columns = max(len(str(t)) for t in terms)
        perfect += base
        no_copy += (base + (role_list.count("copy") + role_list.count("answer")) * math.log(10)
                    + (columns * column_total_entropy(len(terms)) if style == 1 else 0.0))
        tokens += len(row["prompt"]) + len(role_list)
        prompt_tokens += len(row["prompt"])
        for role in role_list:
            roles[role] = roles.get(role, 0) + 1
    n = len(rows)
    return {"perfect": perfect / tokens, "no_copy": no_copy / tokens, "tokens_per_text": tokens / n,
            "prompt_tokens_per_text": prompt_tokens / n, "completion_tokens_per_text": (tokens - prompt_tokens) / n,
            "prompt_entropy_per_prompt_token": (perfect - n * style_entropy) / prompt_tokens,
            "roles_per_text": {k: v / n for k, v in sorted(roles.items())}}


def warm_start_texts(settings, seed: int, n: int | None = None) -> tuple[list[dict], list[int]]:
    """The rows and styles of the warm start's texts, drawn as ``demo.tasks.build_task_checkpoint`` draws them."""
    from harness.settings import SOLUTIONS, TASKS
    import toy

    rng = random.Random(seed + 1)
    rows = toy.sum_problems(n or settings.warm_start_steps * 64, seed=seed + 1, **TASKS[settings.task])
    weights = SOLUTIONS[settings.task][1]
    return rows, rng.choices(range(len(weights)), weights, k=len(rows))


def held_out(settings, seed: int, n: int = 256) -> tuple[list[dict], list[int]]:
    """``evaluate_start``'s held-out prompts (``sum_problems`` seed + 2) with styles in the warm start's parts."""
    from harness.settings import SOLUTIONS, TASKS
    import toy

    rows = toy.sum_problems(n, seed=seed + 2, **TASKS[settings.task])
    weights = SOLUTIONS[settings.task][1]
    return rows, random.Random(seed + 2).choices(range(len(weights)), weights, k=n)


def loss_by_role(path: str, settings, seed: int, device: str) -> dict:
    """The checkpoint's loss on the held-out texts (teacher-forced, as the warm start trains), in nats a token:
    over all tokens as the warm start averages it, and by role (the prompt's tokens after its first; each
    completion role of ``toy.column_token_roles``), next to :func:`loss_levels` on the same texts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness.settings import SOLUTIONS
    import toy

    rows, styles = held_out(settings, seed)
    solution, parts = SOLUTIONS[settings.task]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
    sums: dict[str, list[float]] = {}
    for start in range(0, len(rows), 64):
        chunk = list(zip(rows[start:start + 64], styles[start:start + 64]))
        texts = [r["prompt"] + solution(r["terms"], s) + tokenizer.eos_token for r, s in chunk]
        batch = tokenizer(texts, return_tensors="pt", padding=True).to(device)
        position_ids = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = model(**batch, position_ids=position_ids).logits.float()
        nll = -torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        for i, (r, s) in enumerate(chunk):
            roles = ["prompt"] * (len(r["prompt"]) - 1) + toy.column_token_roles(r["terms"], s)
            for role, value in zip(roles, nll[i, -len(roles):].tolist()):
                total = sums.setdefault(role, [0.0, 0])
                total[0] += value
                total[1] += 1
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    everything = [sum(v[0] for v in sums.values()), sum(v[1] for v in sums.values())]
    return {"all": everything[0] / everything[1], "by_role": {k: v[0] / v[1] for k, v in sorted(sums.items())},
            "levels": {k: v for k, v in loss_levels(rows, styles, parts).items() if k in ("perfect", "no_copy")}}


# -- one candidate (a process of its own) ----------------------------------------------------------------
def one_candidate(lr: float, out: str, work: str, tiny: bool) -> dict:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # as the demo sets it for a deterministic warm start
    import torch

    from harness.tasks import build_task_checkpoint, evaluate_start

    device = "cuda" if torch.cuda.is_available() and not tiny else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)  # the candidates run at once
    settings = settings_for(lr, tiny)
    progress_path = os.path.join(out, "warmscan-progress.jsonl")
    started = time.perf_counter()

    def progress(step: int, loss: float) -> None:  # one line per 100 steps: what a cut call leaves
        with open(progress_path, "a") as f:
            f.write(json.dumps({"lr": lr, "step": step, "loss": loss, "elapsed_s": time.perf_counter() - started}) + "\n")

    path = os.path.join(work, f"lr{lr:g}", "checkpoint")
    built = build_task_checkpoint(path, settings, SEED, device, progress=progress)
    record = {"lr": lr, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              **{k: v for k, v in built.items() if k != "path"}}
    record["start"] = evaluate_start(path, settings, SEED, device)
    record["loss_by_role"] = loss_by_role(path, settings, SEED, device)
    record["wall_s"] = time.perf_counter() - started
    with open(os.path.join(out, f"warmscan-lr{lr:g}.json"), "w") as f:
        json.dump(record, f, indent=1)
    return record


# -- the scan ---------------------------------------------------------------------------------------------
def entry(record: dict | None) -> dict:
    """Section 7's entry conditions that one warm start can show (the sha256 equality needs two invocations:
    the probe's)."""
    if record is None:
        return {"finished": False, "median_length_ok": False, "accuracy_ok": False, "meets": False}
    start = record["start"]
    low, high = ENTRY["accuracy"]
    length_ok = start["length"]["median"] >= ENTRY["median_length_min"]
    accuracy_ok = low <= start["accuracy"] <= high
    return {"finished": True, "median_length_ok": length_ok, "accuracy_ok": accuracy_ok, "meets": length_ok and accuracy_ok}


def choose(lrs: list[float], records: dict) -> tuple[float | None, bool]:
    """The pre-registered rule: (the first candidate in the given order whose warm start meets the entry
    conditions, or None; whether the scan decided it). A candidate the call did not finish says nothing about
    its rate: while one stands before the first that meets them, nothing is decided (it runs again alone)."""
    for lr in lrs:
        if lr not in records:
            return None, False
        if entry(records[lr])["meets"]:
            return lr, True
    return None, True


def write_record(out: str, stem: str, record: dict, text: str) -> None:
    """OUT/STEM.json (the record) and OUT/STEM.md (its text), then the text on stdout: every study33 call's
    record, written the same way."""
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump(record, f, indent=1)
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(text)
    print(text, flush=True)


def markdown(record: dict) -> str:
    lines = ["# Issue 33 warm-start scan (not study data)", "", f"commit {record['commit']}; {record['machine']}; "
             f"candidates in order {record['lrs']}; chosen: **{record['chosen']}**"
             + ("" if record["decided"] else " (undecided: a candidate before any that meets the conditions did not finish)"), "",
             "| lr | finished | s | loss last 50 | held-out loss (perfect / no copy) | copy | answer | sum | median length "
             "| accuracy | reward | entry |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for lr in record["lrs"]:
        r, e = record["candidates"].get(str(lr)), record["entry"][str(lr)]
        if r is None:
            last = record["progress"].get(str(lr))
            lines.append(f"| {lr:g} | no (last: {last}) | | | | | | | | | | no |")
            continue
        held, start = r["loss_by_role"], r["start"]
        lines.append(f"| {lr:g} | yes | {r['warm_start_s']:.0f} | {r['loss_last50']:.3f} | {held['all']:.3f} "
                     f"({held['levels']['perfect']:.3f} / {held['levels']['no_copy']:.3f}) | "
                     f"{held['by_role'].get('copy', float('nan')):.3f} | {held['by_role'].get('answer', float('nan')):.3f} | "
                     f"{held['by_role'].get('sum', float('nan')):.3f} | {start['length']['median']:g} | {start['accuracy']:.3f} | "
                     f"{start['reward']:.3f} | {'meets' if e['meets'] else 'fails'} |")
    lines += ["", "Loss by role in nats a token (held-out, teacher-forced); ln 10 = 2.303 is a digit guessed uniformly.",
              "Entry conditions here: median length at step 0 >= 100, accuracy at step 0 in [0.1, 0.8]; the weights' "
              "sha256 in two invocations is the probe's (rerun with the chosen rate)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out")
    p.add_argument("--lrs", help="candidate learning rates in the pre-registered order, comma-separated")
    p.add_argument("--work", default="/tmp/study33-warmscan")
    p.add_argument("--tiny", action="store_true", help="CPU, a tiny model, 3 steps: the plumbing only")
    p.add_argument("--limit", type=float, default=LIMIT_S, help=f"seconds before unfinished candidates are stopped ({LIMIT_S})")
    p.add_argument("--levels", action="store_true", help="print the loss levels of the warm-start texts and exit")
    p.add_argument("--one", type=float, help=argparse.SUPPRESS)  # a candidate's own process
    args = p.parse_args(argv)
    if args.levels:
        settings = settings_for(1e-3, tiny=False)
        from harness.settings import SOLUTIONS

        print(json.dumps({"warm_start_texts": loss_levels(*warm_start_texts(settings, SEED), SOLUTIONS["long"][1]),
                          "column_total_entropy": {n: column_total_entropy(n) for n in (4, 5)}}, indent=1))
        return 0
    if not args.out or not args.lrs:
        p.error("--out and --lrs are required (or --levels)")
    os.makedirs(args.out, exist_ok=True)
    if args.one is not None:
        one_candidate(args.one, args.out, args.work, args.tiny)
        return 0
    try:
        lrs = [float(x) for x in args.lrs.split(",") if x.strip()]
    except ValueError as e:
        raise SystemExit(f"--lrs={args.lrs!r}: {e}; allowed: comma-separated learning rates, e.g. 3e-4,1e-4") from e
    if not lrs or len(set(lrs)) != len(lrs) or any(not lr > 0 for lr in lrs):
        raise SystemExit(f"--lrs={args.lrs!r}: allowed: distinct learning rates > 0")
    os.makedirs(args.work, exist_ok=True)
    procs = {}
    for lr in lrs:  # all at once: each its own process, its own log
        log = open(os.path.join(args.out, f"warmscan-lr{lr:g}.log"), "w")
        argv_one = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--lrs", args.lrs, "--work", args.work,
                    "--one", repr(lr), *(["--tiny"] if args.tiny else [])]
        procs[lr] = (subprocess.Popen(argv_one, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), log)
    deadline = time.perf_counter() + args.limit
    exits = {}
    for lr, (proc, log) in procs.items():
        try:
            exits[lr] = proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            exits[lr] = "killed at the limit"
        log.close()
    records = {}
    for lr in lrs:
        path = os.path.join(args.out, f"warmscan-lr{lr:g}.json")
        if os.path.exists(path):
            records[lr] = json.load(open(path))
    progress = {}
    progress_path = os.path.join(args.out, "warmscan-progress.jsonl")
    if os.path.exists(progress_path):
        for line in open(progress_path):
            row = json.loads(line)
            progress[str(row["lr"])] = {"step": row["step"], "loss": row["loss"], "elapsed_s": row["elapsed_s"]}
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    summary = {"commit": commit or "unknown", "machine": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
               "lrs": lrs, "exits": {str(k): v for k, v in exits.items()},
               "candidates": {str(k): v for k, v in records.items()},
               "entry": {str(lr): entry(records.get(lr)) for lr in lrs}, "progress": progress,
               "chosen": choose(lrs, records)[0], "decided": choose(lrs, records)[1]}
    write_record(args.out, "warmscan", summary, markdown(summary))
    return 0 if all(v == 0 for v in exits.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
