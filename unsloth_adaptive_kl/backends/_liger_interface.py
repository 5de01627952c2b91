"""Liger's loss-module interface, declared once: the constructor's parameters (Liger-Kernel 0.8.5's
``LigerFusedLinearGRPOLoss``: name, default, and the field of TRL's trainer that means the same),
the loss types and importance-sampling levels it accepts, its argument and version checks, and its
return structure.

``liger.py`` builds its module's signature, its attributes and its call of Liger's ``ppo_loss_fn``
from :data:`LIGER_PARAMETERS`; ``loss_class.py`` builds the module's arguments from a trainer and
checks a foreign ``loss_class`` against the same table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from .._source_patch import PatchError, check_version, version_of
from ..versions import ALL_LOSS_TYPES, LOSS_CLASS_TRL, SUPPORTED, Supported

#: The loss types Liger-Kernel 0.8.5's ``LigerFusedLinearGRPOLoss`` aggregates (``chunked_loss/grpo_loss.py``): Liger's
#: own list, not TRL's. A loss type only TRL has is refused by name when the module is built, not at its first forward.
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
TOKEN_LEVEL_ONLY = ("cispo", "sapo", "vespo")  # Liger refuses sequence level for these


def _trainer_attribute(name: str) -> Callable:
    return lambda trainer: getattr(trainer, name)


def _config_field(name: str) -> Callable:
    return lambda trainer: getattr(trainer.args, name)


@dataclass(frozen=True)
class LigerParameter:
    """One constructor parameter of Liger's loss module.

    ``from_trainer(trainer)`` is its value for a TRL ``GRPOTrainer`` (each read where TRL's
    ``_compute_loss`` reads it: a trainer attribute or a config field); ``policy``: passed on to
    Liger's ``ppo_loss_fn`` as it is.
    """

    name: str
    default: object
    from_trainer: Callable
    policy: bool = False


LIGER_PARAMETERS: tuple[LigerParameter, ...] = (
    LigerParameter("beta", 0.04, _trainer_attribute("beta")),
    LigerParameter("compiled", True, lambda trainer: trainer.accelerator.device.type == "cuda"),
    LigerParameter("use_ref_model", True, lambda trainer: trainer.beta != 0.0),
    LigerParameter("chunk_size", 1, lambda trainer: 1),
    LigerParameter("epsilon_low", 0.2, _trainer_attribute("epsilon_low"), policy=True),
    LigerParameter("epsilon_high", 0.2, _trainer_attribute("epsilon_high"), policy=True),
    LigerParameter("loss_type", "dapo", _trainer_attribute("loss_type"), policy=True),
    LigerParameter("max_completion_length", None, _trainer_attribute("max_completion_length"), policy=True),
    LigerParameter("importance_sampling_level", "token", _trainer_attribute("importance_sampling_level"), policy=True),
    LigerParameter("sapo_temperature_pos", 1.0, _config_field("sapo_temperature_pos"), policy=True),
    LigerParameter("sapo_temperature_neg", 1.05, _config_field("sapo_temperature_neg"), policy=True),
    LigerParameter("temperature", 1.0, _trainer_attribute("temperature")),
    LigerParameter("delta", None, _config_field("delta"), policy=True),
    LigerParameter("use_bias_correction_kl", False, _config_field("use_bias_correction_kl")),
    LigerParameter("vespo_k_pos", 2.0, _config_field("vespo_k_pos"), policy=True),
    LigerParameter("vespo_lambda_pos", 3.0, _config_field("vespo_lambda_pos"), policy=True),
    LigerParameter("vespo_k_neg", 3.0, _config_field("vespo_k_neg"), policy=True),
    LigerParameter("vespo_lambda_neg", 2.0, _config_field("vespo_lambda_neg"), policy=True),
)
LIGER_PARAMETER_NAMES = tuple(p.name for p in LIGER_PARAMETERS)
POLICY_PARAMETER_NAMES = tuple(p.name for p in LIGER_PARAMETERS if p.policy)


def check_liger_version() -> None:
    """Refuse an untested liger-kernel (its ``ppo_loss_fn`` and normalisers are called directly),
    unless ``UNSLOTH_ADAPTIVE_KL_ALLOW_UNTESTED=1``."""
    liger = SUPPORTED["liger-kernel"]
    check_version(liger.distribution, liger.contains, liger.label)
    trl_version = version_of("trl")
    if not Supported("trl", LOSS_CLASS_TRL, LOSS_CLASS_TRL, guarded=True).contains(trl_version):
        raise PatchError(
            f"AdaptiveFusedLinearGRPOLoss and GRPOTrainer(loss_class=...) compute log-probs with TRL's chunked log-prob "
            f"kernel (trl.kernels, trl {LOSS_CLASS_TRL}), but trl {trl_version} is installed: install trl {LOSS_CLASS_TRL}, "
            "or train without loss_class= (the TRL or Unsloth backend)"
        )


def check_liger_arguments(sapo_temperature_pos, sapo_temperature_neg, delta, loss_type, importance_sampling_level, **_) -> None:
    """Liger's constructor checks (keyword arguments: the module's Liger parameters)."""
    if sapo_temperature_pos <= 0 or sapo_temperature_neg <= 0:
        raise ValueError(f"sapo temperatures must be > 0, got pos={sapo_temperature_pos}, neg={sapo_temperature_neg}")
    if delta is not None and delta <= 0:
        raise ValueError(f"delta must be > 0 or None, got {delta}")
    if loss_type not in LOSS_TYPES:
        trl_only = f" (TRL has it; Liger-Kernel {SUPPORTED['liger-kernel'].label} does not)" if loss_type in ALL_LOSS_TYPES else ""
        raise ValueError(f"loss_type={loss_type!r} is not valid for the Liger module{trl_only}; allowed: {list(LOSS_TYPES)}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level={importance_sampling_level!r} is not valid; allowed: {list(IMPORTANCE_SAMPLING_LEVELS)}")


def check_liger_configuration(loss_type, importance_sampling_level, max_completion_length) -> None:
    """Liger's per-call checks (the module's attributes are mutable)."""
    if importance_sampling_level == "sequence" and loss_type in TOKEN_LEVEL_ONLY:
        raise ValueError(
            f"Sequence-level importance sampling is not supported for loss_type='{loss_type}'. "
            "Use importance_sampling_level='token' instead."
        )
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' needs max_completion_length (its normaliser is B * max_completion_length)")


class LossTerms(NamedTuple):
    """What one call computes. ``raw_kl``/``adapted_kl`` are detached ``(B, T)`` tensors, None when β is 0;
    ``kl_mask`` the tokens they are the KL of (the attention mask without ``kl_exclude_token_ids``'), for the metrics."""

    loss: torch.Tensor
    raw_kl: torch.Tensor | None
    adapted_kl: torch.Tensor | None
    kl_mean: torch.Tensor | None
    clip_ratio: torch.Tensor
    kl_mask: torch.Tensor | None = None

    def liger_output(self):
        """Liger's return structure: ``(loss, (kl_mean, clip_ratio))``, or ``(loss, (clip_ratio,))`` when β is 0."""
        if self.kl_mean is None:
            return self.loss, (self.clip_ratio,)
        return self.loss, (self.kl_mean, self.clip_ratio)
