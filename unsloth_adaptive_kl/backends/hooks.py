"""The hook protocol: every method the rewritten library source calls on this package's objects, declared once.

The rewrites (each backend's ``PLAN``, the reward placement's and kl_monitor's plans) are source strings, where no
rename, type checker or static tool sees a call. So each object a rewrite calls into has a ``Protocol`` here, with the
typed signature of every method it calls, and ``tests/test_hook_protocol.py`` parses every rewrite string of every
plan (all version families) with ``ast``: each attribute a rewrite reads on one of these objects must be declared on
its protocol, and each runtime class must implement its protocol with the same parameters.

=====================================================  ==============================================================
object, as the rewrites name it                         protocol
=====================================================  ==============================================================
``self._adaptive_kl`` in a rewritten generation         :class:`GenerationHooks` (kl_monitor, the reward placement)
``self._adaptive_kl`` in TRL's ``_compute_loss``        :class:`TRLLossHooks`
``adaptive_kl`` (the local TRL's rewrites make)         :class:`TokenKLHooks` (``kl_pipeline.TokenKL``)
``trainer._adaptive_kl`` / ``self._adaptive_kl`` in     :class:`UnslothTrainerHooks`
Unsloth's generated trainer
``kwargs["adaptive_kl"]`` in Unsloth's fused loss       :class:`FusedLossHooks` (``unsloth.FusedKLInputs``)
=====================================================  ==============================================================
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from ..kl_pipeline import TokenKL

Tensor = torch.Tensor


class GenerationHooks(Protocol):
    """What a rewritten ``_generate_and_score_completions`` calls (TRL's and Unsloth's)."""

    def runs_reference(self) -> bool:
        """Whether this generation batch scores the reference (β != 0, or a batch kl_monitor watches)."""
        ...

    def scoring_penalty(
        self, ref_logps: Tensor | None, old_logps: Tensor | None, mask: Tensor, policy_logps: Callable[[], Tensor], mode: str,
        left_pad: tuple | None = None, *, completion_ids: Tensor | None = None,
    ) -> Tensor | None:  # fmt: skip
        """Each local completion's KL penalty (``kl_placement="reward"``), or None."""
        ...

    def penalized_rewards(self, rewards: Tensor, local_penalty: Tensor | None, mode: str, num_generations: int | None = None) -> Tensor:
        """The gathered rewards less every completion's penalty."""
        ...


class TRLLossHooks(GenerationHooks, Protocol):
    """What TRL's rewritten ``_compute_loss`` calls."""

    def loss_kl(self, logps: Tensor, inputs: dict, *, mask: Tensor, coef: Tensor | None = None) -> TokenKL | None:
        """The micro-batch's per-token KL from the pipeline, or None where it computes none."""
        ...

    def after_aggregation(self, loss: Tensor, kl: TokenKL | None, *, mask: Tensor, mode: str) -> Tensor:
        """The aggregated loss with what the pipeline adds after aggregation; logs the metrics."""
        ...


class TokenKLHooks(Protocol):
    """What TRL's rewritten ``_compute_loss`` reads of the ``TokenKL`` that ``loss_kl`` returned."""

    raw: Tensor

    def per_token_loss(self, per_token_loss: Tensor) -> Tensor:
        """The per-token loss with β·adapted added where the plan puts it there."""
        ...


class UnslothTrainerHooks(GenerationHooks, Protocol):
    """What Unsloth's generated trainer calls (``grpo_accumulated_loss``, ``compute_loss``, the generation)."""

    def fused_beta_gate(self, kwargs: dict, ref_logps: Tensor | None, completion_mask: Tensor) -> float:
        """Put this micro-batch's ``FusedKLInputs`` in ``kwargs``; return the constant gate the compiled loss sees."""
        ...

    def record_fused(self, stats: Tensor, mode: str) -> float:
        """Log the metrics from the fused loss's statistics; return Unsloth's own kl."""
        ...

    def before_reference_forward(self, unscored_precision_latch: Callable[[object], None]) -> None:
        """Called before the reference forward at β = 0 (kl_monitor)."""
        ...


class FusedLossHooks(Protocol):
    """What Unsloth's compiled ``grpo_compute_loss`` calls on ``kwargs["adaptive_kl"]``."""

    def kl_inputs(self, new: Tensor, coef_1: Tensor) -> tuple[Tensor, Tensor]: ...

    def estimate(self, unsloth_k3: Tensor, new: Tensor, ref: Tensor, clamped_log_ratio: Tensor, mask: Tensor) -> tuple[Tensor, Tensor | None]: ...

    def adapt(self, kl: Tensor, token_ids: Tensor) -> tuple[Tensor, Tensor]: ...

    def per_token(self) -> bool: ...

    def loss_term(self, adapted: Tensor) -> Tensor: ...

    def finish(
        self, loss: Tensor, unsloth_mean_kl: Tensor, raw: Tensor, adapted: Tensor | None, mask: Tensor, rs_keep: Tensor | None,
        accumulation, token_ids: Tensor | None = None, estimator_faults: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]: ...  # fmt: skip


__all__ = ["FusedLossHooks", "GenerationHooks", "TRLLossHooks", "TokenKLHooks", "UnslothTrainerHooks"]
