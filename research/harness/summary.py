"""The table of a demo run: per method, the start/end/final numbers of each seed's run, as mean ± std."""

from __future__ import annotations

import json
import math
import statistics

from unsloth_adaptive_kl.metrics import ADAPTED_KL, CURRENT_BETA, RAW_KL, TOKEN_KL_MAX

from .scheduler import Run

COLUMNS = [  # (header, key in a run's summary, format)
    ("final reward", "final_reward", ".3f"),
    ("peak reward", "peak_reward", ".3f"),
    ("length start", "length_start", ".1f"),
    ("length end", "length_end", ".1f"),
    ("raw KL end", "raw_kl_end", ".4f"),
    ("token KL max final", "token_kl_max_final", ".4g"),
    ("adapted KL end", "adapted_kl_end", ".4f"),
    ("final β", "final_beta", ".4g"),
    ("median step (s)", "median_step_s", ".2f"),
]


def _mean(values) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def _last(values) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return values[-1] if values else math.nan


def summarize_run(rows: list[dict], window: float) -> dict:
    """One run's numbers: "start"/"end"/"final" are means over the first/last ``window`` of steps
    (at least one step); "peak" is the highest single step. A KL is NaN where β had reached 0."""
    k = max(1, round(len(rows) * window))
    head, tail = rows[:k], rows[-k:]
    return {
        "final_reward": _mean(r["reward"] for r in tail),
        "peak_reward": max(r["reward"] for r in rows),
        "length_start": _mean(r["completions/mean_length"] for r in head),
        "length_end": _mean(r["completions/mean_length"] for r in tail),
        "raw_kl_end": _mean(r.get(RAW_KL) for r in tail),
        "token_kl_max_final": _last(r.get(TOKEN_KL_MAX) for r in rows),  # the tail beside the mean
        "adapted_kl_end": _mean(r.get(ADAPTED_KL) for r in tail),
        "final_beta": rows[-1][CURRENT_BETA],
        "median_step_s": statistics.median(r["step_time"] for r in rows),
    }


def read_metrics(runs: list[Run]) -> dict[tuple[str, int], list[dict]]:
    metrics = {}
    for run in runs:
        with open(run.metrics_path) as f:
            metrics[(run.method, run.seed)] = [json.loads(line) for line in f]
    return metrics


def cell(values: list[float], fmt: str) -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "—"
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ± {format(statistics.stdev(values), fmt)}"


def markdown_table(metrics: dict, methods: list[str], seeds: list[int], window: float) -> str:
    lines = ["| method | " + " | ".join(h for h, _, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for method in methods:
        per_seed = [summarize_run(metrics[(method, seed)], window) for seed in seeds]
        cells = [cell([s[key] for s in per_seed], fmt) for _, key, fmt in COLUMNS]
        lines.append(f"| `{method}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_notes(seeds: list[int], steps: int, window: float) -> str:
    k = max(1, round(steps * window))
    spread = f"mean ± std over {len(seeds)} seeds ({', '.join(map(str, seeds))})" if len(seeds) > 1 else f"seed {seeds[0]}"
    return (f"{spread}. start / end / final: mean over the first / last {k} of {steps} steps; peak: the best "
            "step. Length in tokens (TRL's completions/mean_length). KL: adaptive_kl/raw_kl and adapted_kl "
            "(— once β reached 0: no KL is computed); token KL max final: the last logged adaptive_kl/token_kl_max "
            "(the largest per-token raw KL of that logging window, docs/metrics-tail.md). Step time: median wall time of an optimizer step, "
            "generation included.")


def trained_batch_lines(metrics: dict, planned: int) -> list[str]:
    """What the runs' optimizer steps trained, as their rows record it (``StepBatch.fields`` and ``kl_horizon``):
    one line per distinct batch with its number of runs, and a line for every run that trained a number of
    completions other than the ``planned`` one."""
    groups: dict[tuple, list[str]] = {}
    for key, rows in metrics.items():
        first = rows[0] if rows else {}
        batch = tuple(first.get(k) for k in ("completions_per_step", "gradient_accumulation_steps",
                                             "per_device_train_batch_size", "generation_batch_size", "num_processes",
                                             "kl_horizon"))
        groups.setdefault(batch, []).append("/".join(str(k) for k in key if k is not None))
    lines = []
    for (completions, accumulation, micro, generation, processes, horizon), runs in groups.items():
        if completions is None:
            lines.append(f"Trained: not recorded in the rows of {len(runs)} run(s) (written before the demo recorded it).")
            continue
        lines.append(f"Trained (read from each run's trainer): {completions} completions per optimizer step = "
                     f"{micro} x gradient_accumulation_steps {accumulation} x {processes} process(es), generation batch "
                     f"{generation}; kl_horizon {horizon:g} ({horizon / completions:g} steps): {len(runs)} run(s).")
        if completions != planned:
            lines.append(f"DIFFERENCE: {len(runs)} run(s) trained {completions} completions a step, the settings ask "
                         f"for {planned}: {', '.join(runs)}.")
    return lines
