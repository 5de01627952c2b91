"""The runaway alarm (unsloth_adaptive_kl/runaway.py) and the runaway definition of docs/runaway.md, applied to study
33's streams (research/data/study33-p[12]-*/*-stream.jsonl.gz, docs/evidence.md section 7).

    python research/runaway/study33.py                 # the counts docs/runaway.md records
    python research/runaway/study33.py --every 1 4 16  # also with the KL seen every N-th step (the sampled kl_monitor)

Every copy of every run (section 7's rule: every copy counts as a draw) is fed to the package's own
``RunawayAlarm``, step by step, with the step's logged ``adaptive_kl/raw_kl`` and ``reward``: what the alarm would
have seen in training. Section 7's runaways are named by its own definition (``analysis.runaway_step``: the 10-step
KL above 10 x K_nat = 0.247 while the 10-step reward is 0.1 below its best; at beta = 0 the reward alone). Printed:

* the runaways section 7 names at beta > 0, and the step the alarm fired at in each (the delay after section 7's step);
* the calm copies (beta > 0, in a run section 7 found no runaway in) the alarm flags, out of how many;
* the cut copies of runs that ran away in another copy (neither population: shown apart);
* the beta 0.04-0.1 runs (issue 51's test of the definition) flagged;
* with ``--every``: the same counts with the KL kept on every N-th step only, over all N phases (mean and worst).

The beta = 0 copies logged no KL: neither the alarm nor the definition can judge them (docs/runaway.md).
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from blackwell.demo import analysis
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


def alarm_step(rows: list[dict], every: int = 1, phase: int = 0, rule: RunawayRule = RULE) -> int | None:
    """The step at which the package's RunawayAlarm fires on ``rows`` (None: never), with the KL of steps whose
    ``(step - 1) % every == phase`` only (the sampled kl_monitor: ``every`` = kl_monitor_every)."""
    alarm = RunawayAlarm(rule)
    for row in rows:
        step, kl = row["step"], row.get(metrics.RAW_KL)
        if kl is None or (isinstance(kl, float) and math.isnan(kl)) or (step - 1) % every != phase:
            kl = None
        alarm.observe_reward(row.get("reward"))
        if alarm.end_step(step, kl):
            return step
    return None


def populations(copies: list[Copy]) -> dict[str, list[Copy]]:
    ran_away = {c.run for c in copies if c.section7_step is not None}
    with_kl = [c for c in copies if c.beta0 > 0]
    return {
        "runaways": [c for c in with_kl if c.section7_step is not None],
        "calm": [c for c in with_kl if c.run not in ran_away],
        "cut copies of runaway runs": [c for c in with_kl if c.section7_step is None and c.run in ran_away],
        "beta 0 (no KL logged)": [c for c in copies if c.beta0 == 0],
    }


def report(copies: list[Copy], every_list: list[int]) -> str:
    rule = RULE
    groups = populations(copies)
    stated = (
        f"rule: mean KL over the last {rule.recent_steps} steps >= {rule.kl_ratio:g} x the median KL of the "
        f"{rule.base_steps} steps before them (>= {rule.min_base_observations} KLs there), while the mean reward over the "
        f"last {rule.recent_steps} steps is below the mean over those {rule.base_steps}; judged from step {rule.span}"
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
    if every_list:
        out += ["", "## The KL seen every N-th step only (the sampled kl_monitor), over the N phases", ""]
        out.append("| every N steps | runaways flagged (mean over phases) | fewest | calm flagged (mean) | most | most calm (%) "
                   "| latest alarm - section 7 |")
        out.append("|---|---|---|---|---|---|---|")
        for every in every_list:
            ra, ca, late = [], [], []
            for phase in range(every):
                fired = [alarm_step(c.rows, every, phase) for c in groups["runaways"]]
                ra.append(sum(f is not None for f in fired))
                late += [f - c.section7_step for f, c in zip(fired, groups["runaways"]) if f is not None]
                ca.append(sum(alarm_step(c.rows, every, phase) is not None for c in calm))
            out.append(f"| {every} | {sum(ra) / every:.2f} of {len(groups['runaways'])} | {min(ra)} | {sum(ca) / every:.2f} of {len(calm)} | "
                       f"{max(ca)} | {100 * max(ca) / len(calm):.1f} | {max(late) if late else ''} |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=int, nargs="*", default=[], help="also count with the KL of every N-th step only")
    args = parser.parse_args(argv)
    print(report(read_copies(), args.every))
    return 0


if __name__ == "__main__":
    sys.exit(main())
