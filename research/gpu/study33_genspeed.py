"""Issue 33: where a GRPO step of the long task spends its time, before a faster generation is chosen.

Not study data (docs/evidence/study33-long-task.md, Amendment 5). One warm start of seed 0 at the chosen rate (3e-4,
Amendment 3), built by the demo's own code, then phases of the demo's own runs from that one checkpoint (the demo
would warm-start again per invocation: 170 s each). Each phase runs its runs at once, 8 steps each, and records
per step the step's wall time, the part spent in the policy's ``generate`` (the worker's GenerationClock) and
Unsloth's CUDA-graph decode counters:

  g1        one run alone (`none` at β 0.04): a run that has the GPU to itself
  g8        eight at once (section 7's probe list k8): the concurrency the cost rule is applied to
  g16       sixteen at once: does the throughput keep rising with the 16 CPU cores?
  g1-eager  g1 with UNSLOTH_DECODE_CUDA_GRAPHS=0: what Unsloth's graph decode buys (last: dropped first)

A phase that would pass the call's deadline is not started; a phase past its limit has its runs ended.
Writes genspeed.md, genspeed.json and genspeed-stream.jsonl (every phase's rows, tagged) to --out.

    python research/gpu/study33_genspeed.py --out "$OUT"        # GPU (~9 min)
    python research/gpu/study33_genspeed.py --out DIR --tiny    # CPU, a tiny model: the plumbing only
    python research/gpu/study33_genspeed.py --out "$OUT" --phases g1,g8,g16 --env UNSLOTH_GRPO_SEQ_PACKING=0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "research"))

STEPS = 8
DEMO = ["--task", "long", "--loss-type", "dapo", "--seeds", "1", "--keep-going"]
EIGHT = ["--betas", "0.01,0.04,0.1,0.3", "--methods", "none,target"]
PHASES = (  # name, demo arguments, environment, limit in seconds
    ("g1", ["--betas", "0.04", "--methods", "none"], {}, 95),
    ("g8", EIGHT, {}, 125),
    ("g16", ["--betas", "0.01,0.04,0.1,0.3", "--methods", "none,target,clip,length_normalized"], {}, 140),
    ("g1-eager", ["--betas", "0.04", "--methods", "none"], {"UNSLOTH_DECODE_CUDA_GRAPHS": "0"}, 95),
)
TINY = ["--smoke", "--max-completion-length", "24", "--warm-start-steps", "3"]
TINY_PHASES = (("g1", ["--betas", "0.04", "--methods", "none"], {}, 600),
               ("g2", ["--betas", "0.05,0.2", "--methods", "none"], {}, 600))


def demo_args(extra: list[str], folder: str, steps: int, tiny: bool, lr: float):
    from harness import cli

    return cli.parse_args([*DEMO, "--steps", str(steps), "--output-dir", folder, "--warm-start-lr", repr(lr), *extra,
                           *(TINY if tiny else [])])


def run_phase(name: str, extra: list[str], env: dict, limit: float, checkpoint: str, work: str, stream: str,
              steps: int, tiny: bool, lr: float, cuda: bool) -> dict:
    """The demo's runs of one phase, all at once, from ``checkpoint``; their rows, tagged with the phase."""
    from harness import scheduler, settings as demo_settings

    folder = os.path.join(work, name)
    args = demo_args(extra, folder, steps, tiny, lr)
    settings = demo_settings.settings_from(args)
    runs = scheduler.make_runs(args, demo_settings.beta_settings(args, settings), "unsloth" if cuda else "trl", {0: checkpoint})
    threads = max(1, (os.cpu_count() or 1) // len(runs))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    started = time.perf_counter()
    try:
        for run in runs:
            scheduler.start(run, threads, cuda)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    while any(r.process.poll() is None for r in runs) and time.perf_counter() - started < limit:
        time.sleep(1.0)
    ended = [r.name for r in runs if r.process.poll() is None]
    for run in runs:
        if run.process.poll() is None:
            run.process.kill()
            run.process.wait()
    wall = time.perf_counter() - started
    rows = []
    for run in runs:
        if os.path.exists(run.metrics_path):
            rows += [{**json.loads(line), "phase": name} for line in open(run.metrics_path)]
    with open(stream, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return {"runs": len(runs), "env": env, "limit_s": limit, "wall_s": wall, "ended_at_limit": ended,
            "exits": {r.name: r.process.returncode for r in runs}, "summary": summary(rows, len(runs))}


def summary(rows: list[dict], runs: int) -> dict:
    """Medians over every run's steps from 2 on (step 1 compiles): step, generation, the rest; run-steps a second."""
    later = [r for r in rows if r["step"] >= 2]
    if not later:
        return {"steps_logged": len(rows)}
    step = statistics.median(r["step_time"] for r in later)
    gen = statistics.median(r["generation_time"] for r in later)
    last = max(rows, key=lambda r: r["step"])
    return {"steps_logged": len(rows), "step_median_s": step, "generation_median_s": gen,
            "rest_median_s": statistics.median(r["step_time"] - r["generation_time"] for r in later),
            "generation_share": gen / step, "run_steps_per_s": runs / step,
            "first_step_median_s": statistics.median(r["step_time"] for r in rows if r["step"] == 1),
            "mean_length": statistics.fmean(r["completions/mean_length"] for r in later),
            "max_length_median": statistics.median(r["completions/max_length"] for r in later),
            "generation_s_per_token_step": statistics.median(r["generation_time"] / max(r["completions/max_length"], 1)
                                                            for r in later),
            "decode_graphs_last_row": {k: v for k, v in last.items() if k.startswith("decode_graph")}}


def markdown(record: dict) -> str:
    lines = ["# Issue 33: where a step of the long task spends its time (not study data)", "",
             f"{record['machine']}; warm-start rate {record['warm_start_lr']:g}; warm start {record['warm_start_s']:.0f} s "
             f"(sha256 {record['weights_sha256'][:16]})", "",
             "| phase | runs | env | wall s | step s | generate s | rest s | generate share | s / token step | run-steps/s | "
             "mean length | decode graphs (last row) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, ph in record["phases"].items():
        s = ph["summary"]
        if "step_median_s" not in s:
            lines.append(f"| {name} | {ph['runs']} | {ph['env']} | {ph['wall_s']:.0f} | no step after the first "
                         f"({s['steps_logged']} logged) | | | | | | | |")
            continue
        lines.append(f"| {name} | {ph['runs']} | {ph['env']} | {ph['wall_s']:.0f} | {s['step_median_s']:.3f} | "
                     f"{s['generation_median_s']:.3f} | {s['rest_median_s']:.3f} | {s['generation_share']:.2f} | "
                     f"{s['generation_s_per_token_step'] * 1e3:.1f} ms | {s['run_steps_per_s']:.2f} | {s['mean_length']:.1f} | "
                     f"{s['decode_graphs_last_row']} |")
    lines += ["", "Not run (the call's deadline): " + (", ".join(record["not_run"]) or "none")]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/study33-genspeed")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--warm-start-lr", type=float, default=3e-4)
    p.add_argument("--deadline", type=float, default=555.0, help="seconds from the start after which no phase starts")
    p.add_argument("--phases", help="comma-separated phase names to run, in this order (default: all)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set in every run of every phase (recorded in the phase's env); repeatable")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the demo's deterministic warm start
    from harness import settings as demo_settings, tasks

    warm_args = demo_args([], os.path.join(args.work, "warm"), STEPS, args.tiny, args.warm_start_lr)
    os.makedirs(warm_args.output_dir, exist_ok=True)
    checkpoint = tasks.starting_model(warm_args, demo_settings.settings_from(warm_args), 0, "cuda" if cuda else "cpu")
    warm = json.load(open(os.path.join(warm_args.output_dir, "warm_start-seed0.json")))
    record = {"machine": torch.cuda.get_device_name(0) if cuda else "CPU", "warm_start_lr": args.warm_start_lr,
              "warm_start_s": warm["build_s"], "weights_sha256": warm["weights_sha256"], "phases": {}, "not_run": []}
    stream = os.path.join(args.out, "genspeed-stream.jsonl")
    phases = {name: (extra, env, limit) for name, extra, env, limit in (TINY_PHASES if args.tiny else PHASES)}
    chosen = args.phases.split(",") if args.phases else list(phases)
    common = dict(item.split("=", 1) for item in args.env)
    for name in chosen:
        extra, env, limit = phases[name]
        env = {**env, **common}
        if time.perf_counter() - t0 + limit > args.deadline:
            record["not_run"].append(name)
            continue
        phase = run_phase(name, extra, env, limit, checkpoint, args.work, stream, 2 if args.tiny else STEPS, args.tiny,
                          args.warm_start_lr, cuda)
        record["phases"][name] = phase
        print(f"{name}: {json.dumps(phase)}", flush=True)
        with open(os.path.join(args.out, "genspeed.json"), "w") as f:  # as it goes: a cut call keeps what ran
            json.dump(record, f, indent=1)
        with open(os.path.join(args.out, "genspeed.md"), "w") as f:
            f.write(markdown(record))
    print(markdown(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
