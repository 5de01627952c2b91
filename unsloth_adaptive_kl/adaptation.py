"""``AdaptiveKL``: what a backend holds. It estimates and shapes the per-token KL with the core
functions, keeps the β controller, and turns per-step statistics into β updates and metrics.

Pure torch. A backend supplies a ``reduce`` (sum across processes) and a metrics sink.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from . import metrics
from .config import controller_config, validate
from .controllers import BetaController, make_controller
from .estimators import estimate_kl, get_estimator
from .shaping import length_normalized_sum, shape_per_token


def _no_reduce(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class AdaptiveKL:
    """The adaptive-KL state of one trainer (or one loss module).

    ``config`` is any object with the adaptive-KL fields and ``beta`` (a ``GRPOConfig``).
    ``reduce`` sums a tensor across processes (``accelerator.reduce(t, "sum")``); identity by default.
    """

    def __init__(self, config, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.method = validate(config)
        self.estimator = get_estimator(config.kl_estimator).name
        self.clip_threshold = float(config.kl_clip_threshold)
        self.kl_target = float(config.kl_target)
        self.bottom_q = float(config.kl_bottom_q)
        self.use_bias_correction_kl = bool(getattr(config, "use_bias_correction_kl", False))
        self.controller: BetaController = make_controller(self.method.controller, controller_config(config))
        self.reduce = reduce or _no_reduce
        self._step_sums: torch.Tensor | None = None

    # -- the per-token math -------------------------------------------------------------------
    @property
    def beta(self) -> float:
        return self.controller.beta

    @property
    def length_normalized(self) -> bool:
        return self.method.length_normalized

    @property
    def is_stock(self) -> bool:
        """Method ``none`` with the ``k3`` estimator: the library's own KL term, unadapted."""
        return self.method.is_none and self.estimator == "k3"

    def batch_statistic(self, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """The estimator's batch-level statistic (e.g. bottom_q's threshold), or None. Call it
        on the whole batch before any chunking."""
        spec = get_estimator(self.estimator)
        if spec.batch_statistic is None:
            return None
        return spec.batch_statistic(ref_logp, mask, q=self.bottom_q)

    def per_token(
        self,
        logp: torch.Tensor,
        ref_logp: torch.Tensor,
        mask: torch.Tensor,
        coef: torch.Tensor | None = None,
        statistic: torch.Tensor | None = None,
        estimator: Callable[..., torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(raw, adapted)`` per-token KL.

        ``raw`` is the estimator times ``coef`` (the importance ratio when the backend applies
        ``use_bias_correction_kl``); ``adapted`` is ``raw`` after clip and sigmoid. Length
        normalisation acts at aggregation: see :meth:`length_normalized_term`. ``estimator``
        (``fn(logp, ref_logp, *, mask, statistic)``) replaces the configured one, e.g. a loss
        module's overridden KL function.
        """
        if estimator is None:
            raw = estimate_kl(self.estimator, logp, ref_logp, mask=mask, statistic=statistic, bottom_q=self.bottom_q)
        else:
            raw = estimator(logp, ref_logp, mask=mask, statistic=statistic)
        if coef is not None:
            raw = raw * coef
        adapted = shape_per_token(raw, self.method, clip_threshold=self.clip_threshold, target=self.kl_target)
        return raw, adapted

    @staticmethod
    def length_normalized_term(adapted: torch.Tensor, mask: torch.Tensor, num_completions: int | float) -> torch.Tensor:
        """This shard's share of ``mean_i(mean_t adapted_it)`` over ``num_completions`` completions."""
        return length_normalized_sum(adapted, mask) / num_completions

    # -- statistics, metrics and β -------------------------------------------------------------
    def record(self, raw: torch.Tensor | None, adapted: torch.Tensor | None, mask: torch.Tensor, *, training: bool, beta: float) -> dict[str, float]:
        """Reduce this micro-batch's KL sums across processes; return the metric values.

        In training, also accumulate the sums for this optimizer step's controller update.
        With ``raw is None`` (β is 0, no KL computed) only ``current_beta`` is reported and the
        KL metrics are NaN, which the trainer's logger shows as missing.
        """
        sums = None if raw is None else metrics.local_kl_sums(raw, adapted, mask)
        return self.record_sums(sums, training=training, beta=beta)

    def record_sums(self, local_sums: torch.Tensor | None, *, training: bool, beta: float) -> dict[str, float]:
        """As :meth:`record`, from :func:`metrics.local_kl_sums` computed elsewhere (e.g. in a fused loss)."""
        values = {metrics.CURRENT_BETA: float(beta)}
        if local_sums is None:
            values.update({metrics.RAW_KL: math.nan, metrics.ADAPTED_KL: math.nan})
            return values
        totals = self.reduce(local_sums)
        if training:
            self._step_sums = totals if self._step_sums is None else self._step_sums + totals
        values.update(metrics.metric_values(totals, length_normalized=self.length_normalized))
        return values

    def observe_reward(self, reward: float) -> None:
        self.controller.observe_reward(reward)

    def check_step_size(self, num_completions: int) -> None:
        """Refuse, when the trainer is created, a configuration that ``num_completions`` completions per
        optimizer step (all processes) would break at its first update (``target``'s ``kl_horizon``)."""
        self.controller.check_step_size(num_completions)

    @property
    def skipped_updates(self) -> int:
        return self.controller.skipped_updates

    def end_step(self, global_step: int) -> float:
        """Update β once per optimizer step; ``global_step`` is the index of the step about to start.

        A step with no valid token (every completion masked, e.g. all truncated under
        ``mask_truncated_completions``) has no KL: the controller gets ``kl=None``, not 0.
        """
        sums, self._step_sums = self._step_sums, None
        if sums is None or sums[metrics.TOKENS].item() == 0:
            kl = None
        else:
            kl = (sums[metrics.RAW_SUM] / sums[metrics.TOKENS]).item()
        completions = 0 if sums is None else int(sums[metrics.COMPLETIONS].item())
        return self.controller.update(global_step=global_step, kl=kl, num_completions=completions)

    def state_dict(self) -> dict:
        return {"controller": self.controller.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.controller.load_state_dict(state["controller"])
