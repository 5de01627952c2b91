"""The curves: reward, completion length, KL and β against step, mean over seeds (matplotlib, optional)."""

from __future__ import annotations

import math
import statistics

from unsloth_adaptive_kl.metrics import ADAPTED_KL, CURRENT_BETA, RAW_KL

from .analysis import read_rows

PANELS = [("reward", "reward"), ("completions/mean_length", "completion length (tokens)"),
          (RAW_KL, "KL: raw (solid), adapted (dashed)"), (CURRENT_BETA, "β")]


def seed_mean_curve(metrics: dict, method: str, seeds: list[int], key: str, smooth: int, std: bool = False):
    """Per step, the mean over seeds of ``key``, then a trailing moving average over ``smooth`` steps;
    with ``std``, also the smoothed sample standard deviation over seeds (0 with one seed)."""
    by_step: dict[int, list[float]] = {}
    for seed in seeds:
        for row in metrics[(method, seed)]:
            value = row.get(key)
            if value is not None and not math.isnan(value):
                by_step.setdefault(row["step"], []).append(value)
    steps = sorted(by_step)
    means = [sum(by_step[s]) / len(by_step[s]) for s in steps]
    def smoothe(values):
        return [sum(values[max(0, i - smooth + 1): i + 1]) / len(values[max(0, i - smooth + 1): i + 1])
                for i in range(len(values))]

    if not std:
        return steps, smoothe(means)
    stds = [statistics.stdev(by_step[s]) if len(by_step[s]) > 1 else 0.0 for s in steps]
    return steps, smoothe(means), smoothe(stds)


def plot(metrics: dict, methods: list[str], seeds: list[int], steps: int, path: str, title: str) -> str:
    """Write the 2x2 figure; return a line saying where it went (or why it did not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("PNG skipped: matplotlib is not installed. `pip install matplotlib` (or the project's dev extra, "
                "pip install -e '.[dev]') and run again; metrics.jsonl and summary.md are complete without it.")
    smooth = max(1, steps // 20)
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), sharex=True)
    colors = plt.get_cmap("tab10")
    for (key, label), ax in zip(PANELS, axes.flat):
        for i, method in enumerate(methods):
            xs, ys, sd = seed_mean_curve(metrics, method, seeds, key, smooth, std=True)
            ax.plot(xs, ys, color=colors(i), label=method)
            if len(seeds) > 1:  # ± one standard deviation over seeds
                ax.fill_between(xs, [y - d for y, d in zip(ys, sd)], [y + d for y, d in zip(ys, sd)],
                                color=colors(i), alpha=0.12, linewidth=0)
            if key == RAW_KL:
                xs, ys = seed_mean_curve(metrics, method, seeds, ADAPTED_KL, smooth)
                ax.plot(xs, ys, color=colors(i), linestyle="--")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{title}\n(mean over {len(seeds)} seed(s){', band: ± 1 std over seeds' if len(seeds) > 1 else ''}, "
                 f"moving average over {smooth} step(s))", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def plot_analysis(paths: list[str], path: str, baseline: str = "none") -> str:
    """The figure for metrics files: every method of the one setting they hold, or, with several
    settings, the baseline of each (a line per setting)."""
    data = read_rows(paths)
    if len(data) == 1:
        (tag, runs), = data.items()
        methods = list(dict.fromkeys(m for m, _ in runs))
        title = f"setting {tag}"
    else:
        runs = {(tag, s): rows for tag, by_run in data.items() for (m, s), rows in by_run.items() if m == baseline}
        methods = list(data)
        title = f"the fixed-β baseline (`{baseline}`) in each setting"
    seeds = sorted({s for _, s in runs})
    for method in methods:  # seeds a setting lacks are left out of its mean
        for seed in seeds:
            runs.setdefault((method, seed), [])
    steps = max(r["step"] for rows in runs.values() for r in rows)
    return plot(runs, methods, seeds, steps, path, title)
