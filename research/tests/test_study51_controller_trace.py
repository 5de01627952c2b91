"""research/study51/controller_trace.py on synthetic runs whose β path, KL crossing and declaration are known by
construction."""

from __future__ import annotations

import gzip
import json

from research.study51 import controller_trace

K = 0.15


def run(method, seed, beta, kl, *, declared_at=None, steps=100):
    """A run of ``steps`` steps: β ``beta(step)``, raw KL ``kl(step)``, target_reachable 0 from ``declared_at``."""
    rows = []
    for step in range(1, steps + 1):
        row = {"tag": "smollm2-b0.01-s100-kt0.15", "method": method, "seed": seed, "step": step,
               "copy": f"{method}{seed}", "beta0": 0.01, "kl_target": K, "reward": 0.5,
               "adaptive_kl/current_beta": beta(step), "adaptive_kl/raw_kl": kl(step),
               "adaptive_kl/runaway_alarm": 0}
        if method == "target":
            row["adaptive_kl/target_reachable"] = 0.0 if declared_at and step >= declared_at else 1.0
        rows.append(row)
    return rows


def falls_then_rises(step):  # 0.01 until 20, halves linearly to 0.005 at 55, flat, 0.0094 from 90, 0.005 from 93
    if step <= 20:
        return 0.01
    if step <= 55:
        return 0.01 - 0.005 * (step - 20) / 35
    return 0.0094 if 90 <= step < 93 else 0.005


def test_a_run_s_beta_path_kl_crossing_declaration_and_final_kl():
    # KL 0.1 to step 69, 0.3 from step 70: the 10-step mean first above 0.15 at step 72 (7 × 0.3 + 3 × 0.1 = 2.4)
    rows = run("target", 0, falls_then_rises, lambda s: 0.1 if s < 70 else 0.3, declared_at=93)
    t = controller_trace.trace(rows)
    assert t["beta_at"] == {25: falls_then_rises(25), 50: falls_then_rises(50), 75: 0.005, 100: 0.005}
    assert (t["least"], t["least_step"]) == (0.005, 55)  # the first step at the least β
    assert t["last_change"] == 93 and t["kl_above"] == 72 and t["declared"] == 93
    assert abs(t["final_kl"] - 0.3) < 1e-12 and t["held"] is False


def test_a_held_target_a_kl_never_above_and_a_run_cut_short():
    t = controller_trace.trace(run("ziegler", 1, lambda s: 0.01, lambda s: 0.14))
    assert t["last_change"] is None and t["kl_above"] is None and t["declared"] is None
    assert t["held"] is True  # 0.14 within 0.8-1.25 × 0.15
    cut = controller_trace.trace(run("ziegler", 1, lambda s: 0.01, lambda s: 0.14, steps=90))
    assert cut["final_kl"] is None and cut["held"] is False and 100 not in cut["beta_at"]


def test_report_lists_only_the_controllers_that_read_kl_target(tmp_path):
    rows = (run("target", 0, falls_then_rises, lambda s: 0.2, declared_at=93)
            + run("ziegler", 0, lambda s: 0.01 * 0.98 ** s, lambda s: 0.02)
            + [dict(r, method="none", tag="smollm2-b0.04-s100") for r in run("ziegler", 0, lambda s: 0.04, lambda s: 0.2)])
    d = tmp_path / "study51-b-t-x"
    d.mkdir()
    with gzip.open(d / "study51-b-t-x-stream.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    lines = controller_trace.report([str(d)]).splitlines()
    body = lines[2:]
    assert len(body) == 2 and body[0].startswith("| target β 0.01 (kl_target 0.15) | 0 |")
    assert body[1].startswith("| ziegler β 0.01 (kl_target 0.15) | 0 |")
    assert body[0].endswith("| 10 | 93 | 0.200 | no |")  # KL 0.2 from step 1: above K at step 10, the first full window
    assert body[1].endswith("| 100 | — | — | 0.020 | no |")


def test_the_study_page_holds_the_trace_the_streams_give():
    from research.study51 import results

    page = open(results.PAGE).read()
    directories = [d for d in results.directories() if "study51-b-t-" in d]
    if results.missing():  # part B not complete: the page has no trace yet
        assert "**What β did**" not in page
        return
    table = controller_trace.report(directories)
    assert "**What β did**" in page and table in page.split("**What β did**", 1)[1], (
        "the study page's trace is not what the streams give: run python research/study51/controller_trace.py "
        "research/data/study51-b-t-* and put its table under **What β did**")
