"""Study 51, part B's figure (issue 51: "its tables, figure and corrected comparisons are on their page").

    python research/study51/figure.py research/data/study51-b-* --out docs/evidence/study51-figure.png

Drawn from the numbers ``arms_report.py`` tabulates (its ``table``), never recomputed apart:

- top row, per arm in the table's order, a dot per seed and a bar at the arms' mean: (a) final reward, with the best
  fixed β's mean as a line; (b) final KL (log scale; a β-0 arm's from its ``kl_monitor`` steps); (c) final median
  completion length;
- bottom row, per step, the mean over seeds with the 10-step trailing mean (``study_plot.smoothed_curve``, the
  curves of study 33's figure): (d) reward and (e) median completion length of each fixed-β arm, (f) β of each
  controller arm (log scale).

``figure_data`` returns what is drawn (tested against the table and against curves computed by hand); ``draw`` draws
it with matplotlib.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from research.harness.study_plot import smoothed_curve  # noqa: E402
from research.study51 import arms_report  # noqa: E402
from unsloth_adaptive_kl.metrics import CURRENT_BETA  # noqa: E402

POINTS = (("reward", "final reward"), ("kl", "final KL"), ("median", "final median length (tokens)"))
CURVES = (("reward", "reward"), (arms_report.MEDIAN, "median length (tokens)"), (CURRENT_BETA, "β"))


def figure_data(directories: list[str], planned: int = 100) -> dict:
    """{"labels": the arms in the table's order, "points": {key: {label: per-seed values (None: no final value),
    seeds in order}}, "means": {key: {label: the table's mean}}, "best": (label, mean final reward) or None,
    "curves": {key: {label: (steps, smoothed values)}}: reward and median length of the fixed-β arms, β of the
    controller arms (every arm but ``none``)}."""
    table, best = arms_report.table(directories, planned)
    out = {"labels": [a["label"] for a in table], "points": {}, "means": {}, "curves": {},
           "best": (best["label"], best["reward"]) if best else None}
    for key, _ in POINTS:
        out["points"][key] = {a["label"]: [a["numbers"][s][key] for s in sorted(a["numbers"])] for a in table}
        out["means"][key] = {a["label"]: a[key] for a in table}
    for key, _ in CURVES:
        chosen = [a for a in table if (a["method"] != "none") == (key == CURRENT_BETA)]
        out["curves"][key] = {}
        for a in chosen:
            cell = {seed: [rows] for seed, rows in a["runs"].items()}
            out["curves"][key][a["label"]] = smoothed_curve(cell, key)
    return out


def draw(data: dict, path: str, title: str = "Study 51, part B") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = data["labels"]
    fig, axes = plt.subplots(2, 3, figsize=(18, 10))
    for ax, (key, name) in zip(axes[0], POINTS):
        for i, label in enumerate(labels):
            values = [v for v in data["points"][key][label] if v is not None]
            ax.scatter([i] * len(values), values, s=14, color="tab:blue", zorder=3)
            if data["means"][key][label] is not None:
                ax.hlines(data["means"][key][label], i - 0.35, i + 0.35, color="black", zorder=4)
        if key == "kl":
            ax.set_yscale("log")
        if key == "reward" and data["best"]:
            ax.axhline(data["best"][1], color="tab:red", linestyle="--", label=f"best fixed β: {data['best'][0]}")
            ax.legend(fontsize=8)
        ax.set_xticks(range(len(labels)), labels, rotation=75, ha="right", fontsize=7)
        ax.set_title(f"{name}: a dot a seed, a bar the mean")
    for ax, (key, name) in zip(axes[1], CURVES):
        for label, (steps, values) in data["curves"][key].items():
            ax.plot(steps, values, label=label, linewidth=1.2)
        if key == CURRENT_BETA:
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(f"{name}, {'controllers' if key == CURRENT_BETA else 'fixed β'}: mean over seeds, 10-step trailing mean")
        if data["curves"][key]:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directories", nargs="+", help="the study51-b-* directories the calls wrote")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--steps", type=int, default=100, help="the runs' planned steps (default 100)")
    args = parser.parse_args(argv)
    print(f"wrote {draw(figure_data(args.directories, args.steps), args.out)}")


if __name__ == "__main__":
    main()
