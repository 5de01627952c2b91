"""Adaptive KL regularisation for GRPO in TRL and Unsloth.

Importing this package patches TRL's ``GRPOConfig`` and ``GRPOTrainer`` (idempotently);
:func:`unpatch` restores the originals. See docs/methods.md and docs/fields.md for the methods and fields.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from .adaptation import AdaptiveKL
from .config import FIELDS, validate
from .controllers import BetaController, DynamicBeta, FixedBeta, TargetKLBeta, controller_names, register_controller, unregister_controller
from .declarations import Parameter
from .kl_term import KLTerm
from .estimators import estimate_kl, estimator_names, get_estimator, register_estimator, unregister_estimator
from .method import format_method, parse_method
from .metrics import ADAPTED_KL, CURRENT_BETA, RAW_KL
from .shaping import register_shaping, shaping_names, unregister_shaping
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


def _doctor_checks_unsloth() -> bool:
    """Whether this import is ``unsloth-adaptive-kl doctor`` starting, about to check the Unsloth backend
    (``--backend unsloth``, or by default where Unsloth is installed)."""
    argv = sys.argv[1:]
    if not _started_as_doctor() or argv[:1] != ["doctor"] or "-h" in argv or "--help" in argv:
        return False
    requested = [value for flag, value in zip(argv, argv[1:]) if flag == "--backend"]
    requested += [arg.partition("=")[2] for arg in argv if arg.startswith("--backend=")]
    return "unsloth" in requested if requested else importlib.util.find_spec("unsloth") is not None


# The doctor imports unsloth to check it: before patch() imports trl and transformers, as a user's script does
# (Unsloth patches them, and warns "import unsloth first" when they came first).
if _doctor_checks_unsloth():
    try:
        import unsloth  # noqa: F401
    except Exception:  # noqa: BLE001, S110 - the doctor imports it again and reports what stopped it
        pass

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
    "controller_names",
    "estimate_kl",
    "estimator_names",
    "format_method",
    "get_estimator",
    "parse_method",
    "patch",
    "register_controller",
    "register_estimator",
    "register_shaping",
    "shaping_names",
    "unpatch",
    "unregister_controller",
    "unregister_estimator",
    "unregister_shaping",
    "validate",
]
