"""Study 51, part B: its GPU run lists (research/runlists/study51-b-*.txt), made from what part A and part B's first
phase fix (docs/evidence/study51-real-model.md, "Part B").

    python research/study51/partb_lists.py grid --lr 5e-5 --sched cosine --reward-threshold 0.45
    python research/study51/partb_lists.py targets --lr 5e-5 --sched cosine --kl-target 0.0042

``grid`` writes phase 1's 20 lists: for each seed 0-4, the twelve arms that need nothing from part B's own data
(the fixed-β grid, ``dynamic`` twice, ``schedule`` four times, ``reward_conditioned``), three a list, in four lists
``study51-b-sS-{a,b,c,d}``. ``targets`` writes phase 2's 8 lists, after phase 1: ``target`` and ``ziegler`` from
β0 0.01 and 1 at the kl_target phase 1 fixed, each arm's seeds 0-2 in one list and 3-4 in another
(``study51-b-t-NAME-{s0,s3}``). Every list is one demo invocation with the part's settings; the learning rate and
its schedule are part A's choice, the same for every arm. ``--check`` prints the lists instead of writing them.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

STEPS, SEEDS, PER_LIST = 100, range(5), 3
RUNLISTS = os.path.join(ROOT, "research", "runlists")
COMMON = f"--model smollm2 --backend unsloth --loss-type dapo --steps {STEPS}"
HOW = ("# After smollm2-head and smollm2-join on the same machine: `verify.sh \"$OUT\" study51-pair:A,B` (2 GPUs) or "
       "`study51:NAME` (one).\n")


def grid_arms(reward_threshold: float) -> list[str]:
    """Phase 1's arms in ``--runs`` syntax (the harness's method_fields pass reward_window 5 and beta_schedule_steps
    10**6 to every run, so an arm "at its defaults" restates the package's reward_window 10; beta_schedule_steps's
    default, 1000, is past the run's 100 steps either way)."""
    schedule = "beta_min=0.02:beta_schedule={shape}:beta_schedule_steps=" + str(STEPS)
    return [  # not a registry list: the study's arms, each a method with its settings
        "none@0:monitor=on", "none@0.01", "none@0.04",
        "none@0.1", "none@0.3", "reward_conditioned@0.04",
        "dynamic@0.04:reward_window=10", f"dynamic@0.04:reward_threshold={reward_threshold:g}:reward_window=10",
        "schedule@1:" + schedule.format(shape="linear"),
        "schedule@1:" + schedule.format(shape="cosine"), "schedule@0.1:" + schedule.format(shape="linear"),
        "schedule@0.1:" + schedule.format(shape="cosine"),
    ]


def target_arms(kl_target: float) -> dict[str, str]:
    """Phase 2's arms, by the name their lists carry."""
    return {f"{method}{beta0:g}".replace(".", ""): f"{method}@{beta0:g}:kt={kl_target:g}"
            for method in ("target", "ziegler") for beta0 in (0.01, 1)}  # not a registry list: the study's arms


def _runs(arms: list[str], sched: str) -> str:
    """The ``--runs`` value: the learning rate is the invocation's (``--learning-rate``); its schedule is a run
    option (``:sched=``), given to every arm where it is not constant."""
    return ",".join(arm + (f":sched={sched}" if sched != "constant" else "") for arm in arms)


def grid_lists(lr: float, sched: str, reward_threshold: float) -> dict[str, str]:
    arms = grid_arms(reward_threshold)
    out = {}
    for seed in SEEDS:
        for i, part in enumerate("abcd"):
            runs = _runs(arms[i * PER_LIST:(i + 1) * PER_LIST], sched)
            out[f"study51-b-s{seed}-{part}"] = (
                f"# Issue 51, study 51 part B, phase 1 (docs/evidence/study51-real-model.md): SmolLM2-135M-Instruct, seed "
                f"{seed}, {STEPS} steps, learning rate {lr:g} ({sched}). Made by research/study51/partb_lists.py grid.\n"
                + HOW +
                f"{COMMON} --learning-rate {lr:g} --first-seed {seed} --seeds 1 --runs {runs}\n")
    return out


def target_lists(lr: float, sched: str, kl_target: float) -> dict[str, str]:
    out = {}
    for name, run in target_arms(kl_target).items():
        for first, count in ((0, 3), (3, 2)):
            out[f"study51-b-t-{name}-s{first}"] = (
                f"# Issue 51, study 51 part B, phase 2 (docs/evidence/study51-real-model.md): {run.split(':')[0]} at "
                f"kl_target {kl_target:g}, seeds {first}-{first + count - 1}, {STEPS} steps, learning rate {lr:g} "
                f"({sched}). Made by research/study51/partb_lists.py targets.\n"
                + HOW +
                f"{COMMON} --learning-rate {lr:g} --first-seed {first} --seeds {count} --runs {_runs([run], sched)}\n")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("phase", choices=("grid", "targets"))
    parser.add_argument("--lr", type=float, required=True, help="part A's chosen learning rate")
    parser.add_argument("--sched", choices=("constant", "linear", "cosine"), required=True, help="part A's schedule")
    parser.add_argument("--reward-threshold", type=float, help="grid: the acting dynamic arm's reward_threshold")
    parser.add_argument("--kl-target", type=float, help="targets: the kl_target phase 1 fixed")
    parser.add_argument("--check", action="store_true", help="print the lists instead of writing them")
    args = parser.parse_args(argv)
    if args.phase == "grid":
        if args.reward_threshold is None or not 0 < args.reward_threshold < 1:
            parser.error(f"--reward-threshold={args.reward_threshold}: allowed: a number in (0, 1) (the reward is an accuracy)")
        lists = grid_lists(args.lr, args.sched, args.reward_threshold)
    else:
        if args.kl_target is None or not args.kl_target > 0:
            parser.error(f"--kl-target={args.kl_target}: allowed: a number > 0")
        lists = target_lists(args.lr, args.sched, args.kl_target)
    for name, text in lists.items():
        if args.check:
            print(f"== {name}\n{text}", end="")
        else:
            with open(os.path.join(RUNLISTS, f"{name}.txt"), "w") as f:
                f.write(text)
            print(f"wrote research/runlists/{name}.txt")


if __name__ == "__main__":
    main()
