"""The mutation-testing tools (docs/reliability.md, "Mutation testing") where a run cut short or a broken machine would
read as a result: scripts/mutation_backends.py (a mutant stopped by the run's budget is "not run", never "killed"; a
backend whose tests fail unmutated gives no verdict; what a strings+code target mutates), scripts/mutation_summary.py
--merge (the score of a run made in parts) and scripts/gpu/progress_filter.py (mutmut's spinner out of a device call's
output, every other line kept)."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


backends = _load("mutation_backends", "scripts/mutation_backends.py")


@pytest.fixture
def project(tmp_path):
    """A package of one function and a test of it, as mutation_backends copies them (unsloth_adaptive_kl/, tests/)."""
    root = tmp_path / "root"
    (root / "unsloth_adaptive_kl").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "unsloth_adaptive_kl" / "__init__.py").write_text("")
    (root / "unsloth_adaptive_kl" / "line.py").write_text("def kl(log_ratio, beta):\n    return beta * log_ratio\n")
    (root / "tests" / "test_line.py").write_text(textwrap.dedent("""\
        import os, time
        from unsloth_adaptive_kl.line import kl

        def test_kl():
            time.sleep(float(os.environ.get("SLOW_TEST_S", "0")))
            assert kl(3.0, 2.0) == 6.0
        """))
    return root


def _run(project, tmp_path, source, timeout=60, budget_s=60.0, slow_s=0.0, monkeypatch=None):
    target = backends.Target("fake", "unsloth_adaptive_kl/line.py", ("kl",), "code", ("tests/test_line.py",), timeout)
    mutant = dict(backend="fake", path=target.path, line=2, original="*", replacement="/", context="", source=source)
    monkeypatch.setenv("SLOW_TEST_S", str(slow_s))
    return backends.run_mutant(mutant, str(project), str(tmp_path / "work"), 0, target, time.time() + budget_s)


def test_a_mutant_is_killed_by_failing_tests_or_its_own_timeout_and_survives_passing_ones(project, tmp_path, monkeypatch):
    mutated = "def kl(log_ratio, beta):\n    return beta / log_ratio\n"
    assert _run(project, tmp_path, mutated, monkeypatch=monkeypatch)["status"] == "killed"
    assert _run(project, tmp_path, None, monkeypatch=monkeypatch)["status"] == "survived"  # the baseline
    # past the target's own timeout (not the run's budget): an endless loop is a kill
    assert _run(project, tmp_path, None, timeout=2, slow_s=30, monkeypatch=monkeypatch)["status"] == "killed"
    # the copy is restored after each run: the next baseline passes
    assert (tmp_path / "work" / "slot0" / "unsloth_adaptive_kl" / "line.py").read_text() == "def kl(log_ratio, beta):\n    return beta * log_ratio\n"



def test_a_mutant_that_cannot_be_imported_is_invalid_whatever_the_number_of_test_files(project, tmp_path, monkeypatch):
    """A mutant the package refuses at import (as it refuses a replacement reading an undefined name) is a collection
    error: invalid, also where pytest -x, given several test files, exits 1 on it rather than 2 (it did on trl.py:61)."""
    (project / "tests" / "test_other.py").write_text("from unsloth_adaptive_kl.line import kl\n\ndef test_other():\n    assert kl(1.0, 1.0) == 1.0\n")
    refused = "def kl(log_ratio, beta):\n    return beta * log_ratio\n\nraise RuntimeError('refused when patched')\n"
    monkeypatch.setenv("SLOW_TEST_S", "0")
    for n, tests in enumerate([("tests/test_line.py",), ("tests/test_line.py", "tests/test_other.py")]):
        target = backends.Target("fake", "unsloth_adaptive_kl/line.py", ("kl",), "code", tests, 60)
        mutant = dict(backend="fake", path=target.path, line=4, original="", replacement="", context="", source=refused)
        result = backends.run_mutant(mutant, str(project), str(tmp_path / f"work{n}"), 0, target, time.time() + 60)
        assert result["status"] == "invalid", (tests, result)
        baseline = backends.run_mutant(dict(mutant, source=None), str(project), str(tmp_path / f"work{n}"), 0, target, time.time() + 60)
        assert baseline["status"] == "survived"

def test_a_mutant_the_runs_budget_stops_or_does_not_start_is_not_run_never_killed(project, tmp_path, monkeypatch):
    monkeypatch.setattr(backends, "_MIN_START_S", 1)
    cut = _run(project, tmp_path, "def kl(log_ratio, beta):\n    return beta / log_ratio\n", budget_s=3, slow_s=30, monkeypatch=monkeypatch)
    assert cut["status"] == "not run" and cut["seconds"] < 20
    late = _run(project, tmp_path, None, budget_s=0.5, monkeypatch=monkeypatch)
    assert late["status"] == "not run" and late["rc"] is None


def test_a_backend_whose_tests_fail_unmutated_gives_no_verdict(project, tmp_path, monkeypatch):
    """main() on a project whose test fails without any mutant: the killed mutants are invalid, and it exits non-zero."""
    (project / "tests" / "test_line.py").write_text("from unsloth_adaptive_kl.line import kl\n\ndef test_kl():\n    assert kl(3.0, 2.0) == 5.0\n")
    target = backends.Target("fake", "unsloth_adaptive_kl/line.py", ("kl",), "code", ("tests/test_line.py",), 60)
    monkeypatch.setattr(backends, "TARGETS", (target,))
    monkeypatch.setattr(sys, "argv", ["mutation_backends.py", str(project), str(tmp_path / "work"), "--jobs", "2"])
    with pytest.raises(SystemExit, match="fail unmutated"):
        backends.main()
    results = json.loads((tmp_path / "work" / "backends.json").read_text())
    assert results and all(r["status"].startswith("invalid") for r in results), results
    assert "baseline killed" in (tmp_path / "work" / "summary.txt").read_text()
    assert len((tmp_path / "work" / "backends.jsonl").read_text().splitlines()) == len(results)


def test_the_summary_of_a_run_in_parts_adds_their_counts(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"counts": {"m.x": {"killed (behaviour)": 9, "survived (behaviour)": 1, "not checked": 2}}}))
    b.write_text(json.dumps({"counts": {"m.y": {"killed (behaviour)": 10, "killed (message)": 3, "survived (message)": 1}}}))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "mutation_summary.py"), "--merge", str(a), str(b)],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "score, behaviour mutants: 19/20 = 95.0 %" in out
    assert "score, message mutants: 3/4 = 75.0 %" in out
    assert "partial: 2 mutants not checked" in out


def test_the_progress_filter_drops_mutmuts_spinner_and_keeps_every_other_line(tmp_path):
    spinner = "\r".join(f"{c} Running stats" for c in "⠋⠙⠹⠸") + "\r"
    progress = "".join(f"\r⠦ {i}/9  🎉 {i} 🙁 0" for i in range(1, 10))
    raw = f"part 1: core\n{spinner}    done\nRunning mutation testing\n{progress}\n0.5 mutations/second\n"
    log = tmp_path / "log.txt"
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu", "progress_filter.py"), str(log)],
                         input=raw.encode(), capture_output=True, check=True).stdout.decode()  # fmt: skip
    lines = out.splitlines()
    assert lines[:4] == ["part 1: core", "Running stats", "    done", "Running mutation testing"]
    # the first progress line (shown at once), the last one (before the next line), nothing between
    assert lines[4:] == ["⠦ 1/9  🎉 1 🙁 0", "⠦ 9/9  🎉 9 🙁 0", "0.5 mutations/second"]
    assert log.read_text().splitlines() == lines


def test_a_strings_and_code_target_mutates_replacement_strings_assigned_lines_and_code_but_never_a_messages_text(tmp_path):
    """The reward placement's target ("strings+code"): a function building a Rewrite has its replacement's strings
    mutated (not the upstream anchor it repeats), an assignment of source lines every string in it, any other function
    its code lines with the string literals (a message's text, f-strings whole) left out; the target's own operators
    apply beside the common ones."""
    source = textwrap.dedent('''\
        EXTRA = {"a": "    x = y - z\\n"}


        def rewrites():
            return Rewrite("T.f", "lib", "    a = b\\n", "    a = b\\n    c = a * d\\n", "why")


        def code(x, y):
            """Docstring: a - b."""
            if x != y:
                raise ValueError(f"x - y is {x - y}, not " + "a == b")
            return x - y  # a comment: x - y
        ''')
    target = backends.Target("fake", "m.py", ("rewrites", "EXTRA", "code"), "strings+code", (), 60, lines=r"\S",
                             operators=((r"\by\b", "x"),))  # fmt: skip
    data = source.encode()
    found = {data[a:b].decode() for a, b in backends.segments(source, target)}
    assert found == {'"    x = y - z\\n"', '"    a = b\\n    c = a * d\\n"', "    if x != y:", "        raise ValueError(",
                     " + ", ")", "    return x - y  "}, found  # fmt: skip
    (tmp_path / "m.py").write_text(source)
    lines = sorted((m["line"], m["original"], m["replacement"]) for m in backends.mutants(str(tmp_path), target))
    # the docstring, the f-string's {x - y}, the message and the comment give none; the + joining two messages is code
    assert lines == [(1, "-", "+"), (1, "y", "x"), (5, "*", "/"), (10, "!=", "=="), (10, "y", "x"), (11, "+", "-"),
                     (12, "-", "+"), (12, "y", "x")], lines  # fmt: skip
