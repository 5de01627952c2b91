"""``kl_placement="reward"``: β·KL subtracted from each completion's reward when the completions are
scored, before the group normalisation of the advantages; the loss then carries no KL term.

Where it hooks (TRL 1.9-1.16, and Unsloth's trainer generated from TRL 1.15's source): the
trainer's ``_generate_and_score_completions``, rewritten by :data:`TRL_PLAN` / :data:`UNSLOTH_PLAN`:

=================================================  ===========================================================
anchor                                             replacement
=================================================  ===========================================================
``else: ref_per_token_logps = None`` (the end of   ``adaptive_kl_penalty = self._adaptive_kl.scoring_penalty``:
the reference log-probs, inside TRL's no-grad      the per-token KL of the current policy against the reference
block)                                             on the sampled tokens, each completion's penalty (local)
``rewards[unscorable_mask] = torch.nan`` (in       ``rewards = self._adaptive_kl.penalized_rewards(...)``: the
``sum_then_normalize``, before the group mean)     penalties gathered across processes, subtracted, logged
``x = super()._prepare_inputs(x)`` (VLM and tool-  ``super(GRPOTrainer, self)`` (Unsloth: ``_UnslothGRPOTrainer``):
image branches; :data:`SUPER_CALLS`)               the copy is compiled outside the class, with no ``__class__`` cell
=================================================  ===========================================================

The policy's log-probs at scoring time are TRL's ``old_per_token_logps`` where TRL computes them
(generation not aligned with the optimizer steps, or vLLM's importance-sampling correction);
otherwise one more no-grad forward of the policy on the generation batch, the same call TRL makes
for them (and for the reference model's). The rewritten function runs only for a trainer whose
``kl_placement`` is "reward"; every other trainer runs the library's own function, unchanged (or kl_monitor's).
With ``kl_monitor`` too, the trainer runs one copy of the source with both features' edits (``_generation.py``);
at β = 0 the monitor's batches then have their KL computed here for the controller and the alarm, and no penalty.

A library whose anchors do not match is not patched for the reward placement: the reason is kept
and a trainer that asks for it is refused with it (:meth:`RewardPlacement.check_placement`); the
loss placement is unaffected. docs/kl-placement.md is the user's page.
"""

from __future__ import annotations

import logging

import torch

from .. import metrics
from ..kl_pipeline import KL_MONITOR, REWARD_PENALTY, scoring_kl
from ..kl_term import REWARD_KL_BOUND, kl_dominated_groups, kl_only_groups
from .._source_patch import AnchorSet, PatchError, Plan, Rewrite, version_of
from . import _generation

TARGET_NAME = "_generate_and_score_completions"
logger = logging.getLogger("unsloth_adaptive_kl")


#: The lines of ``_generate_and_score_completions`` that call zero-argument ``super()`` (its VLM and tool-image
#: branches), each once in TRL 1.8 to 1.16 and in Unsloth 2026.10's copy of TRL 1.15's source.
SUPER_CALLS = (
    "            image_inputs = super()._prepare_inputs(image_inputs)\n",
    "            prompt_inputs = super()._prepare_inputs(prompt_inputs)\n",
)


def explicit_super(target: str, library: str, line: str) -> Rewrite:
    """``line`` of ``target`` (``"Owner.method"``) with ``super()`` made ``super(Owner, self)``: a function compiled
    from rewritten source outside its class body has no ``__class__`` cell, so zero-argument ``super()`` would raise
    RuntimeError when the branch runs. ``Owner`` is a global of the library's module (the class itself)."""
    owner = target.rsplit(".", 1)[0]
    return Rewrite(
        target,
        library,
        line,
        line.replace("super()", f"super({owner}, self)"),
        "a function compiled from its source outside its class has no __class__ cell: zero-argument super() would fail",
    )


#: Unsloth scores the old and reference log-probs of a left-padded batch on its left-packed layout: each row's
#: leading pads moved to its end, the last ``logits_to_keep + max_left_pad`` columns kept. The rewrite hands the
#: pads over so that the penalty reads each completion's own columns (``completion_columns``).
_LEFT_PAD = {
    "trl": "",
    "unsloth": "                left_pad=(left_pad_tokens_per_prompt, max_left_pad, completion_ids, self.processing_class.pad_token_id)\n"
    "                if max_left_pad is not None else None,\n",
}


def _rewrites(target: str, library: str) -> tuple[Rewrite, ...]:
    return (
        *(explicit_super(target, library, line) for line in SUPER_CALLS),
        Rewrite(
            target,
            library,
            "            else:\n                ref_per_token_logps = None\n",
            """            else:
                ref_per_token_logps = None
            adaptive_kl_penalty = self._adaptive_kl.scoring_penalty(
                ref_logps=ref_per_token_logps,
                old_logps=old_per_token_logps,
                mask=completion_mask if tool_mask is None else completion_mask * tool_mask,
                policy_logps=lambda: self._get_per_token_logps_and_entropies(
                    self.model, prompt_completion_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                    num_images=num_images, num_tiles=num_tiles, **forward_kwargs,
                )[0],
                mode=mode,
""" + _LEFT_PAD[library] + """                completion_ids=completion_ids,
            )
""",
            "each completion's KL penalty, from the policy's and the reference's log-probs at scoring time",
        ),
        Rewrite(
            target,
            library,
            "            rewards[unscorable_mask] = torch.nan\n"
            "            mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)\n",
            "            rewards[unscorable_mask] = torch.nan\n"
            "            rewards = self._adaptive_kl.penalized_rewards(\n"
            "                rewards, local_penalty=adaptive_kl_penalty, mode=mode, num_generations=num_generations\n"
            "            )\n"
            "            mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)\n",
            "the penalty is subtracted before the group mean and std make the advantages",
        ),
    )


TRL_PLAN = Plan(
    backend="trl (kl_placement='reward')",
    anchor_sets=(AnchorSet("trl 1.9", {"trl": ">=1.9,<1.17"}, _rewrites(f"GRPOTrainer.{TARGET_NAME}", "trl")),),
)
#: Unsloth 2026.10 generates its trainer from TRL 1.15's source: the generated function is
#: ``_UnslothGRPOTrainer``'s (``UnslothGRPOTrainer``'s own is Unsloth's rollout wrapper around it). The
#: 2026.8/2026.9 lines (TRL 0.24's source) have no ``unscorable_mask`` and are not covered: a trainer
#: asking for "reward" is refused there.
UNSLOTH_PLAN = Plan(
    backend="unsloth (kl_placement='reward')",
    anchor_sets=(
        AnchorSet("unsloth 2026.10", {"unsloth_zoo": ">=2026.10,<2026.11"}, _rewrites(f"_UnslothGRPOTrainer.{TARGET_NAME}", "unsloth")),
    ),
)

#: Trainer class -> why the reward placement cannot be applied to it (its anchors or locals did not match).
_UNAVAILABLE: dict[type, str] = {}


#: The name of the reward placement as a feature that rewrites the generation (``_generation.Feature``).
FEATURE_NAME = REWARD_PENALTY
#: Trainer class -> why kl_monitor cannot be applied together with the reward placement (both available alone).
_UNAVAILABLE_WITH_MONITOR: dict[type, str] = {}


def _check_penalized(trainer, runtime) -> None:
    if not runtime.reward_placement.rewards_penalized:  # the sum_then_normalize branch did not run: the penalty was not applied
        raise PatchError(
            f"kl_placement='reward': {type(trainer).__qualname__}._generate_and_score_completions did not reach the "
            "rewards' group normalisation (multi_objective_aggregation='sum_then_normalize'); the KL penalty was not applied"
        )


def _start_scoring(runtime) -> None:
    runtime.reward_placement.rewards_penalized = False


def feature(plan: Plan) -> _generation.Feature:
    """The reward placement as a feature of the generation (``plan``: :data:`TRL_PLAN` or :data:`UNSLOTH_PLAN`): on for a
    trainer with ``kl_placement="reward"``, and a call that did not reach the penalised rewards is refused."""
    return _generation.Feature(FEATURE_NAME, plan, enabled=lambda runtime: REWARD_PENALTY in runtime.generation_edits, before=_start_scoring, after=_check_penalized)


def install(trainer_cls, plan: Plan, owners, wrap=None, *, also: tuple[_generation.Feature, ...] = ()) -> dict:
    """Give ``trainer_cls`` the reward placement: its ``_generate_and_score_completions`` runs, for a trainer with
    ``kl_placement="reward"``, the library's source with the edits of ``plan`` and those of the other features of
    ``also`` that the trainer enables (kl_monitor's), composed onto one copy (``_generation.install``; ``also``'s first).
    Where ``plan`` cannot be built for the installed version the reason is kept for
    :meth:`RewardPlacement.check_placement` (and nothing is set where no feature can be applied). ``wrap`` (optional)
    wraps each rewritten function as the library wraps its own (Unsloth's rollout wrapper). Call it before the trainer
    wrappers of ``_trainer.patch_trainer_class`` wrap the method. Returns ``_generation.install``'s reasons."""
    target = next(iter(plan.anchor_sets[0].targets()))
    reasons = _generation.install(trainer_cls, TARGET_NAME, target, (*also, feature(plan)), owners, wrap)
    _keep(_UNAVAILABLE, trainer_cls, reasons.get(frozenset({FEATURE_NAME})))
    for other in also:  # a combination of two features each available alone that cannot be composed
        alone = [reasons.get(frozenset({name})) for name in (other.name, FEATURE_NAME)]
        _keep(_UNAVAILABLE_WITH_MONITOR, trainer_cls, None if any(alone) else reasons.get(frozenset({other.name, FEATURE_NAME})))
    return reasons


def _keep(store: dict, trainer_cls, reason: str | None) -> None:
    if reason is None:
        store.pop(trainer_cls, None)
    else:
        store[trainer_cls] = reason


def unavailable_reason(trainer_cls, store: dict | None = None) -> str | None:
    """Why ``kl_placement="reward"`` cannot be applied to ``trainer_cls`` (None: it can); with ``store``
    :data:`_UNAVAILABLE_WITH_MONITOR`, why it cannot be applied together with kl_monitor."""
    store = _UNAVAILABLE if store is None else store
    for cls in trainer_cls.__mro__:
        if cls in store:
            return store[cls]
    return None


def completions_per_update(args, num_processes: int, num_iterations: int) -> int:
    """Under ``kl_placement="reward"``: the most completions one controller update sees, those of every
    generation batch scored within one optimizer step (one batch when generation is less frequent)."""
    generation_batch = args.per_device_train_batch_size * args.steps_per_generation * num_processes
    generate_every = args.steps_per_generation * num_iterations  # in micro-steps, as TRL counts
    return generation_batch * max(1, -(-args.gradient_accumulation_steps // generate_every))


def completion_columns(logps: torch.Tensor, left_pads: torch.Tensor, max_left_pad: int, completion_ids: torch.Tensor,
                       pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's log-probs, ``(B, L)`` as ``completion_ids``, from Unsloth's left-packed layout, and which
    tokens it scored. Unsloth moves every pad token of a row to its end (unsloth_zoo's ``left_pack_padding``) and
    keeps the last ``L + max_left_pad`` columns: a row's ``p`` prompt pads put its completion at column
    ``max_left_pad - p``, and a pad token sampled inside the completion is taken out (its later tokens move one
    column left; Unsloth's loss skips it). Returned: the log-probs on TRL's layout (0 at a pad token) and the mask
    of the non-pad tokens."""
    width = completion_ids.shape[1]
    if logps.shape[1] != width + max_left_pad:
        raise PatchError(
            f"unsloth_zoo {version_of('unsloth_zoo')}: left-packed log-probs have {logps.shape[1]} columns, expected the "
            f"completion's {width} plus the longest left padding {max_left_pad}; kl_placement='reward' cannot align them"
        )
    kept = completion_ids != pad_id
    start = (max_left_pad - left_pads.to(device=logps.device, dtype=torch.long)).view(-1, 1)
    column = (start + kept.long().cumsum(1) - 1).clamp(min=0, max=logps.shape[1] - 1)
    return torch.where(kept, logps.gather(1, column), 0.0), kept


class RewardPlacement:
    """The reward placement of one trainer: a component its runtime (``backends/_runtime.TrainerAdaptiveKL``) has and
    hands the rewritten ``_generate_and_score_completions``'s calls to (``scoring_penalty``, ``penalized_rewards``).
    It reads the runtime's KL term, plan and β, and feeds its controller the scoring-time sums."""

    def __init__(self, runtime):
        self.runtime = runtime
        #: Whether the last scoring reached the rewards' group normalisation (the penalty was applied).
        self.rewards_penalized = False
        self.warned: set[str] = set()  # what :meth:`warn_once` has warned of

    @property
    def trainer(self):
        return self.runtime.trainer

    def check_placement(self) -> None:
        """Refuse, when the trainer is created, a reward placement this trainer cannot apply."""
        edits = self.runtime.generation_edits
        if REWARD_PENALTY not in edits:
            return
        trainer, cls = self.trainer, type(self.trainer)
        reason = unavailable_reason(cls)
        if reason is not None:
            raise PatchError(f"kl_placement='reward' cannot be applied to {cls.__module__}.{cls.__qualname__}: {reason}")
        reason = unavailable_reason(cls, _UNAVAILABLE_WITH_MONITOR) if KL_MONITOR in edits else None
        if reason is not None:
            raise PatchError(f"kl_monitor=True with kl_placement='reward' cannot be applied to {cls.__module__}.{cls.__qualname__}: {reason}")
        aggregation = getattr(trainer, "multi_objective_aggregation", "sum_then_normalize")
        if aggregation != "sum_then_normalize":
            raise ValueError(
                f"kl_placement='reward' is not valid with multi_objective_aggregation={aggregation!r}: that normalises each "
                "reward function's reward before summing them, so a penalty on the raw reward has no place there; allowed: "
                "multi_objective_aggregation='sum_then_normalize', or kl_placement='loss'"
            )
        module = getattr(trainer, "_adaptive_loss_module", None)
        if module is not None and getattr(module, "adaptive_kl", None) is not self.runtime:
            raise ValueError(
                f"kl_placement='reward' is not valid with loss_class={type(module).__name__}: that module adds β·KL to its "
                "loss from a β of its own; allowed: loss_class=AdaptiveFusedLinearGRPOLoss (or a subclass), which shares "
                "the trainer's placement, or kl_placement='loss'"
            )
        num_iterations = getattr(trainer, "num_iterations", 1)
        self.runtime.check_step_size(completions_per_update(trainer.args, trainer.accelerator.num_processes, num_iterations))

    def scoring_penalty(self, ref_logps, old_logps, mask, policy_logps, mode: str, left_pad=None, *, completion_ids=None) -> torch.Tensor | None:
        """Each local completion's penalty, ``(B,)`` float64; None while β is 0 (the rewards are left as they are).
        At β = 0 under ``kl_monitor``, on a batch it watches (``ref_logps`` given), the KL is computed as at β > 0 and
        its sums reach the controller and the runaway alarm, but no penalty is returned: β·KL is 0.

        ``old_logps``: TRL's ``old_per_token_logps`` (the policy at scoring time) or None, then
        ``policy_logps()`` computes them. In training the generation batch's KL sums go to the β
        controller (but not those of a batch TRL regenerated on resume: the uninterrupted run saw
        the original's before the checkpoint). ``left_pad``: Unsloth's ``(left pads per row, their
        maximum)`` when its log-probs are on its left-packed layout (see ``completion_columns``). ``completion_ids``:
        the sampled tokens, ``(B, L)`` as ``mask``, which the pipeline's first step reads (``kl_pipeline.kl_positions``,
        as in the loss: the positions it leaves out get no penalty and are not counted in the controller's sums)."""
        observed = mode == "train" and not getattr(self.trainer, "_adaptive_kl_regenerated_batch", False)
        # at β = 0 only a batch kl_monitor watches computes the KL, and only for the controller's sums
        plan = self.runtime.plan(ref_logps if observed else None)
        if ref_logps is None or not plan.computes_kl:
            return None
        logps = old_logps if old_logps is not None else policy_logps()
        if left_pad is not None:
            pads, max_left_pad, completion_ids, pad_id = left_pad
            (logps, kept), (ref_logps, _) = (completion_columns(x, pads, max_left_pad, completion_ids, pad_id) for x in (logps, ref_logps))
            mask = mask * kept.to(mask.dtype)  # a sampled pad token: Unsloth scores it as padding, its loss skips it
        if logps.shape != mask.shape or ref_logps.shape != mask.shape:
            raise PatchError(
                f"{self.libraries()}: at scoring time the policy's log-probs "
                f"have shape {tuple(logps.shape)} and the reference's {tuple(ref_logps.shape)}, the completion mask "
                f"{tuple(mask.shape)}; kl_placement='reward' cannot match them"
            )
        token_ids = None if completion_ids is None else completion_ids.to(mask.device)
        scored = scoring_kl(self.runtime.term, plan, logps, ref_logps, mask, token_ids, observed=observed)
        if scored.sums is not None:
            self.runtime.observe_scoring_sums(scored.sums)
        if scored.penalty is not None:
            self.warn_clamped_tokens(scored.adapted, scored.kl_mask)
        return scored.penalty

    def warn_clamped_tokens(self, adapted: torch.Tensor, mask: torch.Tensor) -> None:
        """Say once that :data:`~unsloth_adaptive_kl.kl_term.REWARD_KL_BOUND` clamped a token's KL in a penalty."""
        if getattr(self, "_warned_clamp", False):
            return
        finite = torch.isfinite(adapted) & mask.bool()
        over = finite & (adapted.abs() > REWARD_KL_BOUND)
        if over.any():
            self._warned_clamp = True
            logger.warning(
                "unsloth_adaptive_kl: kl_placement='reward': %d token(s) of this generation batch had a KL beyond "
                "+-%s (largest %.4g); each is clamped to +-%s in its completion's penalty, so that one token cannot "
                "outweigh the task's reward (docs/kl-placement.md, 'How large a penalty can be'; this warning is shown once)",
                int(over.sum()), REWARD_KL_BOUND, adapted[over].abs().max().item(), REWARD_KL_BOUND,
            )

    def libraries(self) -> str:
        """The versions a shape mismatch at scoring time is to be read against."""
        unsloth = "unsloth" in type(self.trainer).__module__.lower() or "unsloth" in type(self.trainer).__name__.lower()
        return f"trl {version_of('trl')}" + (f", unsloth_zoo {version_of('unsloth_zoo')}" if unsloth else "")

    def penalized_rewards(self, rewards: torch.Tensor, local_penalty: torch.Tensor | None, mode: str,
                          num_generations: int | None = None) -> torch.Tensor:
        """``rewards`` (all processes' completions, gathered) less every completion's penalty; logs
        ``adaptive_kl/kl_penalty``, the mean penalty over the completions that have a reward and a finite penalty.

        A NaN or inf penalty (a NaN or inf log-prob) makes its completion unscored (NaN reward: TRL gives it
        advantage 0, as a completion no reward function scored), counted in ``adaptive_kl/nonfinite_penalties`` and
        warned about once. With ``num_generations`` (the group size), a group whose penalties spread wider than its
        task rewards (:func:`kl_dominated_groups`) is counted in ``adaptive_kl/kl_dominated_groups`` and warned about
        once: there the KL, not the task, orders the completions' advantages."""
        self.rewards_penalized = True
        if local_penalty is None:
            return rewards
        penalty = self.trainer.accelerator.gather(local_penalty)  # process order, as TRL gathers the rewards
        if penalty.shape != rewards.shape:
            raise PatchError(
                f"trl {version_of('trl')}: the gathered KL penalties have shape {tuple(penalty.shape)} but the rewards "
                f"{tuple(rewards.shape)}; kl_placement='reward' cannot match them"
            )
        scored = ~torch.isnan(rewards)  # an unscorable completion (NaN reward) gets advantage 0 anyway
        nonfinite = scored & ~torch.isfinite(penalty)
        subtracted = penalty[scored & ~nonfinite]
        values = {metrics.NONFINITE_PENALTIES: float(nonfinite.sum().item())}
        if subtracted.numel():
            values[metrics.KL_PENALTY] = subtracted.mean().item()
        if values[metrics.NONFINITE_PENALTIES]:
            self.warn_nonfinite_penalties(int(values[metrics.NONFINITE_PENALTIES]), rewards.numel())
        if num_generations:
            dominated, worst = kl_dominated_groups(rewards, penalty, num_generations)
            values[metrics.KL_DOMINATED_GROUPS] = float(dominated)
            if dominated:
                self.warn_kl_dominated(dominated, rewards.numel() // num_generations, worst)
            values[metrics.KL_ONLY_GROUPS] = float(kl_only_groups(rewards, penalty, num_generations))
            if values[metrics.KL_ONLY_GROUPS]:
                self.warn_kl_only(int(values[metrics.KL_ONLY_GROUPS]), rewards.numel() // num_generations)
        self.runtime.log_metrics(values, mode)
        penalized = rewards.double() - penalty
        return torch.where(nonfinite, torch.nan, penalized).to(rewards.dtype)

    def warn_once(self, what: str, message: str, *args) -> None:
        """Log ``message % args`` as a warning the first time ``what`` happens to this trainer; nothing after."""
        if what not in self.warned:
            self.warned.add(what)
            logger.warning(message, *args)

    def warn_nonfinite_penalties(self, count: int, total: int) -> None:
        self.warn_once(
            "nonfinite penalties",
            "unsloth_adaptive_kl: kl_placement='reward': %d of %d completions had a NaN or inf KL penalty (a NaN or inf "
            "log-prob of the policy or the reference): each is treated as unscored (NaN reward, advantage 0), left out "
            "of %s and counted in %s (this warning is shown once)",
            count, total, metrics.KL_PENALTY, metrics.NONFINITE_PENALTIES,
        )

    def warn_kl_only(self, groups: int, total: int) -> None:
        self.warn_once(
            "kl-only groups",
            "unsloth_adaptive_kl: kl_placement='reward': in %d of %d groups every completion had the same task reward and "
            "the KL penalties differed: stock GRPO gives such a group advantage 0, here the KL alone sets its advantages "
            "(with TRL's default scale_rewards='group', at the task's usual size whatever beta). They are counted in %s; "
            "TRL's frac_reward_zero_std, computed on the penalised rewards, no longer counts them (docs/kl-placement.md, "
            "'Groups of equal rewards'; this warning is shown once)", groups, total, metrics.KL_ONLY_GROUPS,
        )

    def warn_kl_dominated(self, groups: int, total: int, worst: tuple[float, float]) -> None:
        penalty_spread, reward_spread = worst
        self.warn_once(
            "kl-dominated groups",
            "unsloth_adaptive_kl: kl_placement='reward': in %d of %d groups the KL penalties spread wider than the task "
            "rewards (in one: penalties over %.4g, rewards over %.4g), so there the KL, not the task, orders the "
            "completions' advantages. Consider a smaller beta, length_normalized, or a clip of the per-token KL; such "
            "groups are counted in %s (docs/kl-placement.md, 'How large a penalty can be'; this warning is shown once)",
            groups, total, penalty_spread, reward_spread, metrics.KL_DOMINATED_GROUPS,
        )


__all__ = ["TRL_PLAN", "UNSLOTH_PLAN", "RewardPlacement", "completion_columns", "completions_per_update", "install", "unavailable_reason"]
