"""Issue 33: what the non-generation part of a long-task GRPO step spends its time on (not study data).

study33_genspeed.py found a lone run's step at 2.44 s, of which generate() is 0.33 s (Unsloth's CUDA-graph decode
is on); its steps alternate between ~0.7 s and ~2.5 s. This call profiles the rest, on one run (`none` at β 0.04,
8 steps) of the demo's own worker, from the warm start the study uses (--warm-start-steps, default 2,000; a first
call with 400 steps saw no slow steps after step 2):

  timers    the trainer's own methods timed with a CUDA synchronisation around each (generation and scoring,
            compute_loss, training_step), per step, with torch.compile's graph count per step and
            TORCH_LOGS=recompiles (its lines are reported)
  cprofile  the same run under cProfile: the top functions by cumulative and by own time (--modes)
  torch     torch.profiler over steps 4-6: the top operators by CPU and by CUDA time

Writes profile.md (every table) and profile.json to --out.

    python research/gpu/study33_profile.py --out "$OUT"           # GPU (~5 min)
    python research/gpu/study33_profile.py --out DIR --tiny       # CPU: the plumbing only
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import study33_genspeed as genspeed  # noqa: E402  (ROOT/research on sys.path, the harness's arguments)

TIMED = ("_generate_and_score_completions", "compute_loss", "training_step", "_compute_loss")


def timed_methods(trainer, cuda: bool, totals: dict) -> None:
    """Wrap the trainer's methods of TIMED that exist with synchronised wall clocks (a synchronisation before the
    call too, so no earlier work is counted), summed into ``totals``."""
    import torch

    from harness.worker import synchronised_timer

    for name in TIMED:
        inner = getattr(trainer, name, None)
        if inner is None:
            continue

        def add(seconds, _name=name):
            totals[_name] = totals.get(_name, 0.0) + seconds

        timer = synchronised_timer(inner, cuda, add)

        def timed(*args, _timer=timer, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            return _timer(*args, **kwargs)

        setattr(trainer, name, timed)


def profile_worker(spec_path: str, mode: str, dump: str) -> None:
    """One run of the demo's worker (build_trainer, its step logger) under ``mode``; tables to ``dump``."""
    import torch
    from transformers import TrainerCallback

    from harness import worker

    cuda = torch.cuda.is_available()
    spec = json.load(open(spec_path))
    trainer, trained = worker.build_trainer(spec, cuda)
    clock = worker.GenerationClock(trainer.model, cuda)
    trainer.add_callback(worker.step_logger(spec["metrics_path"], spec, {**trained.fields(), "copy": mode}, clock))
    totals: dict = {}
    per_step: list = []
    lines: list[str] = []

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            totals.clear()
            if mode == "torch" and state.global_step == 3:  # the callback sees the step before it: steps 4-6
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                                   + ([torch.profiler.ProfilerActivity.CUDA] if cuda else []))
                self.prof.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            per_step.append({"step": state.global_step, **{k: round(v, 4) for k, v in totals.items()}})
            if mode == "torch" and state.global_step == 6:
                self.prof.__exit__(None, None, None)
                averages = self.prof.key_averages()
                lines.append("### torch.profiler, steps 4-6, by self CPU time\n\n```\n"
                             + averages.table(sort_by="self_cpu_time_total", row_limit=35, max_name_column_width=60) + "\n```")
                if cuda:
                    try:
                        table = averages.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60)
                    except (AttributeError, KeyError, ValueError):  # older torch: the CUDA name
                        table = averages.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60)
                    lines.append(f"### torch.profiler, steps 4-6, by self CUDA time\n\n```\n{table}\n```")

    timed_methods(trainer, cuda, totals)
    trainer.add_callback(Steps())
    if mode == "cprofile":
        profiler = cProfile.Profile()
        profiler.enable()
        trainer.train()
        profiler.disable()
        for key, n in (("cumulative", 45), ("tottime", 35)):
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(n)
            lines.append(f"### cProfile, the whole run (8 steps), by {key}\n\n```\n{text.getvalue()[-9000:]}\n```")
    else:
        trainer.train()
    with open(dump, "w") as f:
        json.dump({"per_step": per_step, "tables": lines}, f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out")
    p.add_argument("--work", default="/tmp/study33-profile")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--warm-start-lr", type=float, default=3e-4)
    p.add_argument("--warm-start-steps", type=int, default=2000)
    p.add_argument("--modes", default="timers,torch")
    p.add_argument("--profile-worker", nargs=3, metavar=("SPEC", "MODE", "DUMP"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.profile_worker:
        profile_worker(*args.profile_worker)
        return 0
    import torch

    from harness import scheduler, settings as demo_settings, tasks

    cuda = torch.cuda.is_available()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    warm_steps = ["--warm-start-steps", str(args.warm_start_steps)]
    warm_args = genspeed.demo_args(warm_steps, os.path.join(args.work, "warm"),
                                   genspeed.STEPS, args.tiny, args.warm_start_lr)
    os.makedirs(warm_args.output_dir, exist_ok=True)
    checkpoint = tasks.starting_model(warm_args, demo_settings.settings_from(warm_args), 0, "cuda" if cuda else "cpu")
    warm = json.load(open(os.path.join(warm_args.output_dir, "warm_start-seed0.json")))
    record = {"machine": torch.cuda.get_device_name(0) if cuda else "CPU", "warm_start": {
        k: warm[k] for k in ("warm_start_steps", "build_s", "loss_last50") if k in warm}, "start_length": warm["start"]["length"],
        "modes": {}}
    report = [f"# Issue 33: where a lone run's step goes (not study data)\n\n{record['machine']}; warm start "
              f"{json.dumps(record['warm_start'])}; completion length at step 0 {json.dumps(record['start_length'])}\n"]
    for mode in args.modes.split(","):
        folder = os.path.join(args.work, mode)
        run_args = genspeed.demo_args(["--betas", "0.04", "--methods", "none", *warm_steps], folder,
                                      2 if args.tiny else genspeed.STEPS, args.tiny, args.warm_start_lr)
        run = scheduler.make_runs(run_args, demo_settings.beta_settings(run_args, demo_settings.settings_from(run_args)),
                                  "unsloth" if cuda else "trl", {0: checkpoint})[0]
        dump = os.path.join(folder, "dump.json")
        started = time.perf_counter()
        with open(run.log_path, "w") as log:
            rc = subprocess.run([sys.executable, os.path.abspath(__file__), "--profile-worker", run.spec_path, mode, dump],
                                stdout=log, stderr=subprocess.STDOUT,
                                env={**scheduler.child_env(8, folder, cuda), **({"TORCH_LOGS": "recompiles"} if mode == "timers" else {})},
                                timeout=200).returncode
        rows = [json.loads(line) for line in open(run.metrics_path)] if os.path.exists(run.metrics_path) else []
        got = json.load(open(dump)) if os.path.exists(dump) else {"per_step": [], "tables": []}
        steps = [{**t, "step_time": r["step_time"], "generation_time": r.get("generation_time"), "graphs": r.get("compiled_graphs"),
                  "mean_length": r["completions/mean_length"], "max_length": r["completions/max_length"]}
                 for t, r in zip(got["per_step"], rows)]
        record["modes"][mode] = {"exit": rc, "wall_s": time.perf_counter() - started, "steps": steps}
        if rc != 0:
            report.append(f"## {mode}: exit {rc}\n\n```\n{open(run.log_path).read()[-3000:]}\n```\n")
        report.append(f"## {mode}: exit {rc}, {record['modes'][mode]['wall_s']:.0f} s\n\nPer step (seconds, synchronised "
                      "timers; `training_step` includes the generation and scoring of its step):\n\n```\n"
                      + "\n".join(json.dumps(s) for s in steps) + "\n```\n")
        report += got["tables"]
        recompiles = [line for line in open(run.log_path) if "ecompil" in line][:60]
        if recompiles:
            report.append(f"### {mode}: recompile lines (first 60)\n\n```\n" + "".join(recompiles)[-12000:] + "\n```\n")
        with open(os.path.join(args.out, "profile.md"), "w") as f:  # as it goes
            f.write("\n".join(report) + "\n")
        with open(os.path.join(args.out, "profile.json"), "w") as f:
            json.dump(record, f, indent=1)
        print(f"{mode}: exit {rc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
