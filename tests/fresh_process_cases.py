"""Several test cases that each need a fresh Python process (``import unsloth_adaptive_kl`` patches TRL process-wide),
run in one: a process imports torch, transformers and TRL (~9 s of CPU), the cases' own work is small.

``run_cases(preamble, cases)`` runs ``preamble`` (what must happen before the cases, e.g. objects made before the
import), then each case's code in its own function, in order. Before a case, a line naming it goes to stdout and to
stderr, so that each case's output can be told apart; a case that raises prints its traceback and ``CASE FAILED``
and does not stop the next. Used by tests/test_lifecycle.py and tests/test_config.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap

FAILED = "CASE FAILED"


def script(preamble: str, cases: dict[str, str]) -> str:
    functions = "".join(f"def case_{name}():\n{textwrap.indent(textwrap.dedent(code).strip(), '    ')}\n\n\n" for name, code in cases.items())
    runner = f"""
import sys as _sys, traceback as _traceback
for _name in {list(cases)!r}:
    print("=== case", _name, flush=True)
    print("=== case", _name, file=_sys.stderr, flush=True)
    try:
        globals()["case_" + _name]()
    except BaseException:  # a failing case does not stop the next; its test reads this line
        _traceback.print_exc()
        print({FAILED!r}, flush=True)
"""
    return textwrap.dedent(preamble).strip() + "\n\n\n" + functions + runner


def run_cases(preamble: str, cases: dict[str, str], timeout: int = 300) -> tuple[dict[str, str], dict[str, str]]:
    """Each case's stdout and stderr (what the process printed after the case's line); asserts that the process ran
    every case (the preamble did not fail)."""
    proc = subprocess.run([sys.executable, "-c", script(preamble, cases)], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    def split(text):
        parts = text.split("=== case ")[1:]
        return {part.partition("\n")[0]: part.partition("\n")[2] for part in parts}

    stdout, stderr = split(proc.stdout), split(proc.stderr)
    assert list(stdout) == list(stderr) == list(cases), proc.stdout[-2000:] + proc.stderr[-3000:]
    return stdout, stderr
