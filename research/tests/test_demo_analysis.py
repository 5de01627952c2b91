"""The demo's research side (research/study_cli.py's --analyze, --betas and --grid, and the GPU run
lists): the drift analysis, the β grid and its smoke run, reading a run from several streams, and every list of
research/runlists/ parsed as the demo parses it. Moved out of tests/test_blackwell_demo.py (issue 54), whose user-facing
parts (GPU check, backend choice, summary, the --smoke run) stay in the product suite."""

import json
import math
import os

import pytest
from demo_script import ROOT, demo, run_smoke


# -- the drift analysis -----------------------------------------------------------------------------
# References computed by hand: xs 1..4, ys 2, 4, 5, 9: means 2.5 and 5, Sxy = 4.5 + 0.5 + 0 + 6 = 11,
# Sxx = 5, slope 2.2. Values 1, 2, 3: mean 2, sd 1, t(0.975, 2 df) = 4.303, half-width 4.303 / sqrt(3).
def test_ols_slope_matches_the_hand_computed_value():
    assert demo.ols_slope([1, 2, 3, 4], [2, 4, 5, 9]) == pytest.approx(2.2)


def test_the_length_slope_uses_only_the_second_half_of_the_run():
    rows = [{"step": s, "completions/mean_length": 50.0} for s in range(1, 5)]  # the first half: ignored
    rows += [{"step": s, "completions/mean_length": y} for s, y in zip(range(5, 9), [2, 4, 5, 9])]
    assert demo.second_half_slope(rows) == pytest.approx(220.0)  # 2.2 tokens a step, per 100 steps
    assert demo.second_half_slope(rows, per=1) == pytest.approx(2.2)


def test_t_interval_matches_the_hand_computed_value():
    mean, low, high = demo.t_interval([1.0, 2.0, 3.0])
    half = 4.303 / math.sqrt(3)
    assert (mean, low, high) == pytest.approx((2.0, 2.0 - half, 2.0 + half))
    mean, low, high = demo.t_interval([5.0])
    assert mean == 5.0 and math.isnan(low) and math.isnan(high)
    assert demo.T975[4] == 2.571  # 5 degrees of freedom (6 seeds)


def test_paired_differences_are_taken_by_seed_and_skip_seeds_without_a_baseline():
    values = {("none", 0): 1.0, ("none", 1): 2.0, ("none", 2): 4.0,
              ("clip", 0): 2.0, ("clip", 1): 4.0, ("clip", 2): 7.0, ("clip", 3): 100.0}
    assert demo.paired_differences(values, "clip") == [1.0, 2.0, 3.0]
    assert demo.fmt_interval([1.0, 2.0, 3.0]) == "2.00 [-0.48, 4.48]"
    assert demo.fmt_interval([2.0, 3.0, 4.0]) == "3.00 [0.52, 5.48] *"  # the interval excludes 0


def test_analyze_reports_the_baseline_slope_and_the_paired_comparison(tmp_path):
    lines = []
    for seed, (slope_none, slope_clip) in enumerate([(1.0, 0.0), (2.0, 0.5), (3.0, 1.0)]):
        for method, slope in [("none", slope_none), ("clip", slope_clip)]:
            for step in range(1, 11):
                lines.append({"tag": "t", "method": method, "seed": seed, "step": step, "step_time": 1.0,
                              "reward": 0.5, "completions/mean_length": 10 + slope * step,
                              "adaptive_kl/current_beta": 0.1, "adaptive_kl/raw_kl": 0.2, "adaptive_kl/adapted_kl": 0.1,
                              demo.CORRECT: 0.25})
    path = tmp_path / "stream.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines + lines[:5]))  # a repeated step counts once
    text = demo.analyze([str(path)])
    # baseline slopes 100, 200, 300 per 100 steps: mean 200, half-width 4.303 * 100 / sqrt(3) = 248.43
    assert "| t | 3 | 10 | 0.50 → 0.50 |" in text and "200.00 [-48.43, 448.43] | 100.00, 200.00, 300.00 |" in text
    # clip - none by seed: -100, -150, -200 per 100 steps: mean -150, sd 50, half-width 124.22
    assert "| `clip` | 3 |" in text and "-150.00 [-274.22, -25.78] *" in text



def test_a_setting_without_a_baseline_run_gets_a_row_per_method(tmp_path):
    """Study 51's lists of only dynamic or schedule arms gave a table with no row on the GPU (2026-11-30): a setting
    without a `none` run now lists each of its methods, labelled; a setting with one still lists only the baseline."""
    lines = []
    # not a registry list: two settings, one without a `none` run and one with it beside another method
    for tag, method, slope in [("a", "dynamic", 1.0), ("a", "schedule", -2.0), ("b", "none", 3.0), ("b", "clip", 0.0)]:
        for step in range(1, 11):
            lines.append({"tag": tag, "method": method, "seed": 0, "step": step, "step_time": 1.0, "reward": 0.5,
                          "completions/mean_length": 10 + slope * step, "adaptive_kl/current_beta": 0.1,
                          demo.CORRECT: 0.25})
    path = tmp_path / "stream.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    rows = demo.analyze([str(path)]).split("\n\n")[0].splitlines()[2:]
    # one seed: the slope is the run's own, 100 x its tokens a step
    assert rows == ["| a · `dynamic` | 1 | 10 | 0.50 → 0.50 | 11.0 → 20.0 | 100.00 | 100.00 |",
                    "| a · `schedule` | 1 | 10 | 0.50 → 0.50 | 8.0 → -10.0 | -200.00 | -200.00 |",
                    "| b | 1 | 10 | 0.50 → 0.50 | 13.0 → 40.0 | 300.00 | 300.00 |"]


def test_the_accuracy_column_reads_each_tasks_correctness_reward():
    """The drift table's accuracy is the fraction of right answers: 2 x the tiny tasks' 0.5-a-right-answer rewards,
    SmolLM2's 1.0-a-right-answer reward as it is (it read nan for SmolLM2 on the GPU, 2026-11-29), nan without one."""
    from harness.analysis import accuracy

    assert accuracy({demo.CORRECT: 0.2}) == pytest.approx(0.4)
    assert accuracy({"rewards/correctness_reward/mean": 0.25}) == pytest.approx(0.5)
    assert accuracy({"rewards/correct_answer_reward/mean": 0.3, "reward": 0.3}) == pytest.approx(0.3)
    assert accuracy({"reward": 0.3}) is None
    stream = os.path.join(ROOT, "research", "data", "study51-lr-a", "study51-lr-a-stream.jsonl.gz")
    rows = demo.read_rows([stream])["smollm2-explain1-9-dapo-b0.04-L256-s100-lr5e-05"][("none", 0)]
    from harness.analysis import run_numbers

    numbers = run_numbers(rows)
    # one reward function, so the step's reward is its correctness: the first and last 10 steps' mean reward
    assert numbers["accuracy_start"] == pytest.approx(sum(r["reward"] for r in rows[:10]) / 10)
    assert numbers["accuracy_end"] == pytest.approx(sum(r["reward"] for r in rows[-10:]) / 10)
    assert "nan" not in demo.analyze([stream]).splitlines()[2]



# -- the β grid (--betas, --kl-target, --analyze --grid) ----------------------------------------------
# A hand-made grid whose answers are known: 3 seeds x initial β 0.01, 0.1, 1 x none, target; 60 steps a
# run, the first 10 junk (outside the last-50 window), the last 50 alternating ±0.01 around the value.
GRID_KL = {"none": {0.01: 0.4, 0.1: 0.2, 1.0: 0.05}, "target": {0.01: 0.3, 0.1: 0.2, 1.0: 0.16}}
GRID_REWARD = {"none": {0.01: 0.7, 0.1: 0.8, 1.0: 0.6}, "target": {0.01: 0.75, 0.1: 0.75, 1.0: 0.75}}


def _grid_stream(path, kl_target=0.2):
    lines = []
    for method in GRID_KL:
        for beta in GRID_KL[method]:
            tag = f"medium-dapo-b{beta:g}-h128x4-L48-s60-kt{kl_target:g}"
            for seed in range(3):
                kl = GRID_KL[method][beta] * (1 + 0.1 * seed)  # the per-seed max/min ratio stays the same
                reward = GRID_REWARD[method][beta] + (0.01 if method == "none" else 0.02) * seed
                for step in range(1, 61):
                    wiggle = 0.01 * (-1) ** step if step > 10 else 0.0
                    lines.append({"tag": tag, "method": method, "seed": seed, "step": step, "step_time": 1.0,
                                  "beta0": beta, "kl_target": kl_target,
                                  "reward": 0.0 if step <= 10 else reward + wiggle,
                                  "completions/mean_length": 40.0 if step <= 10 else 5.0 + wiggle,
                                  "adaptive_kl/raw_kl": 99.0 if step <= 10 else kl + wiggle,
                                  "adaptive_kl/current_beta": 7.0 if step <= 10 else 2 * beta + wiggle * beta})
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return str(path)


def test_grid_final_values_are_the_means_of_the_last_50_steps(tmp_path):
    from harness import grid

    runs = grid.read_grid([_grid_stream(tmp_path / "g.jsonl")])
    (base, g), = runs.items()
    assert base == "medium-dapo-b*-h128x4-L48-s60-kt0.2" and g["kl_target"] == 0.2
    v = g["runs"][("none", 0.1, 2)]
    assert v["kl"] == pytest.approx(0.2 * 1.2) and v["reward"] == pytest.approx(0.82) and v["length"] == pytest.approx(5.0)
    assert v["beta"] == pytest.approx(0.2) and v["steps"] == 60


def test_grid_spread_target_tracking_and_best_fixed_beta(tmp_path):
    from harness import grid

    g = grid.read_grid([_grid_stream(tmp_path / "g.jsonl")])["medium-dapo-b*-h128x4-L48-s60-kt0.2"]
    none = grid.spread(grid._by(g["runs"], "none"))
    assert none["kl_ratio"] == pytest.approx(0.4 / 0.05) and (none["kl_max_at"], none["kl_min_at"]) == (0.01, 1.0)
    assert none["per_seed_kl_ratio"] == pytest.approx([8.0] * 3)
    # reward seed means: 0.71, 0.81, 0.61 -> range 0.2, the same in every seed
    assert none["reward_range"] == pytest.approx(0.2) and none["per_seed_reward_range"] == pytest.approx([0.2] * 3)
    target = grid.spread(grid._by(g["runs"], "target"))
    assert target["kl_ratio"] == pytest.approx(0.3 / 0.16) and target["reward_range"] == pytest.approx(0.0)
    assert grid.best_fixed_beta(g["runs"]) == 0.1
    text = grid.analyze_grid([str(tmp_path / "g.jsonl")])
    # target's KL / kl_target: seed KLs 0.3 x (1, 1.1, 1.2) / 0.2 = 1.5, 1.65, 1.8 at β 0.01 (none within ±25 %);
    # 0.16 x (1, 1.1, 1.2) / 0.2 = 0.8, 0.88, 0.96 at β 1 (all within)
    assert "| 0.01 | 3 | 1.65 [" in text and "| 1.50, 1.65, 1.80 | 0/3 |" in text
    assert "| 0.80, 0.88, 0.96 | 3/3 |" in text and "| 1.00, 1.10, 1.20 | 3/3 |" in text
    # Δ reward, target minus none at β 0.1 by seed: 0.75 + 0.02 s - (0.8 + 0.01 s) = -0.05, -0.04, -0.03:
    # mean -0.04, half-width 4.303 x 0.01 / sqrt(3) = 0.0248
    assert "| `target` | 1 | -0.040 [-0.065, -0.015] * |" in text
    assert "| `none` | 0.01, 0.1, 1 | 8.00 | 0.01 / 1 | 8.00 [8.00, 8.00] | 0.200 |" in text


def test_grid_names_a_run_cut_before_its_step_count_and_a_rerun_completes_it(tmp_path):
    from harness import grid

    path = tmp_path / "g.jsonl"
    _grid_stream(path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    cut = [r for r in rows if not (r["method"] == "target" and r["beta0"] == 1.0 and r["seed"] == 1 and r["step"] > 45)]
    path.write_text("".join(json.dumps(r) + "\n" for r in cut))
    g = grid.read_grid([str(path)])["medium-dapo-b*-h128x4-L48-s60-kt0.2"]
    assert len(g["runs"]) == 18 and g["runs"][("target", 1.0, 1)]["steps"] == 45
    assert g["incomplete"] == ["target/seed1/b1 (step 45 of 60)"]
    text = grid.analyze_grid([str(path)])
    assert "the 'last step' column is a row's shortest run): target/seed1/b1 (step 45 of 60)." in text
    assert "| `target` | 1 | 3 | 45 |" in text
    rerun = tmp_path / "rerun.jsonl"  # the same seed run again in a later call (deterministic: the same rows)
    rerun.write_text("".join(json.dumps(r) + "\n" for r in rows if r["method"] == "target" and r["beta0"] == 1.0 and r["seed"] == 1))
    g = grid.read_grid([str(path), str(rerun)])["medium-dapo-b*-h128x4-L48-s60-kt0.2"]
    assert g["incomplete"] == [] and g["runs"][("target", 1.0, 1)]["steps"] == 60
    custom = tmp_path / "custom.jsonl"  # a custom tag has no -sN: the rows' planned_steps tell
    custom.write_text("".join(json.dumps({**r, "tag": f"mine-b{r['beta0']:g}", "planned_steps": 60}) + "\n" for r in cut))
    assert grid.read_grid([str(custom)])["mine-b*"]["incomplete"] == ["target/seed1/b1 (step 45 of 60)"]


def test_grid_needs_the_initial_beta_in_the_tag():
    from harness import grid

    assert grid.split_tag("medium-dapo-b1e-05-h128x4-L48-s300") == ("medium-dapo-b*-h128x4-L48-s300", 1e-05)
    assert grid.split_tag("mine-b0.3") == ("mine-b*", 0.3)
    with pytest.raises(ValueError, match="no '-bBETA' part"):
        grid.split_tag("medium-dapo-h128x4")


def test_betas_replace_beta_and_must_be_positive():
    from harness import settings as demo_settings

    args = demo.parse_args(["--betas", "0.01,1", "--kl-target", "0.2", "--tag", "mine"])
    settings = demo_settings.settings_from(args)
    assert settings.kl_target == 0.2 and demo_settings.method_fields(settings, completions_per_step=64)["kl_target"] == 0.2
    assert [(s.beta, tag) for s, tag in demo_settings.beta_settings(args, settings)] == [(0.01, "mine-b0.01"), (1.0, "mine-b1")]
    plain = demo.parse_args(["--beta", "0.3"])
    (one, tag), = demo_settings.beta_settings(plain, demo_settings.settings_from(plain))
    assert one.beta == 0.3 and tag == demo_settings.default_tag(one) and "-kt" not in tag
    for bad in (["--betas", "0.1,0"], ["--betas", "0.1,0.1"], ["--betas", "x"], ["--betas", "0.1", "--beta", "0.2"]):
        with pytest.raises(SystemExit):
            demo.parse_args(bad)


@pytest.fixture(scope="module")
def smoke_betas(tmp_path_factory):
    return run_smoke(tmp_path_factory.mktemp("demo-betas"), "--betas", "0.05,0.2", "--methods", "none,ziegler",
                     "--kl-target", "0.3")


def test_smoke_betas_warm_start_once_and_tag_each_beta(smoke_betas):
    out, stdout = smoke_betas
    assert stdout.count("seed 0: tiny Llama") == 1 and "4 runs, " in stdout  # one warm start for both β
    rows = [json.loads(line) for line in (out / "stream.jsonl").read_text().splitlines()]
    steps = demo.SMOKE["steps"]
    for beta in (0.05, 0.2):
        mine = [r for r in rows if r["tag"] == f"easy-dapo-b{beta:g}-h32x2-L24-s{steps}-kt0.3"]
        assert {r["method"] for r in mine} == {"none", "ziegler"} and {r["beta0"] for r in mine} == {beta}
        assert sorted(r["step"] for r in mine if r["method"] == "none") == list(range(1, steps + 1))
        last = {r["method"]: r["adaptive_kl/current_beta"] for r in mine if r["step"] == steps}
        assert last["none"] == beta and last["ziegler"] != beta  # each run started from its own β
    assert '"kl_target": 0.3' in stdout and (out / "runs" / "ziegler-seed0-b0.2" / "log.txt").exists()
    summary = (out / "summary.md").read_text()
    assert "(initial β 0.05)" in summary and "(initial β 0.2)" in summary
    from harness import grid  # the grid analysis of the smoke stream separates the two β

    runs = grid.read_grid([str(out / "stream.jsonl")])[f"easy-dapo-b*-h32x2-L24-s{steps}-kt0.3"]["runs"]
    assert sorted(runs) == [(m, b, 0) for m in ("none", "ziegler") for b in (0.05, 0.2)]


def test_every_gpu_evidence_list_parses_and_names_known_methods():
    """research/runlists/*.txt feed `verify.sh evidence:NAME` on the GPU, one demo invocation a line: a typo
    there costs a GPU call, so each line must parse here, with methods the demo knows and a loss type given."""
    from harness.settings import ALL_METHODS

    folder = os.path.join(ROOT, "research", "runlists")
    names = sorted(n for n in os.listdir(folder) if n.endswith(".txt"))
    assert "betagrid14.txt" in names and "betagrid15.txt" in names
    for name in names:
        with open(os.path.join(folder, name)) as f:
            lines = [line.split() for line in f if line.strip() and not line.lstrip().startswith("#")]
        assert lines, name
        for argv in lines:
            args = demo.parse_args(argv)
            unknown = [m for m in args.methods if m not in ALL_METHODS]
            assert not unknown, f"{name}: {' '.join(argv)}: unknown methods {unknown}"
            assert "--loss-type" in argv, f"{name}: {' '.join(argv)}: the loss type must be explicit"


def test_a_run_in_several_files_counts_whole_from_its_longest_copy(tmp_path):
    """A cut run and its rerun: the copy that went furthest counts, whole; a rerun that diverged is never
    spliced into the cut run step by step, whichever file comes first."""
    from harness import grid

    def stream(path, steps, kl):
        path.write_text("".join(json.dumps({"tag": "medium-dapo-b0.1-h128x4-L48-s60-kt0.2", "method": "none", "seed": 0,
                                            "step": s, "beta0": 0.1, "reward": 0.5, "completions/mean_length": 4.0,
                                            "adaptive_kl/raw_kl": kl, "adaptive_kl/current_beta": 0.1}) + "\n"
                                for s in range(1, steps + 1)))
        return str(path)

    cut, rerun, shorter = stream(tmp_path / "a.jsonl", 45, 1.0), stream(tmp_path / "b.jsonl", 60, 2.0), stream(tmp_path / "c.jsonl", 30, 3.0)
    for order in ([cut, rerun], [rerun, cut], [cut, rerun, shorter], [shorter, rerun, cut]):
        rows = demo.read_rows(order)["medium-dapo-b0.1-h128x4-L48-s60-kt0.2"][("none", 0)]
        assert [r["step"] for r in rows] == list(range(1, 61)), order
        assert {r["adaptive_kl/raw_kl"] for r in rows} == {2.0}, order  # all from the rerun, none from the others
    rows = demo.read_rows([shorter, cut])["medium-dapo-b0.1-h128x4-L48-s60-kt0.2"][("none", 0)]
    assert len(rows) == 45 and {r["adaptive_kl/raw_kl"] for r in rows} == {1.0}  # the 45-step copy, not steps 31-45 spliced on
    g = grid.read_grid([shorter, cut])["medium-dapo-b*-h128x4-L48-s60-kt0.2"]
    assert g["incomplete"] == ["none/seed0/b0.1 (step 45 of 60)"] and g["runs"][("none", 0.1, 0)]["kl"] == 1.0
