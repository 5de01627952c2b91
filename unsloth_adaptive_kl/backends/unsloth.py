"""Unsloth backend: adaptive KL inside the fused, chunked, ``torch.compile``d GRPO loss.

``import unsloth`` generates a module, ``UnslothGRPOTrainer``, from TRL's source and rebinds
``trl.GRPOTrainer``/``trl.GRPOConfig`` to its classes. Its loss runs
``compute_loss -> grpo_accumulated_loss -> UnslothEfficientGRPO -> grpo_compute_loss``, the last
two inside a ``torch.compile(fullgraph=True)`` region. :data:`PLAN` rewrites them; see
the table at the top of ``backends/unsloth_plan.py`` (the plan and its rewrite strings).

``adaptive_kl`` is ``kwargs["adaptive_kl"]``, one :class:`FusedKLInputs` (the KL term, β, the
batch's completion count and the estimator's batch statistic). The ``beta`` argument Unsloth
threads through its compiled loss stays a Python constant: 1.0 while β != 0 and 0.0 once β is 0
(it selects Unsloth's ``if beta != 0.0`` branches). β itself is the tensor, so a changing β never
recompiles the fused loss (a float would: 6.7x slower steps, measured); a tensor in those branches
would break ``fullgraph=True``. Under ``kl_monitor`` the gate stays 1.0 at β = 0 on the batches it watches (the KL
is computed, so β reaching 0 compiles nothing new; the batches ``kl_monitor_every`` skips take the gate 0.0, Unsloth's
own β = 0 graph, compiled once) and a 0-dim flag keeps the KL out of the loss and its gradient
(:meth:`FusedKLInputs.kl_inputs`, :meth:`FusedKLInputs.in_loss`); :data:`MONITOR_PLAN` runs the reference forward
at β = 0 in the generation (2026.10 only: the older lines refuse kl_monitor), composed with the reward placement's
edits for a trainer with both (``_generation.py``). The ``mean_kl`` slot
carries ``[unsloth_kl, local sums...]``: it is the only output of Unsloth's autograd function a
statistic can leave through.

It also grafts the config fields onto ``UnslothGRPOConfig`` (so no field is printed as
"IGNORED") and gives the trainer the wrappers of ``_trainer.py``. Import order does not matter:
the generated module is patched when this package is imported after it, else as soon as Unsloth
generates it (``unsloth_hooks.watch_generation``), so also a config created before ``import unsloth`` works.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch

from .. import metrics, tail
from .._source_patch import PatchError, check_version, set_attribute, split_target, version_of
from ..config import FIELD_NAMES
from ..kl_pipeline import KL_MONITOR, adapted_in_graph, after_aggregation_term, is_after_aggregation, kl_positions
from ..kl_term import KLTerm
from ..versions import SUPPORTED
from . import _config_class, _generation, _runtime, _trainer
from . import reward_placement
from .unsloth_hooks import forget_accepted_config_arguments
from .unsloth_plan import GENERATED_MODULE, MONITOR_GENERATE, MONITOR_PLAN, PLAN, STATS_SIZE  # noqa: F401  (names of this backend)

#: Trainer class -> why kl_monitor cannot be applied to it (MONITOR_PLAN does not match its generation).
_MONITOR_UNAVAILABLE: dict[type, str] = {}
#: kl_monitor as a feature of the generation (``_generation.Feature``), composed with the reward placement's.
MONITOR = _generation.Feature(KL_MONITOR, MONITOR_PLAN, enabled=lambda runtime: KL_MONITOR in runtime.generation_edits)


class FusedKLInputs(NamedTuple):
    """``kwargs["adaptive_kl"]`` of the fused loss: what its rewritten lines read."""

    term: KLTerm
    beta: torch.Tensor | None  # 0-dim; None while β is 0
    num_completions: torch.Tensor | None  # 0-dim; completions in the whole batch (chunks see a slice)
    statistic: torch.Tensor | None  # the estimator's batch statistic (bottom_q's threshold)
    tail_edges: torch.Tensor | None = None  # tail.edges_on(device): the tail histogram's edges, an input of the graph
    kl_enters_loss: torch.Tensor | None = None  # kl_monitor only: 0-dim bool, False while β is 0 (the KL is then only logged)

    def kl_inputs(self, new, coef_1):
        """What Unsloth's KL reads of the policy: ``new`` and ``coef_1`` as they are, or under kl_monitor each
        detached while β is 0. A ``where`` on a tensor flag, not a Python branch, so β reaching 0 compiles no new
        graph; it selects (never multiplies) the gradient, so the KL's is exactly 0 even where the KL is not finite."""
        if self.kl_enters_loss is None:
            return new, coef_1
        return torch.where(self.kl_enters_loss, new, new.detach()), torch.where(self.kl_enters_loss, coef_1, coef_1.detach())

    def in_loss(self, term):
        """A KL term as it enters the loss: ``term``, or under kl_monitor 0 while β is 0 (exactly: a select)."""
        return term if self.kl_enters_loss is None else torch.where(self.kl_enters_loss, term, 0.0)

    def per_token(self) -> bool:
        """Whether the KL term enters the per-token loss (else :meth:`finish` adds it after aggregation): the KL
        pipeline's decision, a constant of the term (the compiled loss guards on it once)."""
        return not is_after_aggregation(self.term)

    def adapt(self, kl, token_ids):
        """``(raw, adapted)``: the KL pipeline's per-token steps after Unsloth's own clamps (``kl_pipeline.adapted_in_graph``).
        ``token_ids``: the loss's ``input_ids``, the completion tokens aligned with its mask (``(B, T, 1)`` there)."""
        return adapted_in_graph(self.term, kl, token_ids)

    def loss_term(self, adapted):
        """β times the adapted per-token KL, as it enters Unsloth's per-token loss."""
        return self.in_loss(self.beta * adapted)

    def estimate(self, unsloth_k3, new, ref, clamped_log_ratio, mask):
        """``(kl, faults)``: Unsloth's own (clamped) k3, or the configured estimator on the same clamped log-ratio;
        and, for a user estimator, where it was NaN or inf on finite inputs (else None). It runs unchecked here (no
        host read inside the compiled loss): :meth:`finish` counts those tokens in the metric sums, whose read
        refuses the estimator by name (:meth:`AdaptiveKL.refuse_user_faults`)."""
        if self.term.estimator == "k3":
            return unsloth_k3, None
        # ref itself where the clamp is inactive: new + (ref - new) is not always ref in float32, and
        # bottom_q compares ref with its threshold (a value of ref), so the threshold token could drop out.
        clamped_ref = torch.where(clamped_log_ratio == ref - new, ref, new + clamped_log_ratio)
        kl = self.term.estimate(new, clamped_ref, mask, self.statistic, check=False)
        return kl, self.term.estimator_faults(kl, new, clamped_ref)

    def finish(self, loss, unsloth_mean_kl, raw, adapted, mask, rs_keep, accumulation, token_ids=None, estimator_faults=None):
        """Add the length-normalised term; return the loss and ``[unsloth_kl, local sums...]`` (the metric
        sums over the positions the pipeline gives the KL term). ``estimator_faults``: :meth:`estimate`'s (counted there)."""
        if adapted is None:  # β is 0: no KL was computed
            sums = torch.zeros(STATS_SIZE - 1, dtype=torch.float64, device=mask.device)
        else:
            if rs_keep is not None:  # tokens Unsloth's rollout rejection drops leave the KL too
                adapted = torch.where(rs_keep, adapted, 0.0)
            # the positions the KL term applies to (token_ids: the loss's input_ids, None from a direct caller)
            kl_tokens = kl_positions(self.term, mask, None if token_ids is None else token_ids.reshape(mask.shape))
            after = after_aggregation_term(self.term, adapted, kl_tokens, beta=self.beta, num_completions=self.num_completions, accumulation=accumulation)
            if after is not None:
                loss = loss + self.in_loss(after)
            # One chunk (the rewritten call passes n_chunks=1): the chunk's max and min are the micro-batch's.
            sums = metrics.local_metric_sums(
                raw, adapted, kl_tokens, self.tail_edges, count_shaping_faults=bool(self.term.user_shaping_steps),
                estimator_faults=estimator_faults,
            )  # fmt: skip
        return loss, torch.cat([unsloth_mean_kl.reshape(1).to(torch.float64), sums])


class UnslothAdaptiveKL(_runtime.TrainerAdaptiveKL):
    """The trainer-side state for Unsloth's generated trainer."""

    stock_when_unattached = False  # its loss is rewritten in place: method none is stock Unsloth
    fused_computes_kl = False  # whether the last micro-batch's fused loss computed the KL (fused_beta_gate sets it)

    def __init__(self, trainer):
        super().__init__(trainer)
        if KL_MONITOR in self.generation_edits:
            self.check_monitor()

    def check_monitor(self) -> None:
        """kl_monitor: refuse it where this Unsloth's generation was not rewritten for it (its reason), and check
        that the generated ``__init__``, shown β = 1.0 (``building``), made the reference."""
        trainer, cls = self.trainer, type(self.trainer)
        versions = f"unsloth {version_of('unsloth')}, unsloth_zoo {version_of('unsloth_zoo')}"
        reason = next((_MONITOR_UNAVAILABLE[c] for c in cls.__mro__ if c in _MONITOR_UNAVAILABLE), None)
        if reason is not None:
            raise ValueError(
                f"kl_monitor=True is not valid with Unsloth's generated trainer {cls.__qualname__} ({versions}): its "
                f"reference forward at beta = 0 could not be patched ({reason}); allowed: kl_monitor=False, or unsloth "
                "2026.10 (the line generated from TRL 1.15, where it is patched)"
            )
        model = trainer.accelerator.unwrap_model(trainer.model)
        if getattr(trainer, "ref_model", None) is None and not hasattr(model, "peft_config"):
            raise PatchError(
                f"{versions}: kl_monitor=True, but {cls.__qualname__}.__init__ made no reference model although it was "
                "shown beta = 1.0 (and the model has no adapter to disable); the KL cannot be watched at beta = 0"
            )

    def before_reference_forward(self, unscored_precision_latch) -> None:
        """Called by the rewritten generation before the reference forward, which at β = 0 only kl_monitor runs.

        Then two of Unsloth's decisions must stay those of its β = 0 run, whose loss kl_monitor keeps exactly:
        the precision its loss latches when no scoring forward ran (``unscored_precision_latch``, Unsloth's
        ``_unsloth_grpo_autocast_unscored``: the reference forward would latch the scoring one first, float16
        autocast on a forced-float32 model), and the top_k / top_p kept set its vLLM scoring may use. Unsloth
        drops that set when a reference model is scored (another model's set is not the sampler's); at β = 0 it
        keeps it, so the reference would be scored over its own set: refused."""
        trainer = self.trainer
        if float(trainer.beta) != 0.0:
            return
        try:
            from unsloth_zoo.rl_replacements import grpo_truncated_support_kwargs
        except ImportError:  # no kept-set scoring in this unsloth_zoo (Unsloth reads its absence as none too)
            grpo_truncated_support_kwargs = None
        if (
            grpo_truncated_support_kwargs is not None
            and grpo_truncated_support_kwargs(trainer)
            and not getattr(trainer, "_unsloth_truncated_support_refused", False)
        ):
            raise ValueError(
                "kl_monitor=True at beta = 0 is not valid with Unsloth's kept-set scoring of vLLM rollouts "
                "(UNSLOTH_GRPO_TRUNCATED_SUPPORT=1, or its automatic choice for truncated rollouts): the reference model "
                "would be scored over its own top_k / top_p / min_p kept set, a distribution that is not normalised, and "
                "Unsloth's scoring at beta = 0 cannot change without changing the loss; allowed: kl_monitor=False, "
                "UNSLOTH_GRPO_TRUNCATED_SUPPORT=0, or beta > 0"
            )
        unscored_precision_latch(trainer)

    def describe(self) -> str:
        cls = type(self.trainer)
        return f"backend: Unsloth fused loss ({cls.__module__}.{cls.__qualname__}, grpo_compute_loss)"

    def fused_beta_gate(self, kwargs: dict, ref_logps, completion_mask) -> float:
        """Put this step's :class:`FusedKLInputs` in the loss kwargs; return the constant gate the
        compiled loss sees as its ``beta`` (1.0 while β != 0, else 0.0; module docstring)."""
        # At β = 0 the KL is computed only for a batch kl_monitor watched (the generation checks that it has reference
        # log-probs): the others take Unsloth's own β = 0 loss, gate 0.0 (a second graph, compiled once).
        plan = self.plan(ref_logps)
        self.fused_computes_kl = plan.computes_kl
        if not plan.computes_kl:
            kwargs["adaptive_kl"] = FusedKLInputs(self.term, None, None, None)
            return 0.0
        if plan.with_grad and not plan.per_token and kwargs.get("sample_weight") is not None:
            raise ValueError(
                "kl_adaptation_method with length_normalized cannot be combined with Unsloth's per-completion "
                "sample weights (sample_weight): both replace the loss normaliser"
            )
        device = completion_mask.device
        tail_edges = tail.edges_on(device)
        torch._dynamo.mark_static(tail_edges)  # under dynamic=True its length could share a sequence length's symbol
        kwargs["adaptive_kl"] = FusedKLInputs(
            term=self.term,
            # kl_placement='reward': the KL is still computed (for the metrics) but weighs 0 in the loss
            beta=torch.tensor(plan.loss_beta, dtype=torch.float32, device=device),
            num_completions=torch.tensor(float(completion_mask.shape[0]), dtype=torch.float32, device=device),
            statistic=None if ref_logps is None else self.batch_statistic(ref_logps, completion_mask),
            tail_edges=tail_edges,
            # kl_monitor: a flag the graph reads, so β reaching 0 recompiles nothing (the gate stays 1.0)
            kl_enters_loss=torch.tensor(plan.with_grad, device=device) if plan.grad_switch else None,
        )
        return 1.0

    def record_fused(self, stats, mode: str) -> float:
        """Log the adaptive_kl metrics from the fused loss's statistics (``STATS_SIZE``); return Unsloth's own kl."""
        if not torch.is_tensor(stats) or stats.shape != (STATS_SIZE,):
            raise PatchError(
                f"unsloth {version_of('unsloth')} / unsloth_zoo {version_of('unsloth_zoo')}: the GRPO loss returned "
                f"no adaptive-KL statistics (got {getattr(stats, 'shape', stats)}); this loss path is not patched"
            )
        beta = float(self.trainer.beta)
        observed = stats[1:] if self.fused_computes_kl else None  # at β = 0 only kl_monitor's batches compute the KL
        self.log_metrics(self.record_sums(observed, training=mode == "train", beta=beta), mode)
        return stats[0].item()


# -- patching ---------------------------------------------------------------------------------------------
_patched_module = None


def generate_trainer_module():
    """Unsloth's generated GRPO module, generating it through Unsloth's (private) entry point where
    ``import unsloth`` did not (no GPU): for doctor and tests. The one caller of that entry point."""
    import unsloth  # noqa: F401  (generates the RL trainers on a GPU machine)

    if GENERATED_MODULE not in sys.modules:
        from unsloth.models.rl import _patch_trl_rl_trainers

        _patch_trl_rl_trainers("grpo_trainer")
    return sys.modules.get(GENERATED_MODULE)


def owners(module) -> dict[str, object]:
    """The owners of :data:`PLAN`'s targets in a generated module (``""``: the module itself)."""
    return {"": module, "UnslothEfficientGRPO": module.UnslothEfficientGRPO, "UnslothGRPOTrainer": module.UnslothGRPOTrainer}


def forget() -> None:
    """Called by unpatch(), after the ledger restored the attributes themselves."""
    global _patched_module
    _patched_module = None
    forget_accepted_config_arguments()


def maybe_patch() -> None:
    """Patch Unsloth's generated GRPO module if it exists and is not patched yet."""
    from .._source_patch import is_patched

    module = sys.modules.get(GENERATED_MODULE)
    if module is None or module is _patched_module or not is_patched():
        return
    patch_generated_module(module)


def _graft_config_fields(config_cls, pristine_cls) -> None:
    ours = {name: pristine_cls.__dataclass_fields__[name] for name in FIELD_NAMES}
    set_attribute(config_cls, "__dataclass_fields__", {**config_cls.__dataclass_fields__, **ours})
    annotations = dict(config_cls.__dict__.get("__annotations__", {}))
    annotations.update({name: field.type for name, field in ours.items()})
    set_attribute(config_cls, "__annotations__", annotations)
    forget_accepted_config_arguments()


def check_versions() -> None:
    """Refuse an untested unsloth or unsloth_zoo (each against its own range in versions.py)."""
    for distribution in ("unsloth", "unsloth_zoo"):
        supported = SUPPORTED[distribution]
        check_version(distribution, supported.contains, supported.label)


def _rollout_wrapper(trainer_cls):
    """Unsloth wraps the generated ``_generate_and_score_completions`` (optimizer parking during rollouts, the
    inference-mode restore): the function that wraps the reward placement's rewritten one the same way,
    with Unsloth's own wrapper (None where Unsloth did not wrap it)."""
    own = trainer_cls.__dict__.get(reward_placement.TARGET_NAME)
    if not getattr(own, "_unsloth_restore_training_wrapped", False):
        return None
    from unsloth.models import rl

    def wrap(function):
        holder = type("RolloutHolder", (), {reward_placement.TARGET_NAME: function})
        rl._wrap_grpo_generate_and_score(holder)
        return holder.__dict__[reward_placement.TARGET_NAME]

    return wrap


def patch_generated_module(module) -> None:
    global _patched_module
    check_versions()
    targets = owners(module)
    # All rewrites share one namespace, so they call each other's new versions; build them all
    # before changing anything, so a missing anchor leaves Unsloth untouched.
    built = PLAN.build(targets, namespace=dict(module.__dict__))
    trainer_cls, config_cls = module.UnslothGRPOTrainer, module.UnslothGRPOConfig
    pristine_config = config_cls.__mro__[1]
    _config_class.patch_config_class(pristine_config, after_post_init=maybe_patch)
    _graft_config_fields(config_cls, pristine_config)
    for target, function in built.items():
        owner, name = split_target(target)
        set_attribute(targets[owner], name, function)
    # kl_monitor's reference forward and the reward placement's penalty, composed onto one copy of the generated
    # source per combination, each wrapped as Unsloth wraps its own; before the wrappers below wrap it
    reasons = reward_placement.install(
        trainer_cls, reward_placement.UNSLOTH_PLAN, {"_UnslothGRPOTrainer": trainer_cls.__mro__[1]}, wrap=_rollout_wrapper(trainer_cls),
        also=(MONITOR,),
    )  # fmt: skip
    monitor_reason = reasons.get(frozenset({MONITOR.name}))
    if monitor_reason is None:
        _MONITOR_UNAVAILABLE.pop(trainer_cls, None)
    else:
        _MONITOR_UNAVAILABLE[trainer_cls] = monitor_reason
    _trainer.patch_trainer_class(trainer_cls, UnslothAdaptiveKL, loss_path=("compute_loss",))
    _patched_module = module
