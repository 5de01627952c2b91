"""Issue 33's first GPU call: what the long task and its GRPO steps cost, before any run of the study.

Two demo invocations on the long task (research/study_cli.py --task long), one after the other,
each warm-starting seed 0 inside the call (nothing is kept between calls):
  k1: one run alone (`none` at β 0.04), for the step time of a run that has the GPU to itself;
  k8: eight runs at once (`none` and `target` at four initial β), for the throughput of a shared GPU.
Both warm starts must give the same weights (sha256): the study pairs runs of different calls by seed. With --tiny
(a CPU) the warm start runs on one thread in both invocations: a CPU's sums, so the bits, depend on the thread count.
Writes to --out: study33-probe.md and .json (the record: warm start time, loss, tokens a second, accuracy,
reward and length distribution at step 0; step times; the projected cost of the study's run list), the two
streams, and study33-probe-runs.tar.gz (logs, summaries, warm-start records): at most 5 files.

    python research/gpu/study33_probe.py --out "$OUT"            # GPU, the study's settings (~9 min)
    python research/gpu/study33_probe.py --out DIR --tiny        # CPU, a tiny model: checks the plumbing
    python research/gpu/study33_probe.py --out "$OUT" --warm-start-lr 3e-4   # the probe again at another warm-start rate

The record also holds the k8 warm start's held-out loss by token role (study33_warmscan.loss_by_role), next to
the loss of a perfect model and of one that copies nothing from the prompt.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import subprocess
import sys
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "research", "study_cli.py")
sys.path.insert(0, os.path.join(ROOT, "research"))

# The study's run list (docs/evidence/study33-long-task.md), in run-steps, for the projection; kept equal to the
# list there by research/tests/test_study33_probe.py.
STUDY_RUNS = 75  # 5 seeds x (6 fixed β + 3 shaping methods at β 0.04 + 6 target), without the conditional (d)
STUDY_STEPS = 200
CALL_SECONDS = 540  # a 600 s call, less start-up margin
PHASES = {  # name: (demo arguments, time limit in seconds)
    "k1": (["--betas", "0.04", "--methods", "none"], 250),
    "k8": (["--betas", "0.01,0.04,0.1,0.3", "--methods", "none,target"], 290),
}
STEPS = 8
TINY = ["--smoke", "--max-completion-length", "40", "--warm-start-steps", "3"]
TINY_PHASES = {"k1": (["--betas", "0.04", "--methods", "none"], 600), "k8": (["--betas", "0.05,0.2", "--methods", "none"], 600)}


def run_phase(name: str, extra: list[str], limit: int, out: str, work: str, tiny: bool, warm_start_lr: float | None = None) -> dict:
    folder = os.path.join(work, name)
    stream = os.path.join(out, f"study33-probe-{name}-stream.jsonl")
    argv = [sys.executable, DEMO, "--task", "long", "--loss-type", "dapo", "--seeds", "1", "--steps",
            str(2 if tiny else STEPS), "--keep-going", "--stream", stream, "--output-dir", folder, *extra, *(TINY if tiny else []),
            *(["--warm-start-lr", repr(warm_start_lr)] if warm_start_lr else [])]
    # --tiny, on a CPU: the warm start on one thread in both invocations, so its bits depend on nothing the machine
    # decides (a CPU's sums depend on the thread count); the runs' own threads are the scheduler's, as before
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1") if tiny else None
    started = time.perf_counter()
    with open(os.path.join(work, f"{name}.log"), "w") as log:
        try:
            rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=limit, cwd=ROOT, env=env).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - started
    warm = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(folder, "warm_start-seed*.json")))]
    rows = [json.loads(line) for line in open(stream)] if os.path.exists(stream) else []
    return {"argv": argv[1:], "exit": rc, "wall_s": wall, "warm_start": warm[0] if warm else None, "rows": rows}


def step_times(rows: list[dict]) -> dict:
    """Per-step wall times (generation and training) from step 2 on (step 1 compiles), over all runs."""
    later = [r["step_time"] for r in rows if r["step"] >= 2]
    first = [r["step_time"] for r in rows if r["step"] == 1]
    runs = {(r["tag"], r["method"]) for r in rows}
    return {"runs": len(runs), "steps_logged": len(rows), "median_s": statistics.median(later) if later else None,
            "max_s": max(later) if later else None, "first_step_median_s": statistics.median(first) if first else None,
            "mean_length": statistics.fmean(r["completions/mean_length"] for r in rows) if rows else None,
            "completions_per_step": sorted({r.get("completions_per_step") for r in rows})}


def projection(k8: dict, warm_start_s: float) -> dict:
    """The study's cost if every call runs k8's concurrency at k8's median step time, after a warm start and a
    first step as long as k8's (docs/evidence/study33-long-task.md, the cost rule)."""
    runs, median = k8["runs"], k8["median_s"]
    if not runs or not median:
        return {}
    stepping_s = CALL_SECONDS - warm_start_s - (k8["first_step_median_s"] or 0)
    steps_per_call = int(stepping_s / median)
    throughput = runs / median  # run-steps a second on one GPU
    planned = STUDY_STEPS if steps_per_call >= STUDY_STEPS else 20 * (steps_per_call // 20)
    return {"runs_at_once": runs, "run_steps_per_s": throughput, "stepping_s_per_call": stepping_s,
            "steps_per_call_at_this_concurrency": steps_per_call, "planned_steps_by_the_cost_rule": planned,
            "study_runs_as_designed": planned >= 120,
            "one_gpu_calls_at_this_concurrency": math.ceil(STUDY_RUNS / runs) if planned >= 120 else None}


def markdown(record: dict) -> str:
    lines = ["# Issue 33 probe: the long task's warm start and GRPO step time", "",
             f"commit {record['commit']}; {record['machine']}; warm-start learning rate {record['warm_start_lr']:g}", ""]
    for name, phase in record["phases"].items():
        warm, times = phase["warm_start"], phase["step_times"]
        lines += [f"## {name}: exit {phase['exit']}, {phase['wall_s']:.0f} s", "", "`" + " ".join(phase["argv"]) + "`", ""]
        if warm:
            start = warm["start"]
            lines += [f"- warm start: {warm['warm_start_steps']} steps in {warm['warm_start_s']:.1f} s "
                      f"({warm['tokens_per_s']:.3g} tokens/s), {warm['parameters'] / 1e6:.1f} M parameters, loss last 50 "
                      f"{warm['loss_last50']:.4f}, weights sha256 {warm['weights_sha256'][:16]}",
                      f"- at step 0 (n={start['n']}): accuracy {start['accuracy']:.3f}, format {start['format']:.3f}, reward "
                      f"{start['reward']:.3f}, truncated {start['truncated']:.3f}",
                      "- length (tokens): " + ", ".join(f"{k} {v:g}" for k, v in start["length"].items()),
                      "- styles: " + "; ".join(f"{s} {v['share']:.2f} (accuracy {v['accuracy'] if v['accuracy'] is None else round(v['accuracy'], 3)}, "
                                               f"median length {v['median_length']})" for s, v in start["styles"].items())]
        lines += [f"- GRPO: {times['runs']} run(s), {times['steps_logged']} steps logged; step time median "
                  f"{times['median_s']} s (max {times['max_s']}), first step {times['first_step_median_s']} s; mean "
                  f"completion length {times['mean_length']}; completions per optimizer step {times['completions_per_step']}", ""]
    held = record.get("loss_by_role")
    if held:
        lines += ["k8's warm start, held-out loss (nats a token): " + f"{held['all']:.3f} (a perfect model "
                  f"{held['levels']['perfect']:.3f}, one that copies nothing from the prompt {held['levels']['no_copy']:.3f}); "
                  "by role: " + ", ".join(f"{k} {v:.3f}" for k, v in held["by_role"].items()), ""]
    lines += [f"Same warm start in both invocations: **{record['same_warm_start']}**", "",
              "Projection (section 7's run list at k8's concurrency and step time): `" + json.dumps(record["projection"]) + "`"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/study33-probe")
    p.add_argument("--tiny", action="store_true", help="CPU, a tiny model, two steps: the plumbing only")
    p.add_argument("--warm-start-lr", type=float, help="the warm start's learning rate (default: the long task's)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    phases = {}
    for name, (extra, limit) in (TINY_PHASES if args.tiny else PHASES).items():
        phase = run_phase(name, extra, limit, args.out, args.work, args.tiny, args.warm_start_lr)
        phase["step_times"] = step_times(phase.pop("rows"))
        phases[name] = phase
        print(f"{name}: exit {phase['exit']}, {phase['wall_s']:.0f} s, {json.dumps(phase['step_times'])}", flush=True)
    hashes = {n: (ph["warm_start"] or {}).get("weights_sha256") for n, ph in phases.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    import torch

    from harness.settings import TASK_DEFAULTS
    from study33_warmscan import loss_by_role, settings_for, write_record

    machine = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    lr = args.warm_start_lr or TASK_DEFAULTS["long"]["warm_start_lr"]
    checkpoint = os.path.join(args.work, "k8", "checkpoints", "seed0")
    held = (loss_by_role(checkpoint, settings_for(lr, args.tiny), 0, "cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
            if os.path.isdir(checkpoint) else None)
    record = {"commit": commit or "unknown", "machine": machine, "warm_start_lr": lr, "loss_by_role": held, "phases": phases,
              "same_warm_start": len(set(hashes.values())) == 1 and None not in hashes.values(),
              "projection": projection(phases["k8"]["step_times"], (phases["k8"]["warm_start"] or {}).get("build_s", 0.0))}
    write_record(args.out, "study33-probe", record, markdown(record))
    with tarfile.open(os.path.join(args.out, "study33-probe-runs.tar.gz"), "w:gz") as tar:
        for path in sorted(glob.glob(os.path.join(args.work, "*.log")) + glob.glob(os.path.join(args.work, "*", "*.json"))
                           + glob.glob(os.path.join(args.work, "*", "summary.md")) + glob.glob(os.path.join(args.work, "*", "runs", "*", "*.txt"))
                           + glob.glob(os.path.join(args.work, "*", "runs", "*", "trained.json"))):
            tar.add(path, arcname=os.path.relpath(path, args.work))
    return 0 if all(ph["exit"] == 0 for ph in phases.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
