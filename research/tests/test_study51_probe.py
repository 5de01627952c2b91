"""Study 51's learning-rate probe readout (research/study51/probe_report.py, docs/evidence/study51-real-model.md) on
synthetic streams whose answers are set by construction: which arms learn, which hold, which is chosen (ties to the
constant schedule and the lower rate), a cut arm left out, and a second copy refused."""

import gzip
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "research", "study51"))
import probe_report  # noqa: E402


def curve(kind, steps=100):
    """Reward by step: flat 0.16; a rise to `top` by step 40 that stays; a rise to 0.7 by step 30 then a fall to 0.55."""
    if kind == "flat":
        return [0.16] * steps
    if kind == "fall":
        return [0.16 + (0.7 - 0.16) * min(s, 30) / 30 if s <= 30 else 0.7 - 0.15 * min(s - 30, 40) / 40 for s in range(1, steps + 1)]
    top = kind
    return [0.16 + (top - 0.16) * min(s, 40) / 40 for s in range(1, steps + 1)]


def write(directory, name, arms):
    os.makedirs(directory, exist_ok=True)
    with gzip.open(os.path.join(directory, f"{name}-stream.jsonl.gz"), "wt") as f:
        for (lr, schedule, rewards, copy) in arms:
            for step, reward in enumerate(rewards, start=1):
                row = {"tag": f"smollm2-b0.04-lr{lr:g}-{schedule}", "copy": copy, "method": "none", "step": step,
                       "reward": reward, "learning_rate": lr, "adaptive_kl/raw_kl": 0.001 * step,
                       "completions/median_length": 60.0 + step / 10}
                if schedule != "constant":
                    row["lr_scheduler_type"] = schedule
                f.write(json.dumps(row) + "\n")


@pytest.fixture
def probe(tmp_path):
    write(tmp_path / "a", "study51-lr-a", [(1e-5, "constant", curve("flat"), "c1"), (2e-5, "constant", curve(0.50), "c2"),
                                           (5e-5, "constant", curve("fall"), "c3")])
    write(tmp_path / "b", "study51-lr-b", [(5e-5, "cosine", curve(0.51), "c4"), (1e-4, "cosine", curve(0.8)[:80], "c5")])
    return [str(tmp_path / "a"), str(tmp_path / "b")]


def row(text, start):
    (found,) = [line for line in text.splitlines() if line.startswith(start)]
    return [cell.strip() for cell in found.strip("|").split("|")]


def test_each_arms_windows_and_verdicts_are_those_written(probe):
    text = probe_report.report(probe)
    # flat: start = best = final = 0.16: does not learn; holds
    assert row(text, "| 1e-05 |")[3:9] == ["0.160", "0.160 (10)", "0.160", "+0.000", "no", "yes"]
    # a rise to 0.5 by step 40: start = mean of 0.16 + 0.34 s / 40 over s = 1..10, best = final = 0.5
    start = sum(0.16 + 0.34 * s / 40 for s in range(1, 11)) / 10
    assert row(text, "| 2e-05 | constant |")[3:9] == [f"{start:.3f}", "0.500 (49)", "0.500", "+0.000", "yes", "yes"]
    # a peak of 0.7 at step 30, then 0.55 from step 70: the best window ends at 30 or just after; it falls by > 0.05
    cells = row(text, "| 5e-05 | constant |")
    best = max(sum(curve("fall")[i:i + 10]) / 10 for i in range(91))
    assert cells[4].startswith(f"{best:.3f}") and cells[5] == "0.550" and cells[7:9] == ["yes", "no"]
    # the cut cosine arm: 80 of 100 steps, left out of the choice although it ends highest
    assert row(text, "| 0.0001 | cosine |")[2] == "80 (cut)"
    # the KL and median length of the final window, and the last step's rate
    assert row(text, "| 5e-05 | cosine |")[9:12] == [f"{0.001 * 95.5:.4g}", f"{60 + 9.55:.1f}", "5e-05"]


def test_the_choice_ties_to_the_constant_schedule_within_002(probe):
    # cos 5e-5 ends at 0.51, constant 2e-5 at 0.50: within 0.02, so the constant schedule is chosen
    assert probe_report.report(probe).rstrip().endswith("**Chosen**: learning rate 2e-05, constant schedule.")


def test_part_b_takes_the_chosen_rate_and_r_from_the_chosen_arm(probe, tmp_path, capsys):
    """Part B's phase-1 options: the chosen arm (constant 2e-5) and R = (its start + its best window) / 2, rounded to
    2 decimals; partb_lists.py parses them; no chosen arm: refused."""
    start = sum(0.16 + 0.34 * s / 40 for s in range(1, 11)) / 10
    expected = f"--lr 2e-05 --sched constant --reward-threshold {round((start + 0.5) / 2, 2):g}"
    assert probe_report.partb_arguments(probe) == expected
    probe_report.main(probe + ["--partb-arguments"])
    assert capsys.readouterr().out == expected + "\n"
    from research.study51 import partb_lists

    partb_lists.main(["grid", *expected.split(), "--check"])
    assert "dynamic@0.04:reward_threshold=" + f"{round((start + 0.5) / 2, 2):g}" + ":reward_window=10" in capsys.readouterr().out
    write(tmp_path / "n", "x", [(1e-5, "constant", curve("flat"), "c1")])
    with pytest.raises(ValueError, match="the probe chose no arm"):
        probe_report.partb_arguments([str(tmp_path / "n")])


def test_without_a_tie_the_highest_final_window_is_chosen(tmp_path):
    write(tmp_path / "a", "x", [(2e-5, "constant", curve(0.40), "c2"), (5e-5, "cosine", curve(0.51), "c4"),
                                (1e-5, "constant", curve(0.42), "c1")])
    assert probe_report.report([str(tmp_path / "a")]).rstrip().endswith("learning rate 5e-05, cosine schedule.")


def test_no_arm_that_learns_and_holds_chooses_none(tmp_path):
    write(tmp_path / "a", "x", [(1e-5, "constant", curve("flat"), "c1"), (5e-5, "constant", curve("fall"), "c3")])
    assert "**Chosen**: none (no complete arm learns and holds)" in probe_report.report([str(tmp_path / "a")])


def test_an_arm_cut_before_one_window_is_listed_and_left_out(tmp_path):
    write(tmp_path / "a", "x", [(2e-5, "constant", curve(0.5), "c2"), (5e-5, "cosine", curve(0.9)[:6], "c4")])
    text = probe_report.report([str(tmp_path / "a")])
    assert row(text, "| 5e-05 | cosine |")[2:4] == ["6 (cut)", "—"]
    assert text.rstrip().endswith("learning rate 2e-05, constant schedule.")


def test_it_reads_the_harness_stream_of_the_real_model_on_the_cpu(tmp_path):
    """The rows the harness writes for --model smollm2 with per-run rates (a 2-step CPU run's stream, as it wrote it,
    reduced to the keys the readout reads): 2 of 100 planned steps, so both arms are cut."""
    rows = [{"tag": "smollm2-explain1-9-dapo-b0.04-L16-s2-lr1e-05", "copy": "a", "step": s, "reward": 0.0,
             "learning_rate": 1e-05, "completions/median_length": 10.0} for s in (1, 2)]
    rows += [{"tag": "smollm2-explain1-9-dapo-b0.04-L16-s2-lr5e-05-schedcosine", "copy": "b", "step": s, "reward": 0.0,
              "learning_rate": lr, "lr_scheduler_type": "cosine"} for s, lr in ((1, 5e-05), (2, 2.5e-05))]
    os.makedirs(tmp_path / "a")
    with gzip.open(tmp_path / "a" / "x-stream.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    text = probe_report.report([str(tmp_path / "a")])
    assert row(text, "| 1e-05 | constant |")[2] == "2 (cut)" and row(text, "| 5e-05 | cosine |")[11] == "2.5e-05"
    assert "**Chosen**: none" in text


def test_a_second_copy_of_an_arm_is_refused(tmp_path):
    write(tmp_path / "a", "x", [(2e-5, "constant", curve(0.5), "c2"), (2e-5, "constant", curve(0.5), "again")])
    with pytest.raises(ValueError, match="two copies of the arm"):
        probe_report.report([str(tmp_path / "a")])


def test_verify_sh_runs_the_probe_lists_with_packing_off_and_refuses_without_the_model(tmp_path):
    import subprocess

    text = open(os.path.join(ROOT, "scripts", "gpu", "verify.sh")).read()
    stage = text[text.index("    study51:*)"):text.index("    study51-pair:*)")]
    assert 'UNSLOTH_GRPO_SEQ_PACKING=0 EVIDENCE_TIMEOUT=560 evidence "${stage#study51:}"' in stage
    for name in ("study51-lr-a", "study51-lr-b"):
        assert os.path.exists(os.path.join(ROOT, "research", "runlists", f"{name}.txt"))
    env = {k: v for k, v in os.environ.items() if k != "UAKL_SMOLLM2_GGUF"}
    proc = subprocess.run(["bash", "scripts/gpu/verify.sh", str(tmp_path / "out"), "study51:study51-lr-a"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "study51: no SmolLM2 on this machine: run smollm2-head, then smollm2-join, first" in proc.stdout
