"""Study 51, part A: the learning-rate probe's pre-registered readout and rule (docs/evidence/study51-real-model.md).

    python research/study51/probe_report.py research/data/study51-lr-a research/data/study51-lr-b

Each argument is a directory a ``study51:NAME`` call wrote (its ``*-stream.jsonl[.gz]``). One arm a (learning rate,
schedule): its rows' logged ``learning_rate`` at step 1 and ``lr_scheduler_type`` (absent: constant). Per arm: the
start (mean reward of steps 1-10), the best window (the highest mean reward over 10 consecutive steps), the final
window (the last 10 steps), hold = final - best, and the final window's KL and median length. An arm *learns* when
its best window is >= LEARN above its start, and *holds* when its final window is >= its best window - HOLD; the
chosen arm: the highest final window among those that learn and hold, and within TIE of it the constant schedule
first, then the lower rate.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys
from collections import defaultdict

WINDOW, LEARN, HOLD, TIE = 10, 0.10, 0.05, 0.02
KL, MEDIAN = "adaptive_kl/raw_kl", "completions/median_length"


def arms(directories: list[str]) -> dict[tuple[float, str], list[dict]]:
    """{(learning rate at step 1, schedule): rows by step} of every run in the directories' streams; one copy an arm
    (a second copy, a restart, is refused: the page's rule runs a cut call again whole)."""
    runs: dict = defaultdict(list)
    for path in sorted(p for d in directories for p in glob.glob(os.path.join(d, "*-stream.jsonl*"))):
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            for line in f:
                row = json.loads(line)
                runs[(row["tag"], row["copy"])].append(row)
    out: dict = {}
    for (tag, _copy), rows in runs.items():
        rows.sort(key=lambda r: r["step"])
        key = (rows[0]["learning_rate"], rows[0].get("lr_scheduler_type", "constant"))
        if key in out:
            raise ValueError(f"two copies of the arm {key} (tag {tag}): the probe counts one copy an arm")
        out[key] = rows
    return out


def mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def windows(rewards: list[float]) -> list[float]:
    """The mean reward of every WINDOW consecutive steps, in order (none for fewer steps)."""
    return [mean(rewards[i:i + WINDOW]) for i in range(len(rewards) - WINDOW + 1)]


def readouts(directories: list[str], planned: int) -> dict[tuple[float, str], dict]:
    """{arm: its readout}, by arm."""
    return {k: readout(rows, planned) for k, rows in sorted(arms(directories).items())}


def readout(rows: list[dict], planned: int) -> dict:
    complete = len(rows) == planned and rows[-1]["step"] == planned
    if len(rows) < WINDOW:  # cut before one window: nothing to read but its length
        return dict(start=None, best=None, best_ends=None, final=None, hold=None, kl=None, median=None,
                    last_lr=rows[-1]["learning_rate"], steps=rows[-1]["step"], complete=complete, learns=False, holds=False)
    rewards = [r["reward"] for r in rows]
    means = windows(rewards)
    best = max(means)
    final = mean(rewards[-WINDOW:])
    start = mean(rewards[:WINDOW])
    return dict(start=start, best=best, best_ends=rows[means.index(best) + WINDOW - 1]["step"], final=final,
                hold=final - best, kl=mean([r.get(KL) for r in rows[-WINDOW:]]), median=mean([r.get(MEDIAN) for r in rows[-WINDOW:]]),
                last_lr=rows[-1]["learning_rate"], steps=rows[-1]["step"], complete=complete,
                learns=best - start >= LEARN, holds=final >= best - HOLD)


def choose(table: dict) -> tuple[float, str] | None:
    ok = {k: v for k, v in table.items() if v["complete"] and v["learns"] and v["holds"]}
    if not ok:
        return None
    top = max(v["final"] for v in ok.values())
    near = [k for k, v in ok.items() if v["final"] >= top - TIE]
    return min(near, key=lambda k: (k[1] != "constant", k[0]))


def report(directories: list[str], planned: int = 100) -> str:
    table = readouts(directories, planned)
    out = [f"# Study 51, part A: the learning-rate probe ({planned} planned steps; windows of {WINDOW} steps)", "",
           "| learning rate | schedule | steps | start | best window (ends at) | final window | hold | learns (≥ +0.10) | "
           "holds (≥ -0.05) | final KL | final median length | last step's rate |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (lr, schedule), v in table.items():
        if v["best"] is None:
            out.append(f"| {lr:g} | {schedule} | {v['steps']} (cut) | — | — | — | — | no | no | — | — | {v['last_lr']:.3g} |")
            continue
        kl = "—" if v["kl"] is None else f"{v['kl']:.4g}"
        median = "—" if v["median"] is None else f"{v['median']:.1f}"
        out.append(f"| {lr:g} | {schedule} | {v['steps']}{'' if v['complete'] else ' (cut)'} | {v['start']:.3f} | "
                   f"{v['best']:.3f} ({v['best_ends']}) | {v['final']:.3f} | {v['hold']:+.3f} | {'yes' if v['learns'] else 'no'} | "
                   f"{'yes' if v['holds'] else 'no'} | {kl} | {median} | {v['last_lr']:.3g} |")
    chosen = choose(table)
    out += ["", "**Chosen**: " + (f"learning rate {chosen[0]:g}, {chosen[1]} schedule." if chosen else
                                  "none (no complete arm learns and holds): the page's next step is an amendment.")]
    return "\n".join(out) + "\n"


def partb_arguments(directories: list[str], planned: int = 100) -> str:
    """What part B's phase-1 lists take from the probe (docs/evidence/study51-real-model.md, "Part B"), as
    research/study51/partb_lists.py's options: the chosen arm's rate and schedule, and R = (its start + its best
    window) / 2 rounded to 2 decimals, the acting ``dynamic``'s reward_threshold. ValueError when no arm is chosen
    (part B then waits for an amendment)."""
    table = readouts(directories, planned)
    chosen = choose(table)
    if chosen is None:
        raise ValueError("the probe chose no arm (no complete arm learns and holds): part B does not run before an amendment")
    v = table[chosen]
    return f"--lr {chosen[0]:g} --sched {chosen[1]} --reward-threshold {round((v['start'] + v['best']) / 2, 2):g}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directories", nargs="+", help="the study51-lr-* directories the calls wrote")
    parser.add_argument("--steps", type=int, default=100, help="the planned steps (default 100)")
    parser.add_argument("--partb-arguments", action="store_true",
                        help="print only the options part B's phase-1 lists take from the chosen arm "
                        "(python research/study51/partb_lists.py grid $(... --partb-arguments))")
    args = parser.parse_args(argv)
    if args.partb_arguments:
        print(partb_arguments(args.directories, args.steps))
    else:
        print(report(args.directories, args.steps), end="")


if __name__ == "__main__":
    sys.exit(main())
