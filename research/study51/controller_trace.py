"""Study 51, part B: what each KL-target controller's β did, run by run (added 2026-11-30, after every part-B run was
filed and the results section written; a description of the streams, no test, no verdict: the readout's table and
the predictions are the study's results).

    python research/study51/controller_trace.py research/data/study51-b-t-*

Per run of a controller that reads ``kl_target`` (``target``, ``ziegler``): β at steps 25, 50, 75 and 100; the least
β and the first step it was logged; the last step β changed; the first step the raw KL's 10-step trailing mean was
above K; the step ``adaptive_kl/target_reachable`` first logged 0 (``target``: the target declared unreachable;
study 49's "declared"); the final KL (the readout's: the mean over the last quarter of the steps) and whether it held
K (study 49's rule, 0.8-1.25 × K).
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from research.harness import analysis as A  # noqa: E402
from research.study49 import report as study49  # noqa: E402
from research.study51 import arms_report  # noqa: E402
from unsloth_adaptive_kl import metrics  # noqa: E402

AT = (25, 50, 75, 100)
WINDOW = 10


def trace(rows: list[dict], planned: int = 100) -> dict:
    """One run's numbers (rows by step, as ``arms_report.arms`` gives them)."""
    steps = [r["step"] for r in rows]
    betas = [r.get(metrics.CURRENT_BETA) for r in rows]
    least = min(b for b in betas if b is not None)
    changed = [s for s, b, before in zip(steps[1:], betas[1:], betas) if b != before]
    kl_target = rows[0]["kl_target"]
    kls = [r.get(metrics.RAW_KL) for r in rows]
    above = next((steps[i] for i in range(WINDOW - 1, len(rows))
                  if None not in kls[i - WINDOW + 1:i + 1] and sum(kls[i - WINDOW + 1:i + 1]) / WINDOW > kl_target), None)
    final_kl = arms_report.run_numbers(rows, planned)["kl"]
    return {"beta_at": {s: b for s, b in zip(steps, betas) if s in AT},
            "least": least, "least_step": steps[betas.index(least)],
            "last_change": changed[-1] if changed else None,
            "kl_above": above, "declared": study49.declared_step(rows),
            "final_kl": final_kl, "kl_target": kl_target, "held": study49.held(final_kl, kl_target)}


def dash(value, fmt: str = "d") -> str:
    return "—" if value is None else format(value, fmt)


def report(directories: list[str], planned: int = 100) -> str:
    head = ("| arm | seed | " + " | ".join(f"β step {s}" for s in AT) + " | least β (step) | β last changed | "
            f"KL {WINDOW}-step mean first above K | declared unreachable | final KL | held K |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for (method, _tag), seeds in sorted(arms_report.arms(directories).items()):
        first = next(iter(seeds.values()))
        if not A.reads_kl_target(method):
            continue
        name = arms_report.label(method, first)
        for seed, rows in sorted(seeds.items()):
            t = trace(rows, planned)
            out.append(f"| {name} | {seed} | " + " | ".join(dash(t["beta_at"].get(s), ".4g") for s in AT)
                       + f" | {t['least']:.4g} ({t['least_step']}) | {dash(t['last_change'])} | {dash(t['kl_above'])} | "
                       f"{dash(t['declared'])} | {dash(t['final_kl'], '.3f')} | {'yes' if t['held'] else 'no'} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directories", nargs="+")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    print(report(args.directories, args.steps), end="")


if __name__ == "__main__":
    main()
