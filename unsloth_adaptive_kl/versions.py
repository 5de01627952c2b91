"""The library versions this package is tested with: one table, read by the version guards of
every backend, by ``python -m unsloth_adaptive_kl doctor``, by scripts/compat.sh (the stacks of
the version matrix) and rendered as the README's "Supported versions" table.

The specifiers are those of ``pyproject.toml``; tests/test_versions.py checks that pyproject and
the README agree with this file. A guarded library outside its range is refused when its backend
is patched or built, unless ``UNSLOTH_ADAPTIVE_KL_ALLOW_UNTESTED=1``; even then every source
anchor is checked and a missing one raises.
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
    #: Tested releases that no stack of STACKS pins (the machines' torch, what pip resolves beside the
    #: pins); the pinned ones come from STACKS (:func:`tested_releases`).
    unpinned: str = ""

    def contains(self, version: str) -> bool:
        """Whether ``version`` is in the range; local tags (``2.13.0+cpu``) and pre-releases count as their release."""
        try:
            parsed = Version(version)
        except InvalidVersion:
            return False
        return SpecifierSet(self.specifier).contains(Version(parsed.base_version), prereleases=True)


# The dependency policy (docs/compatibility.md, "Dependency policy"): a lower bound is the oldest
# version that the supported TRL/Unsloth lines accept and on which the tests pass; an upper cap only
# on a library whose source this package patches (guarded=True: TRL, Unsloth, unsloth_zoo, Liger),
# at its first untested release line; no cap on the others unless a measured break (named here with
# its failing test), so that installing this package never downgrades a user's transformers or torch.
SUPPORTED: dict[str, Supported] = {
    s.distribution: s
    for s in (
        Supported("torch", ">=2.6", "2.6 and newer", guarded=False, unpinned="2.13.0 (CPU stacks), 2.11.0 (GPU)"),
        Supported("trl", ">=0.24.0,<1.17", "0.24 to 1.16.x", guarded=True),
        # 4.56.1: TRL 0.24's own floor (TRL 1.16 asks 4.56.2). No cap: the patches anchor on TRL's and
        # Unsloth's source, which the runtime anchor check guards whatever transformers is installed.
        Supported("transformers", ">=4.56.1", "4.56.1 and newer", guarded=False),
        Supported("peft", ">=0.17", "0.17 and newer", guarded=False, unpinned="0.21.2 (the newest; every stack resolves it)"),
        Supported("accelerate", ">=1.10", "1.10 and newer", guarded=False, unpinned="1.15.0 (the newest; every stack resolves it)"),
        Supported("datasets", ">=3.0", "3.0 and newer", guarded=False, unpinned="5.0.1 (resolved with transformers 4.x), 5.2.0 (with TRL 1.16)"),
        Supported("liger-kernel", ">=0.8.0,<0.9", "0.8.x", guarded=True),
        Supported("unsloth", ">=2026.8.0,<2026.11", "2026.8.x to 2026.10.x", guarded=True),
        Supported("unsloth_zoo", ">=2026.8.0,<2026.11", "2026.8.x to 2026.10.x", guarded=True),
    )
}
#: The distributions of the ``unsloth`` extra (the others are ``dependencies`` of pyproject.toml).
EXTRA_UNSLOTH = ("unsloth", "unsloth_zoo")
PYTHON = ">=3.10"


#: The ``loss_type`` values of each TRL line (TRL itself checks none of them before its first loss).
ALL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
TRL_LOSS_TYPES = (
    (">=1.0", ALL_LOSS_TYPES),
    (">=0.28", ALL_LOSS_TYPES[:7]),  # vespo came in 1.0
    (">=0.26", ALL_LOSS_TYPES[:6]),  # luspo in 0.28
    (">=0.0", ALL_LOSS_TYPES[:4]),  # cispo and sapo in 0.26
)


#: ``GRPOTrainer(loss_class=...)`` and the Liger drop-in compute log-probs with TRL's chunked log-prob
#: kernel (``trl.kernels``), which TRL has from 1.15 on.
LOSS_CLASS_TRL = ">=1.15"


#: Loss types a TRL line has but this package does not offer there, and why.
TRL_LOSS_TYPES_NOT_OFFERED = (
    (
        ">=0.28,<1.10",
        "luspo",
        "this TRL's luspo sums the KL of padding positions too ((x * lengths).mean() over every position; "
        "TRL 1.10 masks them), which the adapted KL (0 on padding) cannot reproduce",
    ),
)


def trl_loss_types(version: str) -> tuple[str, ...]:
    """The ``loss_type`` values TRL ``version`` has."""
    release = Version(Version(version).base_version)
    return next(types for specifier, types in TRL_LOSS_TYPES if release in SpecifierSet(specifier))


def offered_loss_types(version: str) -> dict[str, str | None]:
    """Each loss type of TRL ``version``: None where this package offers it, else why not."""
    release = Version(Version(version).base_version)
    reasons = {name: why for specifier, name, why in TRL_LOSS_TYPES_NOT_OFFERED if release in SpecifierSet(specifier)}
    return {name: reasons.get(name) for name in trl_loss_types(version)}


def supported_versions_table() -> str:
    """The README's "Supported versions" table (tests/test_versions.py checks the README has it)."""
    rows = ["| library | range | tested |", "|---|---|---|", f"| Python | {PYTHON} | 3.11 (CPU), 3.12 (GPU) |"]
    rows += [f"| {s.distribution} | `{s.specifier}` ({s.label}) | {tested_releases(s.distribution)} |" for s in SUPPORTED.values()]
    return "\n".join(rows)


def pinned_releases(distribution: str) -> list[str]:
    """The releases of ``distribution`` that the stacks of :data:`STACKS` pin, oldest first."""
    pins = {stack.pin(distribution) for stack in STACKS.values()} - {None}
    return sorted(pins, key=Version)


def tested_releases(distribution: str) -> str:
    """The "tested" cell of the table: the releases :data:`STACKS` pins (one per minor line, many of
    them: as a range), then the distribution's ``unpinned`` ones."""
    pinned = pinned_releases(distribution)
    if len(pinned) > 4 and len({Version(v).release[:2] for v in pinned}) == len(pinned):
        text = f"one release per minor line, {pinned[0]} to {pinned[-1]} ({len(pinned)} lines)"
    else:
        text = ", ".join(pinned)
    return ", ".join(part for part in (text, SUPPORTED[distribution].unpinned) if part)


def requirement(distribution: str) -> str:
    """``distribution`` with its supported range, as pip takes it (doctor's hints, pyproject.toml)."""
    return f"{distribution}{SUPPORTED[distribution].specifier}"


def is_supported(distribution: str, version: str) -> bool:
    """Whether ``version`` (as ``_source_patch.version_of`` gives it; "not installed" is not) is in range."""
    return SUPPORTED[distribution].contains(version)


# -- the version matrix ---------------------------------------------------------------------------
# One stack per tested combination, each installed exactly by scripts/compat.sh (which reads this
# table) next to the CPU torch 2.13. Unsloth's full dependency set pulls a CUDA torch, so its two
# distributions are installed with --no-deps there, as scripts/_venv.sh does.
@dataclass(frozen=True)
class Stack:
    """One tested combination of the guarded libraries, pinned exactly."""

    name: str
    pins: tuple[str, ...]
    no_deps: tuple[str, ...] = ()

    def pin(self, distribution: str) -> str | None:
        for requirement in (*self.pins, *self.no_deps):
            name, _, version = requirement.partition("==")
            if name == distribution:
                return version
        return None


_TRANSFORMERS_4 = "transformers==4.57.6"  # the last 4.x: TRL 0.2x lines and Unsloth 2026.8/9 were released on it
_TRANSFORMERS_5 = "transformers==5.17.0"  # the newest that Unsloth 2026.10 allows
# The two ends of the transformers range, each with the TRL line of its end (raised deliberately: a
# new transformers release is tried with `scripts/compat.sh latest`, then pinned here).
_TRANSFORMERS_OLDEST = "transformers==4.56.1"  # TRL 0.24's own floor
_TRANSFORMERS_NEWEST = "transformers==5.24.0"  # the newest on the index, 2026-11-24
_LIGER = "liger-kernel==0.8.5"
#: The latest patch release of every TRL minor line from 0.24 on.
TRL_LINES = (
    "0.24.0", "0.25.1", "0.26.2", "0.27.2", "0.28.0", "0.29.1",
    "1.0.0", "1.1.0", "1.2.0", "1.3.0", "1.4.0", "1.5.1", "1.6.0", "1.7.1", "1.8.0", "1.9.2",
    "1.10.0", "1.11.0", "1.12.0", "1.13.0", "1.14.2", "1.15.0", "1.16.0",
)  # fmt: skip
_TRL_ENDS = {"0.24.0": _TRANSFORMERS_OLDEST, "1.16.0": _TRANSFORMERS_NEWEST}


def _trl_line_transformers(trl: str) -> str:
    return _TRL_ENDS.get(trl, _TRANSFORMERS_4 if trl.startswith("0.") else _TRANSFORMERS_5)


STACKS: dict[str, Stack] = {
    s.name: s
    for s in (
        *(Stack(f"trl-{v.rsplit('.', 1)[0]}", (f"trl=={v}", _trl_line_transformers(v), _LIGER)) for v in TRL_LINES),
        # Unsloth 2026.8 and 2026.9 cap trl at 0.24.0 (and datasets below 4.4); 2026.10 at 1.15.0.
        Stack("unsloth-2026.8", ("trl==0.24.0", _TRANSFORMERS_4, _LIGER, "datasets==4.3.0"), ("unsloth==2026.8.22", "unsloth_zoo==2026.8.17")),
        Stack("unsloth-2026.9", ("trl==0.24.0", _TRANSFORMERS_4, _LIGER, "datasets==4.3.0"), ("unsloth==2026.9.14", "unsloth_zoo==2026.9.9")),
        # The main suite's own stack (scripts/_venv.sh); datasets pinned below 5, as Unsloth 2026.10 asks.
        Stack("unsloth-2026.10", ("trl==1.15.0", _TRANSFORMERS_5, _LIGER, "datasets==4.8.5"), ("unsloth==2026.10.9", "unsloth_zoo==2026.10.9")),
        # The transformers range admits either major with any TRL line: its two ends, crossed.
        Stack("trl-0.24-transformers-5", ("trl==0.24.0", _TRANSFORMERS_5, _LIGER)),
        Stack("trl-1.16-transformers-4", ("trl==1.16.0", "transformers==4.56.2", _LIGER)),  # TRL 1.16 asks >=4.56.2
        # For a check by hand, never pinned: today's newest of everything that the ranges allow
        # (`scripts/compat.sh latest` rebuilds it once a day).
        Stack("latest", tuple(requirement(d) for d in ("trl", "transformers", "liger-kernel"))),
    )
}
#: The distributions every stack installs beside its pins, at the newest that the pins allow.
COMMON = ("peft", "accelerate", "datasets")
#: What CI runs (.ci/run) after the main suite: the oldest TRL with the oldest transformers, the
#: newest TRL with the newest transformers, and the oldest Unsloth line. The newest Unsloth line
#: (unsloth-2026.10) is the main suite's own stack (scripts/_venv.sh).
CI_STACKS = ("trl-0.24", "trl-1.16", "unsloth-2026.8")

#: The install check (scripts/install_check.sh, issue 21): in a fresh venv holding the CPU torch,
#: `pip install -e . TRL TRANSFORMERS` must keep exactly these versions (and torch), and there `none`
#: must train identically to stock TRL and `clip` shape the loss.
INSTALL_CHECKS = (
    ("trl==0.24.0", "transformers==4.57.1"),
    ("trl==0.24.0", "transformers==4.56.2"),
    ("trl==1.16.0", _TRANSFORMERS_NEWEST),
)


if __name__ == "__main__":  # scripts/compat.sh: `python versions.py STACK` prints its pip arguments
    import sys

    if sys.argv[1] == "install-checks":  # scripts/install_check.sh: one check's pins a line
        print("\n".join(" ".join(pins) for pins in INSTALL_CHECKS))
        sys.exit()
    if sys.argv[1] == "common":  # scripts/compat.sh: what every stack installs beside its pins
        print(" ".join(requirement(d) for d in COMMON))
        sys.exit()
    stack = STACKS[sys.argv[1]]
    print(" ".join(stack.pins))
    print(" ".join(stack.no_deps))
