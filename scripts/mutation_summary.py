"""The score of a mutmut run (scripts/mutation.sh), run in its work directory: counts per module, and every surviving
mutant with its diff, sorted into two kinds:

* ``message``: the mutation changes only the text or the arguments of a log line, a warning or an error message
  (inside a ``logger.*``/``warnings.warn`` call or a ``raise`` statement): what the user reads, not what is computed;
* ``behaviour``: anything else.

The score counts killed (and timed-out) mutants over killed + survived, per kind; mutants no selected test executes
("no tests") and those not run ("not checked", e.g. a run stopped early) are counted apart. Writes survivors.txt.

    python scripts/mutation_summary.py [--json counts.json]      (in a mutmut work directory; a partial run too)
    python scripts/mutation_summary.py --merge A.json B.json ...  (the score of runs made in parts, from their --json)
"""

from __future__ import annotations

import argparse
import ast
import collections
import json

MESSAGE_CALLS = {"warning", "info", "debug", "error", "warn", "exception"}


def message_lines(path: str) -> set[int]:
    """Lines of ``path`` inside a log or warning call or a raise statement."""
    lines = set()
    for node in ast.walk(ast.parse(open(path).read())):
        is_message_call = isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in MESSAGE_CALLS
        if isinstance(node, ast.Raise) or is_message_call:
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def changed_lines(diff: str, path: str) -> list[int]:
    """Original-file line numbers of the lines a ``mutmut show`` diff removes (its hunks are relative to the function)."""
    source = open(path).read().splitlines()
    removed = [line[1:] for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")]
    found = []
    for text in removed:
        found += [i + 1 for i, line in enumerate(source) if line.strip() == text.strip()]
    return found


def print_score(counts: dict[str, collections.Counter]) -> None:
    total = collections.Counter()
    for module in sorted(counts):
        total.update(counts[module])
        print(f"{module}: {dict(sorted(counts[module].items()))}")
    print(f"all: {dict(sorted(total.items()))}")
    for kind in ("behaviour", "message"):
        killed, survived = total[f"killed ({kind})"], total[f"survived ({kind})"]
        print(f"score, {kind} mutants: {killed}/{killed + survived} = {100 * killed / max(killed + survived, 1):.1f} %")
    if total["not checked"]:
        print(f"partial: {total['not checked']} mutants not checked")


def merge(paths: list[str]) -> None:
    counts = collections.defaultdict(collections.Counter)
    for path in paths:
        with open(path) as f:
            for module, numbers in json.load(f)["counts"].items():
                counts[module].update(numbers)
    print_score(counts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="also write the counts per module and the survivors' names to this file")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="print the score of these --json files together")
    args = parser.parse_args()
    if args.merge:
        merge(args.merge)
        return
    # mutmut's own API, in one process (its ``show`` command starts a process per mutant)
    from mutmut.__main__ import status_by_exit_code, walk_mutatable_files
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    counts = collections.defaultdict(collections.Counter)
    survivors = []
    for path in walk_mutatable_files():
        data = SourceFileMutationData(path=path)
        module = str(path)[:-3].replace("/", ".")
        try:
            data.load()
        except json.JSONDecodeError as error:  # a run stopped while it wrote this file: its verdicts are lost
            print(f"{path}: results unreadable ({error}): its mutants are left out")
            counts[module]["unreadable results file"] += 1
            continue
        messages = message_lines(str(path))
        for name, exit_code in data.exit_code_by_key.items():
            status = status_by_exit_code[exit_code]
            if status not in ("killed", "survived", "timeout"):
                counts[module][status] += 1
                continue
            diff = get_diff_for_mutant(name, path=path)
            changed = changed_lines(diff, str(path))
            kind = "message" if changed and all(n in messages for n in changed) else "behaviour"
            counts[module][f"{'killed' if status == 'timeout' else status} ({kind})"] += 1
            if status == "survived":
                survivors.append((kind, name, diff))
    print_score(counts)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"counts": counts, "survivors": {name: kind for kind, name, _ in survivors}}, f, indent=1, sort_keys=True)
    with open("survivors.txt", "w") as f:
        for kind, name, diff in sorted(survivors):
            f.write(f"## {kind}: {name}\n{diff}\n")
    print("survivors and their diffs: survivors.txt")


if __name__ == "__main__":
    main()
