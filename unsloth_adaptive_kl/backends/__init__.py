"""The backends, and the one place that patches and unpatches them all.

``trl.py`` (TRL's eager loss), ``unsloth.py`` (Unsloth's fused loss) and ``liger.py`` (the Liger
loss module, with ``loss_class.py`` for ``GRPOTrainer(loss_class=...)``) each declare what they
rewrite as one ``PLAN``; ``_trainer.py`` holds what every trainer gets. No backend imports another.
"""

from __future__ import annotations

import importlib.abc
import sys

from .. import _source_patch

GENERATOR = "unsloth.models.rl"  # its _patch_trl_rl_trainers generates Unsloth's trainer (unsloth_hooks.watch_generation)


class _WatchUnsloth(importlib.abc.MetaPathFinder):
    """On sys.meta_path while this package is patched and ``unsloth.models.rl`` is not imported yet:
    once that module is executed, wrap its generator, so a trainer Unsloth generates after a config
    was created is patched too (nothing else of ours runs between that config and the trainer)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != GENERATOR:
            return None
        spec = next((s for f in sys.meta_path if f is not self and hasattr(f, "find_spec") and (s := f.find_spec(fullname, path, target))), None)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_watch(module):
            exec_module(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            if _source_patch.is_patched():
                from . import unsloth, unsloth_hooks

                unsloth_hooks.watch_generation(module, then=unsloth.maybe_patch)

        spec.loader.exec_module = exec_then_watch
        return spec


_WATCH = _WatchUnsloth()


def _watch_unsloth() -> None:
    from . import unsloth, unsloth_hooks

    generator = sys.modules.get(GENERATOR)
    if generator is not None:
        unsloth_hooks.watch_generation(generator, then=unsloth.maybe_patch)
    elif _WATCH not in sys.meta_path:
        sys.meta_path.insert(0, _WATCH)


def patch() -> None:
    """Patch TRL, and Unsloth's generated trainer if it exists (or as soon as it does). Idempotent."""
    from . import trl, unsloth

    if _source_patch.is_patched():
        unsloth.maybe_patch()
        return
    try:
        # Unsloth generates its trainer when it is imported; if that comes after this package,
        # creating a config (always done before the trainer) is the moment to patch it.
        trl.patch(after_config_created=unsloth.maybe_patch)
        unsloth.maybe_patch()
        _watch_unsloth()  # and a trainer Unsloth generates later is patched when it is generated
    except Exception:
        unpatch()
        raise


def unpatch() -> None:
    """Restore every patched attribute exactly (identity)."""
    from . import _patched_classes, unsloth

    if _WATCH in sys.meta_path:
        sys.meta_path.remove(_WATCH)
    _patched_classes.forget()
    _source_patch.undo_all()
    unsloth.forget()  # last: it may raise, and the classes must be restored all the same
