"""Mutation testing of the backends' KL lines, which mutmut does not reach (scripts/mutation.sh runs it).

mutmut mutates Python code, not code held in strings: the replacement strings that ``backends/trl.py`` and
``backends/unsloth.py`` compile into TRL's and Unsloth's loss are text to it. This mutator applies one textual
operator at a time (an arithmetic or comparison operator, ``not``, ``and``, a variable swapped for its sibling, a
divisor dropped) inside those strings (the added lines only, not the upstream lines an anchor repeats) and inside
the Liger module's KL lines; each mutant runs in a copy of the package against its backend's tests. ``reward``:
``backends/reward_placement.py`` (kl_placement="reward"), its replacement strings and its functions' code (the
rewrite runs at import and the Unsloth tests in a worker process, which mutmut's in-process trampolines and test
records would miss), with a message's text left out and operators of its own.

    python scripts/mutation_backends.py ROOT WORKDIR [--jobs N] [--backend trl|unsloth|liger|reward ...] [--budget S] [--list]

A mutant is *killed* when its tests fail (exit 1) or run past the timeout, *survives* when they pass, and is
*invalid* (left out of the score) when it cannot even be collected (exit 2-5, or a collection error: a replacement
that no longer compiles, or that the package refuses when it patches). Each backend's tests also run once unmutated: where they fail, its mutants have no verdict.
``--budget SECONDS``: mutants not finished by then are *not run* (a partial score). Writes each verdict to
WORKDIR/backends.jsonl as it comes, then WORKDIR/backends.json and summary.txt (the score and every survivor).
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

PYTEST = ["-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]


@dataclass(frozen=True)
class Target:
    backend: str
    path: str
    #: Top-level names (``Class.method`` for a method) whose replacement strings (``strings``) or lines (``code``) are mutated.
    names: tuple[str, ...]
    #: "strings", "code", or "strings+code": a name whose statement builds a ``Rewrite`` or is an assignment has its
    #: strings mutated, any other (a function) its code lines.
    kind: str
    tests: tuple[str, ...]
    timeout: int
    #: The code lines mutated (``code``): those that match this (the Liger module's: the lines that handle the KL).
    lines: str = r"kl|coef|beta|adapted|raw"
    #: Operators of this target only, applied beside OPERATORS.
    operators: tuple[tuple[str, str], ...] = ()


#: The reward placement's own: its replacement strings' arguments swapped or dropped, the evaluation's penalty
#: under "train", the boolean operators and flags, the left-packed columns' arithmetic (completion_columns).
REWARD_OPERATORS = (
    (r"\bref_per_token_logps(?=,\n)", "old_per_token_logps"), (r"\bold_per_token_logps(?=,\n)", "ref_per_token_logps"),
    (r"\badaptive_kl_penalty(?=, mode)", "None"), (r"(?m)(?<=[ (])mode(?=\)?,?(?:$|\\n))", "'train'"),
    (r"\bleft_pad_tokens_per_prompt\b", "0 * left_pad_tokens_per_prompt"), (r"(?<=\w) if \w+ is (?:not )?None else [^,\n]+", ""),
    (r"\bor\b", "and"), (r"\bTrue\b", "False"), (r"\bFalse\b", "True"), (r"~", ""), (r"\b0\.0\b", "1.0"),
    (r"\bmin=0, ", ""), (r", max=[^,)]*\)", ")"), (r"\bcumsum\(1\)", "cumsum(0)"), (r"(?<=\s)//(?=\s)", "/"),
    (r"\bmask \* kept\.to\(mask\.dtype\)", "mask"), (r"(?<==)beta\b", "1.0"),
)  # fmt: skip


TARGETS = (
    Target(
        "trl", "unsloth_adaptive_kl/backends/trl.py", ("_kl", "_ADD", "_after_aggregation"), "strings",
        ("tests/backends/test_trl.py", "tests/backends/test_backend_mutants.py", "-k",
         "bit_identical or kl_part_of_the_loss or metrics_match or length_normalized_changes or beta_reaching_zero "
         "or (test_backend_mutants and trl)"),
        900,
    ),
    Target(
        "unsloth", "unsloth_adaptive_kl/backends/unsloth_plan.py", ("_gate", "UNSLOTH_2026_10"), "strings",
        ("tests/backends/test_unsloth_lines.py", "tests/backends/test_unsloth.py", "-k",
         "test_unsloth_lines or kl_part_of_the_fused or metrics_are_exact or sums_hold"),
        1200,
    ),
    Target(
        "liger", "unsloth_adaptive_kl/backends/liger.py",
        ("AdaptiveFusedLinearGRPOLoss._loss_terms", "AdaptiveFusedLinearGRPOLoss._evaluate",
         "AdaptiveFusedLinearGRPOLoss.kl_terms", "AdaptiveFusedLinearGRPOLoss.per_token_kl"), "code",
        ("tests/backends/test_liger.py", "tests/backends/test_backend_mutants.py", "-k",
         "matches_liger_eager or kl_part_matches or straight_through or bottom_q_threshold or beta_zero or padding_with "
         "or loss_class_logs_trls_kl or (loss_class_matches_trl_loss_and_grads and (dapo or luspo)) "
         "or (test_backend_mutants and liger)"),
        900,
    ),
    Target(
        "reward", "unsloth_adaptive_kl/backends/reward_placement.py",
        ("_rewrites", "_LEFT_PAD", "explicit_super", "install", "unavailable_reason", "_dispatch", "completions_per_update",
         "completion_columns", "RewardPlacement.check_placement", "RewardPlacement.scoring_penalty",
         "RewardPlacement.penalized_rewards"), "strings+code",
        ("tests/backends/test_reward_placement_mutants.py", "tests/backends/test_kl_placement.py", "tests/backends/test_unsloth.py",
         "-k", "test_reward_placement_mutants or test_kl_placement or reward_placement or completion_columns "
         "or rewritten_scoring_function_of_the_generated"),
        600, lines=r"\S", operators=REWARD_OPERATORS,
    ),
)  # fmt: skip

#: (pattern, replacement): each match of each pattern in a mutated segment is one mutant.
OPERATORS = (
    (r"(?<=\s)\*(?=\s)", "/"), (r"(?<=\s)/(?=\s)", "*"), (r"(?<=\s)\+(?=\s)", "-"), (r"(?<=\s)-(?=\s)", "+"),
    (r"!=", "=="), (r"==", "!="), (r"\bnot ", ""), (r"\band\b", "or"), (r" if [^\n]*? else None\b", ""),
    (r"\badaptive_kl_adapted\b", "per_token_kl"), (r"\bper_token_kl\b", "adaptive_kl_adapted"),
    (r"\badaptive_kl_i\b", "kl_i"), (r"\brs_keep\b", "None"), (r"\bcurrent_gradient_accumulation_steps\b", "1"),
    (r"\bfloat64\b", "float32"), (r"\braw\b(?= *[,)*])", "adapted"), (r"\badapted\b(?= *[,)*])", "raw"), (r"\bcoef\b(?= *[,)])", "None"),
    (r"\bstatistic\b(?= *[,)])", "None"), (r"\bkl_mask\b(?= *[,)])", "mask"), (r"\{mode\}", '"train"'), (r"\{coef\}", "None"),
    (r"\.clamp\(min=1\.0\)", ""), (r"(?<![.\w])beta\b(?= \*)", "1.0"),
)  # fmt: skip


def _statement(tree: ast.Module, name: str) -> ast.AST:
    owner, _, member = name.partition(".")
    for node in tree.body:
        names = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else [
            t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)
        ]
        if owner in names:
            if not member:
                return node
            return next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == member)
    raise LookupError(name)


def _rewrite_argument(call: ast.Call, index: int, keyword: str):
    for k in call.keywords:
        if k.arg == keyword:
            return k.value
    return call.args[index] if len(call.args) > index else None


def segments(source: str, target: Target) -> list[tuple[int, int]]:
    """Byte ranges of ``source`` to mutate: the replacement strings' literals (``strings``), or the lines of the named
    functions that handle the KL (``code``), comments and docstrings left out."""
    data, tree = source.encode(), ast.parse(source)
    starts = [0]
    for line in data.split(b"\n"):
        starts.append(starts[-1] + len(line) + 1)

    def offset(line, col):
        return starts[line - 1] + col

    out = []
    for name in target.names:
        node = _statement(tree, name)
        rewrites = [n for n in ast.walk(node) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Rewrite"]
        strings = target.kind == "strings" or (target.kind == "strings+code" and (rewrites or isinstance(node, ast.Assign)))
        if strings and not rewrites:  # an assignment of source lines (a dict or tuple of them): every string in it
            keys = {id(k) for d in ast.walk(node.value) if isinstance(d, ast.Dict) for k in d.keys}
            for literal in ast.walk(node.value):
                if isinstance(literal, ast.Constant) and isinstance(literal.value, str) and literal.value and id(literal) not in keys:
                    out.append((offset(literal.lineno, literal.col_offset), offset(literal.end_lineno, literal.end_col_offset)))
        elif strings:
            for call in (n for n in ast.walk(node) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Rewrite"):
                anchor, replacement = _rewrite_argument(call, 2, "anchor"), _rewrite_argument(call, 3, "replacement")
                anchors = {ast.get_source_segment(source, n) for n in ast.walk(anchor) if isinstance(n, ast.Constant)}
                for literal in ast.walk(replacement):
                    if isinstance(literal, (ast.Constant, ast.JoinedStr)) and isinstance(getattr(literal, "value", ""), (str, list)):
                        if isinstance(literal, ast.Constant) and ast.get_source_segment(source, literal) in anchors:
                            continue  # an upstream line the replacement keeps
                        out.append((offset(literal.lineno, literal.col_offset), offset(literal.end_lineno, literal.end_col_offset)))
        else:
            body = node.body[1:] if isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) else node.body
            # a message's text is not code: the string literals of the lines (f-strings whole) are left out
            parts = {id(v) for n in ast.walk(node) if isinstance(n, ast.JoinedStr) for v in n.values}
            texts = sorted((offset(n.lineno, n.col_offset), offset(n.end_lineno, n.end_col_offset)) for n in ast.walk(node)
                           if id(n) not in parts and (isinstance(n, ast.JoinedStr) or (isinstance(n, ast.Constant) and isinstance(n.value, str))))  # fmt: skip
            for line in range(body[0].lineno, node.end_lineno + 1):
                text = data[starts[line - 1] : starts[line] - 1].decode()
                code = text.split("#", 1)[0]
                if re.search(target.lines, code):
                    begin, end = starts[line - 1], starts[line - 1] + len(code.encode())
                    for t0, t1 in texts:
                        if t0 < end and begin < t1:  # a literal on this line: the code before it, then after it
                            if begin < t0:
                                out.append((begin, t0))
                            begin = max(begin, t1)
                    if begin < end:
                        out.append((begin, end))
    # JoinedStr and its parts overlap in 3.11's positions: keep the outermost ranges only
    out = sorted(set(out))
    return [r for r in out if not any(o != r and o[0] <= r[0] and r[1] <= o[1] for o in out)]


def mutants(root: str, target: Target) -> list[dict]:
    source = open(os.path.join(root, target.path)).read()
    data = source.encode()
    found = []
    for start, end in segments(source, target):
        text = data[start:end].decode()
        for pattern, replacement in OPERATORS + target.operators:
            for match in re.finditer(pattern, text):
                mutated = text[: match.start()] + replacement + text[match.end() :]
                new = data[:start] + mutated.encode() + data[end:]
                line = data[:start].count(b"\n") + text[: match.start()].count("\n") + 1
                found.append(dict(backend=target.backend, path=target.path, line=line, original=match.group(0), replacement=replacement,
                                  context=new.decode().splitlines()[line - 1].strip(), source=new.decode()))  # fmt: skip
    return found


def _pytest(target: Target, copy: str, timeout: float) -> int | str:
    """Exit code of ``target``'s tests in ``copy``, or "timeout"; a timed-out run is ended with the processes it
    started (the Unsloth tests' workers), not only pytest."""
    path = copy + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")  # a site stays behind it
    # No bytecode written: a mutant and the pristine source can have the same size and modification second, and a .pyc
    # written for one would then be taken for the other (seen: the baseline after a "*" -> "/" mutant read killed).
    env = dict(os.environ, PYTHONPATH=path, TRITON_INTERPRET="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.Popen([sys.executable, *PYTEST, *target.tests], cwd=copy, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        output = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return "timeout"
    if proc.returncode != 0:
        _last_output[target.backend] = output.decode(errors="replace")[-3000:]
    if proc.returncode == 1 and b"ERROR collecting" in output:
        return 2  # pytest -x given several files exits 1 on a collection error, given one 2: "cannot be collected" either way
    return proc.returncode


_last_output: dict[str, str] = {}


def run_mutant(mutant: dict, root: str, workdir: str, slot: int, target: Target, deadline: float) -> dict:
    """Runs ``mutant`` (``source`` None: the unmutated baseline) in this thread's copy of the package. Past
    ``deadline`` (a time.time()) it is not started, and a run the deadline cuts short is "not run", never "killed"."""
    copy = os.path.join(workdir, f"slot{slot}")
    if not os.path.isdir(copy):
        for part in ("unsloth_adaptive_kl", "tests"):
            shutil.copytree(os.path.join(root, part), os.path.join(copy, part))
    result = {k: v for k, v in mutant.items() if k != "source"}
    start = time.time()
    if deadline - start < _MIN_START_S:
        return result | {"status": "not run", "rc": None, "seconds": 0}
    timeout = min(target.timeout, deadline - start)
    pristine = open(os.path.join(root, target.path)).read()
    path = os.path.join(copy, target.path)
    with open(path, "w") as f:
        f.write(pristine if mutant["source"] is None else mutant["source"])
    try:
        rc = _pytest(target, copy, timeout)
    finally:
        with open(path, "w") as f:
            f.write(pristine)
    if rc == "timeout" and timeout < target.timeout:
        status = "not run"  # stopped by the run's budget, not by its own timeout
    else:
        status = {0: "survived", 1: "killed", "timeout": "killed"}.get(rc, "invalid")
    return result | {"status": status, "rc": rc, "seconds": round(time.time() - start)}


#: A mutant is not started with less of the budget left (the fastest backend's tests take about this long).
_MIN_START_S = 45


def _line(r: dict) -> str:
    return f"{r['status']:8} {r['seconds']:4d}s {r['path']}:{r['line']}: {r['original']!r} -> {r['replacement']!r}   {r['context']}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("workdir")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--backend", action="append", choices=[t.backend for t in TARGETS])
    parser.add_argument("--budget", type=float, help="seconds: mutants not finished by then are left 'not run'")
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    args = parser.parse_args()
    targets = [t for t in TARGETS if not args.backend or t.backend in args.backend]
    # the slowest backend's mutants first (its timeout says which), so that the pool ends with the short ones
    work = [(m, t) for t in sorted(targets, key=lambda t: -t.timeout) for m in mutants(args.root, t)]
    if args.list:
        for m, _ in work:
            print(f"{m['backend']:8} {m['path']}:{m['line']}: {m['original']!r} -> {m['replacement']!r}   {m['context']}")
        print(f"{len(work)} mutants")
        return
    deadline = time.time() + (args.budget if args.budget else 10**9)
    os.makedirs(args.workdir, exist_ok=True)
    # Each backend's tests run once unmutated beside the mutants: a mutant can only be called killed by tests that
    # pass without it (on a machine where they fail, every mutant would read killed).
    baselines = [(dict(backend=t.backend, path=t.path, baseline=True, source=None), t) for t in targets]
    results, baseline = [], {}
    log = open(os.path.join(args.workdir, "backends.jsonl"), "w")  # each verdict as it comes: a run cut short keeps them
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        slots = {}
        futures = {}
        for m, t in baselines + work:
            futures[pool.submit(lambda m=m, t=t: run_mutant(m, args.root, args.workdir, _slot(slots), t, deadline))] = m
        for future in concurrent.futures.as_completed(futures):
            r = future.result()
            if r.get("baseline"):
                baseline[r["backend"]] = r
                print(f"baseline {r['backend']}: {r['status']} (exit {r['rc']}) in {r['seconds']} s", flush=True)
                if r["status"] != "survived":
                    print(_last_output.get(r["backend"], ""), flush=True)
                continue
            results.append(r)
            log.write(json.dumps(r) + "\n")
            log.flush()
            print(_line(r), flush=True)
    for r in results:  # a backend whose tests fail (or were not run) unmutated has no verdicts
        if baseline[r["backend"]]["status"] != "survived" and r["status"] in ("killed", "survived"):
            r["status"] = f"invalid (baseline {baseline[r['backend']]['status']})"
    json.dump(sorted(results, key=lambda r: (r["path"], r["line"])), open(os.path.join(args.workdir, "backends.json"), "w"), indent=1)
    summary = []
    for backend in sorted({r["backend"] for r in results}):
        mine = [r for r in results if r["backend"] == backend]
        killed = sum(r["status"] == "killed" for r in mine)
        scored = sum(r["status"] in ("killed", "survived") for r in mine)
        not_run = sum(r["status"] == "not run" for r in mine)
        summary.append(f"{backend}: {killed}/{scored} killed ({len(mine) - scored - not_run} invalid, {not_run} not run; "
                       f"baseline {baseline[backend]['status']} in {baseline[backend]['seconds']} s)")  # fmt: skip
    for r in sorted((r for r in results if r["status"] == "survived"), key=lambda r: (r["path"], r["line"])):
        summary.append(f"SURVIVED {r['path']}:{r['line']}: {r['original']!r} -> {r['replacement']!r}   {r['context']}")
    print("\n".join(summary))
    with open(os.path.join(args.workdir, "summary.txt"), "w") as f:
        f.write("\n".join(summary) + "\n")
    if any(b["status"] != "survived" for b in baseline.values()):
        sys.exit("a backend's tests fail unmutated: its mutants have no verdict (see its baseline above)")


_lock = __import__("threading").Lock()


def _slot(slots: dict) -> int:
    """A working copy per thread (each thread runs one mutant at a time in its own copy)."""
    import threading

    with _lock:
        return slots.setdefault(threading.get_ident(), len(slots))


if __name__ == "__main__":
    main()
