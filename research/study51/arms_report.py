"""Study 51, part B's readout (issue 51, items 3-6): every arm on the real model against the best fixed β, paired by
seed, each comparison corrected for the family (Holm), and for each one the seeds it would need.

    python research/study51/arms_report.py research/data/study51-b-*        # --steps N: the planned steps (100)

Each argument is a directory a ``study51:NAME`` call wrote (its ``*-stream.jsonl[.gz]``). An **arm** is one
(method, run tag) of the streams: the harness's tag carries β0 and every per-run option (kl_target, learning rate,
schedule, ``-mon``, controller parameters), so two arms never share one; its runs are its seeds, one copy each (a
second copy of a seed is refused: part B's rule runs a cut call again whole).

Per arm: seeds complete; **final** reward, KL and median length (means over the final window, the last quarter of
the planned steps, study 33's; the KL over the steps that logged one, so at β 0 the ``kl_monitor`` steps in it; a run
that did not reach its planned steps has none, the page's rule); **best window** (the highest mean reward over 10
consecutive steps, study 51 part A's: each run's own, averaged over the arm's runs; a window holding a NaN reward is
skipped), and the arm's best window less the best fixed β's (reported, not tested); **runaways** (runs whose
``adaptive_kl/runaway_alarm`` turned 1: the package's alarm, docs/runaway.md's definition, which works at β 0 through
``kl_monitor``; a run that never logged the alarm is counted apart, "not logged", never as calm). The **best fixed β**
is the `none` arm with the highest mean final reward. Every other arm is
compared with it on the final reward, paired by seed: Δ mean and its 95 % t interval (``analysis.t_interval``); the paired t test's two-sided p,
Holm-adjusted over the family of every comparison (the page's 15; one with fewer than two paired seeds, untested,
stays in the family at p 1, so a lost run never makes the others' correction milder); TOST with margin
±0.05, its p (the larger of its two one-sided p) Holm-adjusted over the same family. **Verdict** at family-wise
α 0.05: *beat* (adjusted p < α and Δ > 0), *lost* (adjusted p < α, Δ < 0), either with ", within ±0.05" where
TOST's adjusted p < α too (a difference smaller than the margin), *matched* (TOST's adjusted p < α alone), else
*inconclusive*; and for an inconclusive comparison the seeds at which a paired t test at Holm's strictest level (α / m) would detect its
observed Δ with power 0.8, at its observed spread (research/stats.py).
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import statistics
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from research import stats  # noqa: E402
from research.harness import analysis as A  # noqa: E402
from research.study51 import probe_report  # noqa: E402
from unsloth_adaptive_kl import metrics  # noqa: E402

WINDOW, FRACTION, ALPHA, MARGIN, POWER = probe_report.WINDOW, 0.25, 0.05, 0.05, 0.8
MEDIAN, ALARM = "completions/median_length", metrics.RUNAWAY_ALARM


def arms(directories: list[str]) -> dict[tuple[str, str], dict[int, list[dict]]]:
    """{(method, tag): {seed: rows by step}} of every run in the directories' streams (read as every study's are,
    ``analysis.read_copies``)."""
    paths = sorted(p for d in directories for p in glob.glob(os.path.join(d, "*-stream.jsonl*")))
    out: dict = defaultdict(dict)
    for tag, runs in A.read_copies(paths).items():
        for (method, seed), copies in runs.items():
            if len(copies) > 1:
                raise ValueError(f"two copies of {method} {tag} seed {seed}: part B counts one copy a seed")
            out[(method, tag)][seed] = copies[0]
    return dict(out)


def _mean(values) -> float | None:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else None


def run_numbers(rows: list[dict], planned: int) -> dict:
    """One run's numbers. The final ones are None unless the run reached its planned steps (the page's rule: a run
    that did not finish has no final value); its best window is over the steps it ran, skipping a window that holds a
    NaN reward. ``alarm_logged``: whether any row logged the runaway alarm (a run that never did is not counted as
    calm: ``runaway`` is then None and the arm's ``alarms_missing`` counts it)."""
    complete = rows[-1]["step"] >= planned
    window = A.final_window(rows, planned, FRACTION) if complete else []
    windows = [w for w in probe_report.windows([r["reward"] for r in rows]) if w is not None and not math.isnan(w)]
    return {"complete": complete,
            "reward": _mean(r["reward"] for r in window) if window else None,
            "best": max(windows) if windows else None,
            "kl": _mean(r.get(metrics.RAW_KL) for r in window if A.logged_kl(r)) if window else None,
            "median": _mean(r.get(MEDIAN) for r in window) if window else None,
            "alarm_logged": any(r.get(ALARM) is not None for r in rows),
            "runaway": next((r["step"] for r in rows if r.get(ALARM) == 1), None)}


def label(method: str, rows: list[dict]) -> str:
    """The arm as a reader names it, from what its rows record: the method and β0, then kl_target (for a controller
    that reads it), a learning-rate schedule other than constant, the monitor, and the controller parameters given."""
    row = rows[0]
    options = [f"kl_target {row['kl_target']:g}"] if A.reads_kl_target(method) and row.get("kl_target") is not None else []
    if row.get("lr_scheduler_type") not in (None, "constant"):
        options.append(f"{row['lr_scheduler_type']} lr")
    if row.get("kl_monitor"):
        options.append("kl_monitor")
    options += [f"{name} {value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else f"{name} {value}"
                for name, value in sorted((row.get("controller_params") or {}).items())]
    return f"{method} β {row['beta0']:g}" + (f" ({', '.join(options)})" if options else "")


def table(directories: list[str], planned: int = 100) -> tuple[list[dict], dict | None]:
    """One dict per arm (its label, its runs' rows by seed, per-seed numbers, means, and its comparison with the best
    fixed β)."""
    out = []
    for (method, tag), seeds in sorted(arms(directories).items()):
        numbers = {seed: run_numbers(rows, planned) for seed, rows in seeds.items()}
        first = next(iter(seeds.values()))
        out.append({"method": method, "tag": tag, "label": label(method, first), "beta0": first[0]["beta0"],
                    "runs": seeds, "numbers": numbers, "seeds": len(numbers),
                    "complete": sum(n["complete"] for n in numbers.values()),
                    "runaways": sum(n["runaway"] is not None for n in numbers.values()),
                    "alarms_missing": sum(not n["alarm_logged"] for n in numbers.values()),
                    **{key: _mean(n[key] for n in numbers.values()) for key in ("reward", "best", "kl", "median")}})
    fixed = [a for a in out if a["method"] == "none" and a["reward"] is not None]
    if not fixed:
        return out, None
    best = max(fixed, key=lambda a: a["reward"])
    others = [a for a in out if a is not best]
    tests = []
    for a in others:
        pairs = [(a["numbers"][s]["reward"], best["numbers"][s]["reward"]) for s in sorted(set(a["numbers"]) & set(best["numbers"]))]
        diffs = [x - y for x, y in pairs if x is not None and y is not None]
        tests.append(_compare(diffs))
    # The family: every comparison (the page's 15 with every arm filed); one with too few paired seeds to test stays
    # in it with p 1, so that a run lost never makes the others' correction milder.
    m = len(tests)
    for key in ("p", "p_tost"):
        adjusted = stats.holm([1.0 if t[key] is None else t[key] for t in tests]) if tests else []
        for t, value in zip(tests, adjusted):
            t[key + "_holm"] = None if t[key] is None else value
    for a, t in zip(others, tests):
        a["test"] = t
        t["best_window_vs_best"] = None if a["best"] is None or best["best"] is None else a["best"] - best["best"]
        t["verdict"] = _verdict(t)
        t["seeds_needed"] = (stats.seeds_needed(t["mean"] / t["sd"], ALPHA / m, POWER)
                             if t["verdict"] == "inconclusive" and t["sd"] else None)
    return out, best


def _compare(diffs: list[float]) -> dict:
    if len(diffs) < 2:
        return {"n": len(diffs), "mean": _mean(diffs), "sd": None, "low": None, "high": None, "p": None, "p_tost": None}
    mean, _t, p = stats.paired_t(diffs)
    _, low, high = A.t_interval(diffs)  # the 95 % interval the studies' tables print
    sd = statistics.stdev(diffs)
    se = sd / math.sqrt(len(diffs))
    # TOST: the two one-sided t tests against -margin and +margin; its p is the larger of the two
    if se == 0:
        p_tost = 0.0 if abs(mean) < MARGIN else 1.0
    else:
        df = len(diffs) - 1
        p_tost = max(1.0 - stats.t_cdf((mean + MARGIN) / se, df), stats.t_cdf((mean - MARGIN) / se, df))
    return {"n": len(diffs), "mean": mean, "sd": sd, "low": low, "high": high, "p": p, "p_tost": p_tost}


def _verdict(t: dict) -> str:
    if t["p"] is None:
        return "too few seeds"
    if t["p_holm"] < ALPHA:  # different; also equivalent when the difference is smaller than the margin
        return ("beat" if t["mean"] > 0 else "lost") + (f", within ±{MARGIN:g}" if t["p_tost_holm"] < ALPHA else "")
    if t["p_tost_holm"] < ALPHA:
        return "matched"
    return "inconclusive"


def _f(value, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def report(directories: list[str], planned: int = 100) -> str:
    arms_, best = table(directories, planned)
    m = len(arms_) - 1
    out = [f"# Study 51, part B ({planned} planned steps; final window: the last {FRACTION:.0%} of them; best window: "
           f"{WINDOW} steps)", ""]
    if best is None:
        return "\n".join(out + ["No `none` arm has a final reward: no best fixed β, no comparison."]) + "\n"
    if not any("test" in a and a["test"]["p"] is not None for a in arms_):
        method = (f"no arm has two seeds paired with it, so nothing is tested (a family of {m} "
                  f"comparison{'s' if m != 1 else ''}, none tested).")
    else:
        method = (f"paired by seed; p-values Holm-adjusted over the family of {m} comparison{'s' if m != 1 else ''} "
                  f"(family-wise α {ALPHA:g}); matched: TOST ±{MARGIN:g}, Holm-adjusted; seeds needed: a paired t test at "
                  f"α/{m} with power {POWER:g} for the observed Δ and spread.")
    out += [f"Best fixed β: **{best['label']}** (mean final reward {best['reward']:.3f}). Every other arm against it, "
            + method, "",
            "| arm | seeds (complete) | final reward | best window | best window vs best | final KL | median length | "
            "runaways | Δ final reward vs best [95 % CI] | p (Holm) | TOST p (Holm) | verdict | seeds needed |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in arms_:
        t = a.get("test")
        runaways = f"{a['runaways']}" + (f" ({a['alarms_missing']} not logged)" if a["alarms_missing"] else "")
        row = (f"| {a['label']} | {a['seeds']} ({a['complete']}) | {_f(a['reward'], '.3f')} | {_f(a['best'], '.3f')} | "
               f"{'—' if t is None else _f(t['best_window_vs_best'], '+.3f')} | "
               f"{_f(a['kl'], '.4g')} | {_f(a['median'], '.1f')} | {runaways} | ")
        if t is None:
            row += "best fixed β | — | — | — | — |"
        elif t["p"] is None:
            row += f"{_f(t['mean'], '+.3f')} | — | — | {t['verdict']} | — |"
        else:
            row += (f"{t['mean']:+.3f} [{t['low']:+.3f}, {t['high']:+.3f}] | {t['p_holm']:.3g} | {t['p_tost_holm']:.3g} | "
                    f"{t['verdict']} | {_f(t['seeds_needed'], 'd') if t['verdict'] == 'inconclusive' else '—'} |")
        out.append(row)
    return "\n".join(out) + "\n"


def phase_two_kl_target(directories: list[str], planned: int = 100) -> float:
    """Part B's K: the final KL of the median fixed-β run at β > 0 (the lower median: the 10th of 20 runs ordered by
    final KL), rounded to 2 significant digits; one fixed-β run ends at it, so it is reachable by issue 49's
    definition. ValueError without such a run."""
    finals = [run_numbers(rows, planned)["kl"] for (method, _tag), seeds in arms(directories).items()
              if method == "none" for rows in seeds.values() if rows[0]["beta0"] > 0]
    finals = sorted(kl for kl in finals if kl is not None)  # a run cut before its final window has none
    if not finals:
        raise ValueError("no fixed-β run at β > 0 has a final KL: phase 2's kl_target cannot be set")
    return float(f"{finals[(len(finals) - 1) // 2]:.2g}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directories", nargs="+", help="the study51-b-* directories the calls wrote")
    parser.add_argument("--steps", type=int, default=100, help="the runs' planned steps (default 100)")
    parser.add_argument("--kl-target", action="store_true",
                        help="print only phase 2's kl_target K (for partb_lists.py targets --kl-target K)")
    args = parser.parse_args(argv)
    if args.kl_target:
        print(f"{phase_two_kl_target(args.directories, args.steps):g}")
    else:
        print(report(args.directories, args.steps), end="")


if __name__ == "__main__":
    main()
