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
    asked = {name for page in _docs_pages() for name in hooks.MARKER.findall((ROOT / "docs" / page).read_text())}
    assert asked == set(hooks.GENERATORS)
    with pytest.raises(ValueError, match="methods.md: unknown generated block 'shaping-tabel'"):
        hooks.render("<!-- generated: shaping-tabel -->", "methods.md")


def _docs_pages() -> list[str]:
    """Every page of the site, as a path under docs/ (the evidence's studies are in docs/evidence/); the raw
    outputs of the GPU runs (docs/*-data/) are linked files, not pages."""
    docs = ROOT / "docs"
    return sorted(str(p.relative_to(docs)) for p in docs.rglob("*.md") if not p.relative_to(docs).parts[0].endswith("-data"))


def test_every_docs_page_is_in_the_sites_nav():
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:\n")[1]
    listed = set(re.findall(r":\s*(\S+\.md)\s*$", nav, re.M))
    pages = set(_docs_pages())
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


@pytest.mark.parametrize("page", _docs_pages())
def test_every_list_of_the_docs_renders_on_the_site(page):
    assert _list_layout_problems((ROOT / "docs" / page).read_text()) == []


def _relative_links(text: str) -> list[tuple[str, str]]:
    """(path, #anchor or "") of every relative link outside code blocks."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"\]\(((?!https?:|mailto:)[^)#\s]*)(#[^)\s]+)?\)", text)


@pytest.mark.parametrize("page", _docs_pages())
def test_every_relative_link_of_the_docs_resolves_with_its_anchor(page):
    """As the README's: a page moved (the evidence's sections into docs/evidence/, issue 51) leaves no link behind."""
    source = ROOT / "docs" / page
    for path, anchor in _relative_links(source.read_text()):
        target = (source.parent / path).resolve() if path else source
        assert target.exists(), f"{page} links {path}, which does not exist"
        if anchor and target.suffix == ".md":
            headings = re.findall(r"^#{1,6} (.+)$", target.read_text(), re.M)
            assert anchor[1:] in {_github_anchor(h) for h in headings}, f"{page} links {path}{anchor}: no such heading"


def test_every_generated_table_is_committed_in_its_page_as_the_registries_make_it():
    """Issue 52, finding 9: docs/fields.md (linked from the README) and methods.md showed no table on GitHub; the
    tables existed only on the built site. Each page now holds its generated blocks' text between start and end
    markers, and the text is what the registries (and versions.py, the README) make now."""
    hooks = _hooks()
    for page in hooks.site_pages():
        text = page.read_text()
        starts = hooks.MARKER.findall(text)
        assert len(hooks.BLOCK.findall(text)) == len(starts), f"{page.name}: a <!-- generated: NAME --> line without its end line"
        assert hooks.with_generated_blocks(text, page.name) == text, (
            f"docs/{page.name}'s generated tables are not the registries': run `python scripts/docs_hooks.py docs`"
        )
    fields = (ROOT / "docs" / "fields.md").read_text()
    assert "| `kl_adaptation_method` |" in fields and "| `kl_placement` |" in fields
    methods = (ROOT / "docs" / "methods.md").read_text()
    assert "| `schedule` |" in methods and "| `reward_conditioned` |" in methods


def test_a_stale_committed_table_is_made_anew_on_the_site_and_by_the_command():
    hooks = _hooks()
    stale = "before\n<!-- generated: controller-table -->\n| old |\n<!-- end generated: controller-table -->\nafter"
    assert hooks.render(stale) == f"before\n{hooks.controller_table()}\nafter"
    assert hooks.with_generated_blocks(stale) == f"before\n<!-- generated: controller-table -->\n{hooks.controller_table()}\n<!-- end generated: controller-table -->\nafter"


def test_no_relative_link_of_the_docs_is_dead_on_the_site():
    """Issue 52, finding 9: 10 links of the built site pointed to raw data that exclude_docs leaves out, and
    `mkdocs build --strict` did not see them. The hook fails the build on a link to no file, and shows a link to a
    file the site leaves out as its repository path."""
    hooks = _hooks()
    rewritten = 0
    for page in hooks.site_pages():
        name = str(page.relative_to(ROOT / "docs"))
        site = hooks.site_links(hooks.render(page.read_text(), name), name)
        for directory in hooks.excluded_dirs():
            assert not re.search(rf"\]\((\.\./)*{directory}", site), f"{name}: a link into {directory} is left on the site"
        rewritten += site.count("` in the repository)")
    assert rewritten >= 10  # the raw-data links the issue counted, now text
    with pytest.raises(ValueError, match=r"a\.md: dead link 'nope\.md#x'"):
        hooks.site_links("see [x](nope.md#x)", "a.md")
    assert hooks.site_links("```\n[x](nope.md)\n```", "a.md") == "```\n[x](nope.md)\n```"  # code is not a link
    assert hooks.site_links("[data](evidence-data/x.md)", "a.md") if (ROOT / "docs/evidence-data/x.md").exists() else True
    assert hooks.site_links("[ok](fields.md#fields) [web](https://x.org/a)", "a.md") == "[ok](fields.md#fields) [web](https://x.org/a)"


def test_every_built_in_controller_has_its_section_in_methods_and_its_line_in_resume():
    """Issue 52, finding 9: `schedule` and `reward_conditioned` had one generated line each in methods.md, and
    docs/resume.md listed only `dynamic` and `target`. Read from the registry: a new built-in needs both."""
    from unsloth_adaptive_kl.controllers import CONTROLLERS, controller_names

    methods = (ROOT / "docs" / "methods.md").read_text()
    resume = (ROOT / "docs" / "resume.md").read_text()
    for name in (n for n in controller_names() if CONTROLLERS[n].builtin):
        section = methods.split(f"\n## `{name}`\n", 1)
        assert len(section) == 2, f"docs/methods.md has no '## `{name}`' section"
        body = section[1].split("\n## ", 1)[0]
        assert len(body) > 400 and all(p.name in body for p in CONTROLLERS[name].parameters), name
        assert f"`{name}`" in resume, f"docs/resume.md does not say how `{name}` resumes"
