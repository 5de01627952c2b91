"""Rewrite an installed library's function at anchors that must each match exactly once, and the
ledger of everything this package patched.

Each backend declares one :class:`Plan`: a table of :class:`Rewrite` (target, anchor, replacement,
why) per version family (:class:`AnchorSet`). ``patch()`` builds from it and ``doctor`` dry-runs
the same table. Every attribute set on a library goes through :func:`set_attribute` and is
restored exactly by :func:`undo_all`.

Only the installed function's own source is rewritten, with literal replacements written in
this package; no string from a user's config is ever compiled. If an anchor is missing or
ambiguous, :class:`PatchError` names the library, its version and the anchor.
"""

from __future__ import annotations

import ast
import builtins
import importlib.metadata
import inspect
import linecache
import os
import re
import textwrap
from dataclasses import dataclass
from typing import Callable, Mapping

from .versions import Supported, requirement

ALLOW_UNTESTED_ENV = "UNSLOTH_ADAPTIVE_KL_ALLOW_UNTESTED"


class PatchError(RuntimeError):
    """The installed library does not look like what a patch expects."""


def version_of(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def check_version(distribution: str, supported: Callable[[str], bool], supported_text: str) -> str:
    """Raise unless ``distribution``'s version is supported (or the user accepts the risk)."""
    version = version_of(distribution)
    if not supported(version) and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise PatchError(
            f"unsloth_adaptive_kl supports {distribution} {supported_text}, but {distribution} {version} is installed. "
            f"Install a supported version (pip install '{requirement(distribution)}'), or set {ALLOW_UNTESTED_ENV}=1 "
            "to try anyway (every patch anchor is "
            "still checked and a missing one still raises)."
        )
    return version


def rewrite_function(
    func: Callable,
    replacements: list[tuple[str, str]],
    *,
    library: str | tuple[str, ...],
    extra_globals: dict | None = None,
    namespace: dict | None = None,
    label: str = "",
) -> Callable:
    """Return a copy of ``func`` compiled from its source with each ``(anchor, replacement)`` applied.

    Each anchor must occur exactly once in the (dedented) source. The new function runs in a copy
    of the original's module globals (plus ``extra_globals``), or in ``namespace`` when rewrites
    must see each other. ``library`` names the distribution(s) whose versions a failure reports. ``label``
    tells apart several rewrites of one function (each has its own file name, so its own source in linecache).
    """
    libraries = (library,) if isinstance(library, str) else tuple(library)
    installed = " / ".join(f"{name} {version_of(name)}" for name in libraries)
    try:
        source = inspect.getsource(func)  # anchors are matched with the installed file's indentation
    except (OSError, TypeError) as error:
        raise PatchError(f"{installed}: cannot read the source of {func.__qualname__} ({error}); the adaptive KL cannot be applied") from error
    replaced: list[_Replaced] = []  # where each replacement landed, to check the names it reads
    for anchor, replacement in replacements:
        count = source.count(anchor)
        if count != 1:
            raise PatchError(
                f"{installed}: expected the anchor {anchor_text(anchor)!r} exactly once in "
                f"{func.__qualname__}, found it {count} times. This version of {' and '.join(libraries)} is not "
                "supported by unsloth_adaptive_kl; the adaptive KL cannot be applied."
            )
        at = source.index(anchor)
        replaced = [r.shifted(at, len(anchor), len(replacement)) for r in replaced]
        replaced.append(_Replaced(at, at + len(replacement), frozenset(_IDENTIFIER.findall(anchor))))
        source = source[:at] + replacement + source[at + len(anchor) :]
    if namespace is None:
        namespace = dict(func.__globals__)
    namespace.update(extra_globals or {})
    check_free_names(func, source, replaced, namespace, installed=installed, libraries=libraries)
    source = textwrap.dedent(source)
    filename = source_filename(func, label)
    # Registered so that a traceback, pdb and profilers show the rewritten lines (mtime None: kept by checkcache).
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own literal rewrite of installed code
    new = namespace[func.__name__]
    target = getattr(new, "__func__", new)  # a @staticmethod in the source comes back wrapped
    target.__qualname__ = func.__qualname__
    target.__module__ = func.__module__
    target.__wrapped_original__ = func
    target.__wrapped__ = func  # inspect.getsource/signature see the installed original (Unsloth reads them)
    return new


def anchor_text(anchor: str) -> str:
    """An anchor as errors and doctor show it: its first two lines, stripped."""
    return " / ".join(line.strip() for line in anchor.strip().splitlines()[:2])


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class _Replaced:
    """Where one replacement sits in the rewritten source (``[start, end)``), and the identifiers its anchor
    holds (the library's own code: names it reads are the library's to define)."""

    start: int
    end: int
    anchor_names: frozenset[str]

    def shifted(self, at: int, old: int, new: int) -> "_Replaced":
        """This span after ``source[at:at + old]`` is replaced by ``new`` characters (a later anchor that
        overlaps it makes it cover that replacement too)."""
        if self.end <= at:
            return self
        if self.start >= at + old:
            return _Replaced(self.start + new - old, self.end + new - old, self.anchor_names)
        return _Replaced(min(self.start, at), max(self.end + new - old, at + new), self.anchor_names)


def _bound_names(function: ast.AST) -> set[str]:
    """Every name ``function`` binds anywhere (its parameters, assignments, imports, loop and ``with`` targets,
    nested definitions and their parameters): the names it can read as its own."""
    bound = set()
    for node in ast.walk(function):
        if isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not function:
            bound.add(node.name)
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
            bound.add(node.name)
    return bound


def check_free_names(func: Callable, source: str, replaced: list, namespace: Mapping, *, installed: str, libraries) -> None:
    """Raise :class:`PatchError` if a replacement in ``source`` (the rewritten ``func``, still indented as
    installed) reads a name that its anchor does not contain and that the function does not define: not
    a parameter or local of it, nor a global of its module (``namespace``), nor a builtin. Such a name
    is one the library renamed or removed; unchecked, it would fail at the first step as a NameError,
    inside Unsloth's ``torch.compile(fullgraph=True)`` region."""
    tree = ast.parse(textwrap.dedent(source))
    function = next(
        (n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == func.__name__), None
    )
    if function is None:
        return
    own = _bound_names(function) | set(namespace) | set(dir(builtins))
    reads = [n for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in own]
    lines = source.splitlines()
    for r in replaced:
        first, last = source.count("\n", 0, r.start) + 1, source.count("\n", 0, max(r.start, r.end - 1)) + 1
        for node in reads:
            if first <= node.lineno <= last and node.id not in r.anchor_names:
                raise PatchError(
                    f"{installed}: the rewrite of {func.__qualname__} reads {node.id!r} "
                    f"({lines[node.lineno - 1].strip()!r}), which {func.__qualname__} does not define: no parameter, "
                    f"local, global of {func.__module__} or builtin has that name. This version of "
                    f"{' and '.join(libraries)} is not supported by unsloth_adaptive_kl (it renamed or removed "
                    f"{node.id!r}); the adaptive KL cannot be applied."
                )


def source_filename(func: Callable, label: str = "") -> str:
    """The file name a rewritten ``func`` is compiled under, and its source registered in ``linecache`` as:
    ``<unsloth_adaptive_kl:module.Qualified.name>`` (with a ``label``: ``...name[label]>``, one per rewrite). ``inspect.getsource(f.__code__)`` gives the rewritten
    source (``inspect.getsource(f)`` follows ``__wrapped__`` to the installed original, which Unsloth reads)."""
    return f"<unsloth_adaptive_kl:{func.__module__}.{func.__qualname__}{f'[{label}]' if label else ''}>"


# -- the patch ledger ---------------------------------------------------------------------------------
# Every attribute this package sets on a library's class or module goes through set_attribute, which
# records what was there, so that undo_all() restores it exactly (the same object, or no attribute).
_ORIGINALS: list[tuple[object, str, object, bool]] = []


def set_attribute(owner, name: str, value) -> None:
    """``setattr(owner, name, value)``, recorded in the ledger."""
    _ORIGINALS.append((owner, name, owner.__dict__.get(name), name in owner.__dict__))
    setattr(owner, name, value)


def is_patched() -> bool:
    return bool(_ORIGINALS)


def undo_all() -> None:
    """Restore every recorded attribute exactly (identity), in reverse order."""
    while _ORIGINALS:
        owner, name, original_value, had_own = _ORIGINALS.pop()
        if had_own:
            setattr(owner, name, original_value)
        else:
            delattr(owner, name)


def original(owner, name: str):
    """The attribute ``owner.name`` had before this package patched it (the library's own)."""
    for patched_owner, patched_name, value, had_own in _ORIGINALS:
        if patched_owner is owner and patched_name == name:
            return value if had_own else getattr(super(owner, owner), name, None)
    return getattr(owner, name)


# -- patch plans ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rewrite:
    """One source rewrite: in ``target`` (``"Owner.attribute"``, or ``"function"`` of the backend's
    module), the ``anchor`` (which must occur exactly once) becomes ``replacement``."""

    target: str
    library: str  # the distribution whose source holds the anchor (named in errors and by doctor)
    anchor: str
    replacement: str
    why: str


@dataclass(frozen=True)
class AnchorSet:
    """The rewrites for one version family of the patched libraries.

    ``versions`` maps a distribution to the specifier this family covers (``{"trl": ">=1.15,<1.17"}``);
    an empty mapping covers every supported version. Where several families cover the installed
    versions, the one whose anchors all match exactly once is used (exactly one must).
    """

    family: str
    versions: Mapping[str, str]
    rewrites: tuple[Rewrite, ...]

    def covers(self, installed: Callable[[str], str]) -> bool:
        return all(
            Supported(distribution, specifier, specifier, guarded=True).contains(installed(distribution))
            for distribution, specifier in self.versions.items()
        )

    def targets(self) -> dict[str, list[Rewrite]]:
        """The rewrites grouped by target, in table order."""
        grouped: dict[str, list[Rewrite]] = {}
        for rewrite in self.rewrites:
            grouped.setdefault(rewrite.target, []).append(rewrite)
        return grouped


def split_target(target: str) -> tuple[str, str]:
    """``"Owner.attribute"`` -> ``("Owner", "attribute")``; ``"function"`` -> ``("", "function")`` (the module)."""
    owner, _, name = target.rpartition(".")
    return owner, name


def libraries_of(rewrites) -> tuple[str, ...]:
    """The distributions that hold these rewrites' anchors, in table order, each once."""
    return tuple(dict.fromkeys(r.library for r in rewrites))


def compile_target(owners: Mapping[str, object], target: str, rewrites, *, namespace: dict | None = None, label: str = "") -> Callable:
    """The library's own function at ``target`` compiled with ``rewrites`` applied (installed nowhere):
    what ``Plan.build`` does per target and ``doctor`` dry-runs (``label``: see :func:`rewrite_function`)."""
    return rewrite_function(
        resolve(owners, target),
        [(r.anchor, r.replacement) for r in rewrites],
        library=libraries_of(rewrites),
        namespace=namespace,
        label=label,
    )


@dataclass(frozen=True)
class Plan:
    """Everything one backend rewrites: a table of :class:`Rewrite` per version family.

    ``patch()`` builds the rewritten functions from it and ``doctor`` dry-runs it; ``owners`` maps
    each owner name of a target (``""`` for the module itself) to the live object.
    """

    backend: str
    anchor_sets: tuple[AnchorSet, ...]

    def select(self, owners: Mapping[str, object], installed: Callable[[str], str] | None = None) -> AnchorSet:
        """The anchor set for the installed versions; PatchError naming the library and version otherwise."""
        installed = installed or version_of  # looked up now: tests replace version_of to fake versions
        covering = [s for s in self.anchor_sets if s.covers(installed)]
        if not covering and os.environ.get(ALLOW_UNTESTED_ENV) == "1":
            covering = list(self.anchor_sets)  # an untested version: whichever family's anchors all match
        elif not covering:
            libraries = libraries_of(r for s in self.anchor_sets for r in s.rewrites)
            shown = " / ".join(f"{name} {installed(name)}" for name in libraries)
            families = ", ".join(s.family for s in self.anchor_sets)
            raise PatchError(
                f"{shown}: no anchor set of the {self.backend} backend covers this version (it has: {families}); "
                f"install a supported version, or set {ALLOW_UNTESTED_ENV}=1 to try anyway"
            )
        if len(covering) == 1:
            return covering[0]
        matching = [s for s in covering if self.mismatches(s, owners) == []]
        if len(matching) == 1 or (matching and os.environ.get(ALLOW_UNTESTED_ENV) == "1"):
            return matching[0]
        if not matching:
            return covering[0]  # building it raises the error that names its first missing anchor
        raise PatchError(
            f"the anchors of several {self.backend} families match ({', '.join(s.family for s in matching)}); "
            "narrow their version ranges"
        )

    def mismatches(self, anchor_set: AnchorSet, owners: Mapping[str, object]) -> list[str]:
        """The targets of ``anchor_set`` whose anchors do not all match exactly once (a dry run)."""
        failed = []
        for target, rewrites in anchor_set.targets().items():
            try:
                source = inspect.getsource(resolve(owners, target))
            except (OSError, TypeError, KeyError, AttributeError):
                failed.append(target)
                continue
            if any(source.count(r.anchor) != 1 for r in rewrites):
                failed.append(target)
        return failed

    def build(self, owners: Mapping[str, object], *, namespace: dict | None = None, anchor_set: AnchorSet | None = None) -> dict[str, Callable]:
        """Compile every rewritten target (installed nowhere); ``{target: new function}``.

        Each target is rewritten from the library's own function (never from one already patched).
        With ``namespace``, all rewrites run in it and so call each other's new versions.
        """
        anchor_set = anchor_set or self.select(owners)
        return {target: compile_target(owners, target, rewrites, namespace=namespace) for target, rewrites in anchor_set.targets().items()}


def resolve(owners: Mapping[str, object], target: str):
    """The library's own function at ``target`` (the pristine one, also after patching)."""
    owner, name = split_target(target)
    return original(owners[owner], name)
