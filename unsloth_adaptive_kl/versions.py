"""The library versions this package is tested with: one table, read by the version guards of
every backend and by ``python -m unsloth_adaptive_kl doctor``.

The specifiers are those of ``pyproject.toml`` (tests/test_doctor.py checks they agree; the
``unsloth`` extra pins one release of the range). A guarded library outside its range is refused
when its backend is patched or built, unless ``UNSLOTH_ADAPTIVE_KL_ALLOW_UNTESTED=1``; even then
every source anchor is checked and a missing one raises.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

@dataclass(frozen=True)
class Supported:
    """A distribution's tested range: ``specifier`` as in pyproject.toml, ``label`` for people."""

    distribution: str
    specifier: str
    label: str
    guarded: bool  # refused outside the range at patch time (others are only reported by doctor)

    def contains(self, version: str) -> bool:
        """Whether ``version`` is in the range; local tags (``2.13.0+cpu``) and pre-releases count as their release."""
        try:
            parsed = Version(version)
        except InvalidVersion:
            return False
        return SpecifierSet(self.specifier).contains(Version(parsed.base_version), prereleases=True)


SUPPORTED: dict[str, Supported] = {
    s.distribution: s
    for s in (
        Supported("torch", ">=2.6", ">= 2.6", guarded=False),
        Supported("trl", ">=1.15.0,<1.16", "1.15.x", guarded=True),
        Supported("transformers", ">=5.0,<=5.17.0", "5.0 to 5.17.0", guarded=False),
        Supported("liger-kernel", ">=0.8.0,<0.9", "0.8.x", guarded=True),
        Supported("unsloth", ">=2026.10.0,<2026.11", "2026.10.x", guarded=True),
        Supported("unsloth_zoo", ">=2026.10.0,<2026.11", "2026.10.x", guarded=True),
    )
}
PYTHON = ">=3.10"


def is_supported(distribution: str, version: str) -> bool:
    """Whether ``version`` (as ``_source_patch.version_of`` gives it; "not installed" is not) is in range."""
    return SUPPORTED[distribution].contains(version)
