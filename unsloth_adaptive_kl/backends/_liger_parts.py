"""What the Liger loss module (``liger.py``) computes its loss from, and how it aggregates it: the
per-token log-probs from the final hidden states and the LM head, padding made neutral, the
importance weights, and Liger's aggregation of a per-token term for each loss type. (Liger's
interface, its parameters, checks and return structure, is ``_liger_interface.py``.)

The log-probs come from TRL 1.15's chunked log-prob kernel (``trl.kernels.ChunkedLogProbFunction``:
cuBLAS tiles of tokens × vocabulary and an online logsumexp in Triton, with a recomputing
backward), so logits are never materialised. Liger's own engine (``fused_linear_ppo.py``) gets the
same memory bound with a Python loop of small matmuls and is several times slower; it is not used.
"""

from __future__ import annotations

import os

import torch

from ._liger_interface import LOSS_TYPES


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


def normaliser_tensor(num_items_in_batch, device) -> torch.Tensor | None:
    """``num_items_in_batch`` as a 0-dim float32 tensor on ``device`` (None stays None): the value Liger's dapo
    normaliser makes of an int or a tensor, but an input of the compiled loss rather than a constant, so
    that a count changing every step does not recompile it (a Python number is specialised into the graph)."""
    if num_items_in_batch is None:
        return None
    if isinstance(num_items_in_batch, torch.Tensor):
        return num_items_in_batch.detach().to(device=device, dtype=torch.float32)
    return torch.tensor(float(num_items_in_batch), device=device, dtype=torch.float32)


def sequence_dynamic(*tensors) -> tuple:
    """The inputs of the compiled loss, each ``(B, T)`` one as a view whose sequence dimension (1) is marked
    dynamic, as Liger's engine marks its chunks (``fused_linear_ppo.py``): completion lengths change every
    step, and without the mark the first graph is specialised to the first length (a recompile at the second,
    a guard on every size after). Views, so that the caller's own tensors carry no mark."""
    marked = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] > 1:
            t = t.view_as(t)
            torch._dynamo.maybe_mark_dynamic(t, 1)
        marked.append(t)
    return tuple(marked)


VOCAB_TILE = 32768  # vocabulary tile width TRL 1.15 uses (trl/trainer/utils.py, _CHUNKED_LOGPROB_CHUNK_SIZE)


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
