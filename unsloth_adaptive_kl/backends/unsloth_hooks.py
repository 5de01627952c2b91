"""Two hooks on Unsloth outside its generated trainer, used by ``unsloth.py`` and by ``patch()``:
its trainer generation (so a trainer generated after a config was created is patched too) and its
memo of the arguments a config class accepts (emptied whenever ``GRPOConfig.__init__`` changes)."""

from __future__ import annotations

import functools
import sys
from typing import Callable

from .._source_patch import PatchError, set_attribute, version_of
from ..versions import SUPPORTED

COMPAT_MODULE = "unsloth.models.rl_config_compat"  # filters the arguments of generated configs


def forget_accepted_config_arguments() -> None:
    """Empty Unsloth's memo of the keyword arguments each config class accepts
    (``rl_config_compat._ACCEPTED_CACHE``, in every supported line): patch() and unpatch() change
    ``GRPOConfig.__init__``, and a stale memo forwards our fields to a stock config (TypeError) or
    drops them from a patched one ("will be IGNORED")."""
    compat = sys.modules.get(COMPAT_MODULE)
    if compat is None:
        return  # not imported yet, so nothing is memoised
    cache = getattr(compat, "_ACCEPTED_CACHE", None)
    if not isinstance(cache, dict):
        raise PatchError(
            f"unsloth {version_of('unsloth')}: {COMPAT_MODULE}._ACCEPTED_CACHE is not a dict (supported lines "
            f"{SUPPORTED['unsloth'].label} memoise the accepted config arguments there); the adaptive-KL fields "
            "of its GRPOConfig could be dropped or kept after unpatch()"
        )
    cache.clear()


def watch_generation(generator, then: Callable[[], None]) -> None:
    """Call ``then`` (``unsloth.maybe_patch``: patch the generated module) each time Unsloth has
    ``exec``ed its generated trainer: wrap ``unsloth.models.rl._patch_trl_rl_trainers``."""
    generate = generator._patch_trl_rl_trainers
    if getattr(generate, "_adaptive_kl_watch", False):
        return

    @functools.wraps(generate)
    def _patch_trl_rl_trainers(*args, **kwargs):
        result = generate(*args, **kwargs)
        then()
        return result

    _patch_trl_rl_trainers._adaptive_kl_watch = True
    set_attribute(generator, "_patch_trl_rl_trainers", _patch_trl_rl_trainers)
