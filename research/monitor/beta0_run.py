"""The sampled kl_monitor against the full one on a real run at beta = 0 (issue 53): a GRPO run of the toy task
(a tiny Llama built and warm-started here, examples/quickstart.py's settings but 4 prompts x 8 = 32 completions a step) at beta = 0 with the full monitor
(``kl_monitor=True, kl_monitor_every=1``), on the CPU, logging the KL of every step; the monitor does not change
training, so keeping every N-th of those values is what the sampled monitor would have logged in the same run.

    python research/monitor/beta0_run.py --seeds 0 1 2 --steps 200 --out research/data/monitor-beta0
    python research/monitor/beta0_run.py --table research/data/monitor-beta0   # the table of docs/metrics-tail.md

Printed: for N in 4, 8, 16, 32, the logged value over the mean KL of its N steps as quantiles of |ratio - 1| over
every cycle of every phase (research/monitor/sampled_kl.py's measure, applied to these beta = 0 runs), and the mean
of 4 consecutive watched values over the mean of the 4N steps they stand for (a trend read from several samples).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
os.environ.setdefault("TRITON_INTERPRET", "1")

from sampled_kl import errors, quantile  # noqa: E402


def train(seed: int, steps: int, out: str) -> str:
    import torch
    from transformers import set_seed

    import unsloth_adaptive_kl  # noqa: F401
    from trl import GRPOConfig, GRPOTrainer
    import toy  # examples/toy.py
    from unsloth_adaptive_kl import RAW_KL

    set_seed(seed)
    work = tempfile.mkdtemp(prefix=f"beta0-monitor-{seed}-")
    model = toy.build_checkpoint(os.path.join(work, "model"), warm_start_steps=150, seed=seed)
    config = GRPOConfig(output_dir=work, use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=32,
                        num_generations=8, max_completion_length=8, max_steps=steps, logging_steps=1, learning_rate=5e-4,
                        save_strategy="no", beta=0.0, loss_type="dapo", kl_monitor=True, kl_monitor_every=1, seed=seed,
                        disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=[toy.format_reward, toy.correctness_reward], args=config,
                          train_dataset=toy.prompt_dataset(4096, seed=seed))
    trainer.train()
    rows = [{"seed": seed, "step": h["step"], "kl": h[RAW_KL], "reward": h["reward"]} for h in trainer.state.log_history
            if RAW_KL in h]
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"beta0-full-monitor-seed{seed}.jsonl.gz")
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    assert torch.isfinite(torch.tensor([r["kl"] for r in rows])).all()
    return path


TREND = 4  # watched steps read together ("read a trend from several watched steps", docs/metrics-tail.md)


def trend_errors(series: list[float], every: int, k: int = TREND) -> list[float]:
    """|mean of k consecutive watched steps / mean of the k * every steps they stand for - 1|, every phase."""
    out = []
    for phase in range(every):
        for start in range(phase, len(series) - k * every + 1, every):
            span = series[start : start + k * every]
            mean = sum(span) / len(span)
            if mean > 0:
                out.append(abs(sum(span[::every]) / k / mean - 1))
    return out


def table(directory: str, everies=(4, 8, 16, 32)) -> str:
    series = []
    for path in sorted(glob.glob(os.path.join(directory, "beta0-full-monitor-seed*.jsonl.gz"))):
        rows = [json.loads(line) for line in gzip.open(path, "rt")]
        if [r["step"] for r in rows] != list(range(1, len(rows) + 1)):
            raise ValueError(f"{path}: not every step logged a KL")
        series.append([r["kl"] for r in rows])
    out = [f"runs: {len(series)} at beta = 0, full monitor, {', '.join(str(len(s)) for s in series)} steps",
           "| kl_monitor_every | runs | cycles | |logged / cycle mean - 1|: median | 90 % | 99 % | max "
           f"| mean of {TREND} watched / mean of their {TREND} cycles, |ratio - 1|: median | 90 % |",
           "|---|---|---|---|---|---|---|---|---|"]
    for every in everies:
        e = [x for s in series for x in errors(s, every)]
        t = [x for s in series for x in trend_errors(s, every)]
        if not e:
            continue
        trend = f"{quantile(t, 0.5):.3f} | {quantile(t, 0.9):.3f}" if t else "— | —"
        out.append(f"| {every} | {len(series)} | {len(e)} | {quantile(e, 0.5):.3f} | {quantile(e, 0.9):.3f} | "
                   f"{quantile(e, 0.99):.3f} | {max(e):.3f} | {trend} |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="*", default=[])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=os.path.join(ROOT, "research/data/monitor-beta0"))
    parser.add_argument("--table", default=None, help="print the table of the runs in this directory")
    args = parser.parse_args(argv)
    for seed in args.seeds:
        print("wrote", train(seed, args.steps, args.out), flush=True)
    if args.table:
        print(table(args.table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
