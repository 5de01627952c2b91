"""The trainer classes this package patched, each with the loss methods that must stay ours for the adaptation to act
(``_trainer.patch_trainer_class`` fills it, ``unpatch()`` empties it)."""

from __future__ import annotations

#: For each patched trainer class, the loss methods that must stay ours for the adaptation to act.
LOSS_PATHS: dict[type, tuple[str, ...]] = {}


def forget() -> None:
    """Called by unpatch(), after the ledger restored the attributes."""
    LOSS_PATHS.clear()


def trainer_is_patched(trainer) -> bool:
    """Whether ``trainer``'s class is currently patched (false after :func:`unpatch`)."""
    return any(isinstance(trainer, cls) for cls in LOSS_PATHS)
