"""Unsloth backend: adaptive KL inside the fused, chunked, ``torch.compile``d GRPO loss.

``import unsloth`` generates a module, ``UnslothGRPOTrainer``, from TRL's source and rebinds
``trl.GRPOTrainer``/``trl.GRPOConfig`` to its classes. Its loss runs
``compute_loss -> grpo_accumulated_loss -> UnslothEfficientGRPO -> grpo_compute_loss``, the last
two inside a ``torch.compile(fullgraph=True)`` region. That is where the per-token KL must be
estimated and shaped. This module rewrites, at anchors that must each match exactly once:

* ``grpo_compute_loss``: the estimator (Unsloth's own clamped k3 stays as is when
  ``kl_estimator="k3"``), shaping after Unsloth's bias correction and ``[-10, 10]`` clamp,
  ``beta * kl`` -> ``beta * beta_tensor * adapted_kl``, the length-normalised term, and the
  local metric sums, returned in the ``mean_kl`` slot as a 6-vector ``[unsloth_kl, sums...]``;
* ``UnslothEfficientGRPO.forward``: its ``mean_kl`` accumulator becomes that 6-vector;
* ``grpo_accumulated_loss``: ``trainer.beta`` becomes a constant gate (1.0 while β != 0, 0.0
  once β reaches 0), and the real β travels as a 0-dim tensor in the loss kwargs, so a
  changing β never recompiles the fused loss (one recompilation for the switch to 0);
* the trainer's ``compute_loss``: records the ``adaptive_kl/*`` metrics (reduced across
  processes) and logs Unsloth's own ``kl`` unchanged.

It also grafts the config fields onto ``UnslothGRPOConfig`` (so no field is printed as
"IGNORED") and gives the trainer the same β controller, reward feed and checkpoint callback as
the TRL backend. Import order does not matter: whichever of ``unsloth`` and this package comes
second, the generated module is patched at the latest when a ``GRPOConfig`` is created.
"""

from __future__ import annotations

import sys

import torch

from .. import metrics
from .._source_patch import PatchError, check_version, rewrite_function, version_of
from ..estimators import estimate_kl, get_estimator
from ..shaping import Method, length_normalized_sum, shape_per_token
from ..versions import SUPPORTED
from . import trl as trl_backend

GENERATED_MODULE = "UnslothGRPOTrainer"
SUPPORTED_UNSLOTH = SUPPORTED["unsloth"].label  # the range lives in versions.py (unsloth_zoo's is the same)
STATS_SIZE = 1 + metrics.NUM_SUMS  # Unsloth's mean_kl, then metrics.local_kl_sums


def _unsloth_supported(version: str) -> bool:
    return SUPPORTED["unsloth"].contains(version)


# -- rewrites ------------------------------------------------------------------------------------
GRPO_COMPUTE_LOSS_REWRITES = [
    (
        "        kl_i = torch.expm1(kl_log_ratio) - kl_log_ratio\n",
        "        kl_i = torch.expm1(kl_log_ratio) - kl_log_ratio\n"
        '        kl_i = kwargs["adaptive_kl"].estimate(kl_i, new, kl_log_ratio, mask, kwargs.get("adaptive_kl_statistic"), ref)\n',
    ),
    (
        "        kl_i = torch.clamp(kl_i, min = -10.0, max = 10.0)\n",
        "        kl_i = torch.clamp(kl_i, min = -10.0, max = 10.0)\n"
        '        adaptive_kl_i = kwargs["adaptive_kl"].shape(kl_i)\n',
    ),
    (
        "    if beta != 0.0:\n        loss_i = loss_i + beta * kl_i\n",
        '    if beta != 0.0 and not kwargs["adaptive_kl"].length_normalized:\n'
        '        loss_i = loss_i + beta * kwargs["adaptive_kl_beta"] * adaptive_kl_i\n',
    ),
    (
        "    completion_length, mean_kl = masked_batch_mean(kl_metric)\n",
        "    completion_length, mean_kl = masked_batch_mean(kl_metric)\n"
        '    loss, mean_kl = kwargs["adaptive_kl"].finish(\n'
        "        loss, mean_kl, kl_metric, adaptive_kl_i if beta != 0.0 else None, mask, rs_keep, kwargs\n"
        "    )\n",
    ),
]
EFFICIENT_FORWARD_REWRITES = [
    (
        "        accumulated_mean_kl           = torch.zeros(1, device = device)[0]\n",
        f"        accumulated_mean_kl           = torch.zeros({STATS_SIZE}, dtype = torch.float64, device = device)\n",
    ),
]
ACCUMULATED_LOSS_REWRITES = [
    (
        "                trainer.beta,\n                trainer.accelerator.scaler,\n                1,\n",
        "                trainer._adaptive_kl.prepare_fused(kwargs, ref_logps, completion_mask),\n"
        "                trainer.accelerator.scaler,\n                1,\n",
    ),
]
TRAINER_COMPUTE_LOSS_REWRITES = [
    (
        '            self._metrics[mode]["kl"].append(mean_kl.item())\n',
        '            self._metrics[mode]["kl"].append(self._adaptive_kl.record_fused(mean_kl, mode))\n',
    ),
]


class FusedKL:
    """The per-token math the compiled loss calls: small, immutable, and free of trainer state,
    so ``torch.compile`` guards on a handful of constants."""

    def __init__(self, method: Method, estimator: str, clip_threshold: float, kl_target: float, bottom_q: float):
        self.method = method
        self.estimator = estimator
        self.clip_threshold = clip_threshold
        self.kl_target = kl_target
        self.bottom_q = bottom_q
        self.length_normalized = method.length_normalized

    def estimate(self, unsloth_k3, new, clamped_log_ratio, mask, statistic, ref=None):
        """Unsloth's own (clamped) k3, or our estimator on the same clamped log-ratio."""
        if self.estimator == "k3":
            return unsloth_k3
        clamped_ref = new + clamped_log_ratio
        if ref is not None:
            # ref itself where the clamp is inactive: new + (ref - new) is not always ref in float32, and
            # bottom_q compares ref with its threshold (a value of ref), so the threshold token could drop out.
            clamped_ref = torch.where(clamped_log_ratio == ref - new, ref, clamped_ref)
        return estimate_kl(
            self.estimator, new, clamped_ref, mask=mask, statistic=statistic, bottom_q=self.bottom_q, check=False
        )

    def shape(self, kl):
        return shape_per_token(kl, self.method, clip_threshold=self.clip_threshold, target=self.kl_target)

    def finish(self, loss, unsloth_mean_kl, raw, adapted, mask, rs_keep, kwargs):
        """Add the length-normalised term; return the loss and ``[unsloth_kl, local sums...]``."""
        if adapted is None:  # β is 0: no KL was computed
            sums = torch.zeros(STATS_SIZE - 1, dtype=torch.float64, device=mask.device)
        else:
            if rs_keep is not None:  # tokens Unsloth's rollout rejection drops leave the KL too
                adapted = torch.where(rs_keep, adapted, 0.0)
            if self.length_normalized:
                accumulation = kwargs.get("current_gradient_accumulation_steps", 1)
                term = length_normalized_sum(adapted, mask) / kwargs["adaptive_kl_rows"]
                loss = loss + kwargs["adaptive_kl_beta"] * term / accumulation
            sums = metrics.local_kl_sums(raw, adapted, mask)
        return loss, torch.cat([unsloth_mean_kl.reshape(1).to(torch.float64), sums])


class UnslothAdaptiveKL(trl_backend.TRLAdaptiveKL):
    """The trainer-side state for Unsloth's generated trainer."""

    def __init__(self, trainer):
        super().__init__(trainer)
        self.fused = FusedKL(self.method, self.estimator, self.clip_threshold, self.kl_target, self.bottom_q)
        if not get_estimator(self.estimator).builtin:
            self._check_user_estimator_once()

    def _check_user_estimator_once(self) -> None:
        # Inside the compiled loss the checks cannot run (they synchronise), so probe once here.
        logp = (-torch.rand(2, 5) * 3).requires_grad_(True)
        estimate_kl(self.estimator, logp, logp.detach() + torch.randn(2, 5), mask=torch.ones(2, 5, dtype=torch.bool))

    def prepare_fused(self, kwargs: dict, ref_logps, completion_mask) -> float:
        """Fill the loss kwargs; return the constant β gate the compiled loss sees."""
        beta = float(self.trainer.beta)
        kwargs["adaptive_kl"] = self.fused
        if beta == 0.0:
            return 0.0
        if self.length_normalized and kwargs.get("sample_weight") is not None:
            raise ValueError(
                "kl_adaptation_method with length_normalized cannot be combined with Unsloth's per-completion "
                "sample weights (sample_weight): both replace the loss normaliser"
            )
        device = completion_mask.device
        kwargs["adaptive_kl_beta"] = torch.tensor(beta, dtype=torch.float32, device=device)
        kwargs["adaptive_kl_rows"] = torch.tensor(float(completion_mask.shape[0]), dtype=torch.float32, device=device)
        kwargs["adaptive_kl_statistic"] = None if ref_logps is None else self.batch_statistic(ref_logps, completion_mask)
        return 1.0

    def record_fused(self, stats, mode: str) -> float:
        """Log the adaptive_kl metrics from the fused loss's 6-vector; return Unsloth's own kl."""
        if not torch.is_tensor(stats) or stats.shape != (STATS_SIZE,):
            raise PatchError(
                f"unsloth {version_of('unsloth')} / unsloth_zoo {version_of('unsloth_zoo')}: the GRPO loss returned "
                f"no adaptive-KL statistics (got {getattr(stats, 'shape', stats)}); this loss path is not patched"
            )
        beta = float(self.trainer.beta)
        self.log_metrics(self.record_sums(None if beta == 0.0 else stats[1:], training=mode == "train", beta=beta), mode)
        return stats[0].item()


# -- patching ----------------------------------------------------------------------------------
_patched_module = None


def forget() -> None:
    """Called by unpatch(): the attributes themselves are restored by the TRL backend's ledger."""
    global _patched_module
    _patched_module = None


def maybe_patch() -> None:
    """Patch Unsloth's generated GRPO module if it exists and is not patched yet."""
    module = sys.modules.get(GENERATED_MODULE)
    if module is None or module is _patched_module or not trl_backend.is_patched():
        return
    patch_generated_module(module)


def _graft_config_fields(config_cls, pristine_cls) -> None:
    from ..config import FIELD_NAMES

    ours = {name: pristine_cls.__dataclass_fields__[name] for name in FIELD_NAMES}
    trl_backend._set(config_cls, "__dataclass_fields__", {**config_cls.__dataclass_fields__, **ours})
    annotations = dict(config_cls.__dict__.get("__annotations__", {}))
    annotations.update({name: field.type for name, field in ours.items()})
    trl_backend._set(config_cls, "__annotations__", annotations)
    # Unsloth caches the accepted keyword names of TRL's config; ours were added after.
    compat = sys.modules.get("unsloth.models.rl_config_compat")
    cache = getattr(compat, "_ACCEPTED_CACHE", None)
    if cache is not None:
        cache.pop(pristine_cls, None)


def patch_generated_module(module) -> None:
    global _patched_module
    check_version("unsloth", _unsloth_supported, SUPPORTED_UNSLOTH)
    check_version("unsloth_zoo", _unsloth_supported, SUPPORTED_UNSLOTH)
    trainer_cls = module.UnslothGRPOTrainer
    config_cls = module.UnslothGRPOConfig
    pristine_config = config_cls.__mro__[1]
    # All rewrites share one namespace, so they call each other's new versions; build them all
    # before changing anything, so a missing anchor leaves Unsloth untouched.
    namespace = dict(module.__dict__)
    library = ("unsloth", "unsloth_zoo")  # the generated code comes from both
    compute = rewrite_function(module.grpo_compute_loss, GRPO_COMPUTE_LOSS_REWRITES, library=library, namespace=namespace)
    forward = rewrite_function(
        module.UnslothEfficientGRPO.forward, EFFICIENT_FORWARD_REWRITES, library=library, namespace=namespace
    )
    accumulated = rewrite_function(
        module.grpo_accumulated_loss, ACCUMULATED_LOSS_REWRITES, library=library, namespace=namespace
    )
    trainer_compute_loss = rewrite_function(
        trainer_cls.compute_loss, TRAINER_COMPUTE_LOSS_REWRITES, library=library, namespace=namespace
    )
    trl_backend.patch_config_class(pristine_config)
    _graft_config_fields(config_cls, pristine_config)
    trl_backend._set(module, "grpo_compute_loss", compute)
    trl_backend._set(module, "grpo_accumulated_loss", accumulated)
    trl_backend._set(module.UnslothEfficientGRPO, "forward", forward)
    trl_backend._set(trainer_cls, "compute_loss", trainer_compute_loss)
    trl_backend.patch_trainer_class(trainer_cls, UnslothAdaptiveKL, loss_path=("compute_loss",))
    _patched_module = module
