"""The runaway alarm (unsloth_adaptive_kl/runaway.py) and the runaway definition of docs/runaway.md, applied to study
33's streams (research/data/study33-p[12]-*/*-stream.jsonl.gz, docs/evidence.md section 7).

    python research/runaway/study33.py --scan    # the counts docs/runaway.md records, and the scan of the thresholds
    python research/runaway/study33.py --every 16  # the counts at kl_monitor_every=16 only (default: 1 4 8 16)

Every copy of every run (section 7's rule: every copy counts as a draw) is fed to the package's own
``RunawayAlarm``, step by step, with the step's logged ``adaptive_kl/raw_kl`` and ``reward``: what the alarm would
have seen in training. Section 7's runaways are named by its own definition (``analysis.runaway_step``: the 10-step
KL above 10 x K_nat = 0.247 while the 10-step reward is 0.1 below its best; at beta = 0 the reward alone). Printed:

* the runaways section 7 names at beta > 0, and the step the alarm fired at in each (the delay after section 7's step);
* the calm copies (beta > 0, in a run section 7 found no runaway in) the alarm flags, out of how many;
* the cut copies of runs that ran away in another copy (neither population: shown apart);
* the beta 0.04-0.1 runs (issue 51's test of the definition) flagged;
* for each N of ``--every`` (kl_monitor_every; default 1, 4, 8, 16): the counts with the KL kept on the watched steps
  only (every N-th; every phase of N tried), and the reward of every step: runaways flagged and when, calm copies
  flagged (mean over phases and worst phase);
* with ``--scan``: the scan the package's thresholds were chosen by (docs/runaway.md's selection rule, written
  before the counts) and its leave-one-seed-out check.

The beta = 0 copies logged no KL: neither the alarm nor the definition can judge them (docs/runaway.md).
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import statistics
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from research.harness import analysis
from unsloth_adaptive_kl import metrics
from unsloth_adaptive_kl.runaway import RunawayAlarm, RunawayRule

STREAMS = "research/data/study33-p[12]-*/*-stream.jsonl.gz"  # phases 1 and 2; not the probe's or genspeed's
K_NAT = 0.0247  # section 7's natural KL (phase 1's best fixed beta, 0.1); its runaway threshold is 10 x K_NAT
LOW_BETAS = (0.04, 0.1)  # issue 51, item 4: the definition flags at most 10 % of these runs


@dataclass
class Copy:
    method: str
    beta0: float
    kl_target: float | None
    placement: str
    seed: int
    rows: list[dict]
    section7_step: int | None  # section 7's runaway step, or None

    @property
    def label(self) -> str:
        target = f", kl_target {self.kl_target}" if self.method == "target" else ""
        placement = "" if self.placement == "loss" else f", KL in the {self.placement}"
        return f"{self.method} beta0 {self.beta0:g}{target}{placement}, seed {self.seed} ({self.rows[-1]['step']} steps)"

    @property
    def run(self) -> tuple:
        return self.method, self.beta0, self.kl_target, self.placement, self.seed


def read_copies(pattern: str = STREAMS) -> list[Copy]:
    paths = sorted(glob.glob(os.path.join(ROOT, pattern)))
    if not paths:
        raise SystemExit(f"no stream matches {pattern} under {ROOT}")
    copies = []
    for cells in analysis.read_copies(paths).values():
        for (method, seed), runs in cells.items():
            for rows in runs:
                first = rows[0]
                beta0 = float(first["beta0"])
                threshold = None if beta0 == 0 else 10 * K_NAT
                kl_target = first.get("kl_target") if method == "target" else None
                placement = first.get("kl_placement") or "loss"
                copies.append(Copy(method, beta0, kl_target, placement, seed, rows, analysis.runaway_step(rows, threshold)))
    return copies


RULE = RunawayRule()  # the package's thresholds
EVERY = (1, 4, 8, 16)  # kl_monitor_every: every step, and the sampled monitor (16: its default)
RATIOS, RECENT_OBSERVATIONS, CONFIRMATIONS = (4.0, 5.0, 6.0, 8.0), (1, 2, 3), (1, 2, 3)  # the scan (docs/runaway.md)
CALM_BOUND = 0.10  # issue 53: at most 10 % of the calm copies flagged


def watched(step: int, every: int, phase: int) -> bool:
    """Whether the sampled kl_monitor at ``kl_monitor_every=every`` logs the KL of ``step`` (1-based), its watched
    steps shifted by ``phase`` (0: steps 1, every + 1, ...; the monitor's own; the others: a runaway starting
    elsewhere in its cycle)."""
    return (step - 1) % every == phase


def step_kl(row: dict, every: int, phase: int) -> float | None:
    kl = row.get(metrics.RAW_KL)
    if kl is None or (isinstance(kl, float) and math.isnan(kl)) or not watched(row["step"], every, phase):
        return None
    return kl


def alarm_step(rows: list[dict], every: int = 1, phase: int = 0, rule: RunawayRule = RULE) -> int | None:
    """The step at which the package's RunawayAlarm fires on ``rows`` (None: never), fed the KL of the watched steps
    only (:func:`watched`) and the reward of every step."""
    alarm = RunawayAlarm(rule)
    for row in rows:
        alarm.observe_reward(row.get("reward"))
        if alarm.end_step(row["step"], step_kl(row, every, phase)):
            return row["step"]
    return None


def signals(rows: list[dict], every: int, phase: int, recent_observations: int = 1) -> list[tuple[int, float | None, bool]]:
    """(step, KL ratio or None where not judged, reward fell) at each observed KL, from the package's ``check`` (an
    alarm that never fires: the ratio and the reward means depend on the windows, not on the ratio or the
    confirmations scanned)."""
    alarm, out = RunawayAlarm(RunawayRule(kl_ratio=math.inf, min_recent_observations=recent_observations)), []
    for row in rows:
        alarm.observe_reward(row.get("reward"))
        kl = step_kl(row, every, phase)
        alarm.end_step(row["step"], kl)
        if kl is not None:
            last = alarm.last
            out.append((row["step"], None if last is None else last.kl_ratio, last is not None and last.recent_reward < last.base_reward))
    return out


def fires_at(sigs: list[tuple[int, float | None, bool]], ratio: float, confirmations: int) -> int | None:
    """The alarm's firing rule over precomputed :func:`signals` (the scan's fast path; checked against the alarm)."""
    streak = 0
    for step, r, fell in sigs:
        streak = streak + 1 if r is not None and r >= ratio and fell else 0
        if streak >= confirmations:
            return step
    return None


@dataclass
class Score:
    """One rule's counts on a set of runaway and calm copies, per N (means over the N phases)."""

    ratio: float
    recent_observations: int
    confirmations: int
    runaways: dict[int, float]  # N -> runaways flagged, mean over phases
    calm: dict[int, float]  # N -> calm copies flagged, mean over phases
    latest: int | None  # the latest alarm step - section 7's step, over every N and phase (None: none flagged)
    calm_total: int  # how many calm copies

    def admissible(self) -> bool:
        return all(flagged <= CALM_BOUND * self.calm_total + 1e-9 for flagged in self.calm.values())

    def key(self) -> tuple:
        """docs/runaway.md's selection rule, 2-5: most runaways, earliest latest alarm, fewest calm, larger r, smaller m
        and k."""
        return (-sum(self.runaways.values()), math.inf if self.latest is None else self.latest, sum(self.calm.values()),
                -self.ratio, self.confirmations, self.recent_observations)

    @property
    def rule(self) -> RunawayRule:
        return RunawayRule(kl_ratio=self.ratio, min_recent_observations=self.recent_observations, confirmations=self.confirmations)


def all_signals(copies: list[Copy], every_list=EVERY) -> dict:
    """{(id(copy), N, phase, k): signals} for every copy given and every k scanned."""
    return {(id(c), every, phase, k): signals(c.rows, every, phase, k)
            for c in copies for every in every_list for phase in range(every) for k in RECENT_OBSERVATIONS}


def score(sigs: dict, runaways: list[Copy], calm: list[Copy], ratio: float, k: int, confirmations: int, every_list=EVERY) -> Score:
    run_means, calm_means, latest = {}, {}, None
    for every in every_list:
        flagged_runaways = flagged_calm = 0
        for phase in range(every):
            for c in runaways:
                fired = fires_at(sigs[id(c), every, phase, k], ratio, confirmations)
                if fired is not None:
                    flagged_runaways += 1
                    latest = fired - c.section7_step if latest is None else max(latest, fired - c.section7_step)
            flagged_calm += sum(fires_at(sigs[id(c), every, phase, k], ratio, confirmations) is not None for c in calm)
        run_means[every], calm_means[every] = flagged_runaways / every, flagged_calm / every
    return Score(ratio, k, confirmations, run_means, calm_means, latest, len(calm))


def select(sigs: dict, runaways: list[Copy], calm: list[Copy]) -> tuple[Score | None, list[Score]]:
    """docs/runaway.md's selection rule over the scanned rules: the chosen one (None: none admissible) and all."""
    scores = [score(sigs, runaways, calm, r, k, m) for r in RATIOS for k in RECENT_OBSERVATIONS for m in CONFIRMATIONS]
    admissible = [s for s in scores if s.admissible()]
    return (min(admissible, key=Score.key) if admissible else None), scores


def scan_report(groups: dict[str, list[Copy]]) -> str:
    runaways, calm = groups["runaways"], groups["calm"]
    sigs = all_signals(runaways + calm)
    chosen, scores = select(sigs, runaways, calm)
    for c in runaways + calm:  # the fast path is the alarm's rule: checked on the chosen setting
        for every in EVERY:
            for phase in range(every):
                fast = fires_at(sigs[id(c), every, phase, chosen.recent_observations], chosen.ratio, chosen.confirmations)
                assert fast == alarm_step(c.rows, every, phase, chosen.rule), c.label
    head = " | ".join(f"N={n}: runaways / calm (mean over phases)" for n in EVERY)
    out = ["## The scan (docs/runaway.md's selection rule), on all copies", "",
           f"| r | k | m | {head} | latest alarm - section 7 | admissible (calm <= {CALM_BOUND:.0%} at every N) |",
           "|---|---|---|" + "---|" * len(EVERY) + "---|---|"]
    for s in scores:
        cells = " | ".join(f"{s.runaways[n]:.2f} / {s.calm[n]:.2f}" for n in EVERY)
        mark = " **chosen**" if s is chosen else ""
        out.append(f"| {s.ratio:g} | {s.recent_observations} | {s.confirmations} | {cells} | {s.latest} | {'yes' if s.admissible() else 'no'}{mark} |")
    package = (chosen.ratio, chosen.recent_observations, chosen.confirmations) == (RULE.kl_ratio, RULE.min_recent_observations, RULE.confirmations)
    out += ["", (f"of {len(runaways)} runaways and {len(calm)} calm copies; the chosen rule is the package's RunawayRule: "
                 f"{'yes' if package else 'NO'}"), "",
            "## Leave one seed out: the rule chosen on the other seeds, counted on the held-out seed", "",
            "| held-out seed | chosen on the others (r, k, m) | runaways of the seed | " + " | ".join(f"N={n}: runaways / calm flagged" for n in EVERY) + " | calm copies of the seed |",
            "|---|---|---|" + "---|" * len(EVERY) + "---|"]
    totals_run, totals_calm = dict.fromkeys(EVERY, 0.0), dict.fromkeys(EVERY, 0.0)
    for seed in sorted({c.seed for c in runaways + calm}):
        fit, _ = select(sigs, [c for c in runaways if c.seed != seed], [c for c in calm if c.seed != seed])
        held_run, held_calm = [c for c in runaways if c.seed == seed], [c for c in calm if c.seed == seed]
        if fit is None:
            out.append(f"| {seed} | none admissible | {len(held_run)} | " + " | ".join("" for _ in EVERY) + f" | {len(held_calm)} |")
            continue
        held = score(sigs, held_run, held_calm, fit.ratio, fit.recent_observations, fit.confirmations)
        for n in EVERY:
            totals_run[n] += held.runaways[n]
            totals_calm[n] += held.calm[n]
        cells = " | ".join(f"{held.runaways[n]:.2f} / {held.calm[n]:.2f}" for n in EVERY)
        out.append(f"| {seed} | {fit.ratio:g}, {fit.recent_observations}, {fit.confirmations} | {len(held_run)} | {cells} | {len(held_calm)} |")
    cells = " | ".join(f"{totals_run[n]:.2f} / {totals_calm[n]:.2f} ({100 * totals_calm[n] / len(calm):.1f} %)" for n in EVERY)
    out.append(f"| all, held out | | {len(runaways)} | {cells} | {len(calm)} |")
    return "\n".join(out)


def populations(copies: list[Copy]) -> dict[str, list[Copy]]:
    ran_away = {c.run for c in copies if c.section7_step is not None}
    with_kl = [c for c in copies if c.beta0 > 0]
    return {
        "runaways": [c for c in with_kl if c.section7_step is not None],
        "calm": [c for c in with_kl if c.run not in ran_away],
        "cut copies of runaway runs": [c for c in with_kl if c.section7_step is None and c.run in ran_away],
        "beta 0 (no KL logged)": [c for c in copies if c.beta0 == 0],
    }


def report(copies: list[Copy], every_list=EVERY) -> str:
    rule = RULE
    groups = populations(copies)
    stated = (
        f"rule: at each observed KL, the mean KL of the recent window (the last {rule.recent_steps} steps, or the steps of the "
        f"last {rule.min_recent_observations} observed KLs where they hold fewer) >= {rule.kl_ratio:g} x the median KL of the "
        f"{rule.base_steps} steps before it (>= {rule.min_base_observations} KLs there), while the mean reward of the recent "
        f"window is below the mean over those {rule.base_steps}; the alarm fires when this holds at {rule.confirmations} "
        "consecutive observed KLs"
    )
    out = [
        stated,
        f"copies read: {len(copies)} ({len(copies) - len(groups['beta 0 (no KL logged)'])} with a KL)",
        "",
        "## Section 7's runaways (beta > 0) and the alarm",
        "",
        "| run | section 7's runaway step | alarm step | alarm - section 7 |",
        "|---|---|---|---|",
    ]
    delays = []
    for c in groups["runaways"]:
        fired = alarm_step(c.rows)
        delays.append(None if fired is None else fired - c.section7_step)
        out.append(f"| {c.label} | {c.section7_step} | {fired if fired is not None else 'never'} | {'' if fired is None else fired - c.section7_step} |")
    flagged = [d for d in delays if d is not None]
    summary = (
        f"runaways flagged: {len(flagged)} of {len(delays)}; alarm - section 7's step: {min(flagged)} to {max(flagged)} steps "
        "(negative: the alarm came first)" if flagged else "runaways flagged: 0"
    )
    out += ["", summary, ""]
    calm = groups["calm"]
    calm_flags = [(c, alarm_step(c.rows)) for c in calm]
    hits = [(c, s) for c, s in calm_flags if s is not None]
    out += ["## Calm copies (beta > 0, in runs section 7 found no runaway in)", "",
            f"calm copies flagged: {len(hits)} of {len(calm)} ({100 * len(hits) / len(calm):.1f} %)"]
    out += [f"- {c.label}: step {s}" for c, s in hits]
    cut = groups["cut copies of runaway runs"]
    out += ["", "## Cut copies of runs that ran away in another copy (in neither count)", ""]
    out += [f"- {c.label}: alarm {alarm_step(c.rows) or 'never'}" for c in cut]
    low = [c for c in copies if c.beta0 in LOW_BETAS]
    low_hits = [c for c in low if alarm_step(c.rows) is not None]
    low_none = [c for c in low if c.method == "none"]
    low_none_hits = [c for c in low_none if alarm_step(c.rows) is not None]
    named = sum(c.section7_step is not None for c in low)
    reward_rule = sum(analysis.runaway_step(c.rows, None) is not None for c in low_none)
    out += ["", "## The definition on the beta 0.04-0.1 runs (issue 51, item 4)", ""]
    out.append(f"every copy at beta0 0.04 or 0.1 (any method, target included): flagged {len(low_hits)} of {len(low)} "
               f"({100 * len(low_hits) / len(low):.1f} %); section 7's definition names {named} of them")
    out.append(f"method none at beta 0.04 or 0.1 (KL in the loss or the reward): flagged {len(low_none_hits)} of {len(low_none)}; "
               f"section 7's reward rule alone flags {reward_rule} of them")
    others = [c for c in low if c.section7_step is None and c not in cut]
    others_hits = [c for c in others if c in low_hits]
    out.append(f"the other copies at beta0 0.04 or 0.1 (neither section 7's runaways nor cut copies of their runs): flagged "
               f"{len(others_hits)} of {len(others)} ({100 * len(others_hits) / len(others):.1f} %)")
    out += [f"- flagged: {c.label}: step {alarm_step(c.rows)} (section 7: {c.section7_step or 'no runaway'})" for c in low_hits]
    out += ["", f"beta 0 copies: {len(groups['beta 0 (no KL logged)'])}, not judged (no KL logged; kl_monitor gives one)"]
    out += ["", sampled_report(groups, every_list)]
    return "\n".join(out)


def sampled_report(groups: dict[str, list[Copy]], every_list=EVERY) -> str:
    """The counts at each kl_monitor_every N, every phase tried: runaways flagged and when, calm copies flagged."""
    runaways, calm = groups["runaways"], groups["calm"]
    out = ["## The counts at each kl_monitor_every N (the KL of the watched steps only; every phase of N tried)", "",
           ("| N | runaways flagged, mean over phases | fewest in a phase | alarm - section 7's step: earliest, median, latest "
            "| calm flagged, mean over phases (%) | most in a phase (%) |"), "|---|---|---|---|---|---|"]
    detail = {}
    for every in every_list:
        per_phase_runaways, per_phase_calm, delays = [], [], []
        for phase in range(every):
            fired = [alarm_step(c.rows, every, phase) for c in runaways]
            per_phase_runaways.append(sum(f is not None for f in fired))
            delays += [f - c.section7_step for f, c in zip(fired, runaways) if f is not None]
            for c, f in zip(runaways, fired):
                detail.setdefault((c.label, every), []).append(None if f is None else f - c.section7_step)
            per_phase_calm.append(sum(alarm_step(c.rows, every, phase) is not None for c in calm))
        mean_calm = sum(per_phase_calm) / every
        spread = f"{min(delays)}, {statistics.median(delays):g}, {max(delays)}" if delays else ""
        out.append(f"| {every} | {sum(per_phase_runaways) / every:.2f} of {len(runaways)} | {min(per_phase_runaways)} | {spread} | "
                   f"{mean_calm:.2f} of {len(calm)} ({100 * mean_calm / len(calm):.1f} %) | {max(per_phase_calm)} ({100 * max(per_phase_calm) / len(calm):.1f} %) |")
    out += ["", "Each runaway: the phases that flag it, and alarm - section 7's step over them (its stream ends at step 200):", "",
            "| run | section 7's step | " + " | ".join(f"N={n}: phases flagged, alarm - section 7" for n in every_list) + " |",
            "|---|---|" + "---|" * len(every_list)]
    for c in runaways:
        cells = []
        for every in every_list:
            got = [d for d in detail[c.label, every] if d is not None]
            cells.append(f"{len(got)} of {every}" + (f", {min(got)} to {max(got)}" if got else ""))
        out.append(f"| {c.label} | {c.section7_step} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=int, nargs="*", default=list(EVERY), help="the kl_monitor_every values counted (default: 1 4 8 16)")
    parser.add_argument("--scan", action="store_true", help="the scan the thresholds were chosen by, and its leave-one-seed-out check")
    args = parser.parse_args(argv)
    copies = read_copies()
    print(report(copies, args.every))
    if args.scan:
        print()
        print(scan_report(populations(copies)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
