"""``doctor`` dry-runs the reward placement's anchors, and the command line says what it does not know (issue 52,
findings 8 and 10): on a library the reward placement does not cover, doctor used to say every backend could work
and a trainer with kl_placement="reward" was then refused; ``unsloth-adaptive-kl doctr`` printed no "unknown
command", and there was no ``--version``."""

import dataclasses
import io

from unsloth_adaptive_kl import __version__, doctor
from unsloth_adaptive_kl.__main__ import main as cli_main
from unsloth_adaptive_kl._source_patch import Rewrite
from unsloth_adaptive_kl.backends import reward_placement
from unsloth_adaptive_kl.backends import trl as trl_backend


def report(*backends):
    out = io.StringIO()
    status = doctor.run(list(backends), out=out)
    return status, out.getvalue()


def test_doctor_finds_the_reward_placements_anchors_on_the_installed_trl():
    status, text = report("trl")
    assert status == 0, text
    family = reward_placement.TRL_PLAN.select(trl_backend.owners()).family
    assert f"[  ok] trl GRPOTrainer._generate_and_score_completions: kl_placement='reward': 4 anchor(s) found (anchor set {family!r})" in text


def test_a_trl_the_reward_placement_does_not_cover_is_a_warning_naming_the_placement(monkeypatch):
    """As on TRL 1.8: no anchor set of the reward placement covers the installed TRL. The loss placement works, so
    the backend is not failed, but doctor says that kl_placement='reward' will be refused."""
    (anchor_set,) = reward_placement.TRL_PLAN.anchor_sets
    uncovered = dataclasses.replace(anchor_set, versions={"trl": ">=0.1,<0.2"})
    monkeypatch.setattr(reward_placement, "TRL_PLAN", dataclasses.replace(reward_placement.TRL_PLAN, anchor_sets=(uncovered,)))
    status, text = report("trl")
    assert status == 0, text
    (line,) = [line for line in text.splitlines() if "[warn]" in line and "kl_placement='reward'" in line]
    assert "cannot work here: a trainer asking for it is refused" in line and "no anchor set" in line
    assert "kl_placement='loss' is unaffected" in line


def test_a_missing_reward_placement_anchor_is_a_warning_naming_the_anchor(monkeypatch):
    (anchor_set,) = reward_placement.TRL_PLAN.anchor_sets
    broken = Rewrite(anchor_set.rewrites[-1].target, "trl", "            a_line_no_trl_has()\n", "", "test")
    replaced = dataclasses.replace(anchor_set, rewrites=(*anchor_set.rewrites[:-1], broken))
    monkeypatch.setattr(reward_placement, "TRL_PLAN", dataclasses.replace(reward_placement.TRL_PLAN, anchor_sets=(replaced,)))
    status, text = report("trl")
    assert status == 0, text
    (line,) = [line for line in text.splitlines() if "[warn]" in line and "kl_placement='reward'" in line]
    assert "a_line_no_trl_has()" in line


def test_an_unknown_command_is_named_with_the_closest_one(capsys):
    assert cli_main(["doctr"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'doctr' (did you mean 'doctor'?)" in err and "allowed: doctor, grpo" in err


def test_version_prints_the_packages_version(capsys):
    assert cli_main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"unsloth-adaptive-kl {__version__}"


def test_doctor_dry_runs_kl_monitor_with_the_reward_placement_and_warns_where_they_cannot_compose(monkeypatch):
    """Issue 53: a trainer with kl_monitor and kl_placement='reward' gets both features' edits on one copy of TRL's
    generation; doctor dry-runs that copy. Two edits of one anchor cannot compose: a warning naming both features (each
    alone still works, so the backend is not failed)."""
    status, text = report("trl")
    assert status == 0 and "[  ok] GRPOTrainer._generate_and_score_completions (kl_monitor with kl_placement='reward'): the edits" in text
    (anchor_set,) = reward_placement.TRL_PLAN.anchor_sets
    monitor_anchor = next(r for r in trl_backend.PLAN.select(trl_backend.owners()).rewrites if "runs_reference" in r.replacement).anchor
    clash = Rewrite(anchor_set.rewrites[-1].target, "trl", monitor_anchor, monitor_anchor.replace(":\n", " and True:\n"), "test")
    replaced = dataclasses.replace(anchor_set, rewrites=(*anchor_set.rewrites, clash))
    monkeypatch.setattr(reward_placement, "TRL_PLAN", dataclasses.replace(reward_placement.TRL_PLAN, anchor_sets=(replaced,)))
    status, text = report("trl")
    assert status == 0, text
    (line,) = [line for line in text.splitlines() if "[warn]" in line]
    assert "kl_monitor=True with kl_placement='reward' cannot work here" in line
    assert "kl_monitor and kl_placement='reward' rewrite the same anchor" in line
