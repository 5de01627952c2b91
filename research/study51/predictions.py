"""Study 51 part B's six predictions (docs/evidence/study51-real-model.md, "Predictions, written first"), each checked
against the runs by the rule its sentence states.

    python research/study51/predictions.py research/data/study51-b-*        # --steps N: the planned steps (100)

Written on 2026-11-30, after 42 of part B's 80 runs were filed and before any part-B result was read; it changes no
prediction and no rule of the readout (every number is ``arms_report.table``'s: final window, best window, runaways,
verdicts). Where a sentence needs a reading to be checked, the reading is this file's and is printed beside it:

1. "No controller beats the best fixed β (0 of the 11 controller arms 'beat' after Holm)": the arms other than
   ``none`` whose verdict is *beat* (with or without "within ±0.05"). "Most comparisons are *inconclusive*": more
   than half of the comparisons that have a verdict. "The fixed β 0.01-0.3 end within ±0.05 of each other in mean
   final reward": the largest and the smallest of those four arms' mean final rewards differ by at most 0.05.
2. "`dynamic` at its defaults never moves β": every logged β of every run of the arm (``dynamic`` without
   ``reward_threshold`` among its controller parameters) equals its β0. "Its final reward is within 0.01 of fixed
   β 0.04's in every seed": the paired difference of final rewards, |Δ| ≤ 0.01, in every seed both have. "The acting
   `dynamic` drops β below 0.004 in at least 3 of 5 seeds": runs of ``dynamic`` with ``reward_threshold`` whose
   smallest logged β is below 0.004.
3. "No runaway in any arm (0 of 80 alarms)": no run's ``adaptive_kl/runaway_alarm`` turned 1 (failed by any alarm;
   not measured while a run never logged the alarm and none alarmed).
4. "`schedule` from 1 ends within ±0.05 of the best fixed β in mean, its best window no higher": for each
   ``schedule`` arm from β0 1 (linear and cosine), |mean paired Δ final reward| ≤ 0.05, and its mean best window
   ≤ the best fixed β's.
5. "`target` and `ziegler` hold K (within ±25 % at the end) in at most half of their runs each": for each method, the
   runs that held K by study 49's rule (``research/study49/report.held``: final KL / kl_target within ×1.25 either way,
   0.8-1.25) are at most half of its runs. "`target`'s β stays within [β0/5, 5 β0]": every logged β of every
   ``target`` run.
6. "The median completion length of the final window is within ±10 tokens of fixed β 0.04's in every arm": each
   arm's mean final median length differs from fixed β 0.04's by at most 10 tokens.

A clause whose arms or runs are absent is "not measured", never "held".
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from research.study49.report import held as held_target  # noqa: E402
from research.study51 import arms_report  # noqa: E402
from unsloth_adaptive_kl import metrics  # noqa: E402

BETA = metrics.CURRENT_BETA
ACTING_BELOW, DYNAMIC_WITHIN, SCHEDULE_WITHIN, FIXED_WITHIN, LENGTH_WITHIN = 0.004, 0.01, 0.05, 0.05, 10.0
NOT_MEASURED = "not measured"


def _params(arm: dict) -> dict:
    first = next(iter(arm["runs"].values()))
    return first[0].get("controller_params") or {}


def _betas(rows: list[dict]) -> list[float]:
    return [r[BETA] for r in rows if r.get(BETA) is not None]


def _verdict(ok: bool | None) -> str:
    return NOT_MEASURED if ok is None else ("held" if ok else "failed")


def check(directories: list[str], planned: int = 100) -> list[dict]:
    """One dict a clause: its number ("1", "1a", ...), the claim, what was measured, and held / failed / not measured."""
    arms, best = arms_report.table(directories, planned)
    out: list[dict] = []

    def clause(number: str, claim: str, measured: str, ok: bool | None) -> None:
        out.append({"number": number, "claim": claim, "measured": measured, "verdict": _verdict(ok)})

    tested = [a for a in arms if "test" in a and a["test"]["p"] is not None]
    controllers = [a for a in tested if a["method"] != "none"]
    beat = [a["label"] for a in controllers if a["test"]["verdict"].startswith("beat")]
    clause("1", "no controller arm beats the best fixed β (Holm)",
           f"{len(beat)} of {len(controllers)} beat" + (f": {', '.join(beat)}" if beat else ""),
           (not beat) if controllers else None)
    inconclusive = sum(a["test"]["verdict"] == "inconclusive" for a in tested)
    clause("1a", "most comparisons inconclusive", f"{inconclusive} of {len(tested)}",
           inconclusive > len(tested) / 2 if tested else None)
    grid = {a["beta0"]: a["reward"] for a in arms if a["method"] == "none" and a["beta0"] in (0.01, 0.04, 0.1, 0.3)
            and a["reward"] is not None}
    spread = max(grid.values()) - min(grid.values()) if len(grid) == 4 else None
    clause("1b", f"fixed β 0.01-0.3 within ±{FIXED_WITHIN:g} of each other (mean final reward)",
           NOT_MEASURED if spread is None else f"largest − smallest {spread:.3f} ("
           + ", ".join(f"β {b:g}: {r:.3f}" for b, r in sorted(grid.items())) + ")",
           None if spread is None else spread <= FIXED_WITHIN + 1e-12)

    dynamic = [a for a in arms if a["method"] == "dynamic"]
    defaults = [a for a in dynamic if "reward_threshold" not in _params(a)]
    acting = [a for a in dynamic if "reward_threshold" in _params(a)]
    moved = [(s, min(betas), max(betas)) for a in defaults for s, rows in sorted(a["runs"].items())
             for betas in [_betas(rows)] if any(b != rows[0]["beta0"] for b in betas)]
    runs = sum(len(a["runs"]) for a in defaults)
    clause("2a", "`dynamic` at its defaults never moves β",
           f"β moved in {len(moved)} of {runs} runs" + "".join(f"; seed {s}: {lo:g}-{hi:g}" for s, lo, hi in moved),
           (not moved) if runs else None)
    fixed04 = next((a for a in arms if a["method"] == "none" and a["beta0"] == 0.04), None)
    diffs = ([(s, a["numbers"][s]["reward"] - fixed04["numbers"][s]["reward"]) for a in defaults
              for s in sorted(set(a["numbers"]) & set(fixed04["numbers"]))
              if a["numbers"][s]["reward"] is not None and fixed04["numbers"][s]["reward"] is not None]
             if fixed04 else [])
    clause("2b", f"its final reward within {DYNAMIC_WITHIN:g} of fixed β 0.04's in every seed",
           ", ".join(f"seed {s}: {d:+.3f}" for s, d in diffs) or NOT_MEASURED,
           all(abs(d) <= DYNAMIC_WITHIN + 1e-12 for _, d in diffs) if diffs else None)
    lows = [(s, min(_betas(rows))) for a in acting for s, rows in sorted(a["runs"].items()) if _betas(rows)]
    below = sum(low < ACTING_BELOW for _, low in lows)
    clause("2c", f"the acting `dynamic` drops β below {ACTING_BELOW:g} in at least 3 of 5 seeds",
           f"{below} of {len(lows)} (smallest β: " + ", ".join(f"{low:.3g}" for _, low in lows) + ")" if lows else NOT_MEASURED,
           below >= 3 if lows else None)

    alarms = [(a["label"], s) for a in arms for s, n in sorted(a["numbers"].items()) if n["runaway"] is not None]
    total = sum(len(a["runs"]) for a in arms)
    unlogged = sum(a["alarms_missing"] for a in arms)  # a run that never logged the alarm is not a calm run
    clause("3", "no runaway in any arm", f"{len(alarms)} of {total} runs alarmed"
           + (": " + ", ".join(f"{label} seed {s}" for label, s in alarms) if alarms else "")
           + (f"; {unlogged} run{'s' if unlogged != 1 else ''} never logged the alarm" if unlogged else ""),
           False if alarms else (None if unlogged or not total else True))

    schedules = [a for a in arms if a["method"] == "schedule" and a["beta0"] == 1 and "test" in a]
    for a in schedules:
        t = a["test"]
        ok = (None if best is None or t["mean"] is None or a["best"] is None
              else abs(t["mean"]) <= SCHEDULE_WITHIN + 1e-12 and a["best"] <= best["best"])
        clause("4", f"{a['label']}: within ±{SCHEDULE_WITHIN:g} of the best fixed β, best window no higher",
               f"Δ {t['mean']:+.3f}; best window {a['best']:.3f} (best fixed β {best['best']:.3f})" if ok is not None
               else NOT_MEASURED, ok)
    if not schedules:
        clause("4", "`schedule` from 1 within the best fixed β's ±0.05", NOT_MEASURED, None)

    # not a registry list: the two controllers prediction 5 names
    for method in ("target", "ziegler"):
        finals = [(n["kl"], a["runs"][s][0]["kl_target"]) for a in arms if a["method"] == method
                  for s, n in sorted(a["numbers"].items()) if n["kl"] is not None]
        held = sum(held_target(kl, kl_target) for kl, kl_target in finals)
        clause("5", f"`{method}` holds K (±25%) in at most half of its runs",
               f"{held} of {len(finals)}" if finals else NOT_MEASURED, held <= len(finals) / 2 if finals else None)
    outside = []
    target_runs = 0
    for a in (a for a in arms if a["method"] == "target"):
        for s, rows in sorted(a["runs"].items()):
            target_runs += 1
            beta0, betas = rows[0]["beta0"], _betas(rows)
            if betas and not (beta0 / 5 * (1 - 1e-9) <= min(betas) and max(betas) <= 5 * beta0 * (1 + 1e-9)):
                outside.append(f"{a['label']} seed {s}: {min(betas):.3g}-{max(betas):.3g}")
    clause("5", "`target`'s β within [β0/5, 5 β0]", f"outside in {len(outside)} of {target_runs} runs"
           + (": " + "; ".join(outside) if outside else ""), (not outside) if target_runs else None)

    lengths = ([(a["label"], a["median"] - fixed04["median"]) for a in arms if a is not fixed04 and a["median"] is not None]
               if fixed04 is not None and fixed04["median"] is not None else [])
    far = [(label, d) for label, d in lengths if abs(d) > LENGTH_WITHIN]
    clause("6", f"every arm's final median length within ±{LENGTH_WITHIN:g} tokens of fixed β 0.04's",
           (f"{len(far)} of {len(lengths)} arms outside" + (": " + ", ".join(f"{label} {d:+.1f}" for label, d in far) if far else ""))
           if lengths else NOT_MEASURED, (not far) if lengths else None)
    return out


def report(directories: list[str], planned: int = 100) -> str:
    rows = check(directories, planned)
    lines = ["| prediction | claim | measured | verdict |", "|---|---|---|---|"]
    lines += [f"| {r['number']} | {r['claim']} | {r['measured']} | {r['verdict']} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directories", nargs="+", help="the study51-b-* directories the calls wrote")
    parser.add_argument("--steps", type=int, default=100, help="the runs' planned steps (default 100)")
    args = parser.parse_args(argv)
    print(report(args.directories, args.steps), end="")


if __name__ == "__main__":
    main()
