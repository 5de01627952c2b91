"""The plant's fit to study 33's streams: docs/simulator-fit.png and the per-run fit table of docs/simulator.md.

    PYTHONPATH=. python research/controller_sim/fit_figure.py docs/simulator-fit.png
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plant  # noqa: E402

SHOWN = [("none", 0.1, None), ("none", 0.001, None), ("target", 0.01, 0.0062), ("target", 1.0, 0.0062),
         ("target", 0.01, 0.099), ("target", 1.0, 0.099)]


def label(run):
    return f"{run.method} β0 {run.beta0:g}" + (f" kt {run.kl_target:g}" if run.kl_target else "") + f" seed {run.seed}"


def main(out: str) -> None:
    shape, fits = plant.fit_all()
    fig, axes = plt.subplots(3, 3, figsize=(15, 11))
    for ax, (method, beta0, kt) in zip(axes.flat[:6], SHOWN):
        fit = next(f for f in fits if (f.run.method, f.run.beta0, f.run.kl_target, f.run.seed) == (method, beta0, kt, 0))
        ax.plot(fit.steps, np.exp(fit.observed), ".", ms=3, color="0.5", label="raw KL")
        ax.plot(fit.steps, np.exp(fit.fitted), "-", color="C0", label="fit")
        ax.set_yscale("log")
        ax2 = ax.twinx()
        ax2.plot(np.arange(1, plant.STEPS + 1), fit.run.beta, color="C3", lw=1, label="β")
        ax2.set_yscale("log")
        ax2.set_ylabel("β", color="C3")
        if kt:
            ax.axhline(kt, color="k", ls="--", lw=0.8)
        ax.set_title(f"{label(fit.run)}: d {fit.d:.2f}, d2 {fit.d2:.2f}, τ {fit.tau if fit.tau else '—'}, σ {fit.sigma:.2f}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("raw KL")
        ax.legend(loc="lower right", fontsize=7)
    resid = np.concatenate([f.observed - f.fitted for f in fits])
    steps = np.concatenate([f.steps for f in fits])
    ax = axes.flat[6]
    ax.hist(resid, bins=60, color="0.5")
    ax.set_title(f"residuals of ln KL, all {len(fits)} runs: sd {resid.std():.2f}", fontsize=9)
    ax = axes.flat[7]
    bins = np.arange(0, 201, 20)
    idx = np.digitize(steps, bins)
    ax.plot([steps[idx == i].mean() for i in range(1, len(bins))], [resid[idx == i].mean() for i in range(1, len(bins))], "o-")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_title("mean residual by 20-step bin (all runs)", fontsize=9)
    ax.set_xlabel("step")
    ax = axes.flat[8]
    fixed = [f for f in fits if f.run.method == "none"]
    xs = [math.log(f.run.beta0) for f in fixed]
    ys = [f.c + f.d * math.log(plant.LEVEL_STEP) + f.d2 * plant.LEVEL_STEP / 100 for f in fixed]
    ax.plot(np.exp(xs), np.exp(ys), "o", color="C1", label="fixed-β runs: KL at step 175 on their drift line")
    grid = np.linspace(math.log(1e-3), math.log(1.0), 100)
    level = np.mean([y - shape(x) for x, y in zip(xs, ys)])
    ax.plot(np.exp(grid), np.exp(level + shape(grid)), "-", color="C0", label=f"g: a {shape.a:.3f}, least at β {math.exp(shape.z0):.3g}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("β")
    ax.legend(fontsize=7)
    ax.set_title("the KL's response to β (shared shape)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    print(f"wrote {out}")
    print("\n| run | c | d | d2 | τ | φ | σ | residual sd |")
    print("|---|---|---|---|---|---|---|---|")
    for f in fits:
        r = f.observed - f.fitted
        print(f"| {label(f.run)} | {f.c:.2f} | {f.d:.2f} | {f.d2:.2f} | {f.tau if f.tau else '—'} | {f.phi:.2f} | {f.sigma:.2f} | {r.std():.2f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/simulator-fit.png")
