"""Study 51 part B's results section (research/study51/results.py): written only once every list of the part is
filed, under its heading between two markers, replaced whole on a second write, read by the one-screen answer; and
the page holds it exactly when research/data holds every list, with what the data give."""

from __future__ import annotations

import gzip

import pytest

from research import evidence_answer
from research.study51 import arms_report, predictions, results
from test_study51_predictions import write_study


def test_part_b_has_the_28_lists_its_two_phases_write():
    names = results.lists()
    assert len(names) == len(set(names)) == 28
    assert [n for n in names if n.startswith("study51-b-s")] == [f"study51-b-s{s}-{p}" for s in range(5) for p in "abcd"]
    controllers = ("target", "ziegler")  # not a registry list: phase 2's two controllers, as the page names them
    assert sorted(n for n in names if n.startswith("study51-b-t-")) == sorted(
        f"study51-b-t-{m}{b}-s{first}" for m in controllers for b in ("001", "1") for first in (0, 3))


def test_writing_is_refused_while_a_list_has_no_stream(tmp_path):
    """A list is filed when its folder holds its stream: a missing folder, or a folder without the stream, refuses."""
    data = tmp_path / "data"
    for name in results.lists()[:-2]:
        filed(data / name)
    (data / results.lists()[-1]).mkdir()  # a folder, but no stream in it
    page = tmp_path / "page.md"
    page.write_text("# Study 51\n")
    with pytest.raises(SystemExit, match="2 of its 28 lists have no stream in .*study51-b-t-ziegler1-s0, study51-b-t-ziegler1-s3"):
        results.write(str(data), str(page))
    assert page.read_text() == "# Study 51\n"


def filed(directory):
    """A list's folder with an empty stream (no run), as a filed list's folder holds its stream."""
    directory.mkdir(parents=True)
    with gzip.open(directory / f"{directory.name}-stream.jsonl.gz", "wt"):
        pass


@pytest.fixture()
def complete(tmp_path):
    """Every list filed: the synthetic study's stream in the first list's folder, the others' streams empty."""
    data = tmp_path / "data"
    names = results.lists()
    write_study(data / names[0])
    for name in names[1:]:
        filed(data / name)
    return data


def test_the_section_is_the_readout_the_predictions_and_the_figure(complete, tmp_path):
    pytest.importorskip("matplotlib")
    page = tmp_path / "page.md"
    page.write_text("# Study 51\n\nThe pre-registration.\n")
    results.write(str(complete), str(page))
    text = page.read_text()
    dirs = results.directories(str(complete))
    body = results.section(dirs)
    assert text == f"# Study 51\n\nThe pre-registration.\n\n\n{results.HEADING}\n\n{results.MARKER}\n{body}\n{results.MARKER}\n"
    table = arms_report.report(dirs).split("\n", 2)[2].rstrip("\n")
    assert table in body and predictions.report(dirs).rstrip("\n") in body
    assert body.startswith("*Study 51, part B (100 planned steps; final window: the last 25% of them; best window: 10 steps)")
    assert (tmp_path / results.FIGURE).stat().st_size > 10_000
    # the one-screen answer reads the section's table
    s51 = evidence_answer.study_51(text)
    assert s51["best"]["label"] == "none β 0.04" and len(s51["controllers"]) == 9 and s51["family"] == 13
    # a second write replaces the section and keeps the prose after it
    page.write_text(text + "\nWhat the numbers say, in words.\n")
    results.write(str(complete), str(page))
    assert page.read_text() == text + "\nWhat the numbers say, in words.\n"


def test_a_marker_away_from_its_heading_is_refused():
    with pytest.raises(ValueError, match="does not follow the heading '### Part B: results'"):
        results.with_section(f"# Page\n\n{results.MARKER}\nold\n{results.MARKER}\n", "new")


def test_the_page_holds_part_bs_results_exactly_when_every_list_is_filed():
    page = open(results.PAGE).read()
    absent = results.missing()
    if absent:
        assert results.held(page) is None and results.HEADING not in page, (
            f"the page holds part B's results while {len(absent)} lists are not filed ({', '.join(absent[:3])}, ...)")
    else:
        assert results.held(page) == results.section(results.directories()), (
            "the page's part B results are not what the data give: run `python research/study51/results.py --write`")
