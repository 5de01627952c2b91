"""Issue 33's phase 2 in the demo: per-run overrides in --runs (METHOD@BETA[:kt=][:placement=][:estimator=]), each
its own setting, tag and run directory; the rows record the trainer's kl_placement and kl_estimator; phase 1's tags
unchanged (against the tags its streams recorded); and the study's (d) table (a KL placement or estimator against
the loss and k3, paired by seed) against values computed by hand (t(0.95; 2) = 2.920, t(0.975; 2) = 4.303)."""

import glob
import gzip
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "research"))

from harness import analysis, scheduler, settings  # noqa: E402
from harness.cli import parse_args  # noqa: E402

from unsloth_adaptive_kl.estimators import estimator_names  # noqa: E402

RunSpec = settings.RunSpec
PHASE2 = "target@0.01:kt=0.0066,target@0.1:kt=0.0066,target@1:kt=0.0066,none@0.04:placement=reward:estimator=k1"


# -- the option ------------------------------------------------------------------------------------------
def test_runs_take_kt_placement_and_estimator_per_run():
    runs = settings.parse_runs(PHASE2)
    assert runs == [RunSpec("target", 0.01, 0.0066), RunSpec("target", 0.1, 0.0066), RunSpec("target", 1.0, 0.0066),
                    RunSpec("none", 0.04, None, "reward", "k1")]
    assert [run.text() for run in runs] == PHASE2.split(",")
    # an alias is its estimator (low_var_kl is k3's other name), and a default spelled out is the default
    assert settings.parse_runs("none@0.04:estimator=low_var_kl:placement=loss") == [RunSpec("none", 0.04)]
    assert settings.parse_runs(" clip@0.04 : kt = 0.5 ") == [RunSpec("clip", 0.04, 0.5)]


@pytest.mark.parametrize("text, message", [
    ("none@0.04:depth=3", "'none@0.04:depth=3': unknown key 'depth'; allowed: kt, placement, estimator"),
    ("target@0.1:kt=0", "'target@0.1:kt=0': kt='0'; allowed: a finite number > 0"),
    ("target@0.1:kt=-0.5", "kt='-0.5'; allowed: a finite number > 0"),
    ("target@0.1:kt=inf", "kt='inf'; allowed: a finite number > 0"),
    ("target@0.1:kt=nan", "kt='nan'; allowed: a finite number > 0"),
    ("target@0.1:kt=x", "kt='x'; allowed: a finite number > 0"),
    ("none@0.04:placement=middle", "'none@0.04:placement=middle': placement='middle'; allowed: one of ['loss', 'reward']"),
    ("none@0.04:estimator=k9", f"'none@0.04:estimator=k9': estimator='k9': kl_estimator='k9' is not a registered KL "
                               f"estimator; allowed: {estimator_names()}"),
    ("none@0.04:kt=0.1:kt=0.2", "key 'kt' is given twice; allowed: each key once per run"),
    ("none@0.04:placement", "'placement' is not KEY=VALUE; allowed: comma-separated METHOD@BETA[:kt=FLOAT]"),
    ("none@0.04:kt=", "'kt=' is not KEY=VALUE"),
    # what the package refuses at the trainer's start, refused here with its own message
    ("none@0:placement=reward", "'none@0:placement=reward': kl_placement='reward' is not valid with beta=0.0"),
    ("none@0:estimator=k1", "'none@0:estimator=k1': kl_estimator='k1' is not valid with beta=0.0"),
    ("none@0.04,none@0.04:estimator=low_var_kl", "'none@0.04:estimator=low_var_kl' is given twice; allowed: each run once"),
])
def test_a_bad_override_names_the_run_the_key_the_value_and_what_is_allowed(text, message):
    with pytest.raises(ValueError) as e:
        settings.parse_runs(text)
    assert f"--runs={text!r}" in str(e.value) and message in str(e.value)


def test_a_bad_override_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--runs", "none@0.04:placement=middle"])
    assert "placement='middle'; allowed: one of ['loss', 'reward']" in capsys.readouterr().err


def _phase2_args(*extra):
    return parse_args(["--task", "long", "--warm-start-lr", "3e-4", "--kl-target", "0.05", *extra, "--runs",
                       "target@0.1:kt=0.0066,target@0.1,none@0.04,none@0.04:placement=reward:estimator=k1,target@1:kt=0.0066"])


def test_each_override_is_its_own_setting_and_tag():
    args = _phase2_args()
    base = settings.settings_from(args)
    per_setting = settings.beta_settings(args, base)
    got = [(s.beta, s.kl_target, s.kl_placement, s.kl_estimator, tag) for s, tag in per_setting]
    stem = "long-dapo-b{}-h768x6-L192-s200-wlr0.0003"
    assert got == [(0.1, 0.0066, "loss", "k3", stem.format(0.1) + "-kt0.0066"),
                   (0.1, 0.05, "loss", "k3", stem.format(0.1) + "-kt0.05"),  # no :kt=: the invocation's --kl-target
                   (0.04, 0.05, "loss", "k3", stem.format(0.04) + "-kt0.05"),
                   (0.04, 0.05, "reward", "k1", stem.format(0.04) + "-kt0.05-plreward-estk1"),
                   (1.0, 0.0066, "loss", "k3", stem.format(1) + "-kt0.0066")]
    for s, _ in per_setting:  # everything else is the invocation's
        assert s == settings.Settings(**{**base.__dict__, "beta": s.beta, "kl_target": s.kl_target,
                                         "kl_placement": s.kl_placement, "kl_estimator": s.kl_estimator})
    # one family for the study's analysis, the same as phase 1's (the tags differ only in β, kt, placement, estimator)
    assert {analysis._family(tag) for _, tag in per_setting} == {"long-dapo-b*-h768x6-L192-s200-wlr0.0003"}
    pairs = settings.run_pairs(args, per_setting)
    assert [(m, tag) for _, tag, m in pairs] == [("target", got[0][4]), ("target", got[1][4]), ("none", got[2][4]),
                                                 ("none", got[3][4]), ("target", got[4][4])]
    fields = settings.method_fields(per_setting[3][0], completions_per_step=64)  # what the trainer's config gets
    assert (fields["kl_placement"], fields["kl_estimator"], fields["kl_target"]) == ("reward", "k1", 0.05)
    assert (settings.method_fields(per_setting[2][0], completions_per_step=64)["kl_placement"],) == ("loss",)
    tagged = settings.beta_settings(_phase2_args("--tag", "mine"), base)
    assert [tag for _, tag in tagged] == ["mine-b0.1-kt0.0066", "mine-b0.1", "mine-b0.04", "mine-b0.04-plreward-estk1",
                                          "mine-b1-kt0.0066"]


def test_a_kt_equal_to_the_invocations_is_the_same_setting_and_refused():
    args = parse_args(["--kl-target", "0.2", "--runs", "none@0.1,target@0.1:kt=0.2"])
    with pytest.raises(ValueError, match=r"target@0.1:kt=0.2 and none@0.1 are the same setting \(kl_target 0.2 is the "
                                         r"invocation's\); allowed: give :kt= only where it differs"):
        settings.beta_settings(args, settings.settings_from(args))


def test_runs_of_one_beta_get_their_own_directories_and_specs(tmp_path):
    args = parse_args(["--runs", "none@0.04,none@0.04:placement=reward:estimator=k1,target@0.04:kt=0.3",
                       "--output-dir", str(tmp_path)])
    per_setting = settings.beta_settings(args, settings.settings_from(args))
    runs = scheduler.make_runs(args, per_setting, "trl", {0: "ckpt0"})
    # the invocation's runs differ in kl_target: every name carries it (with one kl_target, none does: see the smoke)
    assert [r.name for r in runs] == ["none/seed0/b0.04-kt0.1", "none/seed0/b0.04-kt0.1-plreward-estk1",
                                      "target/seed0/b0.04-kt0.3"]
    specs = [json.loads(open(r.spec_path).read()) for r in runs]
    assert [(s["settings"]["kl_placement"], s["settings"]["kl_estimator"], s["settings"]["kl_target"]) for s in specs] \
        == [("loss", "k3", 0.1), ("reward", "k1", 0.1), ("loss", "k3", 0.3)]
    assert len({os.path.dirname(r.spec_path) for r in runs}) == 3


# -- phase 1's tags are what its streams recorded -----------------------------------------------------------
def test_phase1_lists_still_make_the_tags_their_streams_recorded():
    streams = sorted(glob.glob(os.path.join(ROOT, "research", "data", "study33-p1-*", "*-stream.jsonl.gz")))
    assert len(streams) >= 6
    for path in streams:
        name = os.path.basename(os.path.dirname(path))
        with gzip.open(path, "rt") as f:
            recorded = {(row["method"], row["beta0"]): row["tag"] for row in map(json.loads, f)}
        list_path = os.path.join(ROOT, "research", "runlists", f"{name}.txt")
        with open(list_path) as f:
            line, = [line.split() for line in f if line.strip() and not line.lstrip().startswith("#")]
        args = parse_args(line)
        pairs = settings.run_pairs(args, settings.beta_settings(args, settings.settings_from(args)))
        assert {(m, s.beta): tag for s, tag, m in pairs} == recorded, name


# -- a reward-placement run beside a loss-placement run at the same β (CPU smoke, TRL backend) -----------------
@pytest.fixture(scope="module")
def smoke_placement(tmp_path_factory):
    from demo_script import run_smoke

    return run_smoke(tmp_path_factory.mktemp("demo-placement"), "--backend", "trl", "--runs",
                     "none@0.04,none@0.04:placement=reward:estimator=k1")


def test_smoke_trains_both_placements_and_records_them(smoke_placement):
    out, stdout = smoke_placement
    steps = settings.SMOKE["steps"]
    assert stdout.count("seed 0: tiny Llama") == 1 and "2 runs, " in stdout  # one warm start for both runs
    assert ("runs (--runs, method@initial β[:overrides], each β and override its own setting; 'beta' above is the "
            "first's): none@0.04, none@0.04:placement=reward:estimator=k1") in stdout
    rows = [json.loads(line) for line in (out / "stream.jsonl").read_text().splitlines()]
    tag = f"easy-dapo-b0.04-h32x2-L24-s{steps}"
    loss = [r for r in rows if r["tag"] == tag]
    reward = [r for r in rows if r["tag"] == tag + "-plreward-estk1"]
    assert len(loss) + len(reward) == len(rows)
    for mine, placement, estimator in ((loss, "loss", "k3"), (reward, "reward", "k1")):
        assert sorted(r["step"] for r in mine) == list(range(1, steps + 1))
        assert {(r["method"], r["beta0"], r["kl_placement"], r["kl_estimator"]) for r in mine} == {("none", 0.04, placement, estimator)}
        assert all(r["adaptive_kl/current_beta"] == 0.04 and r["adaptive_kl/raw_kl"] is not None for r in mine)
    # the penalty subtracted from the rewards is logged only where the KL is in the reward
    assert all("adaptive_kl/kl_penalty" not in r for r in loss)
    assert all(isinstance(r.get("adaptive_kl/kl_penalty"), float) for r in reward)
    trained = json.loads((out / "runs" / "none-seed0-b0.04-plreward-estk1" / "trained.json").read_text())
    assert (trained["kl_placement"], trained["kl_estimator"]) == ("reward", "k1")
    # both settings in the run's own outputs (not one overwriting the other at the same β)
    written = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sorted((r["tag"], r["step"]) for r in written) == sorted((r["tag"], r["step"]) for r in rows)
    assert (out / "curves-b0.04.png").exists() and (out / "curves-b0.04-plreward-estk1.png").exists()
    report = analysis.study_report([str(out / "stream.jsonl")])  # one family; (d) compares the two runs
    assert f"## easy-dapo-b*-h32x2-L24-s{steps} " in report and "**(d) KL placement and estimator**" in report
    assert "| `none` (KL in the reward, k1) | 0.04 | reward |" in report
    # the runs log the KL's token tail, and (d) still reports none of it (Amendment 14: k1's tail is not k3's)
    assert all(r.get("adaptive_kl/token_kl_p99") is not None for r in rows)
    assert "| token KL" not in report.split("**(d)")[1]


# -- the study's (d) table ---------------------------------------------------------------------------------
def _stream(path):
    """3 seeds x 100 planned steps at β 0.1: `none` with the KL in the loss (rows without kl_placement and
    kl_estimator, as phase 1's streams); `none` with the KL in the reward and k1 (reward, length and KL per seed
    below; the highest reward of all, so a K_nat that took it would be its 0.15); `clip` equal to `none`, its rows
    saying loss and k3 outright."""
    lines = []

    def run(method, seed, reward, length, kl, tag_suffix="", fields=None):
        for s in range(1, 101):
            lines.append({"tag": "long-dapo-b0.1-h768x6-L192-s100" + tag_suffix, "method": method, "seed": seed,
                          "step": s, "beta0": 0.1, "planned_steps": 100, "kl_target": 0.1, "copy": f"{method}{tag_suffix}{seed}",
                          "reward": reward, analysis.LENGTH: length, "adaptive_kl/raw_kl": kl, **(fields or {})})

    for seed in range(3):
        run("none", seed, 0.80 + 0.01 * seed, 100.0, 0.2)
        run("none", seed, [0.83, 0.86, 0.83][seed], 102.0 + seed, [0.1, 0.15, 0.2][seed], "-plreward-estk1",
            {"kl_placement": "reward", "kl_estimator": "k1"})
        run("clip", seed, 0.80 + 0.01 * seed, 100.0, 0.2, fields={"kl_placement": "loss", "kl_estimator": "k3"})
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return str(path)


def test_the_d_table_compares_the_placement_with_the_loss_by_seed(tmp_path):
    path = _stream(tmp_path / "s.jsonl")
    cells, _ = analysis.study_cells([path])
    assert set(cells) == {"long-dapo-b*-h768x6-L192-s100"}  # the suffix is stripped: one family
    keys = set(cells["long-dapo-b*-h768x6-L192-s100"])
    assert keys == {("none", 0.1, None, "loss", "k3"), ("none", 0.1, None, "reward", "k1"), ("clip", 0.1, None, "loss", "k3")}
    text = analysis.study_report([path])
    # K_nat and the best fixed β from `none` in the loss only (the (d) run has the higher reward, and KL 0.15)
    assert "Best fixed β (highest seed-mean final reward of `none`): 0.1" in text
    assert "Natural KL (best fixed β > 0, 0.1): 0.2; runaway threshold 10 x = 2" in text
    # runs table: rewards 0.83, 0.86, 0.83 (mean 0.84, sd 0.01732); lengths 102-104; KL 0.1, 0.15, 0.2 (sd 0.05)
    assert ("| `none` (KL in the reward, k1) | 0.1 | — | 3 | 3 (3) | 0.840 ± 0.017 | 103.0 ± 1.0 | 0.1500 ± 0.0500 | 0 |"
            in text)
    head, rest = text.split("**(a)", 1)
    a, rest = rest.split("**(c)", 1)
    c, d = rest.split("**(d)", 1)
    assert a.count("| 0.1 | 3 |") == 1  # (a): one fixed β 0.1, the loss placement's
    assert "`clip`" in c and "KL in the reward" not in c  # (c) against `none` in the loss; the (d) run not in it
    assert "| `clip` | 0.1 | reward | 0.000 | [0.000, 0.000] | [0.000, 0.000] | equivalent |" in c
    # Δ reward 0.03, 0.05, 0.01: mean 0.03, sd 0.02, se 0.011547: 90 % ± 0.033717 (past +0.05), 95 % ± 0.049687 (holds 0)
    assert "| `none` (KL in the reward, k1) | 0.1 | reward | 0.030 | [-0.004, 0.064] | [-0.020, 0.080] | inconclusive |" in d
    # Δ length 2, 3, 4: mean 3, se 0.57735: 90 % ± 1.685863 inside ±5, 95 % ± 2.484338 excludes 0
    assert ("| `none` (KL in the reward, k1) | 0.1 | length | 3.000 | [1.314, 4.686] | [0.516, 5.484] | "
            "equivalent, and different from 0 |") in d
    # Δ raw KL -0.1, -0.05, 0: mean -0.05, se 0.0288675: 95 % ± 0.124217
    assert "| `none` (KL in the reward, k1) | 0.1 | raw KL | -0.0500 | — | [-0.1742, 0.0742] | not different |" in d
    assert "Note on Δ raw KL of `none` (KL in the reward, k1): its `adaptive_kl/raw_kl` is the per-token KL in the loss " \
           "as k1 measures it, the baseline's as k3 measures it" in d


def test_without_a_loss_placement_baseline_there_is_no_d_row(tmp_path):
    lines = [json.loads(line) for line in open(_stream(tmp_path / "s.jsonl"))]
    only = tmp_path / "only.jsonl"
    only.write_text("".join(json.dumps(r) + "\n" for r in lines if r["method"] == "none" and "kl_placement" in r))
    text = analysis.study_report([str(only)])
    assert "**(d)" not in text and "No natural KL (no `none` run with β > 0)" in text  # the (d) run is not a fixed β
    assert "| `none` (KL in the reward, k1) | 0.1 | — | 3 | 3 (3) |" in text


def test_the_study_figure_draws_d_runs_only_in_the_d_panel_not_as_a_fixed_beta_or_c_method(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from harness import study_plot

    drawn = []
    line = study_plot._line

    def record(ax, cell, key, **style):
        drawn.append((style.get("label", ""), {r.get("kl_placement") for copies in cell.values() for rows in copies for r in rows}))
        return line(ax, cell, key, **style)

    monkeypatch.setattr(study_plot, "_line", record)
    assert study_plot.plot_study([_stream(tmp_path / "s.jsonl")], str(tmp_path / "f.png")) == f"plot: {tmp_path / 'f.png'}"
    moved = [label for label, placements in drawn if "reward" in placements]
    assert moved == ["none β=0.1, KL in the reward (k1) (3 seeds)"]  # once, in (d)'s panel, under its own label
    assert {label.split(" (")[0] for label, placements in drawn if "reward" not in placements} == {
        "none β=0.1", "clip β=0.1", "none β=0.1, KL in the loss"}
