"""One rewrite of the library's ``_generate_and_score_completions`` per combination of the features that edit it.

Two features edit that function: ``kl_monitor`` (its reference forward also runs at β = 0, on the batches the
monitor watches) and ``kl_placement="reward"`` (each completion's KL penalty at scoring, subtracted before the group
normalisation). Each declares its edits as a :class:`~unsloth_adaptive_kl._source_patch.Plan` per version family.
:func:`install` applies the edits of every combination of the features onto ONE copy of the library's own source,
in the order the features are given (an edit two features share, such as the explicit ``super(Owner, self)``, once),
through ``_source_patch``'s exactly-once anchors, free-name check, linecache source and ledger; the function the
class gets runs, for each trainer, the copy with the features that trainer enables (the library's own with none).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Callable, Mapping

from .._source_patch import PatchError, Plan, Rewrite, compile_target, set_attribute


@dataclass(frozen=True)
class Feature:
    """A feature that rewrites the generation: its name as errors say it, its edits (``plan``: the rewrites of the
    generation's target in the anchor set it selects; its other targets are not read here), whether a trainer's
    runtime enables it, and what it checks after a call that applied it (``after(trainer, runtime)``)."""

    name: str
    plan: Plan
    enabled: Callable[[object], bool]
    before: Callable[[object], None] | None = None
    after: Callable[[object, object], None] | None = None


def feature_rewrites(feature: Feature, target: str, owners: Mapping[str, object]) -> tuple[Rewrite, ...]:
    """The rewrites of ``target`` in the anchor set ``feature.plan`` selects for the installed versions; PatchError
    naming the library and version where none covers them or that set has no rewrite of ``target``."""
    anchor_set = feature.plan.select(owners)
    rewrites = tuple(anchor_set.targets().get(target, ()))
    if not rewrites:
        raise PatchError(f"{feature.plan.backend}: the anchor set {anchor_set.family!r} (the installed versions') does not rewrite {target}")
    return rewrites


def compose(edits: Mapping[str, tuple[Rewrite, ...]]) -> tuple[Rewrite, ...]:
    """The edits of several features (name -> its rewrites, in the features' order) as one table: each feature's in
    order, an identical rewrite (same anchor, same replacement) once; two different replacements of one anchor raise
    PatchError naming both features (neither edit could be applied on top of the other)."""
    table: dict[str, tuple[str, Rewrite]] = {}
    for name, rewrites in edits.items():
        for rewrite in rewrites:
            if rewrite.anchor not in table:
                table[rewrite.anchor] = (name, rewrite)
                continue
            first, seen = table[rewrite.anchor]
            if seen.replacement != rewrite.replacement:
                raise PatchError(
                    f"{first} and {name} rewrite the same anchor {rewrite.anchor.strip().splitlines()[0]!r} of "
                    f"{rewrite.target} differently: the two cannot be applied together"
                )
    return tuple(rewrite for _, rewrite in table.values())


def combinations(names: tuple[str, ...]) -> list[frozenset[str]]:
    """Every non-empty combination of ``names``."""
    return [frozenset(c) for size in range(1, len(names) + 1) for c in itertools.combinations(names, size)]


def build(target: str, features: tuple[Feature, ...], owners: Mapping[str, object]) -> tuple[dict, dict]:
    """``(functions, reasons)``: for each combination of ``features`` (a frozenset of their names) the library's
    ``target`` compiled with the edits of those features composed (:func:`compose`), or why it cannot be (each
    feature's own reason first; a combination of available features: the composition's)."""
    edits, reasons, functions = {}, {}, {}
    for feature in features:
        key = frozenset({feature.name})
        try:
            edits[feature.name] = feature_rewrites(feature, target, owners)
        except PatchError as error:
            reasons[key] = str(error)
    for combination in combinations(tuple(f.name for f in features)):
        missing = [f.name for f in features if f.name in combination and f.name not in edits]
        if missing:
            reasons.setdefault(combination, reasons[frozenset({missing[0]})])
            continue
        try:
            names = [f.name for f in features if f.name in combination]
            rewrites = compose({name: edits[name] for name in names})
            # each combination's source under its own file name in linecache (tracebacks show its own lines)
            functions[combination] = compile_target(owners, target, rewrites, label="+".join(names))
        except PatchError as error:
            reasons[combination] = str(error)
    return functions, reasons


def install(trainer_cls, name: str, target: str, features: tuple[Feature, ...], owners: Mapping[str, object], wrap=None) -> dict:
    """Give ``trainer_cls.<name>`` (the generation, ``target`` in the plans) the rewrites of ``features``: a trainer
    whose runtime enables some of them runs the copy compiled with exactly those (:func:`build`), wrapped by ``wrap``
    where the library wraps its own (Unsloth's rollout wrapper); a trainer that enables none, or that has no runtime
    (created before the import), runs the library's own. Returns the reasons :func:`build` gives (a combination
    absent from them can be applied); where no combination can, nothing is set."""
    library_own = getattr(trainer_cls, name)
    functions, reasons = build(target, features, owners)
    if not functions:
        return reasons
    functions = {key: (function if wrap is None else wrap(function)) for key, function in functions.items()}

    @functools.wraps(library_own)
    def _generate_and_score_completions(self, *args, **kwargs):
        runtime = getattr(self, "_adaptive_kl", None)
        enabled = [f for f in features if runtime is not None and f.enabled(runtime)]
        if not enabled:
            return library_own(self, *args, **kwargs)
        key = frozenset(f.name for f in enabled)
        if key not in functions:  # refused when the trainer was created; a runtime swapped in later gets here
            raise PatchError(f"{' with '.join(sorted(key))} cannot be applied to {type(self).__qualname__}: {reasons[key]}")
        for feature in enabled:
            if feature.before is not None:
                feature.before(runtime)
        output = functions[key](self, *args, **kwargs)
        for feature in enabled:
            if feature.after is not None:
                feature.after(self, runtime)
        return output

    set_attribute(trainer_cls, name, _generate_and_score_completions)
    return reasons


__all__ = ["Feature", "build", "combinations", "compose", "feature_rewrites", "install"]
