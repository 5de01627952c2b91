"""Adaptive KL regularisation for GRPO in TRL and Unsloth.

Importing this package patches TRL's ``GRPOConfig`` and ``GRPOTrainer`` (idempotently);
:func:`unpatch` restores the originals. See docs/methods.md and docs/fields.md for the methods and fields.
"""

from __future__ import annotations

import os
import sys

from .adaptation import AdaptiveKL
from .config import FIELDS, validate
from .controllers import BetaController, DynamicBeta, FixedBeta, TargetKLBeta
from .kl_term import KLTerm
from .estimators import estimate_kl, estimator_names, get_estimator, register_estimator, unregister_estimator
from .metrics import ADAPTED_KL, CURRENT_BETA, RAW_KL
from .shaping import Parameter, parse_method, register_shaping, shaping_names, unregister_shaping
from ._source_patch import PatchError

__version__ = "0.1.0"


def patch() -> None:
    """Apply the patches (done on import; calling again is a no-op)."""
    from . import backends

    backends.patch()


def unpatch() -> None:
    """Undo every patch, restoring the original functions and classes."""
    from . import backends

    backends.unpatch()


def _started_as_doctor() -> bool:
    """True when this import is the ``doctor`` command starting (``python -m unsloth_adaptive_kl``
    or the ``unsloth-adaptive-kl`` script): it must report a broken install, not die of it."""
    argv = getattr(sys, "orig_argv", [])
    as_module = any(a == "-m" and b == __name__ for a, b in zip(argv, argv[1:]))
    as_script = len(argv) > 1 and os.path.basename(argv[1]) == "unsloth-adaptive-kl"
    return as_module or as_script


#: The error that stopped the patch at import, seen only by the doctor command; elsewhere it raises.
IMPORT_PATCH_ERROR: PatchError | None = None
try:
    patch()
except PatchError as error:
    if not _started_as_doctor():
        raise
    IMPORT_PATCH_ERROR = error

__all__ = [
    "ADAPTED_KL",
    "AdaptiveKL",
    "BetaController",
    "CURRENT_BETA",
    "DynamicBeta",
    "FIELDS",
    "FixedBeta",
    "KLTerm",
    "Parameter",
    "PatchError",
    "RAW_KL",
    "TargetKLBeta",
    "estimate_kl",
    "estimator_names",
    "get_estimator",
    "parse_method",
    "patch",
    "register_estimator",
    "register_shaping",
    "shaping_names",
    "unpatch",
    "unregister_estimator",
    "unregister_shaping",
    "validate",
]
