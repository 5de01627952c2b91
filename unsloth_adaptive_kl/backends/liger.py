"""Liger fused-linear backend: a drop-in adaptive ``LigerFusedLinearGRPOLoss``. The trainer side,
``GRPOTrainer(loss_class=...)``, is ``backends/loss_class.py``.

:class:`AdaptiveFusedLinearGRPOLoss` takes what ``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss``
(Liger-Kernel 0.8.5, ``chunked_loss/grpo_loss.py``) takes, with the same defaults, and returns the
same ``(loss, (kl_mean, clip_ratio))`` (``(loss, (clip_ratio,))`` when β is 0). It adds
``kl_adaptation_method``, ``kl_estimator`` and the shaping parameters of
:mod:`unsloth_adaptive_kl.config`. One call is three steps:

1. **Per-token log-probs** from the final hidden states and the LM head, logits never
   materialised: by default (``fused_head="auto"``), wherever it is exact, the fused LM head: the gradient
   computed in the forward, 3 GEMMs instead of 4 (``backends/_fused_head.py``); elsewhere, or with
   ``fused_head=False``, TRL's chunked log-prob kernel (``backends/_liger_parts.py``).
   ``module.head_path`` names the last call's path; with ``fused_head=True`` (required) a fallback
   warns once per reason.
2. **Batch-level quantities**, from the whole batch before anything else: the estimator's
   statistic (``bottom_q``'s threshold) and the number of completions (``length_normalized``).
3. **The elementwise loss** (``torch.compile``d when ``compiled=True``). The policy part *is*
   Liger's: ``LigerFusedLinearGRPOFunction.ppo_loss_fn`` on the whole batch with ``beta=0`` (loss
   types, importance sampling, ``delta``, the vLLM ratio, the clip metric, Liger's normalisers).
   The KL part is the core's :class:`~unsloth_adaptive_kl.kl_term.KLTerm`, times the un-clamped
   importance ratio when ``use_bias_correction_kl`` (as Liger and TRL), aggregated with the loss
   type's normaliser (:func:`aggregate`) or as ``mean_i(mean_t kl)`` under ``length_normalized``.

``chunk_size`` is accepted and has no effect: the kernel tiles tokens and vocabulary itself and the
elementwise loss is a few ``B × T`` tensors, so the whole batch is one chunk.

**β** is ``self.beta``, which is ``self.adaptive_kl.beta`` (the controller's: one owner), read on
every call; it enters the compiled graph as a tensor (no recompilation when it changes). Standalone, a method with a β controller (``dynamic``,
``target``, alone or joined) raises ValueError: a loss module sees no optimizer step to update β
at. Under ``GRPOTrainer(loss_class=...)`` the module shares the trainer's state, whose controller
sets β.

**luspo.** As a drop-in the module reproduces Liger's luspo,
``(ℓ * mask.sum(-1, keepdim=True)).sum() / (B * ℓ.shape[1])``, which weighs padded positions too
(TRL's luspo differs; ``backends/loss_class.py`` says how ``loss_class=`` maps it).

Where a subclass changes the KL, it overrides :meth:`AdaptiveFusedLinearGRPOLoss.per_token_kl`
only; see ``examples/custom_kl_variant.py``.
"""

from __future__ import annotations

import functools
import inspect
import types
import warnings

import torch
from torch import nn

from .. import metrics
from ..adaptation import AdaptiveKL
from ..config import DEFAULTS, TERM_FIELD_NAMES
from ..controllers import controller_names
from ..estimators import get_estimator
from ..kl_pipeline import kl_keep, loss_term
from ..shaping import shaping_names
from ._fused_head import check_fused_arguments, fallback_reason, fused_loss
from ._liger_interface import (  # noqa: F401  (LOSS_TYPES: a name of this module's API)
    LIGER_PARAMETER_NAMES,
    LIGER_PARAMETERS,
    LOSS_TYPES,
    POLICY_PARAMETER_NAMES,
    LossTerms,
    check_liger_arguments,
    check_liger_configuration,
    check_liger_version,
)
from ._liger_parts import aggregate, log_importance_weights, neutral_padding, normaliser_tensor, selected_token_logps, sequence_dynamic

class AdaptiveFusedLinearGRPOLoss(nn.Module):
    """Drop-in for Liger's ``LigerFusedLinearGRPOLoss`` with adaptive KL; see the module docstring.

    The arguments before ``kl_adaptation_method`` are Liger 0.8.5's, with its defaults
    (``chunk_size`` has no effect here; the table is ``_liger_interface.LIGER_PARAMETERS``). The
    keyword-only ones are this package's fields of the same names (docs/fields.md), or
    ``adaptive_kl=``: an :class:`AdaptiveKL` whose β controller the caller runs
    (``GRPOTrainer(loss_class=...)`` passes the trainer's).
    """

    def __init__(self, *args, **kwargs):
        super().__init__()
        bound = _SIGNATURE.bind(self, *args, **kwargs)
        given = set(bound.arguments)  # what the caller passed, before the defaults fill the rest
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        del arguments["self"]
        check_liger_version()
        check_liger_arguments(**arguments)
        for name in LIGER_PARAMETER_NAMES:
            if name != "beta":  # β lives in the state's controller (the property below)
                setattr(self, name, arguments[name])
        fields = {name: arguments[name] for name in TERM_FIELD_NAMES}
        adaptive_kl = arguments["adaptive_kl"]
        if adaptive_kl is None:
            config = types.SimpleNamespace(**{**DEFAULTS, **fields}, beta=float(arguments["beta"]))  # the other fields: defaults
            self.adaptive_kl = AdaptiveKL(config)
            if self.adaptive_kl.method.controller != "fixed":
                raise ValueError(
                    f"kl_adaptation_method={fields['kl_adaptation_method']!r} is not valid for a standalone "
                    f"{type(self).__name__}: its β controller ({self.adaptive_kl.method.controller!r}) updates β once per "
                    f"optimizer step, which a loss module does not see; allowed: 'none' or shaping methods joined with '+' "
                    f"({', '.join(repr(n) for n in shaping_names())}), none of the β controllers ({', '.join(repr(n) for n in controller_names())}) "
                    "(set module.beta yourself), adaptive_kl= (an AdaptiveKL whose controller you run), or "
                    "GRPOTrainer(loss_class=...), whose trainer runs the controller"
                )
        else:  # the caller's state (GRPOTrainer(loss_class=...) passes its own), with its controller
            # Any KL field passed here is refused, its default value included (it would be silently
            # overridden by adaptive_kl's); β only where it differs from adaptive_kl's.
            changed = [name for name in fields if name in given]
            if "beta" in given and arguments["beta"] != adaptive_kl.beta:
                changed.append("beta")
            if changed:
                raise ValueError(f"{changed} given together with adaptive_kl=; allowed: the KL settings in one place (adaptive_kl's)")
            self.adaptive_kl = adaptive_kl
        check_fused_arguments(arguments["fused_head"], arguments["fused_chunk_tokens"])
        self.fused_head, self.fused_chunk_tokens = arguments["fused_head"], arguments["fused_chunk_tokens"]
        self.head_path: str | None = None  # "fused" or "log-prob kernel": the path of the last call
        self._compiled_terms, self._warned = None, set()
        self._pending_faults: list[tuple[torch.Tensor, object]] = []  # (count on the host, CUDA event of its copy)

    @property
    def beta(self) -> float:
        """β, read from (and set on) :attr:`adaptive_kl`'s controller: with ``GRPOTrainer(loss_class=...)``, the trainer's."""
        return self.adaptive_kl.beta

    @beta.setter
    def beta(self, value) -> None:
        self.adaptive_kl.beta = value

    # -- the override point ----------------------------------------------------------------------------
    def per_token_kl(self, logp: torch.Tensor, ref_logp: torch.Tensor, *, mask: torch.Tensor, statistic: torch.Tensor | None) -> torch.Tensor:
        """Per-token KL estimate, ``(B, T)``, before the importance ratio and the shaping.

        The configured ``kl_estimator`` by default. Override this (only this) to try another KL;
        ``statistic`` is the estimator's batch statistic (``bottom_q``'s threshold) or None.
        """
        return self.adaptive_kl.term.estimate(logp, ref_logp, mask, statistic)

    def kl_terms(self, logp, ref_logp, mask, coef, statistic) -> tuple[torch.Tensor, torch.Tensor]:
        """``(raw, adapted)`` per-token KL: the core's order (estimator, × importance ratio, the per-token
        shaping) with this module's :meth:`per_token_kl` as the estimator."""
        return self.adaptive_kl.per_token(logp, ref_logp, mask, coef, statistic, estimator=self.per_token_kl)

    # -- Liger's forward ---------------------------------------------------------------------------------
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
        """:meth:`forward`, returning :class:`LossTerms` (with the per-token KL the metrics need).
        Liger's arguments: ``_input`` is ``(B, T, H)``, ``lin_weight`` ``(V, H)``."""
        self._check_configuration()
        with_kl = _is_nonzero(self.beta)
        if with_kl and self.use_ref_model and ref_per_token_logps is None and ref_input is None:
            raise ValueError("use_ref_model=True needs ref_per_token_logps or ref_input (with ref_weight, ref_bias)")
        # Liger's unmasked luspo also weighs padded positions, so it needs their log-probs.
        rows = None if self.loss_type == "luspo" else attention_mask
        head = (_input, lin_weight, bias)
        if self._takes_fused_head(with_kl, advantages, ref_per_token_logps, old_per_token_logps, vllm_is_ratio, num_items_in_batch, head):
            ref = self._reference_logps(None, selected_token_ids, rows, ref_per_token_logps, ref_input, ref_weight, ref_bias) if with_kl else None
            inputs = self._elementwise_inputs(attention_mask, advantages, ref, old_per_token_logps, vllm_is_ratio, num_items_in_batch, selected_token_ids)
            evaluate = functools.partial(self._evaluate, inputs=inputs)
            return fused_loss(_input, lin_weight, bias, selected_token_ids, rows, self.temperature, self.fused_chunk_tokens, evaluate)
        logps = selected_token_logps(_input, lin_weight, bias, selected_token_ids, rows, self.temperature)
        ref = None
        if with_kl:
            ref = self._reference_logps(logps, selected_token_ids, rows, ref_per_token_logps, ref_input, ref_weight, ref_bias)
        return self.loss_from_logps(
            logps, attention_mask, advantages, ref_per_token_logps=ref, old_per_token_logps=old_per_token_logps,
            vllm_is_ratio=vllm_is_ratio, num_items_in_batch=num_items_in_batch, selected_token_ids=selected_token_ids,
        )  # fmt: skip

    def forward(self, *args, **kwargs):
        """Liger's arguments (shown: those of :meth:`loss_and_kl`) and return structure. Used standalone (no trainer
        reads the metric sums), it refuses a user shaping step's NaN or inf on a finite KL by name
        (:meth:`_refuse_user_shaping_faults`)."""
        self._read_pending_faults()
        terms = self.loss_and_kl(*args, **kwargs)
        self._refuse_user_shaping_faults(terms)
        return terms.liger_output()

    # -- user shaping steps, standalone ----------------------------------------------------------------------
    def _refuse_user_shaping_faults(self, terms: LossTerms) -> None:
        """Count the valid tokens a user shaping step made NaN or inf on a finite KL (``metrics.shaping_faults``, a few
        elementwise operations outside the compiled loss: no graph changes) and refuse it by name
        (``AdaptiveKL.refuse_user_faults``). On the CPU the count is read now. On a GPU it is copied to the host
        without waiting and read at a later call, once the copy has finished (:meth:`_read_pending_faults`): no host
        sync is added, and the error comes one call late. Not in :meth:`loss_and_kl`: under ``GRPOTrainer(loss_class=...)``
        the trainer refuses it from the metric sums, on every process alike."""
        if terms.raw_kl is None or not self.adaptive_kl.term.user_shaping_steps:
            return
        count = metrics.shaping_faults(terms.raw_kl, terms.adapted_kl, terms.kl_mask.bool())
        if not _reads_later(count):
            self.adaptive_kl.refuse_user_faults(0, count.item())
            return
        done = torch.cuda.Event()
        host = count.to("cpu", non_blocking=True)
        done.record(torch.cuda.current_stream(count.device))
        self._pending_faults.append((host, done))

    def _read_pending_faults(self) -> None:
        """Refuse by name the faults counted by earlier calls on a GPU whose copies have finished (never waits)."""
        pending, self._pending_faults = self._pending_faults, []
        for position, (host, done) in enumerate(pending):
            if not done.query():
                self._pending_faults.append((host, done))
                continue
            if host.item() > 0:
                self._pending_faults.extend(pending[position + 1 :])
                self.adaptive_kl.refuse_user_faults(
                    0, host.item(), when=" (counted in an earlier call of this module on the GPU, read at this one without a host sync)"
                )

    forward.__signature__ = inspect.signature(loss_and_kl).replace(return_annotation=inspect.Signature.empty)

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
        selected_token_ids=None,
    ) -> LossTerms:
        """The loss this module computes, from per-token log-probs ``(B, T)`` of the whole batch.

        ``ref_per_token_logps=None`` means no KL term (as β = 0). β is ``self.beta``. This is the
        entry point for comparing backends on identical log-probs. ``selected_token_ids`` (the
        completion tokens, ``(B, T)``) are read where the KL pipeline's first step needs them
        (``kl_pipeline.kl_keep``: with ``kl_exclude_token_ids``).
        """
        self._check_configuration()
        inputs = self._elementwise_inputs(
            attention_mask, advantages, ref_per_token_logps, old_per_token_logps, vllm_is_ratio, num_items_in_batch, selected_token_ids
        )  # fmt: skip
        return self._evaluate(per_token_logps, inputs)

    def _elementwise_inputs(self, mask, advantages, ref, old, vllm_is_ratio, num_items_in_batch, token_ids=None) -> tuple:
        """What the elementwise loss takes besides the log-probs, padding made neutral and batch-level quantities
        computed from the whole batch, before anything else: ``_loss_terms``'s arguments after ``logps``."""
        if vllm_is_ratio is not None and vllm_is_ratio.dim() == 1:
            vllm_is_ratio = vllm_is_ratio.unsqueeze(-1)  # (B,) -> (B, 1), as Liger
        with_kl = ref is not None and _is_nonzero(self.beta)
        ref = ref.float() if with_kl else None
        old = old.float() if old is not None else None
        if self.loss_type != "luspo":
            ref, old = neutral_padding(mask, ref, old)
        # the pipeline's first step as a factor of the masks (None: the KL term applies wherever the mask does)
        keep = kl_keep(self.adaptive_kl.term, token_ids, needs=": pass selected_token_ids= to loss_from_logps") if with_kl else None
        statistic = self.adaptive_kl.batch_statistic(ref, mask if keep is None else mask * keep) if with_kl else None
        # kl_placement='reward' (GRPOTrainer(loss_class=...)): the KL is computed for the metrics but weighs 0 in the loss
        beta = torch.as_tensor(self.adaptive_kl.plan(ref).loss_beta, dtype=torch.float32, device=mask.device)
        return mask, advantages, ref, old, vllm_is_ratio, beta, statistic, normaliser_tensor(num_items_in_batch, mask.device), keep

    def _evaluate(self, logps, inputs) -> LossTerms:
        mask = inputs[0]
        if self.loss_type != "luspo":
            (logps,) = neutral_padding(mask, logps)
        arguments = sequence_dynamic(logps, *inputs) if self.compiled else (logps, *inputs)
        loss, raw, adapted, clip_ratio = self._terms_function()(*arguments)
        if raw is None:
            return LossTerms(loss, None, None, None, clip_ratio.detach())
        raw, adapted = raw.detach(), adapted.detach()
        kl_mean = (raw * mask).sum() / mask.sum().clamp(min=1.0)  # Liger's kl metric
        keep = inputs[-1]
        return LossTerms(loss, raw, adapted, kl_mean.float(), clip_ratio.detach(), mask if keep is None else mask * keep)

    # -- the fused head (backends/_fused_head.py) ----------------------------------------------------------
    def _takes_fused_head(self, with_kl, advantages, ref, old, vllm_is_ratio, num_items_in_batch, head) -> bool:
        reason = "fused_head=False"
        if self.fused_head is not False:  # "auto" or True
            reason = fallback_reason(
                loss_type=self.loss_type, level=self.importance_sampling_level, with_kl=with_kl, use_ref_model=self.use_ref_model,
                builtin_estimator=get_estimator(self.adaptive_kl.estimator).builtin, num_items_given=num_items_in_batch is not None,
                builtin_shaping=all(step.builtin for step in self.adaptive_kl.method.per_token_steps),
                own_kl=type(self).per_token_kl is not AdaptiveFusedLinearGRPOLoss.per_token_kl,
                inputs=dict(advantages=advantages, ref_per_token_logps=ref, old_per_token_logps=old, vllm_is_ratio=vllm_is_ratio), head=head,
            )  # fmt: skip
            if reason is not None and self.fused_head is True and reason not in self._warned:  # required: say why not
                self._warned.add(reason)
                warnings.warn(f"{type(self).__name__}(fused_head=True) runs the log-prob kernel path (4 GEMMs): {reason}", stacklevel=3)
        self.head_path = "log-prob kernel" if reason else "fused"
        return reason is None

    def _terms_function(self):
        if not self.compiled:
            return self._loss_terms
        if self._compiled_terms is None:
            self._compiled_terms = torch.compile(self._loss_terms)
        return self._compiled_terms

    def _loss_terms(self, logps, mask, advantages, ref, old, vllm_is_ratio, beta, statistic, num_items_in_batch, keep):
        """The elementwise part (compiled when ``compiled=True``): Liger's policy loss plus β × the adapted KL."""
        from liger_kernel.chunked_loss.grpo_loss import LigerFusedLinearGRPOFunction

        # Liger's policy loss alone (beta=0, no reference): the KL is added below, adapted.
        policy_loss, policy_metrics = LigerFusedLinearGRPOFunction.ppo_loss_fn(
            per_token_logps=logps, attention_mask=mask, full_attention_mask=mask, advantages=advantages,
            ref_per_token_logps=None, old_per_token_logps=old, beta=0.0, use_bias_correction_kl=False,
            vllm_is_ratio=vllm_is_ratio, num_items_in_batch=num_items_in_batch,
            **{name: getattr(self, name) for name in POLICY_PARAMETER_NAMES},
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
        if keep is not None:  # the pipeline leaves these positions out (KLTerm.per_token zeroes what kl_mask leaves out)
            kl_mask = kl_mask * keep
        raw, adapted = self.kl_terms(logps, ref, kl_mask, coef, statistic)
        # the pipeline's loss term: length-normalised (over the tokens with a KL term; accumulation=1: the caller scales
        # the whole loss), or β times the loss type's aggregation
        kl_loss = loss_term(
            self.adaptive_kl.term, adapted, mask if keep is None else mask * keep, beta=beta, num_completions=mask.shape[0],
            aggregate=lambda kl: aggregate(kl, mask, self.loss_type, max_completion_length=self.max_completion_length, num_items_in_batch=num_items_in_batch),
        )  # fmt: skip
        return policy_loss + kl_loss, raw, adapted, clip_ratio

    def _check_configuration(self) -> None:
        """Liger's checks, made before any work (they are per call: the attributes are mutable)."""
        check_liger_configuration(self.loss_type, self.importance_sampling_level, self.max_completion_length)


def _is_nonzero(beta) -> bool:
    return float(beta) != 0.0


def _reads_later(count: torch.Tensor) -> bool:
    """Whether a fault count is read at a later call (a CUDA tensor: reading it now would wait for the device)."""
    return count.is_cuda


def _signature() -> inspect.Signature:
    """The constructor's signature: Liger's parameters (positional or keyword, Liger's defaults), then,
    keyword-only, the KL-term fields (defaults: the config's), ``adaptive_kl`` and the fused-head options."""
    parameter = inspect.Parameter
    liger = [parameter(p.name, parameter.POSITIONAL_OR_KEYWORD, default=p.default) for p in LIGER_PARAMETERS]
    own = {name: DEFAULTS[name] for name in TERM_FIELD_NAMES}
    own.update(adaptive_kl=None, fused_head="auto", fused_chunk_tokens=None)
    keyword_only = [parameter(name, parameter.KEYWORD_ONLY, default=default) for name, default in own.items()]
    return inspect.Signature([parameter("self", parameter.POSITIONAL_OR_KEYWORD), *liger, *keyword_only])


_SIGNATURE = _signature()
AdaptiveFusedLinearGRPOLoss.__init__.__signature__ = _SIGNATURE  # shown by help() and inspect.signature


__all__ = ["AdaptiveFusedLinearGRPOLoss", "LossTerms", "aggregate", "check_liger_version", "selected_token_logps"]
