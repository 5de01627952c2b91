"""The evidence as pages (issue 51): docs/evidence.md is a short index with a one-screen answer, and each study is a
page of docs/evidence/. The moved text is the old single page's, verbatim (its links rewritten one folder down),
and the answer is the one research/evidence_answer.py makes from the studies' tables."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # research/ is not installed: it is study code beside the package

from research import evidence_answer  # noqa: E402

#: The last commit whose docs/evidence.md held every study on one page.
SINGLE_PAGE_COMMIT = "46cd9eb"
STUDY_PAGES = ("study11-drift.md", "study26-beta-grid.md", "study33-long-task.md")


def blocks(text: str) -> list[str]:
    """Paragraphs: text between blank lines, with each heading a block of its own (a heading may follow a
    paragraph's last line directly)."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        current: list[str] = []
        for line in block.split("\n"):
            if re.match(r"#{1,6} ", line):
                out += ["\n".join(current)] if current else []
                out.append(line)
                current = []
            else:
                current.append(line)
        out += ["\n".join(current)] if current else []
    return [b.strip("\n") for b in out if b.strip()]


def single_page() -> str:
    try:
        return subprocess.run(["git", "show", f"{SINGLE_PAGE_COMMIT}:docs/evidence.md"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"no git history with commit {SINGLE_PAGE_COMMIT} here (an sdist, a shallow clone)")


def test_blocks_split_headings_from_the_paragraph_they_follow():
    assert blocks("a\nb\n## 7. c\n\nd\n\n\ne") == ["a\nb", "## 7. c", "d", "e"]


#: Paths issue 54 moved (the research out of the product's tree): the single page's text is compared with them applied,
#: as on the study pages. Its links were relative to docs/; the raw data is now research/data, outside docs/.
MOVED = (("](evidence-data/", "](../research/data/"), ("docs/evidence-data", "research/data"),
         ("`evidence-data/", "`research/data/"), ("scripts/gpu/evidence/", "research/runlists/"),
         ("--write scripts/gpu/evidence`", "--write research/runlists`"),
         ("scripts/study33_phase2.py", "research/study33_phase2.py"), ("scripts/gpu/study33_", "research/gpu/study33_"))
MOVED_TESTS = ("test_demo_batch.py", "test_demo_runs.py", "test_demo_study.py", "test_study33_reanalysis.py",
               "test_study33_corrections.py", "test_study33_phase2.py", "test_study33_probe.py", "test_study33_warmscan.py",
               "test_demo_phase2.py", "test_study_plot.py", "test_kl_gradients.py", "test_evidence_pages.py")


def moved(text: str) -> str:
    for before, after in MOVED:
        text = text.replace(before, after)
    for name in MOVED_TESTS:
        text = re.sub(rf"(?<![\w/])tests/{re.escape(name)}", f"research/tests/{name}", text)
    return text


def test_moved_rewrites_the_paths_issue_54_moved_and_nothing_else():
    assert moved("[`evidence-data/a/`](evidence-data/a/b.md), `docs/evidence-data/x.jsonl.gz`") == (
        "[`research/data/a/`](../research/data/a/b.md), `research/data/x.jsonl.gz`")
    assert moved("`tests/test_demo_runs.py` and `scripts/gpu/evidence/s.txt`") == (
        "`research/tests/test_demo_runs.py` and `research/runlists/s.txt`")
    assert moved("`tests/test_config.py`, research/tests/test_demo_runs.py") == "`tests/test_config.py`, research/tests/test_demo_runs.py"


def test_every_paragraph_of_the_single_page_is_on_a_study_page_verbatim():
    old = blocks(moved(single_page()))
    assert len(old) > 200
    pages = "\n\n".join((ROOT / "docs" / "evidence" / name).read_text() for name in STUDY_PAGES)
    new = set(blocks(pages.replace("](../", "](")))  # the pages are one folder down: their links gained ../
    missing = [b for b in old if b not in new]
    assert missing == [], f"{len(missing)} paragraphs of the single page are on no study page, e.g. {missing[0][:300]!r}"


def test_each_study_page_holds_its_sections_in_order():
    expected = {"study11-drift.md": [f"## {n}. " for n in range(1, 6)], "study26-beta-grid.md": ["## 6. "],
                "study33-long-task.md": ["## 7. "]}
    for name, sections in expected.items():
        headings = re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "evidence" / name).read_text(), re.M)
        assert [f"## {h}. " for h in headings] == sections, name


def test_the_index_holds_the_answer_made_from_the_studies_tables():
    index = evidence_answer.INDEX.read_text()
    assert index.count(evidence_answer.MARKER) == 2
    block = index.split(evidence_answer.MARKER)[1].strip("\n")
    assert block == evidence_answer.current(), (
        "docs/evidence.md's answer is not the one the studies' tables give: run `python research/evidence_answer.py --write`")
    assert len(block.split("\n")) <= evidence_answer.MAX_LINES


S49 = evidence_answer.study_49(evidence_answer.STUDY_49.read_text())


def test_the_answer_reads_study_49s_results_tables():
    """Study 49's held counts, runaways and declarations come from its Results tables: a row changed in a copy of the
    page comes out changed."""
    text = evidence_answer.STUDY_49.read_text()
    s26 = evidence_answer.study_26(evidence_answer.STUDY_26.read_text())
    s33 = evidence_answer.study_33(evidence_answer.STUDY_33.read_text())
    row = "| `target` | 1 | 0.04 | 2.19, 0.81, 0.68, 0.87, 0.62 | 2/5 | 0 |"
    declared = "| design 2 | 92, 91, 56, 23, 49 | 3 of 5 |"
    assert row in text and declared in text
    edited = text.replace(row, "| `target` | 1 | 0.04 | 2.19, 0.81, 0.98, 0.87, 0.92 | 4/5 | 2 |").replace(
        declared, "| design 2 | 92, never, 56, 23, 49 | 3 of 5 |")
    before = evidence_answer.answer(s26, s33, S49)
    after = evidence_answer.answer(s26, s33, evidence_answer.study_49(edited))
    assert "in 3 of 15 runs (`ziegler` 3 of 15; a fixed β 0.3: 4 of 5 seeds), runaways in 1 of 30 runs (`ziegler` 4)" in before
    assert "said in 5 of 5 seeds (updates 23-92)" in before
    assert "in 5 of 15 runs (`ziegler` 3 of 15; a fixed β 0.3: 4 of 5 seeds), runaways in 3 of 30 runs" in after
    assert "said in 4 of 5 seeds (updates 23-92)" in after


def test_the_answer_reads_the_tables_it_names():
    """A table's number moves the answer: the best fixed β's reward and `target`'s KL / kl_target, changed in a copy
    of study 33's text, come out changed."""
    text = evidence_answer.STUDY_33.read_text()
    s26 = evidence_answer.study_26(evidence_answer.STUDY_26.read_text())
    edited = text.replace("| **0.762 ± 0.035** |", "| **0.771 ± 0.035** |").replace("| 0.17 | [0.12, 0.23] |", "| 0.15 | [0.12, 0.23] |")
    assert edited != text
    before, after = evidence_answer.answer(s26, evidence_answer.study_33(text), S49), evidence_answer.answer(s26, evidence_answer.study_33(edited), S49)
    assert "(0.762, 0.757)" in before and "(0.771, 0.757)" in after
    assert "0.17-10.09 ×" in before and "0.15-10.09 ×" in after


def test_the_answer_refuses_more_than_one_screen():
    s26 = evidence_answer.study_26(evidence_answer.STUDY_26.read_text())
    s33 = evidence_answer.study_33(evidence_answer.STUDY_33.read_text())
    lines = evidence_answer.answer(s26, s33, S49).split("\n")
    assert len(lines) <= evidence_answer.MAX_LINES
    original, evidence_answer.MAX_LINES = evidence_answer.MAX_LINES, len(lines) - 1
    try:
        with pytest.raises(ValueError, match=f"the answer has {len(lines)} lines: allowed: at most {len(lines) - 1}"):
            evidence_answer.answer(s26, s33, S49)
    finally:
        evidence_answer.MAX_LINES = original


def test_the_readme_links_the_answer_near_its_top():
    readme = (ROOT / "README.md").read_text().split("\n")
    assert any("](docs/evidence.md)" in line for line in readme[:15])


def test_a_controller_that_beat_the_best_fixed_beta_would_change_the_headline():
    text = evidence_answer.STUDY_26.read_text()
    s33 = evidence_answer.study_33(evidence_answer.STUDY_33.read_text())
    edited = text.replace("| `target` | 0.1 | -0.008 [-0.072, 0.055] |", "| `target` | 0.1 | 0.108 [0.072, 0.155] |")
    assert edited != text
    assert "no controller has been shown to beat it" in evidence_answer.answer(evidence_answer.study_26(text), s33, S49)
    assert "beaten by target from β 0.1" in evidence_answer.answer(evidence_answer.study_26(edited), s33, S49)


# -- study 51 part B: the answer once its page has the readout ------------------------------------------------------


def _study51_page(tmp_path, *, schedule_delta=-0.1, cut=False):
    """A copy of study 51's page with a results section holding arms_report's table of synthetic runs: fixed β 0,
    0.04 (the best: 0.6 + 0.01 × seed), 0.1; `dynamic` within ±0.004 of the best (matched), acting `dynamic` +0.03
    ± 0.07 (inconclusive), `schedule` from 1 ``schedule_delta`` in every seed, `target` 0.01 below with a runaway."""
    import gzip
    import json

    from research.study51 import arms_report

    jitter, noisy = [0.004, -0.004, 0.002, -0.002, 0.0], [0.10, -0.05, 0.08, -0.03, 0.05]
    rows = []
    for seed in range(5):
        best = 0.6 + 0.01 * seed
        arms = [("none", 0.04, best, {}), ("none", 0.1, best - 0.02, {}), ("none", 0.0, best - 0.1, {"kl_monitor": True}),
                ("dynamic", 0.04, best + jitter[seed], {"controller_params": {"reward_window": 10}}),
                ("dynamic", 0.04, best + noisy[seed], {"controller_params": {"reward_threshold": 0.48, "reward_window": 10}}),
                ("schedule", 1.0, best + schedule_delta, {"controller_params": {"beta_min": 0.02, "beta_schedule": "linear"}}),
                ("target", 0.01, best - 0.01, {"kl_target": 0.02, "alarm": seed == 1})]
        if cut:  # an arm whose every run stopped at step 60 (no final value, no pair), one run without the alarm
            arms.append(("reward_conditioned", 0.04, best, {"steps": 60, "no_alarm": seed == 3}))
        for i, (method, beta0, final, options) in enumerate(arms):
            for step in range(1, options.get("steps", 100) + 1):
                row = {"tag": f"t{i}", "method": method, "seed": seed, "step": step, "copy": f"c{i}{seed}", "beta0": beta0,
                       "kl_target": options.get("kl_target", 0.1), "reward": 0.2 if step <= 40 else final,
                       "completions/median_length": 60.0, "adaptive_kl/raw_kl": 0.01,
                       "adaptive_kl/runaway_alarm": int(options.get("alarm", False) and step > 50)}
                if options.get("no_alarm"):
                    del row["adaptive_kl/runaway_alarm"]
                row.update({k: v for k, v in options.items() if k not in ("kl_target", "alarm", "steps", "no_alarm")})
                rows.append(row)
    directory = tmp_path / "study51-b-x"
    directory.mkdir()
    with gzip.open(directory / "study51-b-x-stream.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    table = arms_report.report([str(directory)]).split("\n", 2)[2]  # without its "# Study 51" title
    page = evidence_answer.STUDY_51.read_text().split(f"\n{evidence_answer.RESULTS_51}\n")[0]  # without its own results
    return page + f"\n{evidence_answer.RESULTS_51} (synthetic)\n\n{table}"


def _answer(s51):
    s26 = evidence_answer.study_26(evidence_answer.STUDY_26.read_text())
    s33 = evidence_answer.study_33(evidence_answer.STUDY_33.read_text())
    return evidence_answer.answer(s26, s33, S49, s51)


def test_without_study_51s_results_the_answer_is_the_three_studies_one():
    assert evidence_answer.study_51("# Study 51\n\nno results yet\n") is None
    assert _answer(None) == evidence_answer.answer(
        evidence_answer.study_26(evidence_answer.STUDY_26.read_text()),
        evidence_answer.study_33(evidence_answer.STUDY_33.read_text()), S49)


def test_study_51s_table_gives_the_headline_and_every_controllers_verdict(tmp_path):
    s51 = evidence_answer.study_51(_study51_page(tmp_path))
    assert (s51["best"]["label"], s51["family"], s51["seeds"]) == ("none β 0.04", 6, 5)
    text = _answer(s51)
    lines = text.split("\n")
    assert len(lines) <= evidence_answer.MAX_LINES
    assert lines[2].startswith("- **β: a fixed 0.04 (`none`) on a real model; no controller has been shown to beat it.** "
                               "[Study 51](evidence/study51-real-model.md#part-b-results)")
    assert ("β 0.04 had the most final reward (0.620, its KL 0.01) of 3 fixed β (0: 0.520, 0.04: 0.620, 0.1: 0.600); "
            "β 0 and 0.1 lost.") in lines[2]
    assert "fixed β at 0.04-0.1; [study 26]" in lines[2]  # study 33 keeps its place, named as such
    controllers = lines[3]
    assert controllers.startswith("- **Each controller against it** (study 51, final reward paired by seed, Holm over 6 comparisons): ")
    assert "matched (within ±0.05): `dynamic` 0.04 (+0.000, KL 0.01)" in controllers
    assert "lost by less than 0.05: `target` 0.01 (-0.010, KL 0.01, 1 runaway)" in controllers
    assert "lost: `schedule` 1 linear (-0.100, KL 0.01)" in controllers
    assert re.search(r"inconclusive: `dynamic` 0\.04 threshold 0\.48 \(\+0\.030, KL 0\.01, \d+ seeds would tell\)", controllers)
    assert "study 51: -0.100 [-0.100, -0.100] against β 0.04, lost; study 33:" in lines[4]
    assert "**Not known:** models past 135 M, full fine-tuning, runs past 100 steps" in text
    assert "pretrained models and real tasks (no study has run one)" not in text
    assert "is real on its task (tested as `schedule` from β 1 on the real model: linear lost -0.100); tasks" in text
    assert "tested as `schedule`" not in _answer(None)


def test_a_controller_that_beat_the_best_fixed_beta_on_the_real_model_changes_the_headline(tmp_path):
    text = _answer(evidence_answer.study_51(_study51_page(tmp_path, schedule_delta=+0.1)))
    assert "on a real model; beaten by `schedule` 1 linear on the real model.**" in text
    assert "beat: `schedule` 1 linear (+0.100, KL 0.01)" in text


def test_an_arm_without_final_values_or_alarms_is_named_without_a_delta(tmp_path):
    """arms_report prints "—" for an arm whose runs all stopped before the end (no final reward, no pair) and "(k not
    logged)" for runs without the runaway alarm: the answer names the arm under "too few seeds" without a Δ and says
    the alarm is missing (it was an AttributeError)."""
    s51 = evidence_answer.study_51(_study51_page(tmp_path, cut=True))
    (cut,) = [a for a in s51["controllers"] if a["method"] == "reward_conditioned"]
    assert (cut["reward"], cut["verdict"], cut["unlogged"], s51["family"]) == (None, "too few seeds", 1, 7)
    text = _answer(s51)
    assert "too few seeds: `reward_conditioned` 0.04 (0 seeds, no runaway alarm logged in 1 run)" in text  # 0 complete


def _targets_section(declared=("93", "—", "95")):
    """A results section's prediction-5 rows and a trace table (controller_trace's columns) of two arms."""
    rows = [f"| target β 0.01 (kl_target 0.15) | {seed} | 0.009 | 0.0055 | 0.005 | {end} | 0.0047 (72) | 94 | 74 | {d} | 0.3 | no |"
            for seed, (d, end) in enumerate(zip(declared, ("0.005", "0.0097", "0.0052")))]
    rows += [f"| ziegler β 1 (kl_target 0.15) | {seed} | 0.6 | 0.37 | 0.22 | 0.1353 | 0.1353 (100) | 100 | — | — | 0.025 | no |"
             for seed in range(2)]
    return "\n".join([
        evidence_answer.RESULTS_51, "", "| prediction | claim | measured | verdict |", "|---|---|---|---|",
        "| 5 | `target` holds K (±25%) in at most half of its runs | 1 of 3 | held |",
        "| 5 | `ziegler` holds K (±25%) in at most half of its runs | 0 of 2 | held |", "",
        "**What β did**, run by run:", "",
        "| arm | seed | β step 25 | β step 50 | β step 75 | β step 100 | least β (step) | β last changed | "
        "KL 10-step mean first above K | declared unreachable | final KL | held K |", "|" + "---|" * 12, *rows, ""])


def test_the_target_and_ziegler_lines_read_prediction_5_and_the_trace():
    targets = evidence_answer.targets_51(_targets_section())
    # not a registry list: the two prediction-5 rows the synthetic section holds
    assert targets["held"] == {"target": (1, 3), "ziegler": (0, 2)}
    arm = targets["trace"][("target", 0.01)]
    assert (arm["seeds"], arm["declared"], arm["declared_end"], arm["kl_target"]) == (3, [93, 95], [0.005, 0.0052], 0.15)
    s51 = {"targets": targets}
    assert evidence_answer.target_51(s51) == (
        "- **`target`: it held its target in 1 of 3 runs on the real model.** [Study 51]"
        "(evidence/study51-real-model.md#part-b-results): within ±25 % of its target in 1 of 3 runs (`ziegler` 0 of 2); "
        "from β0 0.01 it declared 0.15 unreachable in 2 of 3 seeds (steps 93-95; β at step 100 0.005-0.0052). ")
    assert evidence_answer.ziegler_51(s51) == "; study 51: β at step 100 0.14 from 1"
    nothing = {"targets": evidence_answer.targets_51(_targets_section(declared=("—", "—", "—")))}
    assert "from β0 0.01 β stopped at 0.005-0.0097, nothing declared. " in evidence_answer.target_51(nothing)


def test_without_prediction_5_the_target_line_is_study_49s():
    assert evidence_answer.targets_51("### Part B: results\n\nno predictions\n") is None
    assert evidence_answer.target_51(None) == evidence_answer.target_51({"targets": None}) == (
        "- **`target`: it held no chosen KL on the long task; it does say when one is out of reach.** ")
    assert evidence_answer.ziegler_51(None) == ""
