"""The trainer side every backend shares: the adaptive-KL state of a trainer, the wrappers every
GRPO trainer class gets (``__init__``, ``_generate_and_score_completions``, ``_load_callback_state``),
the config fields grafted onto a config class, the β callback that carries the controller in
checkpoints, and how metrics reach the trainer's logs.

A backend (``trl.py``, ``unsloth.py``) adds only what is its own: its rewrites (its ``PLAN``) and a
subclass of :class:`TrainerAdaptiveKL` that its rewritten loss calls into. Every attribute set here
goes through the ledger of :mod:`unsloth_adaptive_kl._source_patch`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import inspect
import logging
import sys

from .. import metrics
from .._source_patch import PatchError, set_attribute, version_of
from ..adaptation import AdaptiveKL
from ..config import FIELDS, validate
from ..kl_pipeline import KL_MONITOR
from ..versions import ALL_LOSS_TYPES, offered_loss_types
from . import _callback
from ._resume import observe_generated_reward, resume_generation_schedule
from .reward_placement import RewardPlacement

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


class TrainerAdaptiveKL(RewardPlacement, AdaptiveKL):
    """The :class:`AdaptiveKL` of one GRPO trainer: its KL term and β controller, reduced across the
    trainer's processes, with the trainer's metrics as the sink. A backend subclasses it."""

    #: A trainer created before ``import unsloth_adaptive_kl`` runs the library's own functions
    #: (True), or gets this runtime for method ``none`` (False: its loss is rewritten in place).
    stock_when_unattached = True

    def __init__(self, trainer):
        accelerator = trainer.accelerator
        super().__init__(
            trainer.args, reduce=lambda t: accelerator.reduce(t, reduction="sum"),
            process_index=accelerator.process_index, num_processes=accelerator.num_processes,
        )  # fmt: skip
        self.trainer = trainer
        if KL_MONITOR in self.generation_edits:  # the library's __init__ stored the β it was shown (building)
            trainer.__dict__["beta"] = float(trainer.args.beta)
        #: Micro-batches whose loss went through the patched loss (each reports its metrics once):
        #: how a subclass's override of the loss is seen to reach it (:func:`_guard_loss_path`).
        self.losses_reported = 0

    def record_sums(self, local_sums, *, training: bool, beta: float) -> dict[str, float]:
        # The trainer's log() empties its metrics: no tail metric there means the last window was logged
        # (Unsloth pools its rollout metrics over the window the same way).
        if metrics.TOKEN_KL_MAX not in self.trainer._metrics["train" if training else "eval"]:
            self.restart_tail_window(training)
        return super().record_sums(local_sums, training=training, beta=beta)

    def describe(self) -> str:
        """Which loss computes this trainer's KL, in words (logged once when the trainer is created)."""
        raise NotImplementedError

    def generation_index(self) -> int:
        """The index (0, 1, ...) of the training generation batch being generated: the micro-step over TRL's generation
        period (``steps_per_generation * num_iterations`` micro-steps). The micro-step is counted from the optimizer step
        (``state.global_step``, which a checkpoint restores) plus TRL's ``_step`` within it, the same on every process."""
        trainer = self.trainer
        if not all(hasattr(trainer, name) for name in ("_step", "num_iterations")):
            raise PatchError(
                f"{type(trainer).__qualname__} has no _step or num_iterations: kl_monitor_every cannot count its generation "
                "batches (an unsupported TRL or Unsloth version)"
            )
        accumulation = trainer.args.gradient_accumulation_steps
        micro_step = trainer.state.global_step * accumulation + trainer._step % accumulation
        return micro_step // (trainer.args.steps_per_generation * trainer.num_iterations)

    def runs_reference(self) -> bool:
        """Whether the generation now running scores the reference (the rewritten generation asks): while β != 0, and
        at β = 0 under ``kl_monitor`` on the batches :meth:`AdaptiveKL.monitors_batch` selects."""
        return self.scores_reference(self.generation_index, training=self.trainer.model.training)

    @classmethod
    @contextlib.contextmanager
    def building(cls, config):
        """The context the library's ``__init__`` runs in (``config``: its args). kl_monitor with beta = 0: TRL's
        ``__init__`` (and Unsloth's, generated from it) makes the reference (a model, or under PEFT the frozen "ref"
        copy of a pretrained adapter) only when ``args.beta != 0``, so it is shown β = 1.0 while it builds the
        trainer; the config's β is put back before anything trains (and before attach reads it)."""
        monitored = getattr(config, "kl_monitor", False) is True and getattr(config, "beta", None) == 0
        if not monitored:
            yield
            return
        configured, config.beta = config.beta, 1.0
        try:
            yield
        finally:
            config.beta = configured

    def log_library_kl(self, values: dict[str, float], raw, mask, mode: str) -> None:
        """Log the library's own ``kl`` where it does not (β = 0 under kl_monitor): its global masked mean of the
        raw KL over ``mask``, which is ``values``' raw_kl unless that is NaN (TRL logs 0 for no token) or tokens
        are excluded (TRL's mean counts them, at 0)."""
        kl = values[metrics.RAW_KL]
        if kl != kl or self.term.exclude_token_ids:
            kl = metrics.global_masked_mean(raw, mask, self.reduce)
        self.trainer._metrics[mode]["kl"].append(kl)

    def still_patched(self) -> bool:
        """Whether the trainer's class is still patched (false after ``unpatch()``)."""
        return trainer_is_patched(self.trainer)

    def after_attach(self, loss_class) -> None:
        """A backend's last check once the trainer is set up."""

    def log_metrics(self, values: dict[str, float], mode: str) -> dict[str, float]:
        """Hand the adaptive_kl/* values to the trainer's metrics, which its ``log()`` averages over the
        logging window: the KL values are appended (one per micro-batch); ``current_beta`` and
        ``skipped_updates`` keep only their latest value, so the log shows the β of the window's last
        step and the running count, never an average of them; ``nonfinite_kl_batches`` is summed over the
        window. A KL value that was not observed (NaN: β is 0, or no valid token) is not appended: TRL's
        ``log()`` would turn a window of only NaN into ``None``, which TensorBoard and other loggers refuse
        with a warning at every logged step. A micro-batch whose raw or adapted KL is NaN or inf appends
        neither (both means stay over the same micro-batches) and is counted in ``nonfinite_kl_batches``.
        The tail metrics (``metrics.WINDOW_TAIL_METRICS``) are statistics of the window's tokens pooled so
        far (NaN tokens left out): each keeps its latest value, so the log shows the whole window's."""
        self.losses_reported += 1
        window = self.trainer._metrics[mode]
        left_out = values.get(metrics.NONFINITE_KL_BATCHES, 0.0) > 0
        for name, value in values.items():
            if name in metrics.LATEST_VALUE_METRICS:
                window[name][:] = [value]
            elif name in metrics.WINDOW_SUM_METRICS:
                window[name][:] = [sum(window[name]) + value]
            elif name in metrics.WINDOW_TAIL_METRICS:
                if value == value:
                    window[name][:] = [value]
            elif not (value != value or left_out):
                window[name].append(value)
        return values


# -- the trainer classes and the config class ------------------------------------------------------------
#: For each patched trainer class, the loss methods that must stay ours for the adaptation to act.
_LOSS_PATH: dict[type, tuple[str, ...]] = {}


def forget() -> None:
    """Called by unpatch(), after the ledger restored the attributes."""
    _LOSS_PATH.clear()


def trainer_is_patched(trainer) -> bool:
    """Whether ``trainer``'s class is currently patched (false after :func:`unpatch`)."""
    return any(isinstance(trainer, cls) for cls in _LOSS_PATH)


def patch_config_class(config_cls, after_post_init=None) -> None:
    """Graft the adaptive-KL fields onto a dataclass config class, in place; ``after_post_init()``
    runs after each config's validation (the moment to patch a trainer Unsloth generated late)."""
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
        if hasattr(self, "loss_type"):
            check_loss_type(self.loss_type)
        if after_post_init is not None:
            after_post_init()

    set_attribute(config_cls, "__init__", extended.__init__)
    set_attribute(config_cls, "__dataclass_fields__", extended.__dataclass_fields__)
    set_attribute(config_cls, "__annotations__", annotations)
    set_attribute(config_cls, "__post_init__", __post_init__)


def check_loss_type(value) -> None:
    """Refuse a ``loss_type`` that no TRL release has (a typo: ``'dapoo'``, ``'DAPO'``, ``'grpo '``; TRL itself
    checks it only at the first loss), naming the field, the value, the values the installed TRL offers and
    the closest one. One that some TRL has but the installed one lacks is the backend's to refuse, saying so."""
    if isinstance(value, str) and value in ALL_LOSS_TYPES:
        return
    version = version_of("trl")
    offered = ALL_LOSS_TYPES if version == "not installed" else [name for name, why in offered_loss_types(version).items() if why is None]
    hint = ""
    if isinstance(value, str):
        close = difflib.get_close_matches(value.strip().lower(), ALL_LOSS_TYPES, n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
    others = [name for name in ALL_LOSS_TYPES if name not in offered]
    elsewhere = f"; other TRL releases also have {', '.join(others)}" if others else ""
    raise ValueError(
        f"loss_type={value!r} is not valid: no TRL release has this loss type{hint}; allowed with the installed trl "
        f"{version}: {', '.join(offered)}{elsewhere}"
    )


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
        stored = self.state.stateful_callbacks.get(_callback.AdaptiveKLCallback.__name__)
        if stored is not None:
            stored = stored[0] if isinstance(stored, list) else stored
            runtime.load_state_dict(
                stored["attributes"]["adaptive_kl_state"], restart=self.args.restart_beta_controller, global_step=self.state.global_step
            )
            resume_generation_schedule(self, runtime)  # trainer.beta reads the restored β from the runtime
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
    for base, names in _LOSS_PATH.items():
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
    runtime.term.check_vocabulary(vocabulary_size(trainer))
    args = trainer.args
    runtime.check_step_size(args.per_device_train_batch_size * args.gradient_accumulation_steps * trainer.accelerator.num_processes)
    trainer._adaptive_kl = runtime  # from now on trainer.beta is runtime.beta (trainer_beta)
    _guard_loss_path(trainer)
    trainer._adaptive_loss_module = None
    if loss_class is not None:
        from . import loss_class as loss_class_path

        trainer._adaptive_loss_module = loss_class_path.make_loss_module(trainer, loss_class)
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


#: What :func:`patch_trainer_class` wraps, and :func:`patch_config_class` replaces (doctor checks they exist).
WRAPPED_TRAINER_METHODS = ("__init__", "_generate_and_score_completions", "_load_callback_state")
CONFIG_ATTRIBUTES = ("__init__", "__post_init__", "__dataclass_fields__")


def patch_trainer_class(trainer_cls, runtime_cls, loss_path: tuple[str, ...]) -> None:
    """The wrappers every GRPO trainer class gets, whichever backend computes its loss.

    ``loss_path`` names the methods the loss goes through; a subclass that overrides one of them
    must reach the patched loss from its override (see :func:`_guard_loss_path`).
    """
    _callback.make_callback_class()
    _LOSS_PATH[trainer_cls] = loss_path
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
