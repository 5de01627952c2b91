"""Issue 33's warm-start diagnosis and scan (docs/evidence/study33-long-task.md, Amendment 2): the token roles of a column
solution, the loss levels a model can reach, the pre-registered choice, the warm start's progress records, and
research/gpu/study33_warmscan.py at tiny size on the CPU."""

import importlib.util
import itertools
import json
import math
import os
import random
import re
import subprocess
import sys

import pytest

import toy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "research", "gpu", "study33_warmscan.py")
spec = importlib.util.spec_from_file_location("study33_warmscan", SCRIPT)
scan = importlib.util.module_from_spec(spec)
spec.loader.exec_module(scan)
LONG = dict(min_terms=4, max_terms=5, max_operand=99_999_999)


def test_the_roles_of_the_docstring_example():
    # "1+0+0=1,2+9+0=11,8+3+1=12,4+7+1=12,1>12211" then the end of sequence
    c, m, s, a, k = "copy", "mark", "sum", "answer", "carry"
    column = lambda total_digits: [c, m, c, m, k, m] + [s] * total_digits  # noqa: E731
    expected = (column(1) + [m] + column(2) + [m] + column(2) + [m] + column(2) + [m, k, m] + [a] * 5 + [m])
    assert toy.column_token_roles([4821, 7390], 2) == expected
    assert toy.column_token_roles([4821, 7390], 1) == [s, m, s, s, m, s, s, m, s, s, m, k, m] + [a] * 5 + [m]
    assert toy.column_token_roles([4821, 7390], 0) == [m] + [a] * 5 + [m]


def test_the_roles_name_what_each_token_is_on_the_long_task():
    rows = toy.sum_problems(300, seed=7, **LONG)
    for row, style in itertools.product(rows, range(3)):
        text = toy.column_solution(row["terms"], style) + "$"  # "$" stands for the end of sequence
        roles = toy.column_token_roles(row["terms"], style)
        assert len(roles) == len(text)
        assert [ch for ch, r in zip(text, roles) if r == "mark"] == [ch for ch in text if ch in "+=,>$"]
        assert "".join(ch for ch, r in zip(text, roles) if r == "answer") == row["answer"]
        if style == 2:  # the copied digits are the terms' digits, column by column, least significant first
            width = max(len(str(t)) for t in row["terms"])
            padded = [str(t).rjust(width, "0")[::-1] for t in row["terms"]]
            assert "".join(ch for ch, r in zip(text, roles) if r == "copy") == "".join(
                "".join(p[i] for p in padded) for i in range(width))
        # a carry is the previous column's total // 10
        totals = [int(t) for t in re.findall(r"=(\d+)" if style == 2 else r"(?:^|,)(\d+)(?=[,>])", text)]
        carries = [int(ch) for ch, r in zip(text, roles) if r == "carry"]
        if style == 2:
            assert carries[:len(totals)] == [0] + [t // 10 for t in totals[:-1]]
        if style:
            assert sum(totals[i] % 10 * 10 ** i for i in range(len(totals))) % 10 ** len(totals) == int(row["answer"]) % 10 ** len(totals)


def test_a_column_total_the_model_cannot_read_has_the_entropy_of_its_distribution():
    for terms in (4, 5):  # brute force over every tuple of digits
        counts = {}
        for digits in itertools.product(range(10), repeat=terms):
            counts[sum(digits)] = counts.get(sum(digits), 0) + 1
        total = 10 ** terms
        assert scan.column_total_entropy(terms) == pytest.approx(-sum(c / total * math.log(c / total) for c in counts.values()))


def test_the_loss_levels_count_what_each_model_cannot_know():
    parts = (0.2, 0.2, 0.6)
    rows = toy.sum_problems(200, seed=3, **LONG)
    styles = random.Random(3).choices(range(3), parts, k=len(rows))
    levels = scan.loss_levels(rows, styles, parts)
    texts = [r["prompt"] + toy.column_solution(r["terms"], s) for r, s in zip(rows, styles)]
    tokens = sum(len(t) + 1 for t in texts)  # one token a character, and the end of sequence
    assert levels["tokens_per_text"] == pytest.approx(tokens / len(rows))
    # perfect: the prompt's information (each term 1 in 1e8, 4 or 5 terms) and the style's
    style_entropy = -sum(w * math.log(w) for w in parts)
    information = sum(len(r["terms"]) * math.log(1e8) + math.log(2) + style_entropy for r in rows)
    assert levels["perfect"] == pytest.approx(information / tokens)
    # no copy: ln 10 more for each digit between '>' and the end and each digit before a '+' or at a column's
    # carry-free place in style 2 (read off the text), and a column total's entropy for each of style 1's columns
    extra = 0.0
    for r, s, text in zip(rows, styles, texts):
        scratch, answer = text[len(r["prompt"]):].split(">")
        extra += len(answer) * math.log(10)
        if s == 2:
            extra += sum(len(column.split("=")[0].split("+")) - 1 for column in scratch.split(",") if "=" in column) * math.log(10)
        if s == 1:
            extra += max(len(str(t)) for t in r["terms"]) * scan.column_total_entropy(len(r["terms"]))
    assert levels["no_copy"] == pytest.approx((information + extra) / tokens)


def record(median, accuracy):
    return {"start": {"length": {"median": median}, "accuracy": accuracy}}


def test_the_rule_takes_the_first_candidate_in_order_that_meets_the_entry_conditions():
    records = {3e-4: record(116, 0.05), 1e-4: record(120, 0.1), 5e-4: record(118, 0.3)}
    assert scan.choose([3e-4, 1e-4, 5e-4], records) == (1e-4, True)  # 0.1 is inside [0.1, 0.8]
    assert scan.choose([3e-4, 5e-4, 1e-4], records) == (5e-4, True)
    assert scan.choose([3e-4], records) == (None, True)  # decided: no rate meets them
    assert not scan.entry(record(99, 0.5))["meets"] and not scan.entry(record(130, 0.81))["meets"]
    assert scan.entry(record(100, 0.8))["meets"] and not scan.entry(None)["finished"]


def test_an_unfinished_candidate_leaves_the_choice_open_until_it_has_run():
    records = {3e-4: record(116, 0.05), 5e-4: record(118, 0.3)}
    assert scan.choose([2e-4, 5e-4], records) == (None, False)  # 2e-4 was cut: it comes first, so it runs again
    assert scan.choose([3e-4, 2e-4, 5e-4], records) == (None, False)
    assert scan.choose([5e-4, 2e-4], records) == (5e-4, True)  # the first meets them: what follows does not matter


def test_the_progress_records_change_nothing_in_the_warm_start():
    import torch

    tokenizer = toy.build_scratchpad_tokenizer()
    rows = toy.sum_problems(5 * 8, seed=1, **LONG)
    texts = [r["prompt"] + toy.column_solution(r["terms"], 2) + tokenizer.eos_token for r in rows]
    results = []
    for progress_every in (None, 2):
        model = toy.build_model(tokenizer, hidden_size=16, layers=1, heads=2, max_positions=200)
        seen, losses = [], []
        toy.supervised_warm_start(model, tokenizer, texts, batch_size=8, lr=1e-3, losses=losses,
                                  **({"progress": lambda step, loss: seen.append((step, loss)), "progress_every": progress_every}
                                     if progress_every else {}))
        results.append((losses, [p.detach().clone() for p in model.parameters()], seen))
    (plain, plain_weights, _), (logged, logged_weights, seen) = results
    assert plain == logged and all(torch.equal(a, b) for a, b in zip(plain_weights, logged_weights))
    assert [step for step, _ in seen] == [2, 4, 5]  # every second step and the last
    assert [loss for _, loss in seen] == pytest.approx([logged[1], logged[3], logged[4]])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out, work = tmp_path_factory.mktemp("scan-out"), tmp_path_factory.mktemp("scan-work")
    env = dict(os.environ, TRITON_INTERPRET="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(out), "--work", str(work), "--lrs", "3e-3,1e-3", "--tiny",
                           "--limit", "1200"], capture_output=True, text=True, env=env, timeout=1500, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + "".join(p.read_text()[-2000:] for p in out.glob("*.log"))
    return out, json.loads((out / "warmscan.json").read_text())


def test_the_scan_records_every_candidate_as_the_demo_builds_it(tiny):
    out, summary = tiny
    assert sorted(p.name for p in out.iterdir()) == [
        "warmscan-lr0.001.json", "warmscan-lr0.001.log", "warmscan-lr0.003.json", "warmscan-lr0.003.log",
        "warmscan-progress.jsonl", "warmscan.json", "warmscan.md"]
    assert summary["lrs"] == [3e-3, 1e-3] and summary["exits"] == {"0.003": 0, "0.001": 0}
    progress = [json.loads(line) for line in (out / "warmscan-progress.jsonl").read_text().splitlines()]
    assert sorted((p["lr"], p["step"]) for p in progress) == [(1e-3, 3), (3e-3, 3)]  # 3 steps: the last one only
    for lr in ("0.003", "0.001"):
        r = summary["candidates"][lr]
        assert r["warm_start_steps"] == 3 and len(r["weights_sha256"]) == 64 and r["lr"] == float(lr)
        assert [p["loss"] for p in progress if p["lr"] == float(lr)] == pytest.approx([r["warm_start_loss"]])
        assert r["start"]["n"] == 256 and r["start"]["length"]["max"] <= 40
        held = r["loss_by_role"]
        assert set(held["by_role"]) == {"prompt", "copy", "carry", "sum", "answer", "mark"}
        assert held["levels"]["perfect"] < held["levels"]["no_copy"] < held["all"]  # 3 steps learn nearly nothing
        assert summary["entry"][lr] == scan.entry(r)
    assert summary["candidates"]["0.003"]["weights_sha256"] != summary["candidates"]["0.001"]["weights_sha256"]
    assert (summary["chosen"], summary["decided"]) == scan.choose([3e-3, 1e-3], {float(k): v for k, v in summary["candidates"].items()})
    assert "| 0.003 | yes |" in (out / "warmscan.md").read_text()
