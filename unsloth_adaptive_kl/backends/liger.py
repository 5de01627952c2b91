"""Liger fused-linear backend: a drop-in adaptive ``LigerFusedLinearGRPOLoss``, and
``GRPOTrainer(loss_class=...)``.

:class:`AdaptiveFusedLinearGRPOLoss` takes what ``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss``
(Liger-Kernel 0.8.5, ``chunked_loss/grpo_loss.py``) takes, with the same defaults, and returns the
same ``(loss, (kl_mean, clip_ratio))`` (``(loss, (clip_ratio,))`` when β is 0). It adds
``kl_adaptation_method``, ``kl_estimator`` and the shaping parameters of
:mod:`unsloth_adaptive_kl.config`. One call is three steps:

1. **Per-token log-probs** from the final hidden states and the LM head, with TRL 1.15's chunked
   log-prob kernel (``trl.kernels.ChunkedLogProbFunction``: cuBLAS tiles of tokens × vocabulary
   and an online logsumexp in Triton, with a recomputing backward). Logits are never
   materialised. Liger's own engine (``fused_linear_ppo.py``) gets the same memory bound with a
   Python loop of small matmuls and is several times slower; it is not used.
2. **Batch-level quantities**, from the whole batch before anything else: the estimator's
   statistic (``bottom_q``'s threshold) and the number of completions (``length_normalized``).
3. **The elementwise loss** (compiled with ``torch.compile`` when ``compiled=True``). The policy
   part *is* Liger's: ``LigerFusedLinearGRPOFunction.ppo_loss_fn`` called once on the whole
   batch with ``beta=0`` (every loss type, importance-sampling level, ``delta``, the vLLM ratio,
   the clip metric and Liger's normalisers come from there). The KL part is computed by the core
   (:func:`~unsloth_adaptive_kl.estimators.estimate_kl` and
   :func:`~unsloth_adaptive_kl.shaping.shape_per_token`), multiplied by the un-clamped importance
   ratio when ``use_bias_correction_kl`` (as Liger and TRL do), aggregated with the loss type's own
   normaliser (:func:`aggregate`, Liger's aggregation written out once), or as
   ``mean_i(mean_t kl)`` under ``length_normalized``, and added times β.

``chunk_size`` is accepted and has no effect. Liger splits the batch into row chunks only to
bound the memory of the backward it runs inside the forward; here the kernel tiles tokens and
vocabulary itself and the elementwise loss is a few ``B × T`` float32 tensors, so the whole batch
is one chunk and the result cannot depend on ``chunk_size``.

**β** is read from ``self.beta`` on every call (a float, or a 0-dim tensor) and enters the
compiled graph as a tensor, so it can change every step without recompiling. Standalone, the
β controllers of ``kl_adaptation_method`` (``dynamic``, ``target``) are inert: you set
``self.beta``. Under ``GRPOTrainer(loss_class=...)`` the trainer's controller sets it.

**luspo.** As a drop-in the module reproduces Liger's luspo,
``(ℓ * mask.sum(-1, keepdim=True)).sum() / (B * ℓ.shape[1])``, which weighs padded positions too.
TRL 1.15's luspo is ``(ℓ * mask).sum(-1).mean()``. Both use the clipped-PPO surrogate of
``dr_grpo``, whose Liger normaliser is ``B * max_completion_length``; so ``loss_class=`` runs
TRL's ``luspo`` as Liger's ``dr_grpo`` with ``max_completion_length=1``, which is exactly TRL's
luspo (for our module and for Liger's own).

Where a subclass changes the KL, it overrides :meth:`AdaptiveFusedLinearGRPOLoss.per_token_kl`
only; see ``examples/custom_kl_variant.py``.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import types
import warnings
from typing import NamedTuple

import torch
from torch import nn

from .. import metrics
from ..adaptation import AdaptiveKL
from ..config import FIELDS
from ..estimators import estimate_kl
from .._source_patch import check_version
from ..versions import SUPPORTED

logger = logging.getLogger("unsloth_adaptive_kl")

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
TOKEN_LEVEL_ONLY = ("cispo", "sapo", "vespo")  # Liger refuses sequence level for these
VOCAB_TILE = 32768  # vocabulary tile width TRL 1.15 uses (trl/trainer/utils.py, _CHUNKED_LOGPROB_CHUNK_SIZE)


# -- step 1: per-token log-probs ---------------------------------------------------------------------
def _chunked_log_prob_function():
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "AdaptiveFusedLinearGRPOLoss uses TRL's Triton log-prob kernel; with no GPU it only runs interpreted: "
            "set TRITON_INTERPRET=1 in the environment before triton or trl is first imported."
        )
    from trl.kernels import ChunkedLogProbFunction

    return ChunkedLogProbFunction


def selected_token_logps(hidden, weight, bias, token_ids, rows, temperature: float) -> torch.Tensor:
    """Log-probs (float32, ``(B, T)``) of ``token_ids`` under ``softmax((hidden @ weight.T + bias) / temperature)``.

    Only the positions where ``rows`` is True are computed (all when ``rows`` is None); the others
    are 0, as in TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``). Differentiable
    with respect to ``hidden``, ``weight`` and ``bias``.
    """
    batch, length, width = hidden.shape
    flat_hidden = hidden.reshape(batch * length, width)
    flat_ids = token_ids.reshape(batch * length)
    kernel = _chunked_log_prob_function()
    if rows is None:
        logps = kernel.apply(flat_hidden, weight, bias, flat_ids, temperature, VOCAB_TILE, None, 1.0, ())[0]
        return logps.view(batch, length)
    keep = rows.reshape(-1).bool()
    logps = kernel.apply(flat_hidden[keep], weight, bias, flat_ids[keep], temperature, VOCAB_TILE, None, 1.0, ())[0]
    # masked_scatter keeps an all-padding batch connected to the graph (as TRL does)
    return logps.new_zeros(batch * length).masked_scatter(keep, logps).view(batch, length)


# -- step 3: the elementwise loss ----------------------------------------------------------------------
def neutral_padding(mask, *per_token):
    """Each ``(B, T)`` tensor (or None) with 0 where ``mask`` is 0: an importance ratio of 1 and a KL of 0 there.

    Every aggregation but luspo's multiplies the per-token loss by the mask, so a padded position
    never counts, unless its value is not finite: ``inf * 0`` is NaN. And it can be: the forward
    computes no log-prob at padding (0 there), so the ratio ``exp(0 - old)`` overflows float32 for
    any old log-prob below about -88, which a large vocabulary or sharp logits give (Liger's own
    test grid does). Liger computes real log-probs everywhere, so its ratio there is finite.
    """
    keep = mask.bool()
    return tuple(None if t is None else t.masked_fill(~keep, 0.0) for t in per_token)


def log_importance_weights(logps, old_logps, mask, level: str) -> torch.Tensor:
    """``log(pi / pi_old)`` per token ``(B, T)``, or its masked mean per sequence ``(B, 1)`` (GSPO).

    As in Liger's ``ppo_loss_fn`` and TRL 1.15's ``_compute_loss``.
    """
    log_ratio = logps - old_logps
    if level == "token":
        return log_ratio
    return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)


def aggregate(per_token, mask, loss_type: str, *, max_completion_length=None, num_items_in_batch=None) -> torch.Tensor:
    """Liger 0.8.5's aggregation of a per-token term for ``loss_type`` (``grpo_loss.py``, ``ppo_loss_fn``).

    Linear in ``per_token``: the KL part of the loss is aggregated exactly as the policy part.
    """
    from liger_kernel.chunked_loss.fused_linear_ppo import LigerFusedLinearPPOBase

    batch = mask.shape[0]
    if loss_type in ("grpo", "sapo"):
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / batch
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (batch * max_completion_length)
    if loss_type in ("dapo", "cispo", "vespo"):
        normalizer = LigerFusedLinearPPOBase._compute_dapo_normalizer(mask, num_items_in_batch=num_items_in_batch)
        return (per_token * mask).sum() / normalizer
    if loss_type == "luspo":  # unmasked, as Liger writes it (see the module docstring)
        weighted = per_token * mask.sum(1, keepdim=True)
        return weighted.sum() / (batch * weighted.shape[1])
    raise ValueError(f"loss_type={loss_type!r} is not valid; allowed: {list(LOSS_TYPES)}")


class LossTerms(NamedTuple):
    """What one call computes. ``raw_kl``/``adapted_kl`` are detached ``(B, T)`` tensors, None when β is 0."""

    loss: torch.Tensor
    raw_kl: torch.Tensor | None
    adapted_kl: torch.Tensor | None
    kl_mean: torch.Tensor | None
    clip_ratio: torch.Tensor

    def liger_output(self):
        """Liger's return structure: ``(loss, (kl_mean, clip_ratio))``, or ``(loss, (clip_ratio,))`` when β is 0."""
        if self.kl_mean is None:
            return self.loss, (self.clip_ratio,)
        return self.loss, (self.kl_mean, self.clip_ratio)


def _adaptive_kl_config(beta, use_bias_correction_kl, **fields):
    """A config object for :class:`AdaptiveKL`: the given fields, the others at their defaults."""
    values = {f.name: f.default for f in FIELDS}
    values.update(fields)
    return types.SimpleNamespace(beta=float(beta), use_bias_correction_kl=use_bias_correction_kl, **values)


class AdaptiveFusedLinearGRPOLoss(nn.Module):
    """Drop-in for Liger's ``LigerFusedLinearGRPOLoss`` with adaptive KL; see the module docstring.

    The arguments before ``kl_adaptation_method`` are Liger 0.8.5's, with its defaults
    (``chunk_size`` has no effect here). The keyword-only ones are this package's fields of the
    same names (README, "Fields"). ``self.adaptive_kl`` holds the method and estimator; under
    ``GRPOTrainer(loss_class=...)`` it is the trainer's.
    """

    def __init__(
        self,
        beta: float = 0.04,
        compiled: bool = True,
        use_ref_model: bool = True,
        chunk_size: int = 1,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        loss_type: str = "dapo",
        max_completion_length: int | None = None,
        importance_sampling_level: str = "token",
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        temperature: float = 1.0,
        delta: float | None = None,
        use_bias_correction_kl: bool = False,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
        *,
        kl_adaptation_method: str = "none",
        kl_estimator: str = "k3",
        kl_clip_threshold: float = 1.0,
        kl_target: float = 0.1,
        kl_bottom_q: float = 0.2,
    ):
        super().__init__()
        check_liger_version()
        if sapo_temperature_pos <= 0 or sapo_temperature_neg <= 0:
            raise ValueError(f"sapo temperatures must be > 0, got pos={sapo_temperature_pos}, neg={sapo_temperature_neg}")
        if delta is not None and delta <= 0:
            raise ValueError(f"delta must be > 0 or None, got {delta}")
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={loss_type!r} is not valid; allowed: {list(LOSS_TYPES)}")
        if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"importance_sampling_level={importance_sampling_level!r} is not valid; allowed: {list(IMPORTANCE_SAMPLING_LEVELS)}")
        self.beta = beta
        self.compiled = compiled
        self.use_ref_model = use_ref_model
        self.chunk_size = chunk_size
        self.epsilon_low = epsilon_low
        self.epsilon_high = epsilon_high
        self.loss_type = loss_type
        self.max_completion_length = max_completion_length
        self.importance_sampling_level = importance_sampling_level
        self.sapo_temperature_pos = sapo_temperature_pos
        self.sapo_temperature_neg = sapo_temperature_neg
        self.temperature = temperature
        self.delta = delta
        self.use_bias_correction_kl = use_bias_correction_kl
        self.vespo_k_pos = vespo_k_pos
        self.vespo_lambda_pos = vespo_lambda_pos
        self.vespo_k_neg = vespo_k_neg
        self.vespo_lambda_neg = vespo_lambda_neg
        self.adaptive_kl = AdaptiveKL(
            _adaptive_kl_config(
                beta,
                use_bias_correction_kl,
                kl_adaptation_method=kl_adaptation_method,
                kl_estimator=kl_estimator,
                kl_clip_threshold=kl_clip_threshold,
                kl_target=kl_target,
                kl_bottom_q=kl_bottom_q,
            )
        )
        self._compiled_terms = None

    # -- the override point ----------------------------------------------------------------------------
    def per_token_kl(self, logp: torch.Tensor, ref_logp: torch.Tensor, *, mask: torch.Tensor, statistic: torch.Tensor | None) -> torch.Tensor:
        """Per-token KL estimate, ``(B, T)``, before the importance ratio and the shaping.

        The configured ``kl_estimator`` by default. Override this (only this) to try another KL;
        ``statistic`` is the estimator's batch statistic (``bottom_q``'s threshold) or None.
        """
        spec = self.adaptive_kl
        return estimate_kl(spec.estimator, logp, ref_logp, mask=mask, statistic=statistic, bottom_q=spec.bottom_q)

    def kl_terms(self, logp, ref_logp, mask, coef, statistic) -> tuple[torch.Tensor, torch.Tensor]:
        """``(raw, adapted)`` per-token KL: the core's order (estimator, × importance ratio, clip,
        sigmoid) with this module's :meth:`per_token_kl` as the estimator."""
        return self.adaptive_kl.per_token(logp, ref_logp, mask, coef, statistic, estimator=self.per_token_kl)

    # -- Liger's forward ---------------------------------------------------------------------------------
    def forward(
        self,
        _input,
        lin_weight,
        selected_token_ids,
        attention_mask,
        advantages,
        bias=None,
        ref_per_token_logps=None,
        old_per_token_logps=None,
        ref_input=None,
        ref_weight=None,
        ref_bias=None,
        vllm_is_ratio=None,
        num_items_in_batch=None,
    ):
        """Liger's arguments and return structure; ``_input`` is ``(B, T, H)``, ``lin_weight`` ``(V, H)``."""
        return self.loss_and_kl(
            _input, lin_weight, selected_token_ids, attention_mask, advantages, bias, ref_per_token_logps,
            old_per_token_logps, ref_input, ref_weight, ref_bias, vllm_is_ratio, num_items_in_batch,
        ).liger_output()  # fmt: skip

    def loss_and_kl(
        self,
        _input,
        lin_weight,
        selected_token_ids,
        attention_mask,
        advantages,
        bias=None,
        ref_per_token_logps=None,
        old_per_token_logps=None,
        ref_input=None,
        ref_weight=None,
        ref_bias=None,
        vllm_is_ratio=None,
        num_items_in_batch=None,
    ) -> LossTerms:
        """:meth:`forward`, returning :class:`LossTerms` (with the per-token KL the metrics need)."""
        self._check_configuration()
        with_kl = _is_nonzero(self.beta)
        if with_kl and self.use_ref_model and ref_per_token_logps is None and ref_input is None:
            raise ValueError("use_ref_model=True needs ref_per_token_logps or ref_input (with ref_weight, ref_bias)")
        # Liger's unmasked luspo also weighs padded positions, so it needs their log-probs.
        rows = None if self.loss_type == "luspo" else attention_mask
        logps = selected_token_logps(_input, lin_weight, bias, selected_token_ids, rows, self.temperature)
        ref = None
        if with_kl:
            ref = self._reference_logps(logps, selected_token_ids, rows, ref_per_token_logps, ref_input, ref_weight, ref_bias)
        return self.loss_from_logps(
            logps, attention_mask, advantages, ref_per_token_logps=ref, old_per_token_logps=old_per_token_logps,
            vllm_is_ratio=vllm_is_ratio, num_items_in_batch=num_items_in_batch,
        )  # fmt: skip

    def _reference_logps(self, logps, token_ids, rows, ref_per_token_logps, ref_input, ref_weight, ref_bias):
        """As Liger: no reference model means the policy itself (KL 0); given log-probs win over ``ref_input``."""
        if not self.use_ref_model:
            return logps.detach()
        if ref_per_token_logps is not None:
            if ref_input is not None:
                warnings.warn("Both ref_per_token_logps and ref_input are provided. Using ref_per_token_logps.")  # Liger's words
            return ref_per_token_logps
        with torch.no_grad():
            return selected_token_logps(ref_input, ref_weight, ref_bias, token_ids, rows, self.temperature)

    # -- the loss from per-token log-probs -----------------------------------------------------------------
    def loss_from_logps(
        self,
        per_token_logps,
        attention_mask,
        advantages,
        *,
        ref_per_token_logps=None,
        old_per_token_logps=None,
        vllm_is_ratio=None,
        num_items_in_batch=None,
    ) -> LossTerms:
        """The loss this module computes, from per-token log-probs ``(B, T)`` of the whole batch.

        ``ref_per_token_logps=None`` means no KL term (as β = 0). β is ``self.beta``. This is the
        entry point for comparing backends on identical log-probs.
        """
        self._check_configuration()
        if vllm_is_ratio is not None and vllm_is_ratio.dim() == 1:
            vllm_is_ratio = vllm_is_ratio.unsqueeze(-1)  # (B,) -> (B, 1), as Liger
        with_kl = ref_per_token_logps is not None and _is_nonzero(self.beta)
        ref = ref_per_token_logps.float() if with_kl else None
        old = old_per_token_logps.float() if old_per_token_logps is not None else None
        if self.loss_type != "luspo":
            per_token_logps, ref, old = neutral_padding(attention_mask, per_token_logps, ref, old)
        # Batch-level quantities, from the whole batch, before anything else.
        statistic = self.adaptive_kl.batch_statistic(ref, attention_mask) if with_kl else None
        beta = torch.as_tensor(self.beta, dtype=torch.float32, device=per_token_logps.device)
        loss, raw, adapted, clip_ratio = self._terms_function()(
            per_token_logps, attention_mask, advantages, ref, old, vllm_is_ratio, beta, statistic, num_items_in_batch
        )
        if raw is None:
            return LossTerms(loss, None, None, None, clip_ratio.detach())
        raw, adapted = raw.detach(), adapted.detach()
        kl_mean = (raw * attention_mask).sum() / attention_mask.sum().clamp(min=1.0)  # Liger's kl metric
        return LossTerms(loss, raw, adapted, kl_mean.float(), clip_ratio.detach())

    def _terms_function(self):
        if not self.compiled:
            return self._loss_terms
        if self._compiled_terms is None:
            self._compiled_terms = torch.compile(self._loss_terms)
        return self._compiled_terms

    def _loss_terms(self, logps, mask, advantages, ref, old, vllm_is_ratio, beta, statistic, num_items_in_batch):
        """The elementwise part (compiled when ``compiled=True``): Liger's policy loss plus β × the adapted KL."""
        from liger_kernel.chunked_loss.grpo_loss import LigerFusedLinearGRPOFunction

        policy_loss, policy_metrics = LigerFusedLinearGRPOFunction.ppo_loss_fn(
            per_token_logps=logps,
            attention_mask=mask,
            advantages=advantages,
            full_attention_mask=mask,
            ref_per_token_logps=None,
            old_per_token_logps=old,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            beta=0.0,
            loss_type=self.loss_type,
            max_completion_length=self.max_completion_length,
            importance_sampling_level=self.importance_sampling_level,
            sapo_temperature_pos=self.sapo_temperature_pos,
            sapo_temperature_neg=self.sapo_temperature_neg,
            vllm_is_ratio=vllm_is_ratio,
            delta=self.delta,
            use_bias_correction_kl=False,
            vespo_k_pos=self.vespo_k_pos,
            vespo_lambda_pos=self.vespo_lambda_pos,
            vespo_k_neg=self.vespo_k_neg,
            vespo_lambda_neg=self.vespo_lambda_neg,
            num_items_in_batch=num_items_in_batch,
        )
        clip_ratio = policy_metrics[-1]
        if ref is None:
            return policy_loss, None, None, clip_ratio
        coef = None
        if self.use_bias_correction_kl:  # the un-clamped ratio, (B, T) or (B, 1), as Liger and TRL
            old_or_self = logps.detach() if old is None else old
            coef = torch.exp(log_importance_weights(logps, old_or_self, mask, self.importance_sampling_level))
        # Liger's luspo weighs padded positions too (module docstring), so its KL is taken there as well;
        # every other loss type's KL is 0 on padding (estimate_kl zeroes masked positions).
        kl_mask = torch.ones_like(mask) if self.loss_type == "luspo" else mask
        raw, adapted = self.kl_terms(logps, ref, kl_mask, coef, statistic)
        if self.adaptive_kl.length_normalized:
            kl_part = self.adaptive_kl.length_normalized_term(adapted, mask, mask.shape[0])
        else:
            kl_part = aggregate(
                adapted, mask, self.loss_type, max_completion_length=self.max_completion_length, num_items_in_batch=num_items_in_batch
            )
        return policy_loss + beta * kl_part, raw, adapted, clip_ratio

    def _check_configuration(self) -> None:
        """Liger's checks, made before any work (they are per call: the attributes are mutable)."""
        if self.importance_sampling_level == "sequence" and self.loss_type in TOKEN_LEVEL_ONLY:
            raise ValueError(
                f"Sequence-level importance sampling is not supported for loss_type='{self.loss_type}'. "
                "Use importance_sampling_level='token' instead."
            )
        if self.loss_type == "dr_grpo" and self.max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length (its normaliser is B * max_completion_length)")


def check_liger_version() -> None:
    """Refuse an untested liger-kernel (its ``ppo_loss_fn`` and normalisers are called directly),
    unless ``UNSLOTH_ADAPTIVE_KL_ALLOW_UNTESTED=1``."""
    liger = SUPPORTED["liger-kernel"]
    check_version(liger.distribution, liger.contains, liger.label)


def _is_nonzero(beta) -> bool:
    return float(beta) != 0.0


# -- GRPOTrainer(loss_class=...) ------------------------------------------------------------------------
_LIGER_INIT_PARAMETERS = (
    "beta", "compiled", "use_ref_model", "chunk_size", "epsilon_low", "epsilon_high", "loss_type",
    "max_completion_length", "importance_sampling_level", "sapo_temperature_pos", "sapo_temperature_neg",
    "temperature", "delta", "use_bias_correction_kl", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
    "vespo_lambda_neg",
)  # fmt: skip
_LIGER_FORWARD_PARAMETERS = (
    "_input", "lin_weight", "selected_token_ids", "attention_mask", "advantages", "bias", "ref_per_token_logps",
    "old_per_token_logps", "ref_input", "ref_weight", "ref_bias", "vllm_is_ratio", "num_items_in_batch",
)  # fmt: skip
_ADAPTIVE_FIELDS = ("kl_adaptation_method", "kl_estimator", "kl_clip_threshold", "kl_target", "kl_bottom_q")


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
    args = trainer.args  # each field read where TRL's _compute_loss reads it (trainer attribute or args)
    loss_type, max_completion_length = trainer.loss_type, trainer.max_completion_length
    if loss_type == "luspo":  # TRL's luspo == Liger's dr_grpo with normaliser B * 1 (module docstring)
        loss_type, max_completion_length = "dr_grpo", 1
    kwargs = dict(
        beta=trainer.beta,
        compiled=trainer.accelerator.device.type == "cuda",
        use_ref_model=trainer.beta != 0.0,
        chunk_size=1,
        epsilon_low=trainer.epsilon_low,
        epsilon_high=trainer.epsilon_high,
        loss_type=loss_type,
        max_completion_length=max_completion_length,
        importance_sampling_level=trainer.importance_sampling_level,
        sapo_temperature_pos=args.sapo_temperature_pos,
        sapo_temperature_neg=args.sapo_temperature_neg,
        temperature=trainer.temperature,
        delta=args.delta,
        use_bias_correction_kl=args.use_bias_correction_kl,
        vespo_k_pos=args.vespo_k_pos,
        vespo_lambda_pos=args.vespo_lambda_pos,
        vespo_k_neg=args.vespo_k_neg,
        vespo_lambda_neg=args.vespo_lambda_neg,
    )
    if issubclass(loss_class, AdaptiveFusedLinearGRPOLoss):
        kwargs.update({name: getattr(args, name) for name in _ADAPTIVE_FIELDS})
    return kwargs


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
    module = loss_class(**module_arguments(trainer, loss_class))
    if adaptive:
        module.adaptive_kl = trainer._adaptive_kl
    return module


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
    module.beta, module.use_ref_model = beta, beta != 0.0
    if isinstance(module, AdaptiveFusedLinearGRPOLoss):
        module.adaptive_kl = trainer._adaptive_kl
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


def _global_mean(trainer, local_mean: torch.Tensor, mask) -> float:
    """A local masked mean made global across processes, token-weighted (TRL's ``global_masked_mean``)."""
    tokens = mask.sum().float()
    totals = trainer.accelerator.reduce(torch.stack([local_mean.float() * tokens.clamp(min=1.0), tokens]), reduction="sum")
    return (totals[0] / totals[1].clamp(min=1.0)).item()


def _log_adaptive(trainer, mode, terms: LossTerms, mask, beta) -> None:
    runtime = trainer._adaptive_kl
    values = runtime.log_metrics(runtime.record(terms.raw_kl, terms.adapted_kl, mask, training=mode == "train", beta=beta), mode)
    if terms.raw_kl is not None:
        trainer._metrics[mode]["kl"].append(values[metrics.RAW_KL])  # TRL's kl: the unshaped KL


def _log_foreign(trainer, mode, liger_metrics, mask, beta) -> None:
    """Liger's own class: method none with k3 (checked), so raw = adapted = Liger's kl_mean."""
    kl = math.nan if beta == 0.0 else _global_mean(trainer, liger_metrics[0], mask)
    trainer._adaptive_kl.log_metrics({metrics.CURRENT_BETA: float(beta), metrics.RAW_KL: kl, metrics.ADAPTED_KL: kl}, mode)
    if beta != 0.0:
        trainer._metrics[mode]["kl"].append(kl)


def _log_clip_ratio(trainer, mode, clip_ratio, mask) -> None:
    """Liger reports one clip ratio: TRL's ``clip_ratio/region_mean`` (or ``cispo_clip_ratio``); none for sapo/vespo."""
    loss_type = trainer.loss_type
    if loss_type in ("sapo", "vespo"):
        return
    name = "cispo_clip_ratio" if loss_type == "cispo" else "clip_ratio/region_mean"
    trainer._metrics[mode][name].append(_global_mean(trainer, clip_ratio, mask))


__all__ = [
    "AdaptiveFusedLinearGRPOLoss",
    "LossTerms",
    "aggregate",
    "check_loss_class",
    "compute_loss",
    "make_loss_module",
    "selected_token_logps",
]
