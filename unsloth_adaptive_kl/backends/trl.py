"""TRL backend: adaptive KL inside ``GRPOTrainer._compute_loss`` (TRL's eager loss).

What is patched, each undone by :func:`unpatch`:

* ``GRPOConfig``: gains the fields of :mod:`unsloth_adaptive_kl.config` in place (so a class
  imported before this module gets them too), validated in ``__post_init__``.
* ``GRPOTrainer._compute_loss``: rewritten at three checked anchors so that the per-token KL
  comes from the core estimator and shaping, β from the controller, and the length-normalised
  term is added after aggregation. TRL's ``kl`` metric keeps meaning the unshaped KL.
* ``GRPOTrainer.__init__``: attaches an :class:`AdaptiveKL` and its checkpoint callback.
* ``GRPOTrainer._generate_and_score_completions``: feeds the raw reward TRL logs to the
  controller.
* ``GRPOTrainer._load_callback_state``: brings the controller back on ``resume_from_checkpoint``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from .. import metrics
from .._source_patch import PatchError, check_version, rewrite_function, version_of
from ..adaptation import AdaptiveKL
from ..config import FIELDS, validate
from ..versions import SUPPORTED

logger = logging.getLogger("unsloth_adaptive_kl")

SUPPORTED_TRL = SUPPORTED["trl"].label  # the range lives in versions.py


def _trl_supported(version: str) -> bool:
    return SUPPORTED["trl"].contains(version)


# -- the rewrite of _compute_loss ------------------------------------------------------------------
KL_ANCHOR = """        if self.beta != 0.0:
            ref_per_token_logps = inputs["ref_per_token_logps"]
            per_token_kl = (
                torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
            )
            # Importance sampling correction for the KL divergence
            if self.args.use_bias_correction_kl:
                per_token_kl = per_token_kl * coef_1
"""
KL_REPLACEMENT = """        adaptive_kl_adapted = None
        if self.beta != 0.0:
            ref_per_token_logps = self._adaptive_kl.reference_logps(inputs)
            per_token_kl, adaptive_kl_adapted = self._adaptive_kl.per_token(
                per_token_logps, ref_per_token_logps, mask, coef_1 if self.args.use_bias_correction_kl else None
            )
"""
ADD_ANCHOR = """        if self.beta != 0.0:
            per_token_loss = per_token_loss + self.beta * per_token_kl
"""
ADD_REPLACEMENT = """        if self.beta != 0.0 and not self._adaptive_kl.length_normalized:
            per_token_loss = per_token_loss + self.beta * adaptive_kl_adapted
"""
AFTER_AGGREGATION_ANCHOR = """        if self._entropy_bonus_enabled:
"""
AFTER_AGGREGATION_REPLACEMENT = """        loss = self._adaptive_kl.after_aggregation(
            loss, per_token_kl if self.beta != 0.0 else None, adaptive_kl_adapted, mask, mode
        )
        if self._entropy_bonus_enabled:
"""
COMPUTE_LOSS_REWRITES = [
    (KL_ANCHOR, KL_REPLACEMENT),
    (ADD_ANCHOR, ADD_REPLACEMENT),
    (AFTER_AGGREGATION_ANCHOR, AFTER_AGGREGATION_REPLACEMENT),
]


class TRLAdaptiveKL(AdaptiveKL):
    """The :class:`AdaptiveKL` of one TRL ``GRPOTrainer``; the rewritten loss calls into it."""

    def __init__(self, trainer):
        accelerator = trainer.accelerator
        super().__init__(trainer.args, reduce=lambda t: accelerator.reduce(t, reduction="sum"))
        self.trainer = trainer

    def reference_logps(self, inputs) -> torch.Tensor:
        if "ref_per_token_logps" not in inputs:
            raise RuntimeError(
                "unsloth_adaptive_kl: beta is non-zero but this batch has no reference log-probs (they are only "
                "computed while beta != 0 at generation time). A β controller must not leave 0 once it reached it."
            )
        return inputs["ref_per_token_logps"]

    def after_aggregation(self, loss, raw, adapted, mask, mode):
        """Add the length-normalised KL term (if any) and log this micro-batch's metrics."""
        trainer = self.trainer
        beta = trainer.beta
        if raw is not None and self.length_normalized:
            accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + beta * self.length_normalized_term(adapted, mask, mask.shape[0]) / accumulation
        self.log_metrics(self.record(raw, adapted, mask, training=mode == "train", beta=beta), mode)
        return loss

    def log_metrics(self, values: dict[str, float], mode: str) -> dict[str, float]:
        """Append the adaptive_kl/* values to the trainer's metrics, which its ``log()`` averages."""
        for name, value in values.items():
            self.trainer._metrics[mode][name].append(value)
        return values


# -- the checkpoint callback ---------------------------------------------------------------------------
def _callback_classes():
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState

    class AdaptiveKLCallback(TrainerCallback, ExportableState):
        """Updates β once per optimizer step and carries the controller state in checkpoints.

        The state goes into ``trainer_state.json`` (``stateful_callbacks``) through the Trainer's
        own mechanism; the patched ``_load_callback_state`` restores it on resume.
        """

        def __init__(self, runtime: TRLAdaptiveKL | None = None):
            self.runtime = runtime

        def on_step_end(self, args, state, control, **kwargs):
            self.runtime.trainer.beta = self.runtime.end_step(state.global_step)

        def state(self) -> dict:
            return {"args": {}, "attributes": {"adaptive_kl_state": self.runtime.state_dict()}}

    return AdaptiveKLCallback


AdaptiveKLCallback = None  # set by patch()


# -- patching ----------------------------------------------------------------------------------------
_ORIGINALS: list[tuple[object, str, object, bool]] = []


def _set(owner, name: str, value) -> None:
    _ORIGINALS.append((owner, name, owner.__dict__.get(name), name in owner.__dict__))
    setattr(owner, name, value)


def is_patched() -> bool:
    return bool(_ORIGINALS)


def patch_config_class(config_cls) -> None:
    """Graft the adaptive-KL fields onto a dataclass config class, in place."""
    if "kl_adaptation_method" in config_cls.__dataclass_fields__:
        return
    extended = dataclasses.make_dataclass(
        config_cls.__name__,
        [(f.name, f.type, dataclasses.field(default=f.default, metadata={"help": f.help})) for f in FIELDS],
        bases=(config_cls,),
    )
    annotations = dict(config_cls.__dict__.get("__annotations__", {}))
    annotations.update({f.name: f.type for f in FIELDS})
    original_post_init = config_cls.__post_init__

    @functools.wraps(original_post_init)
    def __post_init__(self):
        original_post_init(self)
        validate(self)
        # Unsloth generates its trainer when it is imported; if that came after this package,
        # creating a config (always done before the trainer) is the moment to patch it.
        from . import unsloth as unsloth_backend

        unsloth_backend.maybe_patch()

    _set(config_cls, "__init__", extended.__init__)
    _set(config_cls, "__dataclass_fields__", extended.__dataclass_fields__)
    _set(config_cls, "__annotations__", annotations)
    _set(config_cls, "__post_init__", __post_init__)


# Every wrapper keeps the original's signature and source (functools.wraps sets __wrapped__):
# Unsloth generates its trainer from TRL's signatures and sources, and must see TRL's own.
def _wrap_init(original, runtime_cls):
    @functools.wraps(original)
    def __init__(self, *args, loss_class=None, **kwargs):
        original(self, *args, **kwargs)
        attach(self, loss_class=loss_class, runtime_cls=runtime_cls)

    return __init__


def _dispatch_compute_loss(rewritten):
    @functools.wraps(rewritten)
    def _compute_loss(self, model, inputs):
        # With loss_class=, the loss comes from that module (backends/liger.py), not TRL's per-token path.
        if getattr(self, "_adaptive_loss_module", None) is not None:
            from . import liger

            return liger.compute_loss(self, model, inputs)
        return rewritten(self, model, inputs)

    return _compute_loss


def _wrap_generate(original):
    @functools.wraps(original)
    def _generate_and_score_completions(self, *args, **kwargs):
        mode = "train" if self.model.training else "eval"
        rewards = self._metrics[mode]["reward"]
        before = len(rewards)
        output = original(self, *args, **kwargs)
        if mode == "train":
            rewards = self._metrics["train"]["reward"]
            if len(rewards) != before + 1:
                raise PatchError(
                    f"trl {version_of('trl')}: _generate_and_score_completions did not log exactly one 'reward' "
                    "value; the dynamic β controller cannot see the reward."
                )
            self._adaptive_kl.observe_reward(rewards[-1])
        return output

    return _generate_and_score_completions


def _wrap_load_callback_state(original):
    @functools.wraps(original)
    def _load_callback_state(self):
        original(self)
        runtime = self._adaptive_kl
        stored = self.state.stateful_callbacks.get(AdaptiveKLCallback.__name__)
        if stored is not None:
            stored = stored[0] if isinstance(stored, list) else stored
            runtime.load_state_dict(stored["attributes"]["adaptive_kl_state"])
            self.beta = runtime.beta
        # With restore_callback_states_from_checkpoint=True the Trainer rebuilt our callback without
        # its runtime: drop such copies and keep exactly one bound callback.
        for callback in list(self.callback_handler.callbacks):
            if isinstance(callback, AdaptiveKLCallback) and callback.runtime is not runtime:
                self.callback_handler.remove_callback(callback)
        if not any(isinstance(cb, AdaptiveKLCallback) for cb in self.callback_handler.callbacks):
            self.callback_handler.add_callback(AdaptiveKLCallback(runtime))

    return _load_callback_state


def _check_loss_path(trainer, method_is_none: bool) -> None:
    """A subclass that overrides the patched loss would train without the adaptation: refuse it."""
    for base, names in _LOSS_PATH.items():
        if not isinstance(trainer, base):
            continue
        overridden = [name for name in names if getattr(type(trainer), name) is not getattr(base, name)]
        if not overridden:
            return
        message = (
            f"{type(trainer).__qualname__} overrides {', '.join(overridden)} of {base.__qualname__}, the loss path "
            "unsloth_adaptive_kl patches: the adaptive KL would not reach its loss"
        )
        if not method_is_none:
            raise PatchError(message + f"; kl_adaptation_method={trainer.args.kl_adaptation_method!r} cannot be applied")
        logger.warning("%s (no adaptation requested, so training goes on; the adaptive_kl metrics may be missing)", message)
        return


def attach(trainer, loss_class=None, runtime_cls=None) -> TRLAdaptiveKL:
    """Give ``trainer`` its adaptive-KL state (and, with ``loss_class``, its loss module); idempotent."""
    existing = getattr(trainer, "_adaptive_kl", None)
    if existing is not None:
        return existing
    runtime = (runtime_cls or TRLAdaptiveKL)(trainer)
    _check_loss_path(trainer, runtime.method.is_none and runtime.estimator == "k3")
    trainer._adaptive_kl = runtime
    trainer.beta = runtime.beta
    trainer._adaptive_loss_module = None
    if loss_class is not None:
        from . import liger

        trainer._adaptive_loss_module = liger.make_loss_module(trainer, loss_class)
    trainer.add_callback(AdaptiveKLCallback(runtime))
    logger.info(
        "unsloth_adaptive_kl: kl_adaptation_method=%r, kl_estimator=%r, beta=%s (logged as %s)",
        trainer.args.kl_adaptation_method,
        runtime.estimator,
        runtime.beta,
        ", ".join(metrics.METRIC_NAMES),
    )
    return runtime


#: For each patched trainer class, the loss methods that must stay ours for the adaptation to act.
_LOSS_PATH: dict[type, tuple[str, ...]] = {}


def patch_trainer_class(trainer_cls, runtime_cls, loss_path: tuple[str, ...]) -> None:
    """The wrappers every GRPO trainer class gets, whichever backend computes its loss.

    ``loss_path`` names the methods the loss goes through; a subclass that overrides one of them
    is refused when an adaptation is on (see :func:`_check_loss_path`).
    """
    _LOSS_PATH[trainer_cls] = loss_path
    _set(trainer_cls, "__init__", _wrap_init(trainer_cls.__init__, runtime_cls))
    _set(trainer_cls, "_generate_and_score_completions", _wrap_generate(trainer_cls._generate_and_score_completions))
    _set(trainer_cls, "_load_callback_state", _wrap_load_callback_state(trainer_cls._load_callback_state))


def _is_unsloth_generated(cls) -> bool:
    return cls.__module__ == "UnslothGRPOTrainer" or getattr(cls, "_unsloth_patched_rl_config", False)


def patch() -> None:
    """Patch TRL's GRPOConfig and GRPOTrainer, and Unsloth's generated trainer if present. Idempotent.

    If Unsloth was imported first, ``trl.GRPOTrainer`` is already Unsloth's generated trainer
    (not a subclass of TRL's): it is patched by ``backends/unsloth.py``, and TRL's eager loss,
    which that trainer does not use, is left alone.
    """
    global AdaptiveKLCallback
    from . import unsloth as unsloth_backend

    if is_patched():
        unsloth_backend.maybe_patch()
        return
    check_version("trl", _trl_supported, SUPPORTED_TRL)
    from trl.trainer import grpo_config, grpo_trainer

    config_cls = grpo_config.GRPOConfig
    if _is_unsloth_generated(config_cls):  # Unsloth's subclass; the fields go on TRL's own class
        config_cls = config_cls.__mro__[1]
    trainer_cls = grpo_trainer.GRPOTrainer
    eager_trl = not _is_unsloth_generated(trainer_cls)
    # Build everything before touching anything, so a missing anchor leaves TRL untouched.
    if eager_trl:
        compute_loss = rewrite_function(trainer_cls._compute_loss, COMPUTE_LOSS_REWRITES, library="trl")
    AdaptiveKLCallback = _callback_classes()
    try:
        patch_config_class(config_cls)
        if eager_trl:
            _set(trainer_cls, "_compute_loss", _dispatch_compute_loss(compute_loss))
            patch_trainer_class(trainer_cls, TRLAdaptiveKL, loss_path=("compute_loss", "_compute_loss"))
        unsloth_backend.maybe_patch()
    except Exception:
        unpatch()
        raise


def unpatch() -> None:
    """Restore every patched attribute exactly (identity), in reverse order."""
    from . import unsloth as unsloth_backend

    unsloth_backend.forget()
    _LOSS_PATH.clear()
    while _ORIGINALS:
        owner, name, original, had_own = _ORIGINALS.pop()
        if had_own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


def original(owner, name: str):
    """The attribute ``owner.name`` had before patching (for tests and comparisons)."""
    for patched_owner, patched_name, value, had_own in _ORIGINALS:
        if patched_owner is owner and patched_name == name:
            return value if had_own else getattr(super(owner, owner), name, None)
    return getattr(owner, name)


__all__ = ["patch", "unpatch", "is_patched", "attach", "TRLAdaptiveKL"]
