"""Running every (method, seed): one spec file and one subprocess per run (the entry script with
``--worker``), at most ``jobs`` at a time, with a progress line per logged step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from .settings import SMOLLM2_MODEL, Settings, run_pairs, setting_labels

ENTRY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "study_cli.py")


@dataclass
class Run:
    method: str
    seed: int
    spec_path: str
    log_path: str
    metrics_path: str
    process: subprocess.Popen | None = None
    started: float = 0.0
    beta: float | None = None  # the initial β, where the invocation runs several settings (--betas, --runs)
    label: str | None = None  # its setting's short name (settings.setting_labels), where the invocation runs several

    @property
    def name(self) -> str:
        return f"{self.method}/seed{self.seed}" + (f"/{self.label}" if self.label is not None else "")


def make_runs(args, settings_list: list[tuple[Settings, str]], backend: str, checkpoints: dict[int, str]) -> list[Run]:
    """A run per seed and (initial β, method) pair (:func:`~harness.settings.run_pairs`: ``--runs``'s pairs, or
    ``--methods`` x ``--betas``): ``settings_list`` holds (settings, tag) per β
    (:func:`~harness.settings.beta_settings`); with several, each run's directory and name carry its setting's label
    (its β, and its kl_target, placement and estimator where those differ: :func:`~harness.settings.setting_labels`)."""
    runs = []
    several = len(settings_list) > 1
    labels = setting_labels(settings_list)
    hub_model = bool(args.model) and args.model != SMOLLM2_MODEL  # 512 positions; the other models: their settings'
    for seed, model in checkpoints.items():
        for settings, tag, method in run_pairs(args, settings_list):
            beta, label = (settings.beta, labels[tag]) if several else (None, None)
            run_dir = os.path.join(args.output_dir, "runs", f"{method}-seed{seed}" + (f"-{label}" if several else ""))
            os.makedirs(run_dir, exist_ok=True)
            run = Run(method, seed, os.path.join(run_dir, "spec.json"), os.path.join(run_dir, "log.txt"),
                      os.path.join(run_dir, "metrics.jsonl"), beta=beta, label=label)
            spec = dict(method=method, seed=seed, backend=backend, model=model, dataset=args.dataset,
                        settings=asdict(settings), run_dir=run_dir, metrics_path=run.metrics_path,
                        max_seq_length=512 if hub_model else settings.max_seq_length, tag=tag,
                        stream=os.path.abspath(args.stream) if args.stream else None)
            with open(run.spec_path, "w") as f:
                json.dump(spec, f, indent=1)
            if os.path.exists(run.metrics_path):
                os.remove(run.metrics_path)
            runs.append(run)
    return runs


def child_env(threads: int, run_dir: str, cuda: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               TORCHINDUCTOR_COMPILE_THREADS="1", UNSLOTH_COMPILE_LOCATION=os.path.join(run_dir, "unsloth_compiled_cache"))
    if not cuda:
        env["TRITON_INTERPRET"] = "1"  # TRL's Triton log-prob kernel, interpreted on the CPU
    return env


def last_step(run: Run) -> dict | None:
    if not os.path.exists(run.metrics_path):
        return None
    with open(run.metrics_path) as f:
        lines = f.read().splitlines()
    return json.loads(lines[-1]) if lines else None


def start(run: Run, threads: int, cuda: bool) -> None:
    log = open(run.log_path, "w")
    run.process = subprocess.Popen([sys.executable, ENTRY, "--worker", run.spec_path],
                                   stdout=log, stderr=subprocess.STDOUT,
                                   env=child_env(threads, os.path.dirname(run.log_path), cuda))
    run.started = time.perf_counter()
    print(f"  started {run.name}", flush=True)


def fail(run: Run) -> None:
    with open(run.log_path) as f:
        tail = f.read().splitlines()[-30:]
    raise SystemExit(f"{run.name} failed (exit {run.process.returncode}); last lines of {run.log_path}:\n  "
                     + "\n  ".join(tail))


def default_jobs(num_runs: int, cuda: bool) -> int:
    """On a GPU, every run at once up to 24 (each keeps one core and a sliver of the GPU busy, so
    3 seeds x 7 methods run in one wave); on the CPU, one run per core."""
    return min(num_runs, 24 if cuda else os.cpu_count() or 1)


def run_all(runs: list[Run], jobs: int, steps: int, cuda: bool, poll_seconds: float, keep_going: bool = False) -> list[Run]:
    """Run at most ``jobs`` runs at a time, printing each run's progress as it advances. A failed run
    stops them all, or with ``keep_going`` is reported and left out; returns the runs that finished."""
    threads = max(1, (os.cpu_count() or 1) // jobs)
    waiting, active, shown, failed = list(runs), [], {}, []
    t0 = time.perf_counter()
    while waiting or active:
        while waiting and len(active) < jobs:
            run = waiting.pop(0)
            start(run, threads, cuda)
            active.append(run)
        time.sleep(poll_seconds)
        for run in list(active):
            row = last_step(run)
            if row and shown.get(run.name) != row["step"]:
                shown[run.name] = row["step"]
                print(f"[{time.perf_counter() - t0:6.0f} s] {run.name:<36} step {row['step']:>4}/{steps} "
                      f"reward {row['reward']:.3f}  length {row['completions/mean_length']:5.1f}  "
                      f"beta {row['adaptive_kl/current_beta']:.4g}", flush=True)
            if run.process.poll() is not None:
                active.remove(run)
                if run.process.returncode != 0:
                    if keep_going:
                        print(f"  FAILED {run.name} (exit {run.process.returncode}): see {run.log_path}", flush=True)
                        failed.append(run)
                        continue
                    for other in active:
                        other.process.terminate()
                    fail(run)
                print(f"  finished {run.name} in {time.perf_counter() - run.started:.0f} s", flush=True)
    return [run for run in runs if run not in failed]
