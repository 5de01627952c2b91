"""Study 51 part B's run lists (research/study51/partb_lists.py): every arm of every seed exactly once, at most three
runs a list, every list parsed by the harness as a GPU call would run it, each run its own directory, and the arms
said to run "at their defaults" given the package's declared defaults."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "research"))

from harness import scheduler, settings  # noqa: E402
from harness.cli import parse_args  # noqa: E402
from research.study51 import partb_lists  # noqa: E402
from unsloth_adaptive_kl.controllers import CONTROLLERS  # noqa: E402


def parsed(text, tmp_path, name):
    (line,) = [ln.split() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    args = parse_args(line + ["--output-dir", str(tmp_path / name)])
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    runs = scheduler.make_runs(args, settings.beta_settings(args, settings.settings_from(args)), "trl",
                               {s: f"ckpt{s}" for s in seeds})
    return args, runs


@pytest.mark.parametrize("lr, sched", [(5e-5, "cosine"), (2e-5, "constant")])
def test_phase_one_runs_each_of_twelve_arms_once_a_seed(tmp_path, lr, sched):
    lists = partb_lists.grid_lists(lr, sched, reward_threshold=0.45)
    assert sorted(lists) == sorted(f"study51-b-s{s}-{p}" for s in range(5) for p in "abcd")
    seen = []
    for name, text in lists.items():
        args, runs = parsed(text, tmp_path, name)
        assert len(runs) <= 3 and len({r.spec_path for r in runs}) == len(runs)
        assert args.learning_rate == lr and args.steps == 100 and args.model == "smollm2"
        for one, _tag in settings.beta_settings(args, settings.settings_from(args)):
            assert (one.learning_rate, one.lr_schedule) == (lr, sched)
        seen += [(run.text().replace(f":sched={sched}", ""), args.first_seed + s) for run in args.runs for s in range(args.seeds)]
    arms = partb_lists.grid_arms(0.45)
    assert sorted(seen) == sorted((arm, s) for arm in arms for s in range(5))
    assert len(set(arms)) == 12
    # not a registry list: the methods issue 51 names for phase 1
    assert {arm.split("@")[0] for arm in arms} == {"none", "dynamic", "schedule", "reward_conditioned"}


def test_phase_two_runs_target_and_ziegler_from_two_starts_on_every_seed(tmp_path):
    lists = partb_lists.target_lists(5e-5, "cosine", kl_target=0.0042)
    assert len(lists) == 8
    seen = []
    for name, text in lists.items():
        args, runs = parsed(text, tmp_path, name)
        assert len(runs) <= 3
        (run,) = args.runs
        assert run.kl_target == 0.0042
        seen += [(run.method, run.beta, args.first_seed + s) for s in range(args.seeds)]
    # not a registry list: the two controllers issue 51 names for phase 2
    assert sorted(seen) == sorted((m, b, s) for m in ("target", "ziegler") for b in (0.01, 1.0) for s in range(5))


def test_the_arms_at_their_defaults_train_with_the_packages_declared_defaults(tmp_path):
    """`dynamic` "at its documented defaults" and `reward_conditioned` "at its defaults": the fields the harness
    gives their runs equal the registry's declared defaults (beta_schedule_steps: past the run's 100 steps either
    way); the acting `dynamic` differs in reward_threshold alone."""
    arms = partb_lists.grid_arms(0.45)
    by_text = {}
    for arm in arms:
        args = parse_args(["--model", "smollm2", "--steps", "100", "--runs", arm, "--output-dir", str(tmp_path)])
        ((one, _tag),) = settings.beta_settings(args, settings.settings_from(args))
        by_text[arm] = settings.method_fields(one, completions_per_step=64)
    # not a registry list: the two controllers this test reads the declared defaults of
    declared = {name: {p.name: p.default for p in CONTROLLERS[name].parameters} for name in ("dynamic", "reward_conditioned")}
    defaults = by_text["dynamic@0.04:reward_window=10"]
    for name, value in declared["dynamic"].items():
        if name == "beta_schedule_steps":
            assert defaults[name] >= value > 100
        else:
            assert defaults[name] == value, name
    acting = by_text["dynamic@0.04:reward_threshold=0.45:reward_window=10"]
    assert {k for k in declared["dynamic"] if acting[k] != defaults[k]} == {"reward_threshold"}
    conditioned = by_text["reward_conditioned@0.04"]
    assert all(conditioned.get(name, value) == value for name, value in declared["reward_conditioned"].items())


def test_the_command_refuses_what_the_phase_needs_and_writes_nothing(tmp_path, capsys):
    with pytest.raises(SystemExit):
        partb_lists.main(["grid", "--lr", "5e-5", "--sched", "cosine"])
    assert "--reward-threshold=None: allowed: a number in (0, 1)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        partb_lists.main(["targets", "--lr", "5e-5", "--sched", "cosine", "--kl-target", "0"])
    assert "--kl-target=0.0: allowed: a number > 0" in capsys.readouterr().err
