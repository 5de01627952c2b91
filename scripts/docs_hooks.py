"""MkDocs hooks (mkdocs.yml, ``hooks:``): the site's generated parts, made at build time.

A page holds one as a block: a line ``<!-- generated: NAME -->``, the generated text, and a line
``<!-- end generated: NAME -->``. The text is committed in the page, so GitHub shows it as the site does;
the hook replaces the block with the text made anew at build time, ``python scripts/docs_hooks.py docs``
rewrites the pages' blocks, and tests/test_docs.py fails while a page's block differs from its generator's
output. (A lone ``<!-- generated: NAME -->`` line, with no end line, is replaced too.) The blocks:

- ``shaping-table``: the README's shaping-method table (between its ``<!-- shaping-table -->``
  markers, which tests/test_shaping.py checks against the registry);
- ``supported-versions-table``: ``versions.supported_versions_table()`` (the README holds the same
  text, checked by tests/test_versions.py);
- ``guarded-versions-table``: which libraries of ``versions.SUPPORTED`` are refused outside their range;
- ``api-reference``: one mkdocstrings block per name of ``unsloth_adaptive_kl.__all__``;
- ``fields-table``, ``controller-table``, ``estimator-table``: the ``GRPOConfig`` fields, the built-in β
  controllers and the built-in KL estimators, read from the registries (``config.FIELDS`` and the
  declarations of :mod:`unsloth_adaptive_kl.declarations`): a controller, estimator or parameter added to its
  registry is on the site with no page edited.

The README, which GitHub shows as it is, holds the controller table as text between two
``<!-- controller-table -->`` markers: ``python scripts/docs_hooks.py readme`` rewrites it from the registry,
and tests/test_docs.py fails while it differs.

An unknown NAME fails the build, and so does a dead relative link (:func:`site_links`): a link to a file that does
not exist, or to one the site leaves out (``exclude_docs``: the raw data; a file outside ``docs/``), which on the
site becomes its repository path as text, since ``mkdocs build --strict`` does not see those. ``versions.py`` is loaded from its file and ``__all__`` is read from
``__init__.py``'s syntax tree. The registry tables import the package's core (torch, no TRL): its modules are
loaded under a bare package, so building the docs never patches TRL.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "unsloth_adaptive_kl"
MARKER = re.compile(r"^<!-- generated: ([\w-]+) -->$", re.M)
#: Documented on the API page besides ``__all__``: the Liger drop-in, imported from its module.
API_EXTRA = ("unsloth_adaptive_kl.backends.liger.AdaptiveFusedLinearGRPOLoss",)


def _versions():
    """``unsloth_adaptive_kl/versions.py`` as a module of its own (it imports only packaging)."""
    name = "_uakl_docs_versions"
    spec = importlib.util.spec_from_file_location(name, PACKAGE / "versions.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolves its string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _core(module: str):
    """``unsloth_adaptive_kl.<module>`` (a core module: torch only). Where the package is not imported yet, its
    modules load under a bare package, without ``__init__.py`` (which imports TRL and patches it)."""
    if "unsloth_adaptive_kl" not in sys.modules:
        package = types.ModuleType("unsloth_adaptive_kl")
        package.__path__ = [str(PACKAGE)]
        sys.modules["unsloth_adaptive_kl"] = package
    return importlib.import_module(f"unsloth_adaptive_kl.{module}")  # controllers registers every built-in, 'target' too


def _cell(text: str) -> str:
    """``text`` for a Markdown table cell: reST's ``code`` and :role:`name` as Markdown code, pipes escaped."""
    text = re.sub(r":\w+:`~?([^`]+)`", lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", str(text))
    return text.replace("``", "`").replace("|", "\\|").replace("\n", " ")


def _readers() -> dict[str, list[str]]:
    """Each built-in parameter's readers, in words (``config.parameter_readers``): the shaping methods, β controllers
    and estimators that read it."""
    suffix = {"shaping": "", "controller": " (β controller)", "estimator": " (estimator)"}
    return {parameter: [f"`{name}`{suffix[kind]}" for kind, name in readers]
            for parameter, readers in _core("config").parameter_readers(builtin=True).items()}


def fields_table() -> str:
    """Every field ``trl.GRPOConfig`` gains (``config.FIELDS``): default, who reads it, what is allowed, its help."""
    config = _core("config")
    declared = {p.name: p for p in config.registered_parameters(builtin=True)}
    readers = _readers()
    rows = ["| field | default | read by | allowed, and what it does |", "|---|---|---|---|"]
    for field in config.FIELDS:
        parameter = declared.get(field.name)
        allowed = ""
        if parameter is not None:
            allowed = parameter.allowed + (f", ≤ `{parameter.at_most}`" if parameter.at_most else "") + ". "
        default = "`None`" if field.default is None else f"`{field.default!r}`".replace("'", '"')
        rows.append(f"| `{field.name}` | {default} | {', '.join(readers.get(field.name, [])) or '—'} | {_cell(allowed + field.help)} |")
    return "\n".join(rows)


def controller_table() -> str:
    """The built-in β controllers of ``controllers.CONTROLLERS``, with their parameters."""
    controllers = _core("controllers")
    rows = ["| β controller | parameters | what it does |", "|---|---|---|"]
    for name in controllers.controller_names():
        spec = controllers.CONTROLLERS[name]
        if spec.builtin:
            rows.append(f"| `{name}` | {', '.join(f'`{p.name}`' for p in spec.parameters)} | {_cell(spec.summary)} |")
    return "\n".join(rows)


def estimator_table() -> str:
    """The built-in KL estimators of ``estimators.ESTIMATORS``, with their aliases and parameters."""
    estimators = _core("estimators")
    rows = ["| estimator | also | parameters | what it is |", "|---|---|---|---|"]
    for name in estimators.builtin_estimator_names():
        spec = estimators.ESTIMATORS[name]
        also = ", ".join(f"`{a}`" for a in estimators.estimator_aliases(name))
        rows.append(f"| `{name}` | {also} | {', '.join(f'`{p.name}`' for p in spec.parameters)} | {_cell(spec.summary)} |")
    return "\n".join(rows)


def exported_names() -> list[str]:
    """``unsloth_adaptive_kl.__all__``, read from ``__init__.py`` without importing it."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise RuntimeError(f"{PACKAGE / '__init__.py'} has no __all__ = [...] assignment")


def shaping_table() -> str:
    readme = (ROOT / "README.md").read_text()
    parts = readme.split("<!-- shaping-table -->")
    if len(parts) != 3:
        raise RuntimeError(f"README.md must hold exactly one table between two <!-- shaping-table --> markers (found {len(parts) - 1} markers)")
    return parts[1].strip()


def supported_versions_table() -> str:
    return _versions().supported_versions_table()


def guarded_versions_table() -> str:
    versions = _versions()
    rows = ["| library | range | outside the range |", "|---|---|---|"]
    for s in versions.SUPPORTED.values():
        outcome = "refused: `PatchError` (unless `UNSLOTH_ADAPTIVE_KL_ALLOW_UNTESTED=1`)" if s.guarded else "reported by `doctor` only"
        rows.append(f"| {s.distribution} | `{s.specifier}` ({s.label}) | {outcome} |")
    return "\n".join(rows)


def api_reference() -> str:
    blocks = [f"::: unsloth_adaptive_kl.{name}" for name in exported_names()]
    blocks += [f"::: {path}\n    options:\n      show_root_full_path: true" for path in API_EXTRA]
    return "\n\n".join(blocks)


GENERATORS = {
    "shaping-table": shaping_table,
    "supported-versions-table": supported_versions_table,
    "guarded-versions-table": guarded_versions_table,
    "api-reference": api_reference,
    "fields-table": fields_table,
    "controller-table": controller_table,
    "estimator-table": estimator_table,
}


#: A generated block as committed in a page: the start line, the text, the end line.
BLOCK = re.compile(r"^<!-- generated: ([\w-]+) -->\n((?:(?!<!-- generated: ).)*?)\n?<!-- end generated: \1 -->$", re.M | re.S)


def _generated(name: str, where: str) -> str:
    if name not in GENERATORS:
        raise ValueError(f"{where}: unknown generated block {name!r} (known: {sorted(GENERATORS)})")
    return GENERATORS[name]()


def render(markdown: str, where: str = "") -> str:
    """``markdown`` with every generated block (or lone ``<!-- generated: NAME -->`` line) replaced by its text."""
    markdown = BLOCK.sub(lambda m: _generated(m.group(1), where), markdown)
    return MARKER.sub(lambda m: _generated(m.group(1), where), markdown)


def with_generated_blocks(markdown: str, where: str = "") -> str:
    """``markdown`` with each generated block's text made anew, its markers kept (what a page should commit); a lone
    start line becomes a block."""
    def block(name: str) -> str:
        return f"<!-- generated: {name} -->\n{_generated(name, where)}\n<!-- end generated: {name} -->"

    parts, last = [], 0
    for match in BLOCK.finditer(markdown):  # the blocks, then the lone start lines between them
        parts += [MARKER.sub(lambda m: block(m.group(1)), markdown[last : match.start()]), block(match.group(1))]
        last = match.end()
    return "".join(parts) + MARKER.sub(lambda m: block(m.group(1)), markdown[last:])


# -- links the site would leave dead ----------------------------------------------------------------------------
DOCS = ROOT / "docs"
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```[^\n]*$", re.M | re.S)


def excluded_dirs() -> tuple[str, ...]:
    """The folders of mkdocs.yml's ``exclude_docs`` (relative to docs/): in the repository, not on the site."""
    block = (ROOT / "mkdocs.yml").read_text().split("\nexclude_docs: |\n", 1)[1]
    lines = []
    for line in block.splitlines():
        if not line.startswith("  "):
            break
        lines.append(line.strip())
    return tuple(line for line in lines if line)


def site_pages() -> list[Path]:
    """Every Markdown page of the site: docs/ and its folders, less those ``exclude_docs`` leaves out."""
    excluded = tuple(d.rstrip("/") for d in excluded_dirs())
    return sorted(p for p in DOCS.rglob("*.md") if not str(p.relative_to(DOCS)).startswith(tuple(f"{d}/" for d in excluded)))


def site_links(markdown: str, page: str) -> str:
    """``markdown`` (the page ``page``, relative to docs/) with each relative link checked: ValueError for a target
    that does not exist; a link to a file the site leaves out (under ``exclude_docs``, or outside docs/) becomes its
    repository path as code, which a reader of the site can open in the repository. Fenced code is left alone."""
    excluded = excluded_dirs()
    folder = Path(page).parent

    def check(match: re.Match) -> str:
        image, text, target = match.groups()
        if re.match(r"^[a-zA-Z][\w+.-]*:", target) or target.startswith("#"):
            return match.group(0)
        relative = Path(os.path.normpath(folder / target.split("#", 1)[0]))
        path = (DOCS / relative).resolve()
        if not path.exists():
            raise ValueError(f"{page}: dead link {target!r} (no file {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path})")
        inside = path.is_relative_to(DOCS)
        if inside and not any(str(relative).startswith(d.rstrip("/") + "/") for d in excluded):
            return match.group(0)
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        return f"{text} (`{where}` in the repository)" if not image else f"(image `{where}` in the repository)"

    parts, last = [], 0
    for fence in FENCE.finditer(markdown):
        parts.append(LINK.sub(check, markdown[last : fence.start()]))
        parts.append(fence.group(0))
        last = fence.end()
    parts.append(LINK.sub(check, markdown[last:]))
    return "".join(parts)


#: A Sphinx role the docstrings use (``:func:`~pkg.mod.name```), as Markdown renders it.
SPHINX_ROLE = re.compile(r":(?:func|class|meth|attr|data|mod|exc|obj):<code>(~?)([^<]+)</code>")


def plain_roles(html: str) -> str:
    """The docstrings' Sphinx markup as a reader should see it: ``:meth:`~a.B.c``` as ``c`` in code
    (the full path without ``~``), and a paragraph ending in ``::`` (reST's literal block) with one colon."""
    html = SPHINX_ROLE.sub(lambda m: f"<code>{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}</code>", html)
    return html.replace("::</p>", ":</p>")


def on_page_markdown(markdown, page, config, files):
    return site_links(render(markdown, page.file.src_uri), page.file.src_uri)


def on_page_content(html, page, config, files):
    return plain_roles(html)


README_BLOCKS = {"controller-table": controller_table}


def readme_with_generated_blocks(readme: str) -> str:
    """``readme`` with the text between each pair of ``<!-- NAME -->`` markers of :data:`README_BLOCKS` made anew."""
    for name, generator in README_BLOCKS.items():
        marker = f"<!-- {name} -->"
        parts = readme.split(marker)
        if len(parts) != 3:
            raise RuntimeError(f"README.md must hold exactly two {marker} markers (found {len(parts) - 1})")
        readme = f"{parts[0]}{marker}\n{generator()}\n{marker}{parts[2]}"
    return readme


if __name__ == "__main__":
    if sys.argv[1:] == ["readme"]:
        path = ROOT / "README.md"
        path.write_text(readme_with_generated_blocks(path.read_text()))
    elif sys.argv[1:] == ["docs"]:
        for path in site_pages():
            text = path.read_text()
            made = with_generated_blocks(text, path.name)
            if made != text:
                path.write_text(made)
    else:
        sys.exit(
            "usage: python scripts/docs_hooks.py readme|docs   (rewrites README.md's, or docs/*.md's, generated tables "
            "from the registries)"
        )
