"""The README and the documentation site (mkdocs.yml, docs/): the README stays short, its links
resolve, its Liger example runs as written, and the site's generated parts (scripts/docs_hooks.py)
are the registries' and versions.py's. `mkdocs build --strict` itself runs in .ci/run."""

import importlib.util
import math
import re
from pathlib import Path

import pytest

import unsloth_adaptive_kl
from unsloth_adaptive_kl import versions

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading (the site uses the same: mkdocs.yml's toc slugify)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_the_readmes_controller_table_is_the_registrys():
    hooks = _hooks()
    assert hooks.readme_with_generated_blocks(README) == README, (
        "README.md's table between the <!-- controller-table --> markers is not the registry's: run "
        "`python scripts/docs_hooks.py readme`"
    )


def test_the_readme_is_at_most_12_kb():
    assert len(README.encode()) <= 12 * 1024, f"README.md is {len(README.encode())} bytes: move detail into docs/"


def test_every_relative_link_of_the_readme_resolves_with_its_anchor():
    links = re.findall(r"\]\(((?!https?:)[^)#\s]+)(#[^)\s]+)?\)", README)
    assert len(links) > 20
    for path, anchor in links:
        target = ROOT / path
        assert target.exists(), f"README links {path}, which does not exist"
        if anchor:
            headings = re.findall(r"^#{1,6} (.+)$", target.read_text(), re.M)
            assert anchor[1:] in {_github_anchor(h) for h in headings}, f"README links {path}{anchor}: no such heading"


def test_the_readme_keeps_its_two_commands():
    assert "bash scripts/quickstart.sh    # the main job" in README
    assert "bash scripts/test.sh          # the test suite" in README


def test_the_readme_liger_example_runs_as_written(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    section = README.split("### The Liger module")[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace = {}
    exec(compile(code, "README.md (the Liger module)", "exec"), namespace)
    assert math.isfinite(namespace["loss"].item()) and namespace["hidden"].grad is not None
    assert namespace["loss_fn"].adaptive_kl.method.shaping == ("clip",)
    assert namespace["kl_mean"].item() > 0


def test_the_api_page_documents_every_exported_name():
    hooks = _hooks()
    assert hooks.exported_names() == list(unsloth_adaptive_kl.__all__)
    page = hooks.render("<!-- generated: api-reference -->")
    documented = re.findall(r"^::: (\S+)$", page, re.M)
    assert documented[: len(unsloth_adaptive_kl.__all__)] == [f"unsloth_adaptive_kl.{n}" for n in unsloth_adaptive_kl.__all__]
    assert "unsloth_adaptive_kl.backends.liger.AdaptiveFusedLinearGRPOLoss" in documented


def test_the_sites_generated_tables_are_the_readmes_and_versions_pys():
    hooks = _hooks()
    assert hooks.render("<!-- generated: supported-versions-table -->") == versions.supported_versions_table()
    shaping = hooks.render("<!-- generated: shaping-table -->")
    assert shaping == README.split("<!-- shaping-table -->")[1].strip() and "| `clip` |" in shaping
    guarded = hooks.render("<!-- generated: guarded-versions-table -->").splitlines()[2:]
    assert [row.split(" | ")[0].strip("| ") for row in guarded] == list(versions.SUPPORTED)
    for row in guarded:
        assert ("refused" in row) == versions.SUPPORTED[row.split(" | ")[0].strip("| ")].guarded, row


def test_every_generated_block_a_page_asks_for_exists_and_an_unknown_one_fails_the_build():
    hooks = _hooks()
    asked = {name for page in (ROOT / "docs").glob("*.md") for name in hooks.MARKER.findall(page.read_text())}
    assert asked == set(hooks.GENERATORS)
    with pytest.raises(ValueError, match="methods.md: unknown generated block 'shaping-tabel'"):
        hooks.render("<!-- generated: shaping-tabel -->", "methods.md")


def test_every_docs_page_is_in_the_sites_nav():
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:\n")[1]
    listed = set(re.findall(r":\s*(\S+\.md)\s*$", nav, re.M))
    docs = ROOT / "docs"  # the pages: docs/*.md and the evidence pages docs/evidence/*.md (not the raw data's reports)
    pages = {p.relative_to(docs).as_posix() for pattern in ("*.md", "evidence/*.md") for p in docs.glob(pattern)}
    assert pages == listed, f"not in mkdocs.yml's nav: {sorted(pages - listed)}; in the nav without a page: {sorted(listed - pages)}"


def _list_layout_problems(text: str) -> list[str]:
    """Where Python-Markdown (the site) would not render a list that GitHub does: a list right
    after a paragraph line (it needs a blank line first) and a nested item indented by fewer than 4
    spaces (it becomes a sibling)."""
    problems, fence, lines = [], False, text.split("\n")
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if fence or i == 0:
            continue
        previous = lines[i - 1]
        if re.match(r"([-*+]|\d+\.) ", line) and previous.strip() and not re.match(r"\s*([-*+]|\d+\.) |\s|\|", previous):
            problems.append(f"line {i + 1}: a list right after a paragraph (add a blank line): {line[:40]!r}")
        if re.match(r" {1,3}([-*+]|\d+\.) ", line):
            problems.append(f"line {i + 1}: a nested list item indented by fewer than 4 spaces: {line[:40]!r}")
    return problems


def test_the_layout_check_finds_what_the_site_would_flatten():
    assert len(_list_layout_problems("Some text:\n- an item\n  - a nested item\n\n- fine\n    - fine")) == 2


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_every_list_of_the_docs_renders_on_the_site(page):
    assert _list_layout_problems((ROOT / "docs" / page).read_text()) == []
