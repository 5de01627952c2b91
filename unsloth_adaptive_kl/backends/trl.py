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
import sys

import torch

from .. import metrics
from .._source_patch import PatchError, check_version, rewrite_function, version_of
from ..adaptation import AdaptiveKL
from ..config import FIELDS, validate
from ..versions import SUPPORTED

logger = logging.getLogger("unsloth_adaptive_kl")


class _WhenNothingElseLogs(logging.Filter):
    """Let the package's own stderr handler print a record only while the root logger has no handler
    (an application that configured logging, or pytest, gets the record there, exactly once)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not logging.getLogger().handlers


def _default_handler() -> None:
    """The one line per trainer that names its backend is INFO: show it by default, as transformers
    shows its own messages. Silence it with ``logging.getLogger("unsloth_adaptive_kl").setLevel("WARNING")``."""
    if any(getattr(h, "_unsloth_adaptive_kl", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(_WhenNothingElseLogs())
    handler._unsloth_adaptive_kl = True
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


_default_handler()

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
        """Hand the adaptive_kl/* values to the trainer's metrics, which its ``log()`` averages over the
        logging window: the KL values are appended (one per micro-batch); ``current_beta`` and
        ``skipped_updates`` keep only their latest value, so the log shows the β of the window's last
        step and the running count, never an average of them."""
        for name, value in values.items():
            if name in metrics.LATEST_VALUE_METRICS:
                self.trainer._metrics[mode][name][:] = [value]
            else:
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
            self._warned_unpatched = False

        def _check_still_patched(self) -> None:
            """After ``unpatch()`` the trainer's class runs the library's own loss: refuse to train on
            it when an adaptation was asked for; warn once when none was."""
            trainer = self.runtime.trainer
            if trainer_is_patched(trainer):
                return
            message = (
                f"unsloth_adaptive_kl.unpatch() was called after this {type(trainer).__qualname__} was created: it now "
                "computes the library's own loss, without the adaptive KL and without the adaptive_kl metrics"
            )
            runtime = self.runtime
            if not runtime.is_stock:
                raise PatchError(
                    f"{message}; kl_adaptation_method={trainer.args.kl_adaptation_method!r} with kl_estimator="
                    f"{trainer.args.kl_estimator!r} cannot be applied. Call unsloth_adaptive_kl.patch() again before "
                    "training it, or create a new trainer"
                )
            if not self._warned_unpatched:
                self._warned_unpatched = True
                logger.warning("%s (kl_adaptation_method='none', so training goes on)", message)

        def on_train_begin(self, args, state, control, **kwargs):
            self._check_still_patched()

        def on_step_begin(self, args, state, control, **kwargs):
            self._check_still_patched()

        def on_step_end(self, args, state, control, **kwargs):
            runtime = self.runtime
            runtime.trainer.beta = runtime.end_step(state.global_step)
            # After the update, so the log written right after this step shows its skip.
            runtime.log_metrics({metrics.SKIPPED_UPDATES: float(runtime.skipped_updates)}, "train")

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


def trainer_is_patched(trainer) -> bool:
    """Whether ``trainer``'s class is currently patched (false after :func:`unpatch`)."""
    return any(isinstance(trainer, cls) for cls in _LOSS_PATH)


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
def fill_missing_fields(config) -> None:
    """A config made before ``import unsloth_adaptive_kl`` lacks the fields its (now patched) class
    has: give it their defaults (method ``none``). A config whose class was never patched is left
    alone, for :func:`validate` to refuse with its hint."""
    missing = [f for f in FIELDS if not hasattr(config, f.name)]
    class_fields = getattr(type(config), "__dataclass_fields__", {})
    if not missing or not all(f.name in class_fields for f in missing):
        return
    for f in missing:
        setattr(config, f.name, f.default)
    logger.info(
        "unsloth_adaptive_kl: this %s was created before `import unsloth_adaptive_kl`; its adaptive-KL fields take "
        "their defaults (kl_adaptation_method='none'). To set them, create the config after the import.",
        type(config).__name__,
    )


def _config_argument(args, kwargs):
    """The ``args=`` of a GRPO trainer call, given by keyword or as the third positional argument."""
    if "args" in kwargs:
        return kwargs["args"]
    return args[2] if len(args) > 2 else None


def _wrap_init(original, runtime_cls):
    @functools.wraps(original)
    def __init__(self, *args, loss_class=None, **kwargs):
        config = _config_argument(args, kwargs)
        if config is not None:
            fill_missing_fields(config)
        original(self, *args, **kwargs)
        attach(self, loss_class=loss_class, runtime_cls=runtime_cls)

    return __init__


def unattached_runtime(trainer, runtime_cls):
    """The runtime of a trainer created before ``import unsloth_adaptive_kl`` (it has none).

    Such a trainer cannot have asked for an adaptation through its config (the fields did not exist):
    if one is set on it anyway, raise. Otherwise a TRL trainer trains as stock TRL (``None``: the
    callers run TRL's own functions), and an Unsloth trainer, whose generated loss is rewritten in
    place, gets the runtime for ``none`` + ``k3`` now (stock Unsloth's loss, tested identical).
    """
    method = getattr(trainer.args, "kl_adaptation_method", "none")
    estimator = getattr(trainer.args, "kl_estimator", "k3")
    if method != "none" or estimator != "k3":
        raise PatchError(
            f"this {type(trainer).__qualname__} was created before `import unsloth_adaptive_kl`, so "
            f"kl_adaptation_method={method!r} with kl_estimator={estimator!r} cannot be applied to it: create the "
            "trainer (and its GRPOConfig) after the import"
        )
    if not getattr(trainer, "_adaptive_kl_unattached_warned", False):
        trainer._adaptive_kl_unattached_warned = True
        logger.warning(
            "unsloth_adaptive_kl: this %s was created before `import unsloth_adaptive_kl`; it trains %s, without the "
            "adaptive_kl metrics. Create the trainer after the import to use the package.",
            type(trainer).__qualname__,
            "as stock TRL" if runtime_cls is TRLAdaptiveKL else "with the library's own KL (method 'none')",
        )
    if runtime_cls is TRLAdaptiveKL:
        return None
    fill_missing_fields(trainer.args)
    return attach(trainer, runtime_cls=runtime_cls)


def _runtime(trainer, runtime_cls):
    runtime = getattr(trainer, "_adaptive_kl", None)
    return runtime if runtime is not None else unattached_runtime(trainer, runtime_cls)


def _dispatch_compute_loss(rewritten, original):
    @functools.wraps(rewritten)
    def _compute_loss(self, model, inputs):
        if _runtime(self, TRLAdaptiveKL) is None:  # created before the import: stock TRL
            return original(self, model, inputs)
        # With loss_class=, the loss comes from that module (backends/liger.py), not TRL's per-token path.
        if getattr(self, "_adaptive_loss_module", None) is not None:
            from . import liger

            return liger.compute_loss(self, model, inputs)
        return rewritten(self, model, inputs)

    return _compute_loss


def _wrap_generate(original, runtime_cls):
    @functools.wraps(original)
    def _generate_and_score_completions(self, *args, **kwargs):
        if _runtime(self, runtime_cls) is None:  # created before the import: stock TRL
            return original(self, *args, **kwargs)
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


def _wrap_load_callback_state(original, runtime_cls):
    @functools.wraps(original)
    def _load_callback_state(self):
        original(self)
        runtime = _runtime(self, runtime_cls)
        if runtime is None:  # created before the import: stock TRL, nothing of ours to restore
            return
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
    runtime_cls = runtime_cls or TRLAdaptiveKL
    runtime = runtime_cls(trainer)
    _check_loss_path(trainer, runtime.is_stock)
    args = trainer.args
    runtime.check_step_size(args.per_device_train_batch_size * args.gradient_accumulation_steps * trainer.accelerator.num_processes)
    trainer._adaptive_kl = runtime
    trainer.beta = runtime.beta
    trainer._adaptive_loss_module = None
    if loss_class is not None:
        from . import liger

        trainer._adaptive_loss_module = liger.make_loss_module(trainer, loss_class)
    trainer.add_callback(AdaptiveKLCallback(runtime))
    logger.info(
        "unsloth_adaptive_kl: %s; kl_adaptation_method=%r, kl_estimator=%r, beta=%s (logged as %s)",
        backend_description(trainer),
        args.kl_adaptation_method,
        runtime.estimator,
        runtime.beta,
        ", ".join(metrics.METRIC_NAMES),
    )
    if runtime_cls is TRLAdaptiveKL and "unsloth" in sys.modules and loss_class is None:
        logger.warning(
            "unsloth_adaptive_kl: unsloth is imported, but this trainer is TRL's own %s (Unsloth did not patch TRL's "
            "GRPO trainer here, e.g. no GPU): it trains on TRL's eager loss, not Unsloth's fused one",
            type(trainer).__qualname__,
        )
    return runtime


def backend_description(trainer) -> str:
    """Which loss computes the KL of this trainer, in words (logged once when the trainer is created)."""
    module = getattr(trainer, "_adaptive_loss_module", None)
    if module is not None:
        cls = type(module)
        return f"backend: loss_class={cls.__module__}.{cls.__qualname__} (fused-linear loss from the LM head's hidden states)"
    from . import unsloth as unsloth_backend

    if isinstance(getattr(trainer, "_adaptive_kl", None), unsloth_backend.UnslothAdaptiveKL):
        return f"backend: Unsloth fused loss ({type(trainer).__module__}.{type(trainer).__qualname__}, grpo_compute_loss)"
    return f"backend: TRL eager loss ({type(trainer).__qualname__}._compute_loss)"


#: For each patched trainer class, the loss methods that must stay ours for the adaptation to act.
_LOSS_PATH: dict[type, tuple[str, ...]] = {}


def patch_trainer_class(trainer_cls, runtime_cls, loss_path: tuple[str, ...]) -> None:
    """The wrappers every GRPO trainer class gets, whichever backend computes its loss.

    ``loss_path`` names the methods the loss goes through; a subclass that overrides one of them
    is refused when an adaptation is on (see :func:`_check_loss_path`).
    """
    _LOSS_PATH[trainer_cls] = loss_path
    _set(trainer_cls, "__init__", _wrap_init(trainer_cls.__init__, runtime_cls))
    _set(trainer_cls, "_generate_and_score_completions", _wrap_generate(trainer_cls._generate_and_score_completions, runtime_cls))
    _set(trainer_cls, "_load_callback_state", _wrap_load_callback_state(trainer_cls._load_callback_state, runtime_cls))


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
            _set(trainer_cls, "_compute_loss", _dispatch_compute_loss(compute_loss, trainer_cls._compute_loss))
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
