"""Rewrite an installed library's function at anchors that must each match exactly once.

Only the installed function's own source is rewritten, with literal replacements written in
this package; no string from a user's config is ever compiled. If an anchor is missing or
ambiguous, :class:`PatchError` names the library, its version and the anchor.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import textwrap
from typing import Callable

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
            f"Install a supported version, or set {ALLOW_UNTESTED_ENV}=1 to try anyway (every patch anchor is "
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
) -> Callable:
    """Return a copy of ``func`` compiled from its source with each ``(anchor, replacement)`` applied.

    Each anchor must occur exactly once in the (dedented) source. The new function runs in a copy
    of the original's module globals (plus ``extra_globals``), or in ``namespace`` when rewrites
    must see each other. ``library`` names the distribution(s) whose versions a failure reports.
    """
    libraries = (library,) if isinstance(library, str) else tuple(library)
    installed = " / ".join(f"{name} {version_of(name)}" for name in libraries)
    try:
        source = inspect.getsource(func)  # anchors are matched with the installed file's indentation
    except (OSError, TypeError) as error:
        raise PatchError(f"{installed}: cannot read the source of {func.__qualname__} ({error}); the adaptive KL cannot be applied") from error
    for anchor, replacement in replacements:
        count = source.count(anchor)
        if count != 1:
            shown = " / ".join(line.strip() for line in anchor.strip().splitlines()[:2])
            raise PatchError(
                f"{installed}: expected the anchor {shown!r} exactly once in "
                f"{func.__qualname__}, found it {count} times. This version of {' and '.join(libraries)} is not "
                "supported by unsloth_adaptive_kl; the adaptive KL cannot be applied."
            )
        source = source.replace(anchor, replacement)
    source = textwrap.dedent(source)
    if namespace is None:
        namespace = dict(func.__globals__)
    namespace.update(extra_globals or {})
    filename = f"<unsloth_adaptive_kl patched {func.__module__}.{func.__qualname__}>"
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own literal rewrite of installed code
    new = namespace[func.__name__]
    target = getattr(new, "__func__", new)  # a @staticmethod in the source comes back wrapped
    target.__qualname__ = func.__qualname__
    target.__module__ = func.__module__
    target.__wrapped_original__ = func
    target.__wrapped__ = func  # inspect.getsource/signature see the installed original (Unsloth reads them)
    return new
