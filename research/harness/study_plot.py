"""The figure of the pre-registered study (docs/evidence/study33-long-task.md, issue 33; ``--analyze ... --study --plot``):
per family, the curves behind the tables of ``analysis.study_report``: (a) length and reward of `none` at every
fixed β, the raw KL of `none` at β > 0 and of `target` against its kl_target, and (c) the other methods against
`none` at the same β, (d) the reward of each run with the KL in the reward against the same method and β with it in
the loss. Every curve: per step, each seed's copies averaged, then the mean over seeds, then the
10-step trailing mean; a copy cut before the planned steps adds only the steps it has."""

from __future__ import annotations

import math

from unsloth_adaptive_kl.metrics import RAW_KL

from .analysis import (LENGTH, CellKey, _mean, compared_cells, final_window_start, fixed_cells, logged_kl, moved_cells,
                       study_cells, target_cells, trailing_means)

SMOOTH = 10  # steps: the trailing mean of the pre-registered runaway and saturation rules
AVERAGING = "mean over seeds, copies averaged within a seed"

Cell = dict[int, list[list[dict]]]  # seed -> copies, each a list of rows sorted by step


def step_curve(cell: Cell, key: str) -> tuple[list[int], list[float]]:
    """Per step, the mean over seeds of each seed's mean over its copies that have that step and a value of
    ``key`` (None, NaN or absent: no value). A seed without a value at a step adds nothing there; a step no seed
    has a value for is left out."""
    per_seed: list[dict[int, float]] = []
    for copies in cell.values():
        values: dict[int, list] = {}
        for rows in copies:
            for row in rows:
                values.setdefault(row["step"], []).append(row.get(key))
        means = {step: _mean(v) for step, v in values.items()}
        per_seed.append({step: m for step, m in means.items() if not math.isnan(m)})
    steps = sorted({step for seed in per_seed for step in seed})
    return steps, [_mean(seed.get(step) for seed in per_seed) for step in steps]


def smoothed_curve(cell: Cell, key: str) -> tuple[list[int], list[float]]:
    """``step_curve`` with the 10-step trailing mean (``analysis.trailing_means``) over its steps."""
    steps, values = step_curve(cell, key)
    return steps, trailing_means(values, SMOOTH)


def has_kl(cell: Cell) -> bool:
    return any(logged_kl(row) for copies in cell.values() for rows in copies for row in rows)


def _line(ax, cell: Cell, key: str, **style) -> bool:
    steps, values = smoothed_curve(cell, key)
    if steps:
        ax.plot(steps, values, **style)
    return bool(steps)


def _seeds(cell: Cell) -> str:
    return f"{len(cell)} seed{'s' if len(cell) != 1 else ''}"


def _empty(ax, why: str) -> None:
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, fontsize=9, wrap=True)
    ax.set_axis_off()


def plot_study(paths: list[str], path: str) -> str:
    """Write the study's figure (six panels, two rows of three, per family) to ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "PNG skipped: matplotlib is not installed (pip install matplotlib)."
    runs, planned_steps = study_cells(paths)
    families = {family: (planned_steps[family], cells) for family, cells in runs.items()}
    if not families:
        raise ValueError(f"--study --plot: no rows in {', '.join(paths)}")
    fig = plt.figure(figsize=(19, 11 * len(families)), layout="constrained")
    rows = fig.subfigures(len(families), 1, squeeze=False)[:, 0]
    for (family, (planned, cells)), sub in zip(families.items(), rows):
        axes = sub.subplots(2, 3).flatten()  # row-major: (a) length, (a) reward, KL; (c) length, (c) KL, (d)
        seeds = sorted({seed for cell in cells.values() for seed in cell})
        start = final_window_start(planned)
        sub.suptitle(f"{family}: {planned} planned steps, seeds {', '.join(map(str, seeds))}. Each line: {AVERAGING}, "
                     f"{SMOOTH}-step trailing mean; a cut copy adds the steps it has. Shaded: the final window, steps "
                     f"{start + 1}-{planned}", fontsize=10)
        fixed = sorted(fixed_cells(cells), key=lambda k: k[1])  # (d)'s other KL placements are not fixed-β runs
        positive = [k for k in fixed if k[1] > 0]
        shade = plt.get_cmap("viridis")  # darker for smaller β; β = 0 (no KL at all) in gray, dashed
        color = {k: shade(i / max(1, len(positive) - 1) * 0.9) for i, k in enumerate(positive)}
        dash = {k: "--" if k[1] == 0 else "-" for k in fixed}
        color.update({k: "gray" for k in fixed if k[1] == 0})
        label = {k: f"none β={k[1]:g} ({_seeds(cells[k])})" for k in fixed}
        ax_len, ax_reward, ax_kl, ax_c_len, ax_c_kl, ax_d = axes
        drawn_kl = False
        for k in fixed:
            _line(ax_len, cells[k], LENGTH, color=color[k], linestyle=dash[k], label=label[k])
            _line(ax_reward, cells[k], "reward", color=color[k], linestyle=dash[k], label=label[k])
            if k[1] > 0 and has_kl(cells[k]):
                drawn_kl |= _line(ax_kl, cells[k], RAW_KL, color=color[k], label=label[k])
        others = plt.get_cmap("tab10")
        targets = sorted(target_cells(cells), key=lambda k: (k.kl_target, k.beta))
        for i, k in enumerate(targets):
            if has_kl(cells[k]):
                drawn_kl |= _line(ax_kl, cells[k], RAW_KL, color=others(i), linewidth=1.6,
                                  label=f"target β0={k[1]:g}, kl_target {k[2]:g} ({_seeds(cells[k])})")
                ax_kl.axhline(k[2], color=others(i), linestyle="--", linewidth=1)
        ax_len.set_title(f"(a) completion length (tokens), `none` per fixed β\n{AVERAGING}", fontsize=9)
        ax_reward.set_title(f"(a) reward, `none` per fixed β\n{AVERAGING}", fontsize=9)
        ax_kl.set_title(f"raw KL (log), `none` at β > 0{' and `target` (dashed: its kl_target)' if targets else ''}"
                        f"\n{AVERAGING}", fontsize=9)
        ax_kl.set_yscale("log")
        if not drawn_kl:
            _empty(ax_kl, "no logged KL here (β = 0 computes none)")
        compared = compared_cells(cells)
        betas = sorted({k[1] for k in compared})
        what = ", ".join(dict.fromkeys(k[0] for k in sorted(compared)))
        for ax, key, name in ((ax_c_len, LENGTH, "completion length (tokens)"), (ax_c_kl, RAW_KL, "raw KL (log)")):
            if not compared:
                _empty(ax, "(c): no other method next to `none` at its β")
                continue
            for beta in betas:
                base = CellKey("none", beta, None)
                _line(ax, cells[base], key, color="black", linewidth=1.8, label=f"none β={beta:g} ({_seeds(cells[base])})")
            for i, k in enumerate(sorted(compared)):
                _line(ax, cells[k], key, color=others(i), label=f"{k[0]} β={k[1]:g} ({_seeds(cells[k])})")
            ax.set_title(f"(c) {name}: {what}\nagainst `none` at β {', '.join(f'{b:g}' for b in betas)}\n{AVERAGING}",
                         fontsize=9)
            if key == RAW_KL:
                ax.set_yscale("log")
        moved = sorted(moved_cells(cells), key=lambda k: k.order)
        for i, k in enumerate(moved):  # the baseline dashed, in the same colour
            base = k.baseline()
            _line(ax_d, cells[base], "reward", color=others(i), linestyle="--",
                  label=f"{k.method} β={k.beta:g}, KL in the loss ({base.estimator}) ({_seeds(cells[base])})")
            _line(ax_d, cells[k], "reward", color=others(i), linewidth=1.8,
                  label=f"{k.method} β={k.beta:g}, KL in the {k.placement} ({k.estimator}) ({_seeds(cells[k])})")
        if moved:
            ax_d.set_title(f"(d) reward: KL placement and estimator (solid) against the KL in the loss (dashed)\n"
                           f"{AVERAGING}", fontsize=9)
        else:
            _empty(ax_d, "(d): no run with another KL placement or estimator")
        for ax in axes:
            if ax.axison:
                ax.axvspan(start + 1, planned, color="gray", alpha=0.12, linewidth=0)
                ax.set_xlabel("step")
                ax.grid(alpha=0.3, which="both")
                if ax.get_legend_handles_labels()[0]:
                    ax.legend(fontsize=7)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot: {path}"
