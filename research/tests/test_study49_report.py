"""Study 49's analysis (research/study49/report.py, docs/evidence/study49-target.md) on synthetic streams whose
answers are known by construction: the held counts, runaways, paired rewards and the unreachable cell's declaration
are set when the streams are written, and the report must print the verdicts those numbers give. The unreachable
cell's β series, declaration and warning come from the package's own `target` controller on a KL that does not
respond to β, so the report reads the message the controller really writes."""

import gzip
import io
import json
import logging
import math
import os
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "research", "study49"))
import report  # noqa: E402

from unsloth_adaptive_kl.controllers import ControllerConfig, make_controller  # noqa: E402
from unsloth_adaptive_kl.metrics import CURRENT_BETA, RAW_KL, TARGET_REACHABLE  # noqa: E402

STEPS, SEEDS = 200, range(5)
FAMILY = "long-dapo-b{b:g}-h768x6-L192-s200-wlr0.0003"


def rows(method, seed, beta0, kl_target, final_kl, final_reward, *, runaway=False, betas=None, reachable=None):
    """A run of 200 steps: KL and reward constant at their final values from step 100 (so the final window's means
    are exactly ``final_kl`` and ``final_reward``), lower before; a ``runaway`` has its KL at 10 x the study's
    threshold and its reward 0.3 below its peak from step 120."""
    tag = FAMILY.format(b=beta0) + (f"-kt{kl_target:g}" if kl_target != 0.1 else "")
    out = []
    for step in range(1, STEPS + 1):
        kl, reward = (final_kl, final_reward) if step >= 100 else (final_kl / 3, final_reward - 0.1)
        if runaway and step >= 120:
            kl, reward = final_kl, final_reward - 0.3
        row = {"tag": tag, "method": method, "seed": seed, "step": step, "copy": f"{method}{seed}{beta0}{kl_target}",
               "beta0": beta0, "planned_steps": STEPS, "kl_target": kl_target, "kl_placement": "loss", "kl_estimator": "k3",
               "reward": reward, "completions/mean_length": 120.0, CURRENT_BETA: betas[step - 1] if betas else beta0}
        if beta0 > 0:
            row[RAW_KL] = kl
        if reachable is not None:
            row[TARGET_REACHABLE] = reachable[step - 1]
        out.append(row)
    return out


def write(directory, name, all_rows, logs=None, archive="xz", specs=None):
    """A call's folder as research/data keeps it: the runs archive ``xz`` (recompressed when committed), or ``gz`` as a
    call's archive comes back; ``specs`` ({run: (method, seed, β0, kl_target)}) adds the harness's spec.json beside a
    run's log, with the fields the harness writes there."""
    os.makedirs(directory, exist_ok=True)
    with gzip.open(os.path.join(directory, f"{name}-stream.jsonl.gz"), "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in all_rows)
    if logs:
        with tarfile.open(os.path.join(directory, f"{name}-runs.tar.{archive}"), f"w:{archive}") as tar:
            for run, text in logs.items():
                files = {"log.txt": text}
                if specs and run in specs:
                    method, seed, beta0, kl_target = specs[run]
                    files["spec.json"] = json.dumps({"method": method, "seed": seed, "backend": "unsloth",
                                                     "settings": {"steps": STEPS, "beta": beta0, "kl_target": kl_target},
                                                     "run_dir": f"/tmp/x/1/runs/{run}"}, indent=1)
                for leaf, content in files.items():
                    data = content.encode()
                    info = tarfile.TarInfo(f"./1/runs/{run}/{leaf}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


# phase 1: fixed β's final KL and reward by seed; K_nat = β 0.1's seed-mean KL 0.02 (its reward is the best at β > 0),
# so the runaway threshold is 0.2; β 0.001 runs away in seeds 0 and 1 (KL 1.0)
PHASE1 = {0.001: ([1.0, 1.0, 0.05, 0.05, 0.05], [0.6] * 5), 0.01: ([0.04] * 5, [0.70, 0.71, 0.72, 0.73, 0.74]),
          0.1: ([0.02] * 5, [0.76] * 5), 0.3: ([0.05] * 5, [0.68] * 5)}


def unreachable_run():
    """The package's `target` from β0 0.1 at kl_target 0.0062 on a KL stuck at 0.03: its β series, reachable flags
    and warning (logged by the controller itself)."""
    controller = make_controller("target", ControllerConfig(0.1, kl_target=0.0062))
    betas, flags = [], []
    handler = logging.Handler()
    handler.records = []
    handler.emit = handler.records.append
    logger = logging.getLogger("unsloth_adaptive_kl")
    logger.addHandler(handler)
    try:
        for step in range(1, STEPS + 1):
            betas.append(controller.beta)
            controller.update(global_step=step, kl=0.03, num_completions=64)
            flags.append(controller.metrics()[TARGET_REACHABLE])
    finally:
        logger.removeHandler(handler)
    (warning,) = [r.getMessage() for r in handler.records if "not reachable" in r.getMessage()]
    return betas, flags, warning


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """Writes phase 1 and study 49's cells; target at 0.04 holds 5/5, 4/5 and 5/5 (β0 0.01, 0.1, 1: 14 of 15),
    ziegler 2/5 in each β0; target at 0.099 runs away in one seed from β0 0.01."""
    base = tmp_path_factory.mktemp("study49")
    phase1 = []
    for beta, (kls, rewards) in PHASE1.items():
        write(base / "p1", f"p1-b{beta:g}", [r for s in SEEDS for r in rows("none", s, beta, 0.1, kls[s], rewards[s],
                                                                           runaway=kls[s] == 1.0)])
    phase1 = sorted(str(p) for p in (base / "p1").glob("*-stream.jsonl.gz"))
    inside, outside = 0.04 * 1.2, 0.04 * 1.3  # within ±25 % (ln 1.2 < ln 1.25) and not (ln 1.3 > ln 1.25)
    held = {0.01: [inside] * 5, 0.1: [inside, inside, inside, inside, outside], 1: [0.04 / 1.2] * 5}
    betas, flags, warning = unreachable_run()
    directories = []
    for seed in SEEDS:
        d = base / f"study49-seed{seed}-a"
        a = [r for b0, kls in held.items() for r in rows("target", seed, b0, 0.04, kls[seed], 0.71 + 0.01 * seed)]
        a += rows("target", seed, 0.1, 0.0062, 0.03, 0.65, betas=betas, reachable=flags)
        write(d, d.name, a, {f"target-seed{seed}-b0.1-kt0.0062": "some output\n" + warning + "\nmore output\n"},
              archive="xz" if seed % 2 == 0 else "gz")
        d_b = base / f"study49-seed{seed}-b"
        write(d_b, d_b.name, [r for b0 in held for r in rows("ziegler", seed, b0, 0.04, inside if seed < 2 else outside, 0.7)])
        d_c = base / f"study49-seed{seed}-c"
        runaway = {b0: b0 == 0.01 and seed == 0 for b0 in held}
        write(d_c, d_c.name, [r for b0 in held for r in rows("target", seed, b0, 0.099, 1.0 if runaway[b0] else 0.1, 0.70,
                                                               runaway=runaway[b0])])
        directories += [str(d), str(d_b), str(d_c)]
    return report.report(directories, phase1), betas, flags, warning


def line(text, start):
    (found,) = [l for l in text.splitlines() if l.startswith(start)]
    return found


def test_the_cells_hold_counts_and_natural_kl_are_those_written(study):
    text = study[0]
    assert "K_nat (best fixed β > 0 of phase 1, 0.1): 0.02; runaway threshold 10 x = 0.2." in text
    assert "| 5/5 |" in line(text, "| `target` | 0.01 | 0.04 |") and "| 4/5 |" in line(text, "| `target` | 0.1 | 0.04 |")
    assert "| 2/5 |" in line(text, "| `ziegler` | 1 | 0.04 |")
    # the seed-mean ratio of β0 0.1: the geometric mean of four 1.2s and one 1.3, computed here
    assert f"| {math.exp((4 * math.log(1.2) + math.log(1.3)) / 5):.2f} |" in line(text, "| `target` | 0.1 | 0.04 |")
    assert line(text, "| 0.001 | 5 |").endswith("| 2 |")  # the two runaways written into β 0.001


def test_h1_is_met_at_14_of_15_with_every_beta0_at_4_or_more_and_ziegler_below(study):
    h1 = line(study[0], "- **H1")
    assert "`target` 14 of 15 runs" in h1 and "0.01: 5/5, 0.1: 4/5, 1: 5/5" in h1 and "`ziegler` 6 of 15" in h1
    # TOST needs the 90 % interval of the log ratio inside ±ln 1.25: 5 equal values of 1.2 have no spread, so yes;
    # four 1.2s and one 1.3: mean ln 1.22, its interval's upper end above ln 1.25? computed here from the t table
    logs = [math.log(1.2)] * 4 + [math.log(1.3)]
    mean = sum(logs) / 5
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 4)
    equivalent = mean + 2.132 * sd / math.sqrt(5) < math.log(1.25)
    assert ("TOST equivalent in every β0: yes" in h1) == equivalent
    assert h1.endswith("**met**.") == equivalent and ("**not met**" in h1) == (not equivalent)


def test_h2_counts_target_runaways_against_the_comparators(study):
    text = study[0]
    assert "`target` per β0 0.01: 0, 0.1: 0, 1: 0; comparator β 0.01: 0. **met**" in line(text, "- **H2, runaways at 0.04")
    assert "`target` per β0 0.01: 1, 0.1: 0, 1: 0; comparator β 0.001: 2. **met**" in line(text, "- **H2, runaways at 0.099")


def test_h3_pairs_rewards_by_seed_against_the_fixed_comparator(study):
    text = study[0]
    # target at 0.04 ends at 0.71 + 0.01 s, β 0.01 at 0.70 + 0.01 s: every paired difference 0.01, inside ±0.05
    assert "| `target` β0 0.01 vs fixed β 0.01 | 0.010 |" in text
    assert "equivalent in every β0: **met**" in line(text, "- **H3, reward at 0.04")
    # at 0.099 against β 0.1 (0.76): 0.70 - 0.76 = -0.06 from β0 0.1, outside the margin
    assert "| `target` β0 0.1 vs fixed β 0.1 | -0.060 |" in text and "**not met**" in line(text, "- **H3, reward at 0.099")


def test_the_unreachable_cell_reads_the_controllers_own_declaration_and_warning(study):
    text, betas, flags, warning = study
    declared = flags.index(0.0) + 1
    cap = float(warning.split("Beta is capped at ")[1].split(" ")[0])
    for seed in SEEDS:  # the even seeds' logs in .tar.xz, the odd seeds' in .tar.gz
        assert f"seed {seed}: declared at {declared}, warning caps β at {cap:.4g}" in text
    u1 = line(text, "- **U1")
    assert u1.endswith("**met**.") == (declared <= 60), (declared, u1)
    in_range = 0.02 <= min(betas) and max(betas) <= 0.5 and max(betas[declared:]) <= cap
    assert line(text, "- **U2").endswith("**met**.") == in_range


def test_a_beta0_below_four_of_five_fails_h1_and_an_incomplete_study_says_so(tmp_path):
    phase1 = []
    for beta, (kls, rewards) in PHASE1.items():
        write(tmp_path / "p1", f"p1-b{beta:g}", [r for s in SEEDS for r in rows("none", s, beta, 0.1, kls[s], rewards[s])])
    phase1 = sorted(str(p) for p in (tmp_path / "p1").glob("*-stream.jsonl.gz"))
    d = tmp_path / "study49-seed0-a"
    write(d, d.name, [r for s in SEEDS for b0, kl in ((0.01, 0.04), (0.1, 0.04), (1, 0.06 if s < 2 else 0.04))
                      for r in rows("target", s, b0, 0.04, kl, 0.7)])
    h1 = line(report.report([str(d)], phase1), "- **H1")
    assert "`target` 13 of 15 runs" in h1 and "1: 3/5" in h1 and "(≥ 4 each: no)" in h1
    assert "**not met** (incomplete: not all 15 + 15 runs yet)." in h1  # no ziegler runs were given


def controlled_rows(cls, seed, beta0, kl_target, kl_of, reward=0.7, copy="design1"):
    """A run whose β is the controller ``cls``'s own on the KL ``kl_of(step, β)`` (so research/study49/replay.py can
    replay it), with the fields the report and the replay read; returns the rows and the controller."""
    controller, out = cls(ControllerConfig(beta0, kl_target=kl_target)), []
    for step, row in enumerate(rows("target", seed, beta0, kl_target, 0.0, reward), start=1):  # the KL set below
        kl = kl_of(step, controller.beta)
        row.update({RAW_KL: kl, CURRENT_BETA: controller.beta, "completions_per_step": 64, "copy": f"{copy}-{seed}-{kl_target}"})
        controller.update(global_step=step, kl=kl, num_completions=64)
        row[TARGET_REACHABLE] = controller.metrics()[TARGET_REACHABLE]
        out.append(row)
    return out, controller


def test_design_two_keeps_the_runs_it_trains_identically_and_takes_the_reruns_of_the_others(tmp_path, caplog):
    """Amendment 1's report: seed 0's 0.0062 run (the KL answers β until β reaches its top, then grows to 3 × the
    target: design 2 declares and cuts β, so its replay diverges) is replaced by its rerun; seed 1's (the KL stays at
    1.3 × the target with β at its top: design 2 declares with the cap at that same β, so its β series is design 1's)
    is kept with design 2's declaration from the replay; the 0.04 runs (the KL held) are kept unchanged."""
    from research.controller_sim.compare import DesignOne
    from unsloth_adaptive_kl.target_controller import HeldTargetKL

    phase1 = []
    for beta, (kls, rewards) in PHASE1.items():
        write(tmp_path / "p1", f"p1-b{beta:g}", [r for s in SEEDS for r in rows("none", s, beta, 0.1, kls[s], rewards[s])])
    phase1 = sorted(str(p) for p in (tmp_path / "p1").glob("*-stream.jsonl.gz"))
    grows = lambda step, beta: 0.05 * (0.1 / beta) * (0.0062 / 0.01) if step <= 100 else 0.0186  # noqa: E731
    stays = lambda step, beta: 0.05 * (0.1 / beta) * (0.0062 / 0.01) if step <= 40 else 0.0062 * 1.3  # noqa: E731
    held = lambda step, beta: 0.04  # noqa: E731
    d1, d2 = tmp_path / "study49-seed0-a", tmp_path / "study49d2-seed0"
    design1 = {0: controlled_rows(DesignOne, 0, 0.1, 0.0062, grows)[0], 1: controlled_rows(DesignOne, 1, 0.1, 0.0062, stays)[0]}
    write(d1, d1.name, design1[0] + design1[1] + [r for s in (0, 1) for r in controlled_rows(DesignOne, s, 0.1, 0.04, held)[0]])
    with caplog.at_level(logging.WARNING, logger="unsloth_adaptive_kl"):
        rerun, controller = controlled_rows(HeldTargetKL, 0, 0.1, 0.0062, grows, reward=0.6, copy="rerun")
    (warning,) = [r.getMessage() for r in caplog.records if "not reachable" in r.getMessage()]
    # a list of one run: the harness names its directory "target-seed0" (no β0), its spec.json says what it trained
    write(d2, d2.name, rerun, {"target-seed0": warning + "\n"}, specs={"target-seed0": ("target", 0, 0.1, 0.0062)})
    kept = controlled_rows(HeldTargetKL, 1, 0.1, 0.0062, stays)[0]  # seed 1 under design 2: the same β as design 1's
    kept_step = next(r["step"] for r in kept if r[TARGET_REACHABLE] == 0)
    rerun_step = next(r["step"] for r in rerun if r[TARGET_REACHABLE] == 0)
    assert [r[CURRENT_BETA] for r in kept] == [r[CURRENT_BETA] for r in design1[1]]

    text = report.report([str(d1)], phase1, design2=[str(d2)])
    assert text.startswith("# Study 49, design 2 (Amendment 1)")
    assert f"seed 0: declared at {rerun_step}, warning caps β at {controller.ceiling:.4g}" in text  # the rerun's
    assert f"seed 1: declared at {kept_step}, warning caps β at 0.5" in text  # design 1's run, declared by the replay
    assert "target β0 0.1 kl_target 0.0062 seed 0: design 2's rerun" in text
    assert f"target β0 0.1 kl_target 0.0062 seed 1: design 1's run (identical β under design 2), declared by design 2 at step {kept_step}" in text
    assert "| 2/2 |" in line(text, "| `target` | 0.1 | 0.04 |")
    assert "| 2 (2) |" in line(text, "| `target` | 0.1 | 0.0062 |")  # two copies: the rerun replaced seed 0's run
    assert "| 0.650 ± " in line(text, "| `target` | 0.1 | 0.0062 |")  # its final reward 0.6, seed 1's kept 0.7
    # design 1's report of the same runs: seed 1 never declared, seed 0 its own run
    assert "seed 1: declared at never" in report.report([str(d1)], phase1)
    with pytest.raises(ValueError, match=r"no rerun in .*\(0.1, 0.0062, 0\)"):
        report.report([str(d1)], phase1, design2=[str(tmp_path / "empty")])


def test_u2_reads_the_cap_at_the_precision_the_warning_prints_it():
    """The rerun of seed 0 (study49d2-seed0) held β at 0.19111102467695817 after a warning that printed its cap as
    0.1911 (``%.4g``): within the cap as stated; a β that prints above it is not."""
    warning_cap = float("%.4g" % 0.19111102467695817)
    assert warning_cap == 0.1911
    assert report.within_cap(0.19111102467695817, warning_cap)
    assert report.within_cap(0.1911, warning_cap) and report.within_cap(0.1, warning_cap)
    assert not report.within_cap(0.19116, warning_cap)  # prints 0.1912
    assert not report.within_cap(0.5, warning_cap)


def test_the_study_page_holds_the_reports_of_research_data_as_they_print_now(capsys):
    """docs/evidence/study49-target.md's raw output is what report.py prints on the committed data, both designs
    (the page's tables and criteria were written from it)."""
    import glob as _glob
    from pathlib import Path

    root = Path(report.ROOT)
    page = (root / "docs" / "evidence" / "study49-target.md").read_text()
    data = str(root / "research" / "data")
    design1 = sorted(d for d in _glob.glob(os.path.join(data, "study49-seed*-?")))
    assert len(design1) == 20  # seeds 0-4, lists a-d
    for name, extra in (("design 1", []), ("design 2", ["--design2", *sorted(_glob.glob(os.path.join(data, "study49d2-*")))])):
        report.main(design1 + extra)
        printed = capsys.readouterr().out
        _, block, _ = page.split(f"<!-- report: {name} -->")
        assert block.strip() == "```text\n" + printed.rstrip("\n") + "\n```", name
