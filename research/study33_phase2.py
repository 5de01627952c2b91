"""Issue 33, phase 2 from phase 1 (docs/evidence/study33-long-task.md): the natural KL, the two targets, question (b)'s
mechanical prediction, and the phase-2 run lists.

Reads phase 1's streams with the study's own analysis (``analysis.study_cells`` and ``analysis.natural_kl``, the
functions the pre-registered report uses), refuses to go on unless every phase-1 run has a final value for every
seed, and prints:

- K_nat, the seed-mean final KL of `none` at the best fixed β > 0, and the targets 0.25 x and 4 x K_nat, each
  rounded to 2 significant digits (section 7);
- (b)'s prediction: β_need, where the seed-mean final KL of the fixed β crosses the target (log-log interpolation
  between neighbouring fixed β > 0; every crossing is listed, since the KL need not fall monotonically in β),
  and whether it lies in the room the controller has from each initial β in the 150 steps before the final window
  (at most x1.02 up or x0.98 down a step: [β0 x 0.98^150, β0 x 1.02^150]).

With ``--write DIR`` it also writes the lists, two per seed, each one demo invocation with phase 1's settings:
``study33-p2-seedS-a.txt`` (`target` from 0.01, 0.1, 1.0 at the low target, and question (d)'s run, `none` at 0.04
with the KL in the reward, estimator k1) and ``study33-p2-seedS-b.txt`` (`target` from the three β at the high
target).

    python research/study33_phase2.py research/data/study33-p1-*/*-stream.jsonl.gz
    python research/study33_phase2.py research/data/study33-p1-*/*-stream.jsonl.gz --write research/runlists
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "research"))

from harness import analysis  # noqa: E402

SEEDS = range(5)
PHASE1 = [("none", 0.0), ("none", 0.001), ("none", 0.01), ("none", 0.04), ("none", 0.1), ("none", 0.3),
          ("clip", 0.04), ("soft_clip", 0.04), ("length_normalized", 0.04)]
TARGET_BETAS = (0.01, 0.1, 1.0)  # section 7, (b): the three initial β
TARGET_FACTORS = (0.25, 4.0)  # section 7, (b): kl_target = 0.25 x and 4 x K_nat
PLACEMENT_RUN = "none@0.04:placement=reward:estimator=k1"  # section 7, (d)
ROOM_STEPS = 150  # steps before the final window of 200
STEP_UP, STEP_DOWN = 1.02, 0.98  # kl_horizon = 10 steps of completions: β moves at most this much a step


def two_significant(x: float) -> float:
    return float(f"{x:.2g}")


def beta_needed(curve: list[tuple[float, float]], target: float) -> list[float]:
    """Every β at which the fixed-β KL curve [(β, KL), ...] (β > 0, ascending) crosses ``target``, by log-log
    interpolation between the neighbouring β; [] when the target is outside the measured range."""
    out = []
    for (b0, k0), (b1, k1) in zip(curve, curve[1:]):
        if k0 == target:
            out.append(b0)
        elif (k0 - target) * (k1 - target) < 0:
            frac = (math.log(target) - math.log(k0)) / (math.log(k1) - math.log(k0))
            out.append(math.exp(math.log(b0) + frac * (math.log(b1) - math.log(b0))))
    if curve and curve[-1][1] == target:
        out.append(curve[-1][0])
    return out


def controller_room(beta0: float) -> tuple[float, float]:
    return beta0 * STEP_DOWN ** ROOM_STEPS, beta0 * STEP_UP ** ROOM_STEPS


def phase1(paths: list[str]) -> tuple[str, dict, int]:
    """The one family of phase 1's runs, its cells and planned steps; raises unless every run has a final value
    for every seed."""
    runs, planned = analysis.study_cells(paths)
    if len(runs) != 1:
        raise SystemExit(f"phase 1's streams hold {len(runs)} families ({', '.join(runs)}); expected one")
    family, cells = next(iter(runs.items()))
    steps = planned[family]
    missing = []
    for method, beta in PHASE1:
        cell = cells.get(analysis.CellKey(method, beta, None), {})
        for seed in SEEDS:
            if seed not in cell or analysis.seed_values(cell[seed], steps, "reward") is None:
                missing.append(f"{method}@{beta:g} seed {seed}")
    if missing:
        raise SystemExit(f"phase 1 is not complete: no final value for {', '.join(missing)}")
    return family, cells, steps


def prediction(cells: dict, steps: int) -> tuple[float, list[float], list[str]]:
    """K_nat, the two targets and the markdown of (b)'s prediction."""
    _, natural_key, k_nat = analysis.natural_kl(cells, steps)
    curve = sorted((key.beta, analysis.cell_mean(cell, steps, "kl")) for key, cell in analysis.fixed_cells(cells).items()
                   if key.beta > 0)
    targets = [two_significant(f * k_nat) for f in TARGET_FACTORS]
    lines = [f"K_nat (`none` at the best fixed β > 0, {natural_key[1]:g}): {k_nat:.4g}; targets "
             + ", ".join(f"{f:g} x = {t:g}" for f, t in zip(TARGET_FACTORS, targets)), "",
             "Fixed β's seed-mean final KL: " + ", ".join(f"β {b:g}: {k:.4g}" for b, k in curve), "",
             "| kl_target | β0 | β_need | room [β0 x 0.98^150, β0 x 1.02^150] | predicted |", "|---|---|---|---|---|"]
    for target in targets:
        need = beta_needed(curve, target)
        for beta0 in TARGET_BETAS:
            low, high = controller_room(beta0)
            inside = [b for b in need if low <= b <= high]
            verdict = ("holds" if inside else "does not hold (no room)" if need else
                       "does not hold (β_need outside the measured range)")
            lines.append(f"| {target:g} | {beta0:g} | {', '.join(f'{b:.3g}' for b in need) or 'none'} | "
                         f"[{low:.3g}, {high:.3g}] | {verdict} |")
    return k_nat, targets, lines


def base_options(seed: int) -> str:
    """Phase 1's settings for ``seed``, from its shaping list, without its runs."""
    path = os.path.join(ROOT, "research", "runlists", f"study33-p1-seed{seed}-shape.txt")
    with open(path) as f:
        (line,) = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    return re.sub(r" --runs \S+", "", line)


def write_lists(folder: str, targets: list[float]) -> list[str]:
    low, high = targets
    written = []
    for seed in SEEDS:
        for part, target, extra, what in (
                ("a", low, [PLACEMENT_RUN], "the low target, and (d)'s run (KL in the reward, k1, at β 0.04)"),
                ("b", high, [], "the high target")):
            runs = [f"target@{b:g}:kt={target:g}" for b in TARGET_BETAS] + extra
            path = os.path.join(folder, f"study33-p2-seed{seed}-{part}.txt")
            with open(path, "w") as f:
                f.write(f"# Issue 33, phase 2 (docs/evidence.md section 7), seed {seed}: `target` from β0 "
                        f"{', '.join(f'{b:g}' for b in TARGET_BETAS)} at {what}.\n"
                        f"# Written by research/study33_phase2.py from phase 1's streams. Run with "
                        f"`verify.sh \"$OUT\" study33:study33-p2-seed{seed}-{part}`.\n"
                        f"{base_options(seed)} --runs {','.join(runs)}\n")
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("streams", nargs="+", help="phase 1's streams (.jsonl or .jsonl.gz)")
    p.add_argument("--write", metavar="DIR", help="write the phase-2 lists to DIR")
    args = p.parse_args(argv)
    family, cells, steps = phase1(args.streams)
    _, targets, lines = prediction(cells, steps)
    print(f"## Phase 2 from phase 1: {family} ({steps} planned steps)\n")
    print("\n".join(lines))
    if args.write:
        print("\nwritten: " + ", ".join(write_lists(args.write, targets)))


if __name__ == "__main__":
    main()
