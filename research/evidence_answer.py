"""The one-screen answer at the top of docs/evidence.md (issue 51), made from the studies' tables.

    python research/evidence_answer.py           # prints the answer
    python research/evidence_answer.py --write   # rewrites it in docs/evidence.md, between its two markers

Every number of the answer is read from a table of a study page (docs/evidence/*.md): the wording is this file's,
the numbers are the tables'. Study 51's part B enters once its page has a section "### Part B: results" holding
``research/study51/arms_report.py``'s table (the real model's best fixed β, and every controller against it; written
by ``research/study51/results.py``), and with it prediction 5's rows (``target`` and ``ziegler`` holding K) and the
trace of their β under **What β did** (``research/study51/controller_trace.py``'s table, checked against the streams by
research/tests/test_study51_controller_trace.py). research/tests/test_evidence_pages.py fails while docs/evidence.md holds another
answer than this one, so a table that changes changes the answer, or the test says so.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "docs" / "evidence.md"
STUDY_26 = ROOT / "docs" / "evidence" / "study26-beta-grid.md"
STUDY_33 = ROOT / "docs" / "evidence" / "study33-long-task.md"
STUDY_49 = ROOT / "docs" / "evidence" / "study49-target.md"
STUDY_51 = ROOT / "docs" / "evidence" / "study51-real-model.md"
RESULTS_51 = "### Part B: results"
MARKER = "<!-- answer -->"
MAX_LINES = 10  # one screen


def clean(cell: str) -> str:
    return cell.replace("**", "").replace("`", "").strip()


def table_after(text: str, marker: str, start: str | None = None) -> list[dict[str, str]]:
    """The rows of the first markdown table after the first line that starts with ``marker`` (searched from the
    first line starting with ``start``, if given), as {header: cell} with bold and code marks removed. A header
    that appears twice (two "verdict" columns) keeps both: the second as "header 2"."""
    lines = text.split("\n")
    begin = 0
    if start is not None:
        begin = next(i for i, line in enumerate(lines) if line.startswith(start))
    at = next(i for i in range(begin, len(lines)) if lines[i].startswith(marker))
    first = next(i for i in range(at, len(lines)) if lines[i].startswith("|"))  # the marker may be the header
    rows = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        rows.append([clean(c) for c in line.strip().strip("|").split("|")])
    header, body = rows[0], rows[2:]
    names = [h if header[:i].count(h) == 0 else f"{h} {header[:i].count(h) + 1}" for i, h in enumerate(header)]
    return [dict(zip(names, row)) for row in body]


def number(cell: str) -> float:
    """The first number of a cell ("0.762 ± 0.035", "2: seed 0 step 147", "+0.052", "0.1 (best)")."""
    return float(re.search(r"[-+]?\d+(?:\.\d+)?(?:e-?\d+)?", cell).group())


def number_or_none(cell: str) -> float | None:
    """A cell's first number; None for a cell without one (arms_report's "—": no final value, no pair)."""
    return number(cell) if re.search(r"\d", cell) else None


def span(values, fmt: str) -> str:
    low, high = min(values), max(values)
    return format(low, fmt) if format(low, fmt) == format(high, fmt) else f"{format(low, fmt)}-{format(high, fmt)}"


def study_33(text: str) -> dict:
    runs = table_after(text, "| method | β0 | copies", start="### Results, phase 1")
    fixed = {number(r["β0"]): r for r in runs if r["method"] == "none"}
    by_reward = sorted((b for b in fixed if b > 0), key=lambda b: -number(fixed[b]["final reward"]))
    shaping = {r["method"]: r for r in runs if r["method"] != "none"}
    low = table_after(text, "**(b) `target` at the low target**")
    high = table_after(text, "**(b) `target` at the high target**")
    c = table_after(text, "**(c) Against `none` at β 0.04**")
    d = table_after(text, "**(d) KL in the reward (k1) against in the loss (k3)**")
    correction = table_after(text, "Points 1 and 4 in one table")
    zero, gain = correction
    return {
        "best": by_reward[:2], "reward": {b: number(fixed[b]["final reward"]) for b in fixed},
        "kl": {b: number(fixed[b]["final KL"]) for b in fixed if b > 0}, "fixed_betas": sorted(fixed),
        "runaways": {m: number(r["runaways (copies)"]) for m, r in shaping.items()},
        "none_0.04_runaways": number(fixed[0.04]["runaways (copies)"]),
        "target_ratio": [number(r["KL / kl_target"]) for r in low + high],
        "target_reward": [number(r["Δ reward"]) for r in low + high], "target_cells": len(low + high),
        "shaping_reward": {r["method"]: (number(r["Δ mean"]), r["verdict"]) for r in c if r["quantity"] == "reward"},
        "placement_reward": next((number(r["Δ mean"]), r["verdict"]) for r in d if r["quantity"] == "reward"),
        "zero": (number(zero["Δ final reward"]), zero["95 % CI"], zero["verdict"], int(number(zero["seeds"])),
                 number(zero["sign-flip p"])),
        "gain": (number(gain["Δ final reward"]), number(gain["sign-flip p"]), number(gain["Bonferroni"])),
    }


def study_26(text: str) -> dict:
    out = {}
    for loss in ("dapo", "grpo"):
        start = f"#### Loss `{loss}`"
        runs = table_after(text, "| method | initial β | seeds", start=start)
        spread = {r["method"]: number(r["final KL max / min"]) for r in table_after(text, "**Spread across initial β**", start=start)}
        ratio = [number(r["KL / kl_target"]) for r in table_after(text, "**`target`: final KL / kl_target", start=start)]
        reward = [number(r["final reward"]) for r in runs if r["method"] == "none" and number(r["initial β"]) <= 0.3]
        against = table_after(text, "**The best fixed β against every start**", start=start)
        # a method whose Δ final reward has its 95 % interval above 0: it beat the best fixed β
        beat = [f"{r['method']} from β {r['initial β']}" for r in against
                if number(re.search(r"\[(.*?),", r["Δ final reward"]).group(1)) > 0]
        out[loss] = {"spread": spread, "target_ratio": ratio, "none_reward": reward, "beat": beat}
    return out


def study_49(text: str) -> dict:
    """Study 49's results: runs held within ±25 % of the reachable target (0.04), runaways at both targets, by method;
    the fixed β that held 0.04 in the most seeds; and design 2's declarations of the unreachable target."""
    held = table_after(text, "**Held, at 0.04 and 0.099**")
    counts = lambda r: tuple(int(x) for x in r["held (±25 %)"].split("/"))  # noqa: E731  ("3/5": held, runs)
    out: dict = {"held": {}, "runs": {}, "runaways": {}, "all_runs": {}}
    for r in held:
        if not r["method"].startswith("fixed β"):  # the study's two arms; the fixed-β rows are study 33's
            got, of = counts(r)
            if number(r["kl_target"]) == 0.04:
                out["held"][r["method"]] = out["held"].get(r["method"], 0) + got
                out["runs"][r["method"]] = out["runs"].get(r["method"], 0) + of
            out["runaways"][r["method"]] = out["runaways"].get(r["method"], 0) + number(r["runaways"])
            out["all_runs"][r["method"]] = out["all_runs"].get(r["method"], 0) + of
    fixed = [(*counts(r), number(r["method"])) for r in held if r["method"].startswith("fixed β")]
    out["fixed"] = max(fixed)
    (design2,) = [r for r in table_after(text, "**The unreachable target, 0.0062 from β0 0.1:**") if r["design"] == "design 2"]
    steps = [int(x) for x in re.findall(r"\d+", design2["declared at update (seeds 0-4)"])]
    out["declared"] = (len(steps), len(design2["declared at update (seeds 0-4)"].split(",")), min(steps), max(steps))
    return out


def study_51(text: str) -> dict | None:
    """Study 51 part B's readout table (arms_report's) from the page's results section; None while it has none."""
    lines = text.split("\n")
    if not any(line.startswith(RESULTS_51) for line in lines):
        return None
    rows = table_after(text, "| arm | seeds (complete)", start=RESULTS_51)
    section = text[text.index("\n" + RESULTS_51) + 1:]
    family = int(re.search(r"family of (\d+) comparison", section).group(1))
    (best,) = [r for r in rows if r["Δ final reward vs best [95 % CI]"] == "best fixed β"]
    arms = []
    for r in rows:
        method, rest = r["arm"].split(" β ", 1)
        beta0, _, options = rest.partition(" (")
        params = dict(o.split(" ", 1) if " " in o else (o, "") for o in options.rstrip(")").split(", ") if o)
        arms.append({"label": r["arm"], "method": method, "beta0": float(beta0), "params": params,
                     "seeds": int(number(r["seeds (complete)"].split("(")[1])), "reward": number_or_none(r["final reward"]),
                     "kl": number_or_none(r["final KL"]),
                     "runaways": int(number(r["runaways"])), "verdict": r["verdict"],
                     "unlogged": int(m.group(1)) if (m := re.search(r"\((\d+) not logged\)", r["runaways"])) else 0,
                     "delta": None if r is best else r["Δ final reward vs best [95 % CI]"],
                     "needed": r["seeds needed"]})
    fixed = sorted((a for a in arms if a["method"] == "none"), key=lambda a: a["beta0"])
    (best_arm,) = [a for a in arms if a["label"] == best["arm"]]
    return {"best": best_arm, "fixed": fixed, "controllers": [a for a in arms if a["method"] != "none"],
            "family": family, "seeds": max(a["seeds"] for a in arms), "targets": targets_51(section)}


def targets_51(section: str) -> dict | None:
    """What ``target`` and ``ziegler`` did on the real model, from the results section: prediction 5's "holds K"
    rows (runs held of runs, per controller) and, where the page has it, the trace of each run's β
    (``research/study51/controller_trace.py``'s table under **What β did**): per arm (method, β0), the seeds, those
    declared unreachable, the declaration steps and β at step 100. None without the predictions' rows."""
    held = {}
    for line in section.split("\n"):
        if m := re.match(r"\| 5 \| `(\w+)` holds K \(±25%\) in at most half of its runs \| (\d+) of (\d+) \|", line):
            held[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    if not held:
        return None
    trace: dict = {}
    if "**What β did**" in section:
        for r in table_after(section, "| arm | seed | β step 25", start="**What β did**"):
            method, rest = r["arm"].split(" β ", 1)
            arm = trace.setdefault((method, float(rest.split(" ")[0])),
                                   {"seeds": 0, "declared": [], "end": [], "declared_end": []})
            arm["seeds"] += 1
            arm["end"].append(number(r["β step 100"]))
            if number_or_none(r["declared unreachable"]) is not None:
                arm["declared"].append(int(number(r["declared unreachable"])))
                arm["declared_end"].append(number(r["β step 100"]))
            arm["kl_target"] = number(r["arm"].split("kl_target ")[1])
    return {"held": held, "trace": trace}


def short(arm: dict) -> str:
    """A controller arm in a few words: its method and β0, and the one option that tells its arms apart."""
    extra = [arm["params"][k] if k == "beta_schedule" else f"threshold {arm['params'][k]}"
             for k in ("beta_schedule", "reward_threshold") if k in arm["params"]]
    return f"`{arm['method']}` {arm['beta0']:g}" + "".join(f" {e}" for e in extra)


#: How the answer groups study 51's verdicts (arms_report's words), in this order.
GROUPS = (("beat", "beat"), ("beat, within ±0.05", "beat by less than 0.05"), ("matched", "matched (within ±0.05)"),
          ("lost, within ±0.05", "lost by less than 0.05"), ("lost", "lost"), ("inconclusive", "inconclusive"),
          ("too few seeds", "too few seeds"))


def controllers_51(s51: dict) -> str:
    parts = []
    for verdict, words in GROUPS:
        arms = [a for a in s51["controllers"] if a["verdict"] == verdict]
        if not arms:
            continue
        items = []
        for a in arms:
            delta = number_or_none(a["delta"])
            notes = [] if delta is None else [f"{delta:+.3f}"]
            if a["kl"] is not None:
                notes.append(f"KL {a['kl']:.2g}")
            if verdict == "inconclusive" and a["needed"] not in ("—", ""):
                notes.append(f"{a['needed']} seeds would tell")
            if a["seeds"] < s51["seeds"]:
                notes.append(f"{a['seeds']} seeds")
            if a["unlogged"]:
                notes.append(f"no runaway alarm logged in {a['unlogged']} run{'s' if a['unlogged'] != 1 else ''}")
            if a["runaways"]:
                notes.append(f"{a['runaways']} runaway{'s' if a['runaways'] != 1 else ''}")
            items.append(f"{short(a)}" + (f" ({', '.join(notes)})" if notes else ""))
        parts.append(f"{words}: " + ", ".join(items))
    return "; ".join(parts)


def target_51(s51: dict | None) -> str:
    """The ``target`` line's opening: study 49's alone, or with study 51's runs (held, and what the trace shows)."""
    targets = None if s51 is None else s51.get("targets")
    if targets is None or "target" not in targets["held"]:
        return "- **`target`: it held no chosen KL on the long task; it does say when one is out of reach.** "
    held, runs = targets["held"]["target"]
    z_held, z_runs = targets["held"].get("ziegler", (None, None))
    words = "no chosen KL on the long task or the real model" if held == 0 else f"its target in {held} of {runs} runs on the real model"
    out = (f"- **`target`: it held {words}.** [Study 51](evidence/study51-real-model.md"
           f"#part-b-results): within ±25 % of its target in {held} of {runs} runs" + (f" (`ziegler` {z_held} of {z_runs})" if z_runs else ""))
    parts = []
    for (method, beta0), arm in sorted(targets["trace"].items()):
        if method != "target":
            continue
        if arm["declared"]:
            parts.append(f"from β0 {beta0:g} it declared {arm['kl_target']:g} unreachable in {len(arm['declared'])} of "
                         f"{arm['seeds']} seeds (steps {span(arm['declared'], 'd')}; β at step 100 {span(arm['declared_end'], '.2g')})")
        else:
            parts.append(f"from β0 {beta0:g} β stopped at {span(arm['end'], '.3g')}, nothing declared")
    return out + ("; " + "; ".join(parts) if parts else "") + ". "


def ziegler_51(s51: dict | None) -> str:
    """``ziegler``'s study-51 clause: β at step 100 of each start, from the trace; "" without one."""
    trace = {} if s51 is None or s51.get("targets") is None else s51["targets"]["trace"]
    arms = [(beta0, arm) for (method, beta0), arm in sorted(trace.items()) if method == "ziegler"]
    if not arms:
        return ""
    return "; study 51: β at step 100 " + ", ".join(f"{span(arm['end'], '.2g')} from {beta0:g}" for beta0, arm in arms)


def decay_51(s51: dict | None) -> str:
    """Study 51's test of study 33's β decay (``schedule`` from β0 1), as a clause: its arms' verdicts and Δ; "" without
    such an arm."""
    arms = [] if s51 is None else [a for a in s51["controllers"] if a["method"] == "schedule" and a["beta0"] == 1]
    if not arms:
        return ""
    parts = ", ".join(f"{a['params'].get('beta_schedule', '')} {a['verdict']}".strip()
                      + ("" if number_or_none(a["delta"] or "") is None else f" {number(a['delta']):+.3f}") for a in arms)
    return f" (tested as `schedule` from β 1 on the real model: {parts})"


def answer(s26: dict, s33: dict, s49: dict, s51: dict | None = None) -> str:
    b1, b2 = s33["best"]
    lo_b, hi_b = sorted((b1, b2))
    toy_reward = s26["dapo"]["none_reward"] + s26["grpo"]["none_reward"]
    spread = lambda m: [s26[loss]["spread"][m] for loss in ("dapo", "grpo")]  # noqa: E731
    z_mean, z_ci, z_verdict, z_seeds, z_sign_p = s33["zero"]
    gain, gain_p, gain_bonferroni = s33["gain"]
    shaping = s33["shaping_reward"]
    others = [(f"`{m}`", *shaping[m]) for m in ("soft_clip", "length_normalized")]
    others.append(("KL in the reward", *s33["placement_reward"]))
    beat = s26["dapo"]["beat"] + s26["grpo"]["beat"] + (["target's β decay"] if gain_bonferroni < 0.05 else [])
    if s51 is not None:
        beat = [f"{short(a)} on the real model" for a in s51["controllers"] if a["verdict"].startswith("beat")] + beat
    beaten = "no controller has been shown to beat it" if not beat else "beaten by " + ", ".join(beat)
    correction = "evidence/study33-long-task.md#correction-2026-11-28-issue-51-what-the-record-got-wrong"
    study33 = (f"[Study 33](evidence/study33-long-task.md) (35 M Llama, ~124-token sums, 5 seeds): the most reward "
               f"({s33['reward'][b1]:.3f}, {s33['reward'][b2]:.3f}) and the least KL of {len(s33['fixed_betas'])} fixed β"
               + (f" at {lo_b:g}-{hi_b:g}" if s51 is not None else "")
               + f"; [study 26](evidence/study26-beta-grid.md) (0.7 M Llama, 4-10 tokens, 3 seeds): any β 0.001-0.3 "
               f"about the same ({span(toy_reward, '.3f')}).")
    zero = (f"study 33: {z_mean:+.3f} {z_ci} reward against β {b1:g}, "
            + (f"{'lower' if z_mean < 0 else 'higher'} in all {z_seeds} seeds, " if z_sign_p == 2 / 2**z_seeds else "")
            + f"{z_verdict} ([correction]({correction})).")
    if s51 is None:
        headline = [f"- **β: a fixed {lo_b:g}-{hi_b:g} (`none`); {beaten}.** {study33}"]
    else:
        best, fixed = s51["best"], s51["fixed"]
        grid = ", ".join(f"{a['beta0']:g}: " + ("—" if a["reward"] is None else f"{a['reward']:.3f}") for a in fixed)
        page = "evidence/study51-real-model.md#part-b-results"
        # the fixed β not shown worse than the best: the best and those whose comparison did not say "lost"
        kept = [a for a in fixed if a is best or not (a["verdict"].startswith("lost") or a["reward"] is None)]
        lo_k, hi_k = min(a["beta0"] for a in kept), max(a["beta0"] for a in kept)
        named = lambda arms: " and ".join(f"{a['beta0']:g}" for a in arms)  # noqa: E731
        near = [a for a in kept if a is not best]
        lost = [a for a in fixed if a["verdict"].startswith("lost")]
        against = "; ".join(part for part in (
            f"β {named(near)} {'inconclusive' if all(a['verdict'] == 'inconclusive' for a in near) else 'not shown worse'} against it" if near else "",
            f"β {named(lost)} lost" if lost else "") if part)
        headline = [
            f"- **β: a fixed {lo_k:g}" + (f"-{hi_k:g}" if hi_k != lo_k else "") + f" (`none`) on a real model; {beaten}.** "
            f"[Study 51]({page}) (SmolLM2-135M-Instruct, chat addition, LoRA, 100 steps, {s51['seeds']} seeds): β "
            f"{best['beta0']:g} had the most final reward ({best['reward']:.3f}" + (f", its KL {best['kl']:.2g}" if best["kl"] is not None else "")
            + f") of {len(fixed)} fixed β ({grid})" + (f"; {against}" if against else "") + ". "
            + study33,
            f"- **Each controller against it** (study 51, final reward paired by seed, Holm over {s51['family']} "
            f"comparisons): {controllers_51(s51)}."]
        (zero_51,) = [a for a in fixed if a["beta0"] == 0]
        zero = (f"study 51: {zero_51['delta']} against β {best['beta0']:g}, {zero_51['verdict']}; " + zero
                if zero_51 is not best else "study 51: the best fixed β; " + zero)
    not_known = ("pretrained models and real tasks (no study has run one); `schedule`, `reward_conditioned`, "
                 "and `dynamic` beyond the toy task" if s51 is None else
                 "models past 135 M, full fine-tuning, runs past 100 steps, other tasks and learning rates")
    lines = [
        "**What to use**, and what each answer rests on (made from the studies' tables by `research/evidence_answer.py`):",
        "",
        *headline,
        f"- **β = 0 (TRL's default):** {zero}",
        target_51(s51) +
        f"[Study 49](evidence/study49-target.md#results) (study 33's task, 5 seeds): a reachable target (0.04) ended within "
        f"±25 % in {s49['held']['target']} of {s49['runs']['target']} runs (`ziegler` {s49['held']['ziegler']} of "
        f"{s49['runs']['ziegler']}; a fixed β {s49['fixed'][2]:g}: {s49['fixed'][0]} of {s49['fixed'][1]} seeds), "
        f"runaways in {s49['runaways']['target']:g} of {s49['all_runs']['target']} runs (`ziegler` {s49['runaways']['ziegler']:g}); "
        f"a target below every KL reached said in {s49['declared'][0]} of {s49['declared'][1]} seeds (updates "
        f"{s49['declared'][2]}-{s49['declared'][3]}).",
        f"- **`ziegler` (`target` before issue 49): only for a KL you know you want, with a `beta_min`.** Study 26 held it under `grpo` from every "
        f"initial β ({span(s26['grpo']['target_ratio'], '.2f')} × the target; `dapo`: "
        f"{span(s26['dapo']['target_ratio'], '.2f')}); study 33 held neither of its targets "
        f"({span(s33['target_ratio'], '.2f')} × in {s33['target_cells']} cells), reward "
        f"{min(s33['target_reward']):+.3f} to {max(s33['target_reward']):+.3f} against the best fixed β"
        + ziegler_51(s51) + ".",
        f"- **`dynamic`, `clip`: no gain.** Study 26: final-KL spread across initial β "
        f"{span(spread('dynamic') + spread('clip'), '.1f')}× (`none` {span(spread('none'), '.1f')}×, `ziegler` "
        f"{span(spread('target'), '.2f')}×), and runaway seeds of their own; study 33, β 0.04: `clip` "
        f"{s33['runaways']['clip']:g} runaways in 5 seeds, `none` {s33['none_0.04_runaways']:g}.",
        "- **" + ", ".join(name for name, _, _ in others) + ":** study 33, β 0.04: Δ reward against `none` "
        + ", ".join(f"{mean:+.3f}" for _, mean, _ in others) + "; no gain.",
        f"- **Not known:** {not_known}; whether study 33's β decay found after the data ({gain:+.3f}, 1 of 6 "
        f"tests, Bonferroni p {gain_bonferroni:.3f}, exact p {gain_p:.4f}) is real on its task" + decay_51(s51)
        + "; tasks where longer completions pay.",
    ]
    if len(lines) > MAX_LINES:
        raise ValueError(f"the answer has {len(lines)} lines: allowed: at most {MAX_LINES} (one screen)")
    return "\n".join(lines)


def current() -> str:
    return answer(study_26(STUDY_26.read_text()), study_33(STUDY_33.read_text()), study_49(STUDY_49.read_text()),
                  study_51(STUDY_51.read_text()))


def with_answer(index: str, block: str) -> str:
    """The index with ``block`` between its two markers."""
    before, _, after = index.split(MARKER)
    return f"{before}{MARKER}\n{block}\n{MARKER}{after}"


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        INDEX.write_text(with_answer(INDEX.read_text(), current()))
    elif sys.argv[1:]:
        raise SystemExit(f"usage: python {sys.argv[0]} [--write]")
    else:
        print(current())
