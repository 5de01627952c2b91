"""research/gpu/study33_probe.py, issue 33's first GPU call, at tiny size on the CPU (--tiny): both demo
invocations on the long task, their warm-start records, the step times, the record and the files it returns."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "research", "gpu", "study33_probe.py")
spec = importlib.util.spec_from_file_location("study33_probe", SCRIPT)
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out, work = tmp_path_factory.mktemp("probe-out"), tmp_path_factory.mktemp("probe-work")
    env = dict(os.environ, TRITON_INTERPRET="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(out), "--work", str(work), "--tiny"], capture_output=True,
                          text=True, env=env, timeout=1500, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + "".join(
        p.read_text()[-2000:] for p in work.glob("*.log"))
    return out, json.loads((out / "study33-probe.json").read_text())


def test_the_probe_returns_at_most_five_files(tiny):
    out, _ = tiny
    assert sorted(p.name for p in out.iterdir()) == ["study33-probe-k1-stream.jsonl", "study33-probe-k8-stream.jsonl",
                                                     "study33-probe-runs.tar.gz", "study33-probe.json", "study33-probe.md"]


def test_both_invocations_warm_start_the_same_model_and_record_it(tiny):
    _, record = tiny
    assert record["same_warm_start"] is True, {name: {k: (ph["warm_start"] or {}).get(k) for k in (
        "weights_sha256", "torch_threads", "device", "loss_curve")} for name, ph in record["phases"].items()}
    for name in ("k1", "k8"):
        warm = record["phases"][name]["warm_start"]
        assert warm["warm_start_steps"] == 3 and len(warm["loss_curve"]) >= 2 and warm["tokens_per_s"] > 0
        assert (warm["device"], warm["torch_threads"]) == ("cpu", 1)  # --tiny: the warm start on one CPU thread
        start = warm["start"]
        assert start["n"] == 256 and 0 <= start["accuracy"] <= 1 and 0 <= start["truncated"] <= 1
        assert start["length"]["p10"] <= start["length"]["median"] <= start["length"]["p90"] <= start["length"]["max"] <= 40
        assert abs(sum(s["share"] for s in start["styles"].values()) - 1) < 1e-9


def test_the_step_times_come_from_every_run_and_name_the_trained_batch(tiny):
    _, record = tiny
    k1, k8 = record["phases"]["k1"]["step_times"], record["phases"]["k8"]["step_times"]
    assert (k1["runs"], k1["steps_logged"]) == (1, 2) and (k8["runs"], k8["steps_logged"]) == (2, 4)
    assert k1["median_s"] > 0 and k1["completions_per_step"] == [8]  # smoke: 2 prompts x 4
    projection = record["projection"]
    assert projection["runs_at_once"] == 2 and projection["run_steps_per_s"] == pytest.approx(2 / k8["median_s"])


def test_the_projection_applies_section_7s_cost_rule():
    k8 = {"runs": 8, "median_s": 1.5, "first_step_median_s": 40.0}
    p = probe.projection(k8, warm_start_s=100.0)  # 540 - 100 - 40 = 400 s of steps: 266 steps, 200 planned
    assert (p["steps_per_call_at_this_concurrency"], p["planned_steps_by_the_cost_rule"]) == (266, 200)
    assert p["one_gpu_calls_at_this_concurrency"] == 10  # 75 runs, 8 a call
    slow = probe.projection({**k8, "median_s": 3.0}, warm_start_s=100.0)  # 133 steps: 120 planned
    assert slow["planned_steps_by_the_cost_rule"] == 120 and slow["study_runs_as_designed"]
    too_slow = probe.projection({**k8, "median_s": 4.0}, warm_start_s=100.0)  # 100 steps: not as designed
    assert not too_slow["study_runs_as_designed"] and too_slow["one_gpu_calls_at_this_concurrency"] is None


def test_the_projected_run_list_is_section_7s():
    text = open(os.path.join(ROOT, "docs", "evidence", "study33-long-task.md")).read()
    section = text[text.index("## 7. Evidence 4"):]
    assert re.search(rf"\n{probe.STUDY_RUNS} runs \(80 with \(d\)\) × {probe.STUDY_STEPS} steps", section)
    rows = re.findall(r"^\| [12] \| \([abc]\) \|.*\| (\d+) \|$", section, flags=re.M)
    assert sum(map(int, rows)) == probe.STUDY_RUNS


def test_the_study_analysis_reads_the_probe_streams(tiny):
    out, _ = tiny
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "research", "study_cli.py"), "--analyze",
                           str(out / "study33-probe-k8-stream.jsonl"), "--study"], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # two fixed β of one family, one copy each, 2 planned steps: the final window is step 2 (the last quarter of 2)
    assert "## long-dapo-b*-h32x2-L40-s2-wlr0.001 (2 planned steps; final window: steps 2-2)" in proc.stdout
    assert "| `none` | 0.05 | — | 1 | 1 (1) |" in proc.stdout and "| `none` | 0.2 | — | 1 | 1 (1) |" in proc.stdout
