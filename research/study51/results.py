"""Study 51, part B's results section on its page (docs/evidence/study51-real-model.md, "### Part B: results"): the
readout's table (``arms_report.py``), the predictions' check (``predictions.py``) and the figure, written from the
streams once every list of the part has been filed, and only then.

    python research/study51/results.py              # prints the section from research/data/study51-b-*
    python research/study51/results.py --write      # writes it on the page (and the figure beside it)

Part B's lists are phase 1's 20 (``study51-b-sS-{a,b,c,d}``) and phase 2's 8 (``study51-b-t-NAME-s{0,3}``), their
names ``partb_lists.py``'s. ``--write`` refuses, naming what is missing, while a list has no folder in research/data
holding its stream (``NAME-stream.jsonl.gz``, as ``file_pair.sh`` files it):
no result of part B is written before its runs are complete (the page's rule). The section sits between two
markers under its heading; writing again replaces what is between them, and the prose a reader adds after the second
marker stays. research/tests/test_study51_results.py checks that the page holds the section exactly when every list
is filed, and that what it holds is what this file makes from the data.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from research.evidence_answer import RESULTS_51  # noqa: E402
from research.study51 import arms_report, figure, partb_lists, predictions  # noqa: E402

PAGE = os.path.join(ROOT, "docs", "evidence", "study51-real-model.md")
DATA = os.path.join(ROOT, "research", "data")
HEADING = RESULTS_51  # the one-screen answer reads the section under it
MARKER = "<!-- part-b-results -->"
FIGURE = "study51-figure.png"


def lists() -> list[str]:
    """Every list of part B, by name: phase 1's and phase 2's (the kl_target does not enter a name)."""
    phase1 = partb_lists.grid_lists(5e-05, "constant", 0.5)
    phase2 = partb_lists.target_lists(5e-05, "constant", 0.01)
    return sorted(phase1) + sorted(phase2)


def missing(data: str = DATA) -> list[str]:
    """The lists not filed: no folder, or a folder without the list's stream."""
    return [name for name in lists() if not glob.glob(os.path.join(data, name, f"{name}-stream.jsonl*"))]


def directories(data: str = DATA) -> list[str]:
    return [os.path.join(data, name) for name in lists()]


def section(dirs: list[str], planned: int = 100) -> str:
    """The text between the markers: the readout's title as a sentence, its table, the predictions and the figure."""
    title, _blank, table = arms_report.report(dirs, planned).split("\n", 2)
    return "\n".join([
        f"*{title.removeprefix('# ')}; made by `python research/study51/results.py --write` from "
        f"`research/data/study51-b-*`.*", "", table.rstrip("\n"), "",
        "**The predictions** (written before any run; checked by `research/study51/predictions.py`, each by the rule "
        "its sentence states):", "", predictions.report(dirs, planned).rstrip("\n"), "",
        f"![Study 51 part B: final reward, KL and median length per arm; reward, length and β per step]({FIGURE})"])


def with_section(page: str, body: str) -> str:
    """The page with ``body`` between its markers under the results heading; the heading and markers are appended at the
    end of the page the first time."""
    block = f"{MARKER}\n{body}\n{MARKER}"
    if MARKER not in page:
        return page.rstrip("\n") + f"\n\n\n{HEADING}\n\n{block}\n"
    before, _old, after = page.split(MARKER)
    if not before.rstrip("\n").endswith(HEADING):
        raise ValueError(f"{MARKER} does not follow the heading {HEADING!r} on the page: allowed: the section as this "
                         "file writes it")
    return f"{before}{block}{after}"


def held(page: str) -> str | None:
    """The section's body the page holds, or None without one."""
    if MARKER not in page:
        return None
    return page.split(MARKER)[1].strip("\n")


def write(data: str = DATA, page_path: str = PAGE, planned: int = 100) -> None:
    absent = missing(data)
    if absent:
        raise SystemExit(f"part B is not complete: {len(absent)} of its {len(lists())} lists have no stream in {data} "
                         f"({', '.join(absent)}): its results are written only after every list has run")
    dirs = directories(data)
    with open(page_path) as f:
        page = f.read()
    with open(page_path, "w") as f:
        f.write(with_section(page, section(dirs, planned)))
    figure.draw(figure.figure_data(dirs, planned), os.path.join(os.path.dirname(page_path), FIGURE))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="write the section on the page, and the figure")
    parser.add_argument("--data", default=DATA, help="where the lists' folders are (default research/data)")
    parser.add_argument("--steps", type=int, default=100, help="the runs' planned steps (default 100)")
    args = parser.parse_args(argv)
    if args.write:
        write(args.data, PAGE, args.steps)
    else:
        absent = missing(args.data)
        if absent:
            raise SystemExit(f"part B is not complete: missing {', '.join(absent)}")
        print(section(directories(args.data), args.steps))


if __name__ == "__main__":
    main()
