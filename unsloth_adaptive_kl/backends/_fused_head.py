"""The fused LM head of the Liger module (its default, ``fused_head="auto"``, wherever exact; ``True`` requires it):
the gradient computed in the forward, 3 GEMMs of 2·N·H·V FLOP instead of the 4 of a forward that recomputes
the logits in its backward.

**Why it can be done.** The loss is ``L = Σ_t w_t ℓ_t(logp_t)``: every loss type aggregates its
per-token loss linearly, with weights ``w_t`` known before any logit (token counts from the mask,
``1/L_i``, ``num_items_in_batch``, ``B · max_completion_length``, ``mean_i(mean_t ·)`` of
``length_normalized``), and ``ℓ_t`` reads only token t's log-prob besides quantities fixed for the
call (advantages, old and reference log-probs, the vLLM ratio, β, the estimator's batch statistic,
which is a function of the *reference* log-probs). So ``dL/dlogp_t`` is known as soon as token t's
log-prob is, and each chunk of tokens can be finished in one visit:

    logits_c = h_c @ Wᵀ (+ b)                           GEMM 1 (bf16, fp32 accumulate)
    lse_c, logp_c = row logsumexp, the selected logit   one pass over the chunk
    g_c = dL/dlogp_c                                    the module's own loss code, autograd on (B, T)
    logits_c ← g_c · (onehot − softmax(logits_c / τ)) / τ   one pass, in place
    grad_h_c = logits_c @ W                             GEMM 2
    grad_W += logits_cᵀ @ h_c,  grad_b += Σ logits_c    GEMM 3 (fp32 accumulator, as TRL's kernel)

and the backward only scales the stored gradients by the incoming one.

**Where it is exact** (every ``kl_adaptation_method``; β and the controller state are fixed for the
call): every loss type (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo; luspo's weight
``mask.sum(1)`` also counts padded positions, whose log-probs are then computed) at token-level
importance sampling, with or without ``delta``, the vLLM ratio, ``use_bias_correction_kl`` (the
token-level ratio), ``num_items_in_batch``; the built-in estimators (bottom_q's threshold comes from
the reference log-probs); the built-in shaping methods (each per token, or length_normalized's
weights), dynamic, target. The KL metrics
(raw / adapted per token, their token means) are computed from the same log-probs, as in the other
path. This module has no entropy term (``loss_class`` refuses TRL's entropy options).

**Where it is not** (:func:`fallback_reason` names it; the module then runs the log-prob kernel path):
sequence-level importance sampling (GSPO: a token's ratio is its completion's mean), vespo (its
detached weight is a function of the completion's summed log-ratio), ``use_ref_model=False`` with a
KL (the reference is the batch's own log-probs), an estimator or a shaping method registered by the
user or an overridden ``per_token_kl`` (locality unknown), inputs other than hidden states, weight and bias
that require grad, hidden states and weight (or bias) of different dtypes, and the dapo/cispo normaliser
without ``num_items_in_batch`` under
``torch.distributed`` (Liger all-reduces it on every evaluation, and the number of chunks differs
between ranks).

**Memory and the chunk schedule.** Over several chunks the weight gradient is accumulated in an
fp32 buffer (4 bytes × V·H) and converted to the weight's dtype at the end (2 bytes × V·H more,
after the logits buffer is freed), so that path peaks at no less than 6 bytes × V·H. The logits
buffer holds ``chunk_tokens × V`` values: by default what TRL's kernel tile takes (4096 × 32768)
plus, when the weight needs a gradient, the weight's own size. When all N tokens fit in one chunk
within that same 6 bytes × V·H (``N · V ≤ 2 · V · H``, i.e. N ≤ 2H: 2·N·V bytes of logits and
the gradient in the weight's dtype), there is one chunk and no accumulator: the weight gradient
is one GEMM written in the weight's dtype (accumulated in fp32 inside the GEMM and rounded once,
as the accumulator's conversion rounds once), which saves zeroing, reading and writing the fp32
accumulator per chunk and the final conversion. Either way the peak stays at or below the
log-prob kernel's, whose backward holds the fp32 accumulator, the converted gradient and its tile at once.
"""

from __future__ import annotations

import math
import os

import torch

from ..config import fused_head_setting
from ._liger_parts import VOCAB_TILE

KERNEL_TILE = 4096 * VOCAB_TILE  # values in TRL 1.15's log-prob kernel tile (TOKEN_CHUNK_SIZE × the package's VOCAB_TILE)
BLOCK = 1024  # vocabulary columns per Triton program
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Run the Triton kernels in Triton's CPU interpreter (TRITON_INTERPRET=1) instead of torch's ops on CPU tensors: the
#: tests that check the kernels themselves set it.
INTERPRET_KERNELS = False


def check_fused_arguments(fused_head, chunk_tokens) -> None:
    fused_head_setting(fused_head, "fused_head", text=False)
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1):
        raise ValueError(f"fused_chunk_tokens={chunk_tokens!r} is not valid; allowed: None (from the memory rule) or an int >= 1")


def fallback_reason(*, loss_type, level, with_kl, use_ref_model, builtin_estimator, builtin_shaping, own_kl, num_items_given, inputs, head=()):
    """Why the fused head would not be exact for this call (see the module docstring), or None. ``inputs``: the
    loss's tensor inputs other than hidden states, weight and bias, by name; ``head``: hidden states, weight, bias."""
    dist = torch.distributed
    distributed_normaliser = loss_type in ("dapo", "cispo") and not num_items_given and dist.is_available() and dist.is_initialized()
    grad_inputs = [name for name, t in inputs.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    if level == "sequence":
        return "sequence-level importance sampling: a token's ratio is the mean over its completion"
    if loss_type == "vespo":
        return "vespo: its weight is a function of the completion's summed log-ratio"
    if with_kl and not use_ref_model:
        return "use_ref_model=False: the reference log-probs are the batch's own"
    if with_kl and not builtin_estimator:
        return "an estimator registered outside this package: its locality is unknown"
    if with_kl and not builtin_shaping:
        return "a shaping method registered outside this package: its locality is unknown"
    if with_kl and own_kl:
        return "per_token_kl is overridden: its locality is unknown"
    if distributed_normaliser:
        return f"loss_type={loss_type!r} without num_items_in_batch under torch.distributed: Liger all-reduces its normaliser per call"
    if grad_inputs:
        return f"{grad_inputs} require grad"
    dtypes = sorted({str(t.dtype) for t in head if t is not None})
    if len(dtypes) > 1:
        return f"hidden states, weight and bias of different dtypes ({', '.join(dtypes)}): the logits GEMM takes one"
    return None


def default_chunk_tokens(tokens: int, vocab: int, weight_needs_grad: bool, hidden: int) -> int:
    """Tokens per chunk: all of them when the weight gets a gradient and N ≤ 2H (one chunk, no accumulator);
    else a buffer of ``KERNEL_TILE`` values (+ the weight's, when it gets a gradient), then chunks of equal
    size, multiples of 128 where the budget allows."""
    if tokens == 0:
        return 1
    if weight_needs_grad and tokens <= 2 * hidden:  # one chunk, no fp32 accumulator, within the same peak (docstring)
        return tokens
    budget = KERNEL_TILE + (vocab * hidden if weight_needs_grad else 0)
    most = max(1, budget // vocab)
    if most >= 128:
        most -= most % 128
    chunks = math.ceil(tokens / most)
    even = math.ceil(tokens / chunks)
    return max(1, min(most, tokens, 128 * math.ceil(even / 128) if most >= 128 else even))


# -- the two passes over a chunk of logits -------------------------------------------------------------------
def _use_triton(logits: torch.Tensor) -> bool:
    """The Triton kernels on a GPU; torch's ops on the CPU, where Triton only interprets (TRITON_INTERPRET=1, which
    TRL's own kernel needs there) one program at a time in Python: each pass is a row-wise logsumexp or softmax, which
    torch computes in the same float32. ``INTERPRET_KERNELS`` (tests) runs the kernels in the interpreter instead."""
    if logits.dtype not in TRITON_DTYPES:
        return False
    return logits.is_cuda or (INTERPRET_KERNELS and os.environ.get("TRITON_INTERPRET") == "1")


def row_logsumexp(logits: torch.Tensor, ids: torch.Tensor, inv_t: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logsumexp(z), z[id])`` per row of ``z = logits · inv_t``, in float32 (float64 for float64 logits)."""
    if not _use_triton(logits):
        z = logits.to(torch.promote_types(logits.dtype, torch.float32)) * inv_t
        return torch.logsumexp(z, -1), z.gather(1, ids.unsqueeze(1)).squeeze(1)
    kernels = _kernels()
    rows, cols = logits.shape
    lse = torch.empty(rows, device=logits.device, dtype=torch.float32)
    target = torch.empty_like(lse)
    kernels.row_stats[(rows,)](logits, logits.stride(0), ids, lse, target, cols, inv_t, BLOCK=BLOCK)
    return lse, target


def logits_to_grad_(logits: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, grad_logp: torch.Tensor, inv_t: float) -> None:
    """Overwrite ``logits`` with ``d L / d logits = g · (onehot(id) − softmax(z)) · inv_t`` per row."""
    if not _use_triton(logits):
        z = logits.to(lse.dtype) * inv_t
        grad = torch.exp(z - lse.unsqueeze(1)).mul_(-grad_logp.unsqueeze(1))
        grad.scatter_add_(1, ids.unsqueeze(1), grad_logp.unsqueeze(1).to(grad.dtype))
        logits.copy_(grad.mul_(inv_t))
        return
    kernels = _kernels()
    rows, cols = logits.shape
    grid = (rows, (cols + BLOCK - 1) // BLOCK)
    kernels.logits_grad[grid](logits, logits.stride(0), ids, lse, grad_logp.float().contiguous(), cols, inv_t, BLOCK=BLOCK)


_KERNELS = None


def _kernels():
    """The Triton kernels, defined on first use (importing triton reads TRITON_INTERPRET)."""
    global _KERNELS
    if _KERNELS is not None:
        return _KERNELS
    import types

    import triton
    import triton.language as tl

    @triton.jit
    def row_stats(logits_ptr, stride, ids_ptr, lse_ptr, target_ptr, cols, inv_t, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        start_ptr = logits_ptr + row * stride
        running_max = tl.max(tl.full((BLOCK,), float("-inf"), tl.float32), axis=0)
        running_sum = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
        for start in range(0, cols, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            z = tl.load(start_ptr + offsets, mask=offsets < cols, other=float("-inf")).to(tl.float32) * inv_t
            new_max = tl.maximum(running_max, tl.max(z, axis=0))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
            running_max = new_max
        tl.store(lse_ptr + row, running_max + tl.log(running_sum))
        tl.store(target_ptr + row, tl.load(start_ptr + tl.load(ids_ptr + row)).to(tl.float32) * inv_t)

    @triton.jit
    def logits_grad(logits_ptr, stride, ids_ptr, lse_ptr, grad_ptr, cols, inv_t, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < cols
        ptrs = logits_ptr + row * stride + offsets
        z = tl.load(ptrs, mask=inside, other=0.0).to(tl.float32) * inv_t
        prob = tl.exp(z - tl.load(lse_ptr + row))
        onehot = (offsets == tl.load(ids_ptr + row)).to(tl.float32)
        grad = tl.load(grad_ptr + row) * inv_t * (onehot - prob)
        tl.store(ptrs, grad.to(logits_ptr.dtype.element_ty), mask=inside)

    _KERNELS = types.SimpleNamespace(row_stats=row_stats, logits_grad=logits_grad)
    return _KERNELS


# -- the GEMMs ---------------------------------------------------------------------------------------------
def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` in float32 (or float64), the product not rounded to bf16 first."""
    if acc.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _full_precision_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in the inputs' dtype, reduced in fp32 (no reduced-precision split-K for bf16/fp16 on CUDA): one
    rounding of the fp32 sum, as the fp32 accumulator's conversion."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = matmul.allow_fp16_reduced_precision_reduction = False
    try:
        return torch.mm(a, b)
    finally:
        matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = saved


class FusedLinearLogProbs(torch.autograd.Function):
    """``(logps, anchor)``: the log-probs ``(N,)`` of ``ids`` under ``softmax((hidden @ weightᵀ + bias) / τ)``
    (float32, float64 for a float64 weight; no gradient through them) and a 0-dim zero carrying the loss's gradient.

    ``local_gradient(start, end, logps_chunk)`` returns ``dL/dlogp`` of tokens ``start:end``. The caller
    adds ``anchor`` to the loss it computes from ``logps``; the gradient reaching ``anchor`` scales
    the hidden, weight and bias gradients accumulated here. One backward per forward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, temperature, chunk_tokens, local_gradient):
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        tokens, vocab = hidden.shape[0], weight.shape[0]
        acc_dtype = torch.promote_types(weight.dtype, torch.float32)
        inv_t = 1.0 / temperature
        logps = torch.empty(tokens, device=hidden.device, dtype=acc_dtype)
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        one_chunk = 0 < tokens <= chunk_tokens  # the weight gradient in one GEMM, no accumulator (module docstring)
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=acc_dtype) if needs_weight and not one_chunk else None
        grad_bias = torch.zeros(vocab, device=weight.device, dtype=acc_dtype) if needs_bias else None
        buffer = torch.empty(min(tokens, chunk_tokens), vocab, device=hidden.device, dtype=hidden.dtype)
        logits = None
        for start in range(0, tokens, chunk_tokens):
            end = min(start + chunk_tokens, tokens)
            logits, h = buffer[: end - start], hidden[start:end]
            torch.mm(h, weight.t(), out=logits)
            if bias is not None:
                logits.add_(bias)
            lse, target = row_logsumexp(logits, ids[start:end], inv_t)
            logps[start:end] = target - lse
            if not (needs_hidden or needs_weight or needs_bias):
                continue
            grad_logp = local_gradient(start, end, logps[start:end]).to(lse.dtype)
            logits_to_grad_(logits, ids[start:end], lse, grad_logp, inv_t)
            if needs_hidden:
                torch.mm(logits, weight, out=grad_hidden[start:end])
            if needs_weight and one_chunk:
                grad_weight = _full_precision_mm(logits.t(), h)
            elif needs_weight:
                _accumulate(grad_weight, logits.t(), h)
            if needs_bias:
                grad_bias += logits.sum(0, dtype=acc_dtype)
        del buffer, logits  # before the conversion below, which needs the weight's size again
        ctx.grads = [
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
        ]
        anchor = torch.zeros((), device=hidden.device, dtype=torch.float32)
        ctx.mark_non_differentiable(logps)
        return logps, anchor

    @staticmethod
    def backward(ctx, _grad_logps, grad_anchor):
        if ctx.grads is None:
            raise RuntimeError("the fused LM head (fused_head=True) supports one backward per forward; use fused_head=False to backward twice")
        grads, ctx.grads = ctx.grads, None  # dropped here, so that autograd can take them as .grad without a copy
        if grad_anchor is None:
            return None, None, None, None, None, None, None
        if bool(grad_anchor != 1):
            grads = [None if g is None else g.mul_(grad_anchor.to(g.dtype)) for g in grads]
        return (*grads, None, None, None, None)


def fused_loss(hidden, weight, bias, token_ids, rows, temperature, chunk_tokens, evaluate):
    """The loss terms of ``evaluate`` (the module's elementwise loss: ``(B, T)`` log-probs -> ``LossTerms``) on the
    log-probs of ``token_ids``, its gradient computed chunk by chunk in the forward. ``rows``: the positions to
    compute (``(B, T)`` mask), None for all; the others hold 0, as in the log-prob kernel path."""
    batch, length, width = hidden.shape
    flat_hidden, flat_ids = hidden.reshape(batch * length, width), token_ids.reshape(batch * length)
    if rows is None:
        positions = torch.arange(batch * length, device=hidden.device)
    else:
        positions = rows.reshape(-1).nonzero().squeeze(1)
        flat_hidden, flat_ids = flat_hidden[positions], flat_ids[positions]
    logps = torch.zeros(batch * length, device=hidden.device, dtype=torch.promote_types(weight.dtype, torch.float32))

    def local_gradient(start, end, chunk_logps):
        """dL/dlogp of these tokens, exact whatever the other positions hold (where fallback_reason is None)."""
        with torch.enable_grad():
            leaf = chunk_logps.detach().requires_grad_(True)
            probe = logps.index_put((positions[start:end],), leaf)
            return torch.autograd.grad(evaluate(probe.view(batch, length)).loss, leaf)[0]

    if not torch.is_grad_enabled():  # no gradient wanted (evaluation): the forward only
        flat_hidden, weight, bias = (None if t is None else t.detach() for t in (flat_hidden, weight, bias))
    chunk_tokens = chunk_tokens or default_chunk_tokens(flat_ids.numel(), weight.shape[0], weight.requires_grad, width)
    flat_logps, anchor = FusedLinearLogProbs.apply(flat_hidden, weight, bias, flat_ids, temperature, chunk_tokens, local_gradient)
    logps[positions] = flat_logps
    with torch.no_grad():
        terms = evaluate(logps.view(batch, length))
    return terms._replace(loss=terms.loss + anchor)
