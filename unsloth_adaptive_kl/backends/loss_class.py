"""``GRPOTrainer(loss_class=...)``: TRL's trainer with its loss computed by a Liger-shaped module.

The module is :class:`~unsloth_adaptive_kl.backends.liger.AdaptiveFusedLinearGRPOLoss` (or a
subclass), or Liger's own ``LigerFusedLinearGRPOLoss`` for method ``none`` with ``k3``. It is
built from the trainer's config (:func:`make_loss_module`, TRL's meaning of each field), shares
the trainer's adaptive-KL state (so the trainer's β controller sets its β), and
:func:`compute_loss` replaces TRL's per-token path for one micro-batch: hidden states from the
backbone, the module's loss, TRL's scaling and metrics.

**luspo.** Liger's luspo is ``(ℓ * mask.sum(-1, keepdim=True)).sum() / (B * ℓ.shape[1])``, which
weighs padded positions too; TRL 1.15's is ``(ℓ * mask).sum(-1).mean()``. Both use the clipped-PPO
surrogate of ``dr_grpo``, whose Liger normaliser is ``B * max_completion_length``; so this path
runs TRL's ``luspo`` as Liger's ``dr_grpo`` with ``max_completion_length=1``, which is exactly
TRL's luspo (for our module and for Liger's own).
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn

from .. import metrics
from ..config import fused_head_setting
from ..kl_pipeline import KL_MONITOR
from . import _trainer
from ._liger_interface import LIGER_PARAMETER_NAMES, LIGER_PARAMETERS, LossTerms, check_liger_configuration, check_liger_version
from .liger import AdaptiveFusedLinearGRPOLoss

#: What a foreign ``loss_class`` must accept: Liger's constructor and forward arguments.
_LIGER_INIT_PARAMETERS = LIGER_PARAMETER_NAMES
_LIGER_FORWARD_PARAMETERS = tuple(inspect.signature(AdaptiveFusedLinearGRPOLoss.forward).parameters)[1:]


def check_loss_class(loss_class) -> None:
    """Raise TypeError unless ``loss_class`` is an ``nn.Module`` class with Liger's constructor and forward."""
    expected = "AdaptiveFusedLinearGRPOLoss, a subclass of it, or a class with the constructor and forward of liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss"
    if not (isinstance(loss_class, type) and issubclass(loss_class, nn.Module)):
        raise TypeError(f"loss_class={loss_class!r} is not an nn.Module class; pass {expected}")
    for method, names in (("__init__", _LIGER_INIT_PARAMETERS), ("forward", _LIGER_FORWARD_PARAMETERS)):
        parameters = inspect.signature(getattr(loss_class, method)).parameters
        accepts_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        missing = [name for name in names if name not in parameters and not accepts_any]
        if missing:
            raise TypeError(f"loss_class={loss_class.__name__}.{method} does not accept {missing}; pass {expected}")


def _check_trainer_supported(trainer) -> None:
    """Refuse the TRL features this path does not compute, naming the argument to change."""
    args = trainer.args
    unsupported = {
        "off_policy_mask_threshold": (args.off_policy_mask_threshold is not None, "None"),
        "top_entropy_quantile": (args.top_entropy_quantile < 1.0, "1.0"),
        "entropy_coef": (getattr(trainer, "_entropy_bonus_enabled", False), "0.0 (and no adaptive entropy)"),
        "router_aux_loss_coef": (getattr(trainer, "aux_loss_enabled", False), "0.0"),
    }
    for name, (active, allowed) in unsupported.items():
        if active:
            raise ValueError(f"GRPOTrainer(loss_class=...) does not support {name}={getattr(args, name, None)!r}; allowed: {allowed}")
    config = trainer.model.config.get_text_config()
    softcap, scale = getattr(config, "final_logit_softcapping", None), getattr(config, "logit_scale", None)
    if softcap is not None or scale not in (None, 1.0):
        raise ValueError("GRPOTrainer(loss_class=...) does not support models with logit soft-capping or logit_scale (Liger's loss has neither)")


def module_arguments(trainer, loss_class) -> dict:
    """The constructor arguments for ``loss_class``, from ``trainer.args`` (TRL's meaning of each field)."""
    kwargs = {p.name: p.from_trainer(trainer) for p in LIGER_PARAMETERS}
    if kwargs["loss_type"] == "luspo":  # TRL's luspo == Liger's dr_grpo with normaliser B * 1 (module docstring)
        kwargs.update(loss_type="dr_grpo", max_completion_length=1)
    if _trainer.reads_fused_head(loss_class):
        kwargs["fused_head"] = fused_head_setting(getattr(trainer.args, "liger_fused_head", "auto"))
    return kwargs  # the adaptive-KL fields reach the module as the trainer's state (make_loss_module)


def make_loss_module(trainer, loss_class):
    """Build the ``loss_class`` module for ``trainer``; TypeError for a class that is not Liger-shaped."""
    check_loss_class(loss_class)
    check_liger_version()
    adaptive = issubclass(loss_class, AdaptiveFusedLinearGRPOLoss)
    if not adaptive and not trainer._adaptive_kl.is_stock:
        raise ValueError(
            f"loss_class={loss_class.__name__} computes Liger's fixed k3 KL, so kl_adaptation_method="
            f"{trainer.args.kl_adaptation_method!r} with kl_estimator={trainer.args.kl_estimator!r} would be ignored; "
            "allowed: kl_adaptation_method='none' with kl_estimator='k3', or loss_class=AdaptiveFusedLinearGRPOLoss (or a subclass)"
        )
    _check_trainer_supported(trainer)
    if KL_MONITOR in trainer._adaptive_kl.generation_edits:
        raise ValueError(
            "GRPOTrainer(loss_class=...) does not support kl_monitor=True (the module computes no KL at beta = 0); "
            "allowed: kl_monitor=False, or the TRL backend (no loss_class)"
        )
    arguments = module_arguments(trainer, loss_class)
    # Liger checks these at each call; a trainer that cannot train is refused now, not at its first step
    check_liger_configuration(arguments.get("loss_type"), arguments.get("importance_sampling_level"), arguments.get("max_completion_length"))
    if adaptive:  # the trainer's state: its controller sets β (a standalone module refuses one)
        arguments["adaptive_kl"] = trainer._adaptive_kl
    return loss_class(**arguments)


def _backbone_and_head(model):
    """The causal LM's backbone (``base_model``, as TRL's fused head uses) and its LM head."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    return causal_lm.base_model, causal_lm.get_output_embeddings()


def completion_hidden_states(trainer, model, inputs) -> torch.Tensor:
    """The final hidden states that predict the completion tokens, ``(B, T_completion, H)``."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    length = inputs["completion_ids"].shape[1]
    backbone, _ = _backbone_and_head(trainer.accelerator.unwrap_model(model))
    with trainer.accelerator.autocast():
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    return hidden[:, -length - 1 : -1]  # position t predicts token t + 1


def compute_loss(trainer, model, inputs):
    """The loss of one micro-batch through ``trainer._adaptive_loss_module``, scaled as TRL scales its own.

    TRL 1.15 divides grpo/bnpo/dr_grpo/luspo/sapo by the gradient-accumulation steps in training, and
    normalises dapo/cispo/vespo by ``num_items_in_batch / processes * accumulation / steps_per_generation``.
    Liger divides by ``num_items_in_batch / processes``; so it gets ``num_items_in_batch / steps_per_generation``
    and the whole loss (with a length-normalised KL term, as TRL adds it) is divided by the accumulation steps.
    """
    module = trainer._adaptive_loss_module
    mode = "train" if trainer.model.training else "eval"
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1
    generation_split = trainer.args.steps_per_generation if mode == "train" else 1
    beta = trainer.beta
    module.use_ref_model = beta != 0.0
    if isinstance(module, AdaptiveFusedLinearGRPOLoss):
        module.adaptive_kl = trainer._adaptive_kl  # its β is the trainer's (one owner: the controller)
    else:
        module.beta = beta  # Liger's own class keeps a plain attribute
    mask = inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
    _, head = _backbone_and_head(trainer.accelerator.unwrap_model(model))
    vllm_ratio = inputs.get("importance_sampling_ratio") if trainer.use_vllm and trainer.vllm_importance_sampling_correction else None
    arguments = dict(
        _input=completion_hidden_states(trainer, model, inputs),
        lin_weight=head.weight,
        selected_token_ids=inputs["completion_ids"],
        attention_mask=mask,
        advantages=inputs["advantages"],
        bias=head.bias,
        ref_per_token_logps=inputs["ref_per_token_logps"] if beta != 0.0 else None,
        old_per_token_logps=inputs.get("old_per_token_logps"),
        vllm_is_ratio=vllm_ratio,
        num_items_in_batch=inputs["num_items_in_batch"] / generation_split,
    )
    if isinstance(module, AdaptiveFusedLinearGRPOLoss):
        terms = module.loss_and_kl(**arguments)
        _log_adaptive(trainer, mode, terms, mask, beta)
        loss, clip_ratio = terms.loss, terms.clip_ratio
    else:
        loss, liger_metrics = module(**arguments)
        _log_foreign(trainer, mode, liger_metrics, mask, beta)
        clip_ratio = liger_metrics[-1]
    _log_clip_ratio(trainer, mode, clip_ratio, mask)
    return loss / accumulation


def _log_adaptive(trainer, mode, terms: LossTerms, mask, beta) -> None:
    runtime = trainer._adaptive_kl
    kl_mask = mask if terms.kl_mask is None else terms.kl_mask  # without the kl_exclude_token_ids positions
    values = runtime.log_metrics(runtime.record(terms.raw_kl, terms.adapted_kl, kl_mask, training=mode == "train", beta=beta), mode)
    if terms.raw_kl is not None:  # TRL's kl: the unshaped KL
        kl = values[metrics.RAW_KL]
        if kl != kl:  # NaN: no valid token on any process, or a NaN KL. Stock TRL logs 0 for the first, NaN for
            # the second: its own formula decides. The value is global, so every process takes this branch together.
            kl = metrics.global_masked_mean(terms.raw_kl, mask, runtime.reduce)
        trainer._metrics[mode]["kl"].append(kl)


def _log_foreign(trainer, mode, liger_metrics, mask, beta) -> None:
    """Liger's own class: method none with k3 (checked), so raw = adapted = Liger's kl_mean."""
    runtime = trainer._adaptive_kl
    if beta == 0.0:
        runtime.log_metrics(runtime.record_sums(None, training=mode == "train", beta=beta), mode)
        return
    kl = metrics.global_token_mean(liger_metrics[0], mask, runtime.reduce)
    nonfinite = float(not math.isfinite(kl))  # left out of the window's means and counted, as on every path
    runtime.log_metrics({metrics.CURRENT_BETA: float(beta), metrics.RAW_KL: kl, metrics.ADAPTED_KL: kl, metrics.NONFINITE_KL_BATCHES: nonfinite}, mode)
    trainer._metrics[mode]["kl"].append(kl)


def _log_clip_ratio(trainer, mode, clip_ratio, mask) -> None:
    """Liger reports one clip ratio: TRL's ``clip_ratio/region_mean`` (or ``cispo_clip_ratio``); none for sapo/vespo."""
    loss_type = trainer.loss_type
    if loss_type in ("sapo", "vespo"):
        return
    name = "cispo_clip_ratio" if loss_type == "cispo" else "clip_ratio/region_mean"
    trainer._metrics[mode][name].append(metrics.global_token_mean(clip_ratio, mask, trainer._adaptive_kl.reduce))


_trainer.register_loss_module_maker(make_loss_module)  # GRPOTrainer(loss_class=...) builds its module here


__all__ = ["check_loss_class", "compute_loss", "make_loss_module", "module_arguments"]
