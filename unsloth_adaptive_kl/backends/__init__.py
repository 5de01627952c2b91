"""The backends, and the one place that patches and unpatches them all.

``trl.py`` (TRL's eager loss), ``unsloth.py`` (Unsloth's fused loss) and ``liger.py`` (the Liger
loss module, with ``loss_class.py`` for ``GRPOTrainer(loss_class=...)``) each declare what they
rewrite as one ``PLAN``; ``_trainer.py`` holds what every trainer gets. No backend imports another.
"""

from __future__ import annotations

from .. import _source_patch


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
    except Exception:
        unpatch()
        raise


def unpatch() -> None:
    """Restore every patched attribute exactly (identity)."""
    from . import _trainer, unsloth

    _trainer.forget()
    _source_patch.undo_all()
    unsloth.forget()  # last: it may raise, and the classes must be restored all the same
