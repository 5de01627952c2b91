"""The rewrites of Unsloth's generated GRPO trainer (``UnslothGRPOTrainer``), one :class:`AnchorSet` per unsloth_zoo
line: :data:`PLAN` (the fused loss: ``grpo_accumulated_loss``, ``UnslothEfficientGRPO``, ``grpo_compute_loss``; the
trainer's ``compute_loss``) and :data:`MONITOR_PLAN` (kl_monitor's reference forward in the generation). The rewritten
lines call the hooks of ``backends/hooks.py``: ``kwargs["adaptive_kl"]`` is ``unsloth.FusedKLInputs``
(:class:`~unsloth_adaptive_kl.backends.hooks.FusedLossHooks`), ``trainer._adaptive_kl`` / ``self._adaptive_kl`` is
``unsloth.UnslothAdaptiveKL`` (:class:`~unsloth_adaptive_kl.backends.hooks.UnslothTrainerHooks`).

=================================  =============================================  ==========================================
anchor (in the generated module)   replacement                                    why
=================================  =============================================  ==========================================
``kl_i = expm1(r) - r``            ``kl_i, faults = adaptive_kl.estimate(..)``    the configured estimator on Unsloth's
                                                                                  clamped log-ratio (k3 stays Unsloth's);
                                                                                  a user one's NaN on finite inputs
``kl_i = clamp(kl_i, -10, 10)``    ``kl_i, adapted = adaptive_kl.adapt(..)``       the pipeline's per-token steps, given the
                                                                                  token ids, after Unsloth's clamps
``loss_i + beta * kl_i``           ``loss_i + adaptive_kl.loss_term(..)``         β (the pipeline's loss β) as a 0-dim tensor
``masked_batch_mean(kl_metric)``   ``adaptive_kl.finish(...)``                    length-normalised term; the metric sums
                                                                                  (the faults counted: refused at their read)
``accumulated_mean_kl = zeros(1)``  ``zeros(STATS_SIZE)``                          room for the sums in the ``mean_kl`` slot
``trainer.beta,`` (the call)       ``trainer._adaptive_kl.fused_beta_gate(...)``  fills ``kwargs["adaptive_kl"]`` (unsloth.py)
``_metrics["kl"].append(..)``      ``_adaptive_kl.record_fused(mean_kl, mode)``   logs adaptive_kl/*, and Unsloth's own kl
``ref - new``, ``kl_i * coef_1``    ``kl_new``, ``kl_coef_1`` (``kl_inputs``)       kl_monitor: detached while β is 0
=================================  =============================================  ==========================================

"""

from __future__ import annotations

from .. import metrics
from .._source_patch import AnchorSet, Plan, Rewrite
from . import reward_placement

GENERATED_MODULE = "UnslothGRPOTrainer"
STATS_SIZE = 1 + metrics.SUMS_SIZE  # Unsloth's mean_kl, then metrics.local_metric_sums (the KL sums, the tail histogram)

# -- the plan --------------------------------------------------------------------------------------------
# After Unsloth's own clamps, in every line: the pipeline's per-token steps, given the token ids (kl_i: Unsloth's kl
# and our raw; adaptive_kl_i: the adapted KL).
_ADAPT = '        kl_i, adaptive_kl_i = kwargs["adaptive_kl"].adapt(kl_i, input_ids)\n'


def _gate(indent: str) -> Rewrite:
    """``trainer.beta`` in the call of ``UnslothEfficientGRPO.apply`` (indented ``indent``, which
    differs between unsloth_zoo lines) becomes the constant gate, with β put in the kwargs."""
    return Rewrite(
        "grpo_accumulated_loss",
        "unsloth_zoo",
        f"{indent}trainer.beta,\n{indent}trainer.accelerator.scaler,\n{indent}1,\n",
        f"{indent}trainer._adaptive_kl.fused_beta_gate(kwargs, ref_logps=ref_logps, completion_mask=completion_mask),\n"
        f"{indent}trainer.accelerator.scaler,\n{indent}1,\n",
        "β goes in kwargs['adaptive_kl'] as a tensor; the compiled loss sees a constant gate",
    )


# 2026.10's rewrites, each named: the older lines below reuse them by these names.
_KL = Rewrite(
    "grpo_compute_loss",
    "unsloth_zoo",
    "        kl_i = torch.expm1(kl_log_ratio) - kl_log_ratio\n",
    "        kl_i = torch.expm1(kl_log_ratio) - kl_log_ratio\n"
    '        kl_i, adaptive_kl_estimator_faults = kwargs["adaptive_kl"].estimate(kl_i, new=kl_new, ref=ref, clamped_log_ratio=kl_log_ratio, mask=mask)\n',
    "the configured estimator, on Unsloth's clamped log-ratio",
)
_MONITOR_NEW = Rewrite(
    "grpo_compute_loss",
    "unsloth_zoo",
    "        kl_log_ratio = torch.clamp(ref - new, min = -20.0, max = 20.0)\n",
    '        kl_new, kl_coef_1 = kwargs["adaptive_kl"].kl_inputs(new, coef_1)\n'
    "        kl_log_ratio = torch.clamp(ref - kl_new, min = -20.0, max = 20.0)\n",
    "kl_monitor: while β is 0 the KL reads new and coef_1 detached, so no gradient goes through it",
)
_MONITOR_COEF = Rewrite(
    "grpo_compute_loss",
    "unsloth_zoo",
    "        if use_bias_correction_kl:\n            kl_i = kl_i * coef_1\n",
    "        if use_bias_correction_kl:\n            kl_i = kl_i * kl_coef_1\n",
    "kl_monitor: the bias correction's ratio, detached while β is 0",
)
_SHAPE = Rewrite(
    "grpo_compute_loss",
    "unsloth_zoo",
    "        kl_i = torch.clamp(kl_i, min = -10.0, max = 10.0)\n",
    "        kl_i = torch.clamp(kl_i, min = -10.0, max = 10.0)\n"
    + _ADAPT,
    "the pipeline's per-token steps (the shaping, the positions without a KL term), after Unsloth's bias correction and clamp",
)
_ADD = Rewrite(
    "grpo_compute_loss",
    "unsloth_zoo",
    "    if beta != 0.0:\n        loss_i = loss_i + beta * kl_i\n",
    '    if beta != 0.0 and kwargs["adaptive_kl"].per_token():\n'
    '        loss_i = loss_i + kwargs["adaptive_kl"].loss_term(adaptive_kl_i)\n',
    "β (a tensor) times the adapted KL (none while kl_monitor watches β = 0); length_normalized adds its term in finish",
)
_FINISH = Rewrite(
    "grpo_compute_loss",
    "unsloth_zoo",
    "    completion_length, mean_kl = masked_batch_mean(kl_metric)\n",
    "    completion_length, mean_kl = masked_batch_mean(kl_metric)\n"
    '    loss, mean_kl = kwargs["adaptive_kl"].finish(\n'
    "        loss=loss, unsloth_mean_kl=mean_kl, raw=kl_metric, adapted=adaptive_kl_i if beta != 0.0 else None, mask=mask,\n"
    "        rs_keep=rs_keep, accumulation=current_gradient_accumulation_steps, token_ids=input_ids,\n"
    "        estimator_faults=adaptive_kl_estimator_faults if beta != 0.0 else None,\n"
    "    )\n",
    "the length-normalised term, and the local metric sums in the mean_kl slot",
)
_FORWARD = Rewrite(
    "UnslothEfficientGRPO.forward",
    "unsloth_zoo",
    "        accumulated_mean_kl           = torch.zeros(1, device = device)[0]\n",
    f"        accumulated_mean_kl           = torch.zeros({STATS_SIZE}, dtype = torch.float64, device = device)\n"
    "        torch._dynamo.mark_static(accumulated_mean_kl)\n",
    "the mean_kl accumulator holds Unsloth's kl and the metric sums; static: under Unsloth's dynamic=True its "
    f"length would get a symbol that duck sizing shares with a sequence length of {STATS_SIZE}, specialising it",
)
_GATE = _gate(" " * 16)
_TRAINER_KL = Rewrite(
    "UnslothGRPOTrainer.compute_loss",
    "unsloth",
    '            self._metrics[mode]["kl"].append(mean_kl.item())\n',
    '            self._metrics[mode]["kl"].append(self._adaptive_kl.record_fused(mean_kl, mode=mode))\n',
    "the adaptive_kl/* metrics, reduced across processes; Unsloth's own kl unchanged",
)
UNSLOTH_2026_10 = AnchorSet(
    family="unsloth 2026.10",
    versions={"unsloth_zoo": ">=2026.10,<2026.11"},
    rewrites=(_KL, _MONITOR_NEW, _MONITOR_COEF, _SHAPE, _ADD, _FINISH, _FORWARD, _GATE, _TRAINER_KL),
)
# Older unsloth_zoo lines (docs/compatibility.md): 2026.9 clamps k3 in one line, before the bias
# correction; 2026.8 neither clamps nor corrects. Neither has kl_metric or rollout rejection (rs_keep).
_FINISH_BEFORE_2026_10 = Rewrite(
    "grpo_compute_loss",
    "unsloth_zoo",
    "    completion_length, mean_kl = masked_batch_mean(kl_i)\n",
    "    completion_length, mean_kl = masked_batch_mean(kl_i)\n"
    '    loss, mean_kl = kwargs["adaptive_kl"].finish(\n'
    "        loss=loss, unsloth_mean_kl=mean_kl, raw=kl_i, adapted=adaptive_kl_i if beta != 0.0 else None, mask=mask,\n"
    "        rs_keep=None, accumulation=current_gradient_accumulation_steps, token_ids=input_ids,\n"
    "        estimator_faults=adaptive_kl_estimator_faults if beta != 0.0 else None,\n"
    "    )\n",
    _FINISH.why,
)
UNSLOTH_2026_9 = AnchorSet(
    "unsloth 2026.9",
    {"unsloth_zoo": ">=2026.9,<2026.10"},
    (
        Rewrite(
            "grpo_compute_loss",
            "unsloth_zoo",
            "        kl_i = torch.clamp(torch.expm1(kl_log_ratio) - kl_log_ratio, min = -10.0, max = 10.0)\n",
            "        kl_i = torch.clamp(torch.expm1(kl_log_ratio) - kl_log_ratio, min = -10.0, max = 10.0)\n"
            '        kl_i, adaptive_kl_estimator_faults = kwargs["adaptive_kl"].estimate(kl_i, new=new, ref=ref, clamped_log_ratio=kl_log_ratio, mask=mask)\n',
            _KL.why + " (the [-10, 10] clamp is Unsloth's k3's own here)",
        ),
        Rewrite(
            "grpo_compute_loss",
            "unsloth_zoo",
            "        if use_bias_correction_kl:\n            kl_i = kl_i * coef_1\n",
            "        if use_bias_correction_kl:\n            kl_i = kl_i * coef_1\n"
            + _ADAPT,
            "the pipeline's per-token steps (the shaping, the positions without a KL term), after Unsloth's bias correction",
        ),
        _ADD, _FINISH_BEFORE_2026_10, _FORWARD, _GATE, _TRAINER_KL,
    ),
)  # fmt: skip
UNSLOTH_2026_8 = AnchorSet(
    "unsloth 2026.8",
    {"unsloth_zoo": ">=2026.8,<2026.9"},
    (
        Rewrite(
            "grpo_compute_loss",
            "unsloth_zoo",
            "        kl_i = torch.exp(ref - new) - (ref - new) - 1.0\n",
            "        kl_i = torch.exp(ref - new) - (ref - new) - 1.0\n"
            '        kl_i, adaptive_kl_estimator_faults = kwargs["adaptive_kl"].estimate(kl_i, new=new, ref=ref, clamped_log_ratio=ref - new, mask=mask)\n'
            + _ADAPT,
            "the configured estimator (this Unsloth's k3 is unclamped, with no bias correction), the pipeline's per-token steps",
        ),
        _ADD, _FINISH_BEFORE_2026_10, _FORWARD, _gate(" " * 12), _TRAINER_KL,
    ),
)  # fmt: skip
PLAN = Plan(backend="unsloth", anchor_sets=(UNSLOTH_2026_10, UNSLOTH_2026_9, UNSLOTH_2026_8))  # newest first

# kl_monitor's reference forward at β = 0, in the generation of the trainer generated from TRL 1.15's source
# (``_UnslothGRPOTrainer``'s; ``UnslothGRPOTrainer``'s own is Unsloth's rollout wrapper around it). The 2026.8 and
# 2026.9 lines generate theirs from TRL 0.24's, where the TRL backend does not offer kl_monitor either: refused there.
MONITOR_GENERATE = "_UnslothGRPOTrainer._generate_and_score_completions"


MONITOR_PLAN = Plan(
    backend="unsloth (kl_monitor)",
    anchor_sets=(
        AnchorSet(
            "unsloth 2026.10",
            {"unsloth_zoo": ">=2026.10,<2026.11"},
            (
                Rewrite(
                    MONITOR_GENERATE,
                    "unsloth",
                    "            # Compute the per-token log probabilities for the reference model\n            if self.beta != 0.0:\n",
                    "            # Compute the per-token log probabilities for the reference model\n"
                    "            if self._adaptive_kl.runs_reference():\n"
                    "                self._adaptive_kl.before_reference_forward(_unsloth_grpo_autocast_unscored)\n",
                    "kl_monitor: the reference forward also runs at β = 0 (every kl_monitor_every-th generation batch), with the "
                    "loss's precision latch of a β = 0 run",
                ),
                *(reward_placement.explicit_super(MONITOR_GENERATE, "unsloth", line) for line in reward_placement.SUPER_CALLS),
            ),
        ),
    ),
)
