"""Study 49, Amendment 1: each design-1 ``target`` run's logged KL replayed through both designs of ``target``.

    python research/study49/replay.py research/data/study49-seed*-?       # one row per run

``target`` updates β from the step's global raw KL alone, so feeding a run's logged ``adaptive_kl/raw_kl`` into a
fresh controller must give its logged ``adaptive_kl/current_beta`` exactly: design 1 (``freeze_at_bounds`` off, as it
ran) is checked to do so, to the bit. Design 2, fed the same KL, gives the same β up to the first update at which the
designs differ; from there on the run would have trained differently, so only that step and the update design 2
declares the target unreachable at (if before the divergence's effect could reach the KL, i.e. at the divergence) are
read. The GPU runs are deterministic per seed (the warm start's sha256 per seed, and equal β series giving equal KL
series across lists), so a run whose design-2 replay never diverges is what design 2 would have trained: the
Amendment's rule reruns only the runs that diverge.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import logging
import os
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from research.controller_sim.compare import DesignOne  # noqa: E402
from unsloth_adaptive_kl.controllers import ControllerConfig  # noqa: E402
from unsloth_adaptive_kl.target_controller import HeldTargetKL  # noqa: E402

BETA, KL = "adaptive_kl/current_beta", "adaptive_kl/raw_kl"


def target_runs(dirs):
    """{(beta0, kl_target, seed, copy): [stream rows by step]} of every ``target`` run in the directories' streams."""
    runs = defaultdict(list)
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "*-stream.jsonl*"))):
            with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
                for line in f:
                    row = json.loads(line)
                    if row.get("method") == "target":
                        runs[(row["beta0"], row["kl_target"], row["seed"], row["copy"])].append(row)
    return {key: sorted(rows, key=lambda r: r["step"]) for key, rows in runs.items()}


def replay(rows, cls):
    """β before each step's update (what the step trained with) and the step at which the target was declared."""
    beta0, kl_target = rows[0]["beta0"], rows[0]["kl_target"]
    controller, betas, declared = cls(ControllerConfig(beta0, kl_target=kl_target)), [], None
    for row in rows:
        betas.append(controller.beta)
        controller.update(global_step=row["step"], kl=row[KL], num_completions=row["completions_per_step"])
        if declared is None and not controller.reachable:
            declared = row["step"]
    return betas, declared, controller


def compare_designs(rows):
    """(design 1 reproduces the log exactly, first step whose β differs between the designs or None, design 2's
    declaration step or None, design 1's, design 2's cap)."""
    logged = [row[BETA] for row in rows]
    one, declared_one, _ = replay(rows, DesignOne)
    two, declared_two, second = replay(rows, HeldTargetKL)
    diverges = next((row["step"] for row, a, b in zip(rows, one, two) if a != b), None)
    return one == logged, diverges, declared_two, declared_one, second.ceiling


def determinism(runs):
    """For two runs of one seed and β0 at different targets (they train the same until their β first differs): the
    number of leading steps with equal β, and whether their logged KL was bit-identical over those steps."""
    out = []
    by_start = defaultdict(list)
    for (beta0, kl_target, seed, _copy), rows in sorted(runs.items()):
        by_start[(beta0, seed)].append((kl_target, rows))
    for (beta0, seed), group in sorted(by_start.items()):
        for i in range(len(group)):
            for j in range(i + 1, len(group)):
                (ta, a), (tb, b) = group[i], group[j]
                same = 0
                while same < min(len(a), len(b)) and a[same][BETA] == b[same][BETA]:
                    same += 1
                out.append((beta0, seed, ta, tb, same, all(x[KL] == y[KL] for x, y in zip(a[:same], b[:same]))))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", help="study-49 data directories (research/data/study49-seedS-X)")
    args = parser.parse_args(argv)
    logger = logging.getLogger("unsloth_adaptive_kl")
    level = logger.level
    logger.setLevel(logging.ERROR)  # the replays' own warnings
    try:
        return _main(args)
    finally:
        logger.setLevel(level)


def _main(args) -> int:
    print("| β0 | kl_target | seed | steps | design 1 replayed exactly | design 2 first differs at step | design 2 declares "
          "unreachable at | (cap) | design 1 declared at |")
    print("|---|---|---|---|---|---|---|---|---|")
    exact, rerun, runs = True, [], target_runs(args.dirs)
    for (beta0, kl_target, seed, _copy), rows in sorted(runs.items()):
        same, diverges, declared_two, declared_one, cap = compare_designs(rows)
        exact &= same
        if diverges is not None:
            rerun.append(f"target@{beta0:g}:kt={kl_target:g} seed {seed}")
        print(f"| {beta0:g} | {kl_target:g} | {seed} | {len(rows)} | {'yes' if same else 'NO'} | {diverges or '—'} | "
              f"{declared_two or '—'} | {f'{cap:.4g}' if cap else '—'} | {declared_one or '—'} |")
    pairs = determinism(runs)
    print("\nDeterminism: runs of one seed and β0 at two targets (different lists and calls) train alike until β differs:\n")
    print("| β0 | seed | targets | leading steps with equal β | their KL bit-identical |")
    print("|---|---|---|---|---|")
    for beta0, seed, ta, tb, same, identical in pairs:
        print(f"| {beta0:g} | {seed} | {ta:g}, {tb:g} | {same} | {'yes' if identical else 'NO'} |")
    print(f"\nDesign 1 reproduced every logged β exactly: {'yes' if exact else 'NO'}. Runs design 2 would train "
          f"differently (rerun under Amendment 1): {', '.join(rerun) if rerun else 'none'}.")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
