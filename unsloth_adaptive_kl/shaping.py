"""Shaping of the per-token KL term, and the composition grammar of ``kl_adaptation_method``.

Shaping acts on the per-token KL term that β multiplies, *before* the loss aggregates it, so it
changes the gradient, not only a logged number. The order is fixed, whatever order the user
writes the ``+``-joined names in:

1. the estimator (``kl_estimator``), times the importance ratio when ``use_bias_correction_kl``;
2. ``clip``: ``min(kl_t, kl_clip_threshold)``;
3. ``sigmoid``: ``sigmoid(kl_t - kl_target) * kl_t``;
4. ``length_normalized``: each completion's KL counts as its per-token mean, whatever the
   loss type: the KL part of the loss is ``beta * mean_i(mean_t kl_it)``.

At most one β controller (``dynamic`` or ``target``) may be joined with any shaping methods,
e.g. ``"dynamic+length_normalized"``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SHAPING_ORDER = ("clip", "sigmoid", "length_normalized")
CONTROLLERS = ("dynamic", "target")
METHOD_NAMES = ("none", *SHAPING_ORDER, *CONTROLLERS)


@dataclass(frozen=True)
class Method:
    """A parsed ``kl_adaptation_method``: one β controller and the shaping steps, in applied order."""

    controller: str  # "fixed", "dynamic" or "target"
    shaping: tuple[str, ...]

    @property
    def length_normalized(self) -> bool:
        return "length_normalized" in self.shaping

    @property
    def is_none(self) -> bool:
        return self.controller == "fixed" and not self.shaping


def parse_method(method: str) -> Method:
    """Parse ``"none"``, a single method, or a ``+``-joined composition; raise ValueError otherwise."""
    allowed = f"one of {list(METHOD_NAMES)} or a '+'-joined combination of at most one of {list(CONTROLLERS)} and any of {list(SHAPING_ORDER)}"
    if not isinstance(method, str) or not method.strip():
        raise ValueError(f"kl_adaptation_method={method!r} is not valid; allowed: {allowed}")
    parts = [p.strip() for p in method.split("+")]
    if parts == ["none"]:
        return Method("fixed", ())
    if "none" in parts:
        raise ValueError(f"kl_adaptation_method={method!r} joins 'none' (no adaptation) with other parts; allowed: 'none' alone, or the other parts without it")
    unknown = [p for p in parts if p not in METHOD_NAMES]
    if unknown:
        raise ValueError(f"kl_adaptation_method={method!r} has unknown part(s) {unknown}; allowed: {allowed}")
    if len(set(parts)) != len(parts):
        raise ValueError(f"kl_adaptation_method={method!r} repeats a part; allowed: {allowed}")
    controllers = [p for p in parts if p in CONTROLLERS]
    if len(controllers) > 1:
        raise ValueError(f"kl_adaptation_method={method!r} names {len(controllers)} β controllers; allowed: {allowed}")
    shaping = tuple(name for name in SHAPING_ORDER if name in parts)
    return Method(controllers[0] if controllers else "fixed", shaping)


def clip(kl: torch.Tensor, threshold: float) -> torch.Tensor:
    """Hard cap: ``min(kl_t, threshold)``; tokens above the cap get no KL gradient."""
    return torch.clamp(kl, max=threshold)


def sigmoid(kl: torch.Tensor, target: float) -> torch.Tensor:
    """Soft cap around ``target``: ``sigmoid(kl_t - target) * kl_t``; never above ``kl_t`` when kl_t >= 0."""
    return torch.sigmoid(kl - target) * kl


def shape_per_token(kl: torch.Tensor, method: Method, *, clip_threshold: float, target: float) -> torch.Tensor:
    """Apply the per-token shaping steps of ``method`` (clip, then sigmoid) to the KL term."""
    if "clip" in method.shaping:
        kl = clip(kl, clip_threshold)
    if "sigmoid" in method.shaping:
        kl = sigmoid(kl, target)
    return kl


def sequence_mean(kl: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-completion masked mean over tokens, shape ``(B,)``; an all-masked row gives 0.

    Masked positions are zeroed with ``where`` (not a product) so NaN or inf there cannot leak.
    """
    valid = mask.bool()
    summed = torch.where(valid, kl, torch.zeros_like(kl)).sum(-1)
    return summed / valid.sum(-1).clamp(min=1).to(kl.dtype)


def length_normalized_term(kl: torch.Tensor, mask: torch.Tensor, num_completions: int | float | torch.Tensor) -> torch.Tensor:
    """The length-normalised KL term ``mean_i(mean_t kl_it)``, or this shard's share of it: the sum
    over these completions of each one's mean per-token KL, divided by ``num_completions``, the
    number of completions in the *whole* batch. Backends that see a batch in chunks add the chunks'
    shares, so the result does not depend on the chunk size.
    """
    return sequence_mean(kl, mask).sum() / num_completions
