"""Adaptive KL regularisation for GRPO in TRL and Unsloth.

Importing this package patches TRL's ``GRPOConfig`` and ``GRPOTrainer`` (idempotently);
:func:`unpatch` restores the originals. See the README for the methods and fields.
"""

from __future__ import annotations

from .adaptation import AdaptiveKL
from .config import FIELDS, validate
from .controllers import BetaController, DynamicBeta, FixedBeta, TargetKLBeta
from .estimators import estimate_kl, estimator_names, get_estimator, register_estimator, unregister_estimator
from .metrics import ADAPTED_KL, CURRENT_BETA, RAW_KL
from .shaping import parse_method
from ._source_patch import PatchError

__version__ = "0.1.0"


def patch() -> None:
    """Apply the patches (done on import; calling again is a no-op)."""
    from .backends import trl as _trl

    _trl.patch()


def unpatch() -> None:
    """Undo every patch, restoring the original functions and classes."""
    from .backends import trl as _trl

    _trl.unpatch()


patch()

__all__ = [
    "ADAPTED_KL",
    "AdaptiveKL",
    "BetaController",
    "CURRENT_BETA",
    "DynamicBeta",
    "FIELDS",
    "FixedBeta",
    "PatchError",
    "RAW_KL",
    "TargetKLBeta",
    "estimate_kl",
    "estimator_names",
    "get_estimator",
    "parse_method",
    "patch",
    "register_estimator",
    "unpatch",
    "unregister_estimator",
    "validate",
]
