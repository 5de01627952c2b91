"""The wrappers every GRPO trainer class gets, whichever backend computes its loss (``__init__``,
``_generate_and_score_completions``, ``_load_callback_state``, ``trainer.beta``), and :func:`attach`, which gives a
trainer its runtime (``_runtime.TrainerAdaptiveKL``) and β callback. ``GRPOTrainer(loss_class=...)`` builds its loss
module through the maker that ``loss_class.py`` registers here (:func:`register_loss_module_maker`): this layer does
not import the Liger stack. Every attribute set here goes through the ledger of :mod:`unsloth_adaptive_kl._source_patch`.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

from .. import metrics
from ..config import DEFAULTS
from .._source_patch import PatchError, set_attribute, version_of
from . import _callback
from ._config_class import check_loss_type, fill_missing_fields, logger
from ._patched_classes import LOSS_PATHS, trainer_is_patched
from ._resume import observe_generated_reward, resume_generation_schedule
from ._runtime import TrainerAdaptiveKL

#: How ``GRPOTrainer(loss_class=...)`` builds its loss module: ``maker(trainer, loss_class)``, registered by
#: ``loss_class.py`` (imported by the TRL backend).
_LOSS_MODULE_MAKERS: list[Callable] = []


def register_loss_module_maker(maker: Callable) -> None:
    """Register how a trainer's ``loss_class=`` becomes its loss module (``loss_class.make_loss_module``)."""
    _LOSS_MODULE_MAKERS[:] = [maker]


def make_loss_module(trainer, loss_class):
    if not _LOSS_MODULE_MAKERS:
        raise PatchError(f"GRPOTrainer(loss_class={loss_class!r}): no loss-module maker is registered (the TRL backend registers it)")
    return _LOSS_MODULE_MAKERS[0](trainer, loss_class)


def reads_fused_head(loss_class) -> bool:
    """Whether ``loss_class`` (None: the backend's own loss) takes ``liger_fused_head`` (ours does; Liger's own class
    has no fused head)."""
    return loss_class is not None and "fused_head" in inspect.signature(loss_class).parameters


def _config_argument(args, kwargs):
    """The ``args=`` of a GRPO trainer call, given by keyword or as the third positional argument."""
    if "args" in kwargs:
        return kwargs["args"]
    return args[2] if len(args) > 2 else None


class _OwnLoss:
    """The default of ``loss_class=``: the trainer's own loss. Not ``None`` on purpose: Unsloth generates
    its trainer's ``__init__`` from this signature and copies the parameters whose default is a plain
    literal; ``loss_class`` is handled by our wrapper and must not be passed on to TRL's ``__init__``."""

    def __repr__(self) -> str:
        return "OWN_LOSS"


OWN_LOSS = _OwnLoss()


def _signature_with_loss_class(original) -> inspect.Signature:
    """``original``'s signature plus the keyword-only ``loss_class`` the wrapper accepts."""
    signature = inspect.signature(original)
    parameters = list(signature.parameters.values())
    extra = inspect.Parameter("loss_class", inspect.Parameter.KEYWORD_ONLY, default=OWN_LOSS)
    at = next((i for i, p in enumerate(parameters) if p.kind is p.VAR_KEYWORD), len(parameters))
    return signature.replace(parameters=[*parameters[:at], extra, *parameters[at:]])


def _wrap_init(original, runtime_cls):
    @functools.wraps(original)
    def __init__(self, *args, loss_class=OWN_LOSS, **kwargs):
        config = _config_argument(args, kwargs)
        if config is not None:
            fill_missing_fields(config)
        with runtime_cls.building(config):
            original(self, *args, **kwargs)
        attach(self, loss_class=None if loss_class is OWN_LOSS else loss_class, runtime_cls=runtime_cls)

    __init__.__signature__ = _signature_with_loss_class(original)  # shown by help() and inspect.signature
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
            "as stock TRL" if runtime_cls.stock_when_unattached else "with the library's own KL (method 'none')",
        )
    if runtime_cls.stock_when_unattached:
        return None
    fill_missing_fields(trainer.args)
    return attach(trainer, runtime_cls=runtime_cls)


def runtime_of(trainer, runtime_cls):
    """The trainer's runtime; for a trainer created before the import, see :func:`unattached_runtime`."""
    runtime = getattr(trainer, "_adaptive_kl", None)
    return runtime if runtime is not None else unattached_runtime(trainer, runtime_cls)


def _wrap_generate(original, runtime_cls):
    @functools.wraps(original)
    def _generate_and_score_completions(self, *args, **kwargs):
        if runtime_of(self, runtime_cls) is None:  # created before the import: stock TRL
            return original(self, *args, **kwargs)
        mode = "train" if self.model.training else "eval"
        rewards = self._metrics[mode]["reward"]
        before = len(rewards)
        runtime = self._adaptive_kl
        monitored = runtime.beta == 0.0 and runtime.runs_reference()  # at β = 0 only kl_monitor's batches score it
        output = original(self, *args, **kwargs)
        if monitored and (not isinstance(output, dict) or output.get("ref_per_token_logps") is None):
            raise PatchError(
                f"{type(self).__qualname__}._generate_and_score_completions returned no reference log-probs for a generation "
                "batch kl_monitor watches at beta = 0 (its reference forward did not run); the KL cannot be computed"
            )
        if mode == "train":
            rewards = self._metrics["train"]["reward"]
            if len(rewards) != before + 1:
                raise PatchError(
                    f"trl {version_of('trl')}: _generate_and_score_completions did not log exactly one 'reward' "
                    "value; the β controller cannot see the reward."
                )
            observe_generated_reward(self, rewards[-1])
        return output

    return _generate_and_score_completions


def _wrap_load_callback_state(original, runtime_cls):
    @functools.wraps(original)
    def _load_callback_state(self):
        original(self)
        runtime = runtime_of(self, runtime_cls)
        if runtime is None:  # created before the import: stock TRL, nothing of ours to restore
            return
        name = _callback.AdaptiveKLCallback.__name__
        stored = self.state.stateful_callbacks.get(name)
        if stored is not None:
            stored = stored[0] if isinstance(stored, list) else stored
            runtime.load_state_dict(
                stored["attributes"]["adaptive_kl_state"], restart=self.args.restart_beta_controller, global_step=self.state.global_step
            )
            resume_generation_schedule(self, runtime)  # trainer.beta reads the restored β from the runtime
        else:  # a checkpoint of a run without this package (stock TRL or Unsloth): it trained with no β controller
            runtime.resume_without_state(restart=self.args.restart_beta_controller, global_step=self.state.global_step)
            # the Trainer's save writes each stateful callback's state under its name, which must be there: a KeyError
            # at the next checkpoint otherwise (the restored state lists only the callbacks of the run that wrote it)
            self.state.stateful_callbacks[name] = {}
        # With restore_callback_states_from_checkpoint=True the Trainer rebuilt our callback without
        # its runtime: drop such copies and keep exactly one bound callback.
        for callback in list(self.callback_handler.callbacks):
            if isinstance(callback, _callback.AdaptiveKLCallback) and callback.runtime is not runtime:
                self.callback_handler.remove_callback(callback)
        if not any(isinstance(cb, _callback.AdaptiveKLCallback) for cb in self.callback_handler.callbacks):
            self.callback_handler.add_callback(_callback.AdaptiveKLCallback(runtime))

    return _load_callback_state


def _guard_loss_path(trainer) -> None:
    """A subclass that overrides a method of the patched loss path (``compute_loss``, TRL's ``_compute_loss``)
    trains with the adaptation when its override reaches the patched loss (``super().compute_loss(...)``).
    Whether it does is seen at every call: the trainer's ``compute_loss`` becomes a check that the patched
    loss reported this micro-batch, before the loss goes back to the training step, so a bypassed loss is
    refused before its backward pass and before any optimizer step."""
    for base, names in LOSS_PATHS.items():
        if not isinstance(trainer, base):
            continue
        overridden = [name for name in names if getattr(type(trainer), name) is not getattr(base, name)]
        if overridden:
            trainer.compute_loss = _reached_loss_check(trainer, base, names, overridden)
        return


def _reached_loss_check(trainer, base, names: tuple[str, ...], overridden: list[str]):
    own = trainer.compute_loss  # the subclass's bound method

    @functools.wraps(own)
    def compute_loss(*args, **kwargs):
        runtime = trainer._adaptive_kl
        before = runtime.losses_reported
        result = own(*args, **kwargs)
        if runtime.losses_reported == before and trainer_is_patched(trainer):  # after unpatch() nothing reports
            _loss_not_reached(trainer, base, names, overridden)
        return result

    return compute_loss


def _loss_not_reached(trainer, base, names: tuple[str, ...], overridden: list[str]) -> None:
    """A call of an overriding subclass's ``compute_loss`` returned without running the patched loss:
    refuse it when the adaptation is on (its update would train without it); with ``none`` + ``k3``
    (nothing to adapt) warn once that the adaptive_kl metrics are not logged."""
    runtime = trainer._adaptive_kl
    cls, path = type(trainer).__qualname__, " -> ".join(f"{base.__qualname__}.{name}" for name in names)
    message = (
        f"{cls} overrides {', '.join(overridden)} of {base.__qualname__}, and this call of {cls}.compute_loss returned "
        f"a loss that did not go through {path}, the loss unsloth_adaptive_kl patches"
    )
    how = (
        f"make the override build on the patched loss: in {cls}.compute_loss, `loss = super().compute_loss(model, inputs, "
        "return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)`"
        + (" (or `super()._compute_loss(model, inputs)` in an override of _compute_loss)" if "_compute_loss" in names else "")
        + ", then change and return that loss (docs/reliability.md, 'Subclasses of the trainer')"
    )
    if runtime.is_stock:
        if not getattr(trainer, "_adaptive_kl_bypass_warned", False):
            trainer._adaptive_kl_bypass_warned = True
            logger.warning(
                "unsloth_adaptive_kl: %s. No adaptation is requested (kl_adaptation_method='none', kl_estimator='k3'), so "
                "training goes on with that loss, without the adaptive_kl metrics. To have them, %s.", message, how
            )
        return
    args = trainer.args
    raise PatchError(
        f"{message}: kl_adaptation_method={args.kl_adaptation_method!r} with kl_estimator={args.kl_estimator!r} would not "
        f"act on this update, so it is refused before its backward pass (no optimizer step has applied it). To train "
        f"with the adaptation, {how}."
    )


def attach(trainer, runtime_cls, loss_class=None) -> TrainerAdaptiveKL:
    """Give ``trainer`` its adaptive-KL state (and, with ``loss_class``, its loss module); idempotent."""
    existing = getattr(trainer, "_adaptive_kl", None)
    if existing is not None:
        return existing
    check_loss_type(getattr(trainer, "loss_type", trainer.args.loss_type))  # the config's may have changed since it was checked
    runtime = runtime_cls(trainer)
    runtime.check_model(vocab_size=vocabulary_size(trainer))
    args = trainer.args
    runtime.check_step_size(args.per_device_train_batch_size * args.gradient_accumulation_steps * trainer.accelerator.num_processes)
    trainer._adaptive_kl = runtime  # from now on trainer.beta is runtime.beta (trainer_beta)
    _guard_loss_path(trainer)
    trainer._adaptive_loss_module = None
    if loss_class is not None:
        trainer._adaptive_loss_module = make_loss_module(trainer, loss_class)
    if args.liger_fused_head != DEFAULTS["liger_fused_head"] and not reads_fused_head(loss_class) and runtime.process_index == 0:
        logger.warning(
            "unsloth_adaptive_kl: liger_fused_head=%r has no effect: it sets the fused LM head of "
            "GRPOTrainer(loss_class=AdaptiveFusedLinearGRPOLoss), and this trainer's loss is %s",
            args.liger_fused_head, "Liger's own class, which has none" if loss_class is not None else "its backend's own (no loss_class)",
        )
    trainer.add_callback(_callback.AdaptiveKLCallback(runtime))
    logger.info(
        "unsloth_adaptive_kl: %s; kl_adaptation_method=%r, kl_estimator=%r, beta=%s (logged as %s)",
        backend_description(trainer),
        args.kl_adaptation_method,
        runtime.estimator,
        runtime.beta,
        ", ".join(metrics.METRIC_NAMES),
    )
    runtime.check_placement()  # kl_placement='reward': refused here where this trainer cannot apply it
    runtime.after_attach(loss_class)
    return runtime


def vocabulary_size(trainer) -> int | None:
    """How many token ids the trainer's model can sample: its LM head's rows (its config's ``vocab_size`` where the head
    cannot be read); None when neither is known."""
    model = getattr(trainer, "model", None)
    try:
        return int(model.get_output_embeddings().weight.shape[0])
    except (AttributeError, TypeError):
        size = getattr(getattr(model, "config", None), "vocab_size", None)
        return size if isinstance(size, int) else None


def backend_description(trainer) -> str:
    """Which loss computes the KL of this trainer, in words (logged once when the trainer is created)."""
    module = getattr(trainer, "_adaptive_loss_module", None)
    if module is not None:
        cls = type(module)
        return f"backend: loss_class={cls.__module__}.{cls.__qualname__} (fused-linear loss from the LM head's hidden states)"
    return trainer._adaptive_kl.describe()


#: What :func:`patch_trainer_class` wraps (doctor checks they exist).
WRAPPED_TRAINER_METHODS = ("__init__", "_generate_and_score_completions", "_load_callback_state")


def patch_trainer_class(trainer_cls, runtime_cls, loss_path: tuple[str, ...]) -> None:
    """The wrappers every GRPO trainer class gets, whichever backend computes its loss.

    ``loss_path`` names the methods the loss goes through; a subclass that overrides one of them
    must reach the patched loss from its override (see :func:`_guard_loss_path`).
    """
    _callback.make_callback_class()
    LOSS_PATHS[trainer_cls] = loss_path
    for name, wrap in zip(WRAPPED_TRAINER_METHODS, (_wrap_init, _wrap_generate, _wrap_load_callback_state)):
        set_attribute(trainer_cls, name, wrap(getattr(trainer_cls, name), runtime_cls))
    set_attribute(trainer_cls, "beta", trainer_beta)


def _get_beta(trainer):
    runtime = trainer.__dict__.get("_adaptive_kl")
    return runtime.beta if runtime is not None else trainer.__dict__["beta"]


def _set_beta(trainer, value):
    runtime = trainer.__dict__.get("_adaptive_kl")
    if runtime is not None:
        runtime.beta = value
    # Kept for the library's own loss after unpatch() (which removes this property): only method
    # 'none' trains on then (the callback refuses the others), whose β nothing but this setter changes.
    trainer.__dict__["beta"] = float(value) if runtime is not None else value


#: ``trainer.beta`` of every patched trainer class: β has one owner, the trainer's β controller
#: (``trainer._adaptive_kl``); the losses read it through this, and assigning it sets the controller's.
#: Before the trainer is attached (TRL's ``__init__`` sets ``self.beta = args.beta``) it is a plain value.
trainer_beta = property(_get_beta, _set_beta, doc="β, read from and written to the trainer's β controller")
