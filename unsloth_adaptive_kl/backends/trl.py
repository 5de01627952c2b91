"""TRL backend: adaptive KL inside ``GRPOTrainer._compute_loss`` (TRL's eager loss).

What is patched, each undone by ``unpatch()``:

* ``GRPOConfig``: gains the fields of :mod:`unsloth_adaptive_kl.config` in place (so a class
  imported before this module gets them too), validated in ``__post_init__``.
* ``GRPOTrainer._compute_loss``: rewritten by :data:`PLAN` (below) so that the per-token KL comes
  from the core :class:`~unsloth_adaptive_kl.kl_term.KLTerm`, β from the controller, and the
  length-normalised term is added after aggregation. TRL's ``kl`` metric keeps meaning the
  unshaped KL. With ``GRPOTrainer(loss_class=...)`` the loss comes from that module instead
  (``backends/loss_class.py``).
* ``_generate_and_score_completions``: :data:`PLAN`'s edit for ``kl_monitor`` (the reference forward at β = 0) and
  the reward placement's, composed per trainer (``backends/_generation.py``).
* ``__init__``, ``_generate_and_score_completions``, ``_load_callback_state``: the wrappers every
  trainer gets (``backends/_trainer.py``): state and callback, reward feed, resume.
"""

from __future__ import annotations

import functools
import sys

import torch

from .._source_patch import AnchorSet, Plan, Rewrite, check_version, is_patched, original, rewrite_function, set_attribute, version_of  # noqa: F401
from ..kl_pipeline import KL_MONITOR, TokenKL, token_kl
from ..versions import SUPPORTED, offered_loss_types
from . import _config_class, _generation, _runtime, _trainer
from . import loss_class as loss_class_path
from . import reward_placement

SUPPORTED_TRL = SUPPORTED["trl"].label  # the range lives in versions.py

# -- the plan: what is rewritten in TRL, per version family ----------------------------------------------
# Four families of TRL's _compute_loss (docs/compatibility.md has the differences): 1.8+ (the anchors
# were written on 1.15), 0.27-1.7 (no entropy bonus: the term goes before the metrics block), 0.26
# (`mask` is defined only after the KL block) and 0.24-0.25 (no use_bias_correction_kl, no `mask`).
_COMPUTE_LOSS = "GRPOTrainer._compute_loss"
_KL_BLOCK = """        if self.beta != 0.0:
            ref_per_token_logps = inputs["ref_per_token_logps"]
            per_token_kl = (
                torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
            )
"""
_BIAS_CORRECTION = """            # Importance sampling correction for the KL divergence
            if self.args.use_bias_correction_kl:
                per_token_kl = per_token_kl * coef_1
"""
_CORRECTED = "coef_1 if self.args.use_bias_correction_kl else None"
_TOOL_MASK = 'completion_mask if not self.tools else completion_mask * inputs["tool_mask"]'  # TRL 0.26's own mask
_LOG_METRICS = "        # Log the metrics\n"
_MODE = '"train" if self.model.training else "eval"'


def _kl(anchor: str, mask: str, coef: str, tail: str = "") -> Rewrite:
    return Rewrite(
        target=_COMPUTE_LOSS,
        library="trl",
        anchor=anchor + tail,
        replacement=f"""        adaptive_kl = self._adaptive_kl.loss_kl(per_token_logps, inputs, mask={mask}, coef={coef})
        if adaptive_kl is not None:
            per_token_kl = adaptive_kl.raw
{tail}""",
        why="the per-token KL (raw, for TRL's kl metric) and its adapted form come from the KL pipeline, without the "
        "excluded tokens; also at β = 0 under kl_monitor, on the batches whose reference forward it ran",
    )


_ADD = Rewrite(
    target=_COMPUTE_LOSS,
    library="trl",
    anchor="""        if self.beta != 0.0:
            per_token_loss = per_token_loss + self.beta * per_token_kl
""",
    replacement="""        if adaptive_kl is not None:
            per_token_loss = adaptive_kl.per_token_loss(per_token_loss)
""",
    why="β times the adapted KL enters the per-token loss where the pipeline's plan puts it there (not under "
    "length_normalized, which adds it after aggregation, nor under kl_placement='reward')",
)


def _after_aggregation(anchor: str, mask: str, mode: str) -> Rewrite:
    return Rewrite(
        target=_COMPUTE_LOSS,
        library="trl",
        anchor=anchor,
        replacement=f"""        loss = self._adaptive_kl.after_aggregation(loss, adaptive_kl, mask={mask}, mode={mode})
""" + anchor,
        why="after aggregation: the length-normalised term, and the adaptive_kl/* metrics",
    )


GENERATE = "GRPOTrainer._generate_and_score_completions"
_REFERENCE_WHILE_MONITORED = Rewrite(
    target=GENERATE,
    library="trl",
    anchor="            # Compute the per-token log probabilities for the reference model\n            if self.beta != 0.0:\n",
    replacement="            # Compute the per-token log probabilities for the reference model\n"
    "            if self._adaptive_kl.runs_reference():\n",
    why="kl_monitor: the reference forward also runs at β = 0, on every kl_monitor_every-th generation batch (checked on "
    "trl 1.8, 1.11, 1.14, 1.15, 1.16)",
)


_GENERATE_REWRITES = (
    _REFERENCE_WHILE_MONITORED,
    *(reward_placement.explicit_super(GENERATE, "trl", line) for line in reward_placement.SUPER_CALLS),
)
TRL_1_8 = AnchorSet(
    family="trl 1.8",
    versions={"trl": ">=1.8,<1.17"},
    rewrites=(
        _kl(_KL_BLOCK + _BIAS_CORRECTION, "mask", _CORRECTED),
        _ADD,
        _after_aggregation("        if self._entropy_bonus_enabled:\n", "mask", "mode"),
        *_GENERATE_REWRITES,
    ),
)
TRL_0_27 = AnchorSet(
    family="trl 0.27",
    versions={"trl": ">=0.27,<1.8"},
    rewrites=(_kl(_KL_BLOCK + _BIAS_CORRECTION, "mask", _CORRECTED), _ADD, _after_aggregation(_LOG_METRICS, "mask", _MODE)),
)
TRL_0_26 = AnchorSet(
    family="trl 0.26",
    versions={"trl": ">=0.26,<0.27"},
    rewrites=(_kl(_KL_BLOCK + _BIAS_CORRECTION, _TOOL_MASK, _CORRECTED), _ADD, _after_aggregation(_LOG_METRICS, "mask", _MODE)),
)
TRL_0_24 = AnchorSet(
    family="trl 0.24",
    versions={"trl": ">=0.24,<0.26"},
    rewrites=(
        # The line after the block is part of the anchor: without it, this block also matches 0.26+.
        _kl(_KL_BLOCK, "completion_mask", "None", tail="\n        # Compute the loss\n"),
        _ADD,
        _after_aggregation(_LOG_METRICS, "completion_mask", _MODE),
    ),
)
# Newest first: a version outside every family (UNSLOTH_ADAPTIVE_KL_ALLOW_UNTESTED=1) gets the first set whose anchors all match.
PLAN = Plan(backend="trl", anchor_sets=(TRL_1_8, TRL_0_27, TRL_0_26, TRL_0_24))


def _trl_supported(version: str) -> bool:
    return SUPPORTED["trl"].contains(version)


_MONITORED: set[str] = set()  # the patched targets kl_monitor needs that this TRL's family has (patch() fills it)
#: kl_monitor as a feature of the generation: PLAN's rewrites of ``_generate_and_score_completions`` (TRL >= 1.8).
MONITOR = _generation.Feature(KL_MONITOR, PLAN, enabled=lambda runtime: KL_MONITOR in runtime.generation_edits)


class TRLAdaptiveKL(_runtime.TrainerAdaptiveKL):
    """The :class:`AdaptiveKL` of one TRL ``GRPOTrainer``; the rewritten loss calls into it."""

    def reference_logps(self, inputs) -> torch.Tensor:
        if "ref_per_token_logps" not in inputs:
            raise RuntimeError(
                "unsloth_adaptive_kl: beta is non-zero but this batch has no reference log-probs (they are only "
                "computed while beta != 0 at generation time). A β controller must not leave 0 once it reached it."
            )
        return inputs["ref_per_token_logps"]

    def loss_kl(self, logps, inputs, *, mask, coef=None) -> TokenKL | None:
        """The micro-batch's per-token KL (:func:`~unsloth_adaptive_kl.kl_pipeline.token_kl`), or None where its plan
        computes none: TRL's log-probs, the reference's from ``inputs``, TRL's ``mask`` and importance ratio ``coef``."""
        plan = self.plan(inputs.get("ref_per_token_logps"))
        if not plan.computes_kl:
            return None
        return token_kl(self.term, plan, logps, self.reference_logps(inputs), mask, inputs["completion_ids"], coef)

    def after_aggregation(self, loss, kl: TokenKL | None, *, mask, mode: str):
        """Add what the pipeline adds after aggregation (the length-normalised term) and log this micro-batch's
        metrics (over ``kl.kl_mask``: the valid tokens that are not excluded)."""
        training = mode == "train"
        if kl is not None:
            loss = kl.after_aggregation(loss, accumulation=lambda: self.trainer.current_gradient_accumulation_steps if training else 1.0)
        values = self.log_metrics(self.record_kl(kl, training=training), mode)
        if kl is not None and not kl.plan.with_grad:  # β = 0 (kl_monitor): TRL logs its own kl only while β != 0
            self.log_library_kl(values, kl.raw, mask, mode)
        return loss

    def describe(self) -> str:
        return f"backend: TRL eager loss ({type(self.trainer).__qualname__}._compute_loss)"

    def after_attach(self, loss_class) -> None:
        version, loss_type = version_of("trl"), self.trainer.loss_type
        offered = offered_loss_types(version)
        if loss_class is None and offered.get(loss_type, "") is not None:
            allowed = ", ".join(name for name, why in offered.items() if why is None)
            why = offered.get(loss_type) or "a newer TRL has it"
            raise ValueError(f"loss_type={loss_type!r} is not offered with the installed trl {version} ({why}); allowed: {allowed}")
        if KL_MONITOR in self.generation_edits and GENERATE not in _MONITORED:
            raise ValueError(
                f"kl_monitor=True is not valid with the installed trl {version}: the reference forward at beta = 0 is "
                "patched into TRL >= 1.8 only; allowed: kl_monitor=False, or trl >= 1.8"
            )
        if "unsloth" in sys.modules and loss_class is None:
            _runtime.logger.warning(
                "unsloth_adaptive_kl: unsloth is imported, but this trainer is TRL's own %s (Unsloth did not patch TRL's "
                "GRPO trainer here, e.g. no GPU): it trains on TRL's eager loss, not Unsloth's fused one",
                type(self.trainer).__qualname__,
            )


def _dispatch_compute_loss(rewritten, library_own):
    @functools.wraps(rewritten)
    def _compute_loss(self, model, inputs):
        if _trainer.runtime_of(self, TRLAdaptiveKL) is None:  # created before the import: stock TRL
            return library_own(self, model, inputs)
        if getattr(self, "_adaptive_loss_module", None) is not None:  # GRPOTrainer(loss_class=...)
            return loss_class_path.compute_loss(self, model, inputs)
        return rewritten(self, model, inputs)

    return _compute_loss


def is_unsloth_generated(cls) -> bool:
    """Whether ``cls`` is one of the classes Unsloth generated from TRL's (``UnslothGRPOTrainer``)."""
    return cls.__module__ == "UnslothGRPOTrainer" or getattr(cls, "_unsloth_patched_rl_config", False)


def owners() -> dict[str, object]:
    """TRL's own classes, the owners of :data:`PLAN`'s targets (also when Unsloth rebound the names)."""
    from trl.trainer import grpo_config, grpo_trainer

    config_cls, trainer_cls = grpo_config.GRPOConfig, grpo_trainer.GRPOTrainer
    if is_unsloth_generated(config_cls):  # Unsloth's subclass; TRL's own class is its base
        config_cls = config_cls.__mro__[1]
    if is_unsloth_generated(trainer_cls):
        trainer_cls = trainer_cls.__mro__[1]
    return {"GRPOConfig": config_cls, "GRPOTrainer": trainer_cls}


def patch(after_config_created=None) -> None:
    """Patch TRL's GRPOConfig, and TRL's GRPOTrainer unless Unsloth already replaced it.

    If Unsloth was imported first, ``trl.GRPOTrainer`` is Unsloth's generated trainer (not a
    subclass of TRL's): ``backends/unsloth.py`` patches it, and TRL's eager loss, which that
    trainer does not use, is left alone. ``after_config_created()`` runs after each config's
    ``__post_init__``. Everything is built before anything is set, so a missing anchor leaves TRL
    untouched.
    """
    check_version("trl", _trl_supported, SUPPORTED_TRL)
    from trl.trainer import grpo_trainer

    classes = owners()
    eager_trl = not is_unsloth_generated(grpo_trainer.GRPOTrainer)
    built = PLAN.build(classes) if eager_trl else {}
    _config_class.patch_config_class(classes["GRPOConfig"], after_post_init=after_config_created)
    if eager_trl:
        trainer_cls = classes["GRPOTrainer"]
        set_attribute(trainer_cls, "_compute_loss", _dispatch_compute_loss(built[_COMPUTE_LOSS], trainer_cls._compute_loss))
        # kl_monitor's reference forward (PLAN's rewrites of the generation) and the reward placement's penalty, composed
        # onto one copy of TRL's source per combination; before the wrappers below wrap it
        reasons = reward_placement.install(trainer_cls, reward_placement.TRL_PLAN, classes, also=(MONITOR,))
        _MONITORED.clear()
        if frozenset({MONITOR.name}) not in reasons:
            _MONITORED.add(GENERATE)
        _trainer.patch_trainer_class(trainer_cls, TRLAdaptiveKL, loss_path=("compute_loss", "_compute_loss"))


__all__ = ["PLAN", "TRLAdaptiveKL", "is_unsloth_generated", "owners", "patch"]
