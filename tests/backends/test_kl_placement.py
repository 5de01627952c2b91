"""kl_placement: "loss" is TRL's behaviour bit for bit; "reward" lowers each completion's reward by β times
its summed (shaped) KL before the group normalisation, against a float64 reference written from the
definitions, and the loss then carries no KL term. Also: the controllers act on the scoring-time KL,
the metric, the refusals, resume, and GRPOTrainer(loss_class=...)."""

import dataclasses
import inspect
import json
import math

import pytest
import torch
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

import reference
import unsloth_adaptive_kl
from unsloth_adaptive_kl import metrics
import toy
from unsloth_adaptive_kl._source_patch import PatchError, version_of
from unsloth_adaptive_kl.backends import reward_placement
from unsloth_adaptive_kl.backends import trl as trl_backend
from unsloth_adaptive_kl.backends.liger import AdaptiveFusedLinearGRPOLoss
from unsloth_adaptive_kl.kl_term import KLTerm

MAX_COMPLETION = reference.MAX_COMPLETION
BETA = 0.5  # large, so that the penalty visibly moves the advantages


def length_reward(completions, **kwargs) -> list[float]:
    """A reward with spread within every group (the toy task's rewards are mostly 0)."""
    return [len(c) / 10.0 for c in completions]


def grpo_config(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=8, num_generations=4,
        max_completion_length=MAX_COMPLETION, max_steps=2, logging_steps=1, learning_rate=2e-2, beta=BETA, save_strategy="no",
        seed=0, kl_placement="reward",
    )  # fmt: skip
    base.update(overrides)
    return GRPOConfig(**base)


def make_trainer(checkpoint, tmp_path, reward_funcs=None, **overrides):
    return GRPOTrainer(
        model=checkpoint, reward_funcs=reward_funcs or [toy.format_reward, length_reward], args=grpo_config(tmp_path, **overrides),
        train_dataset=toy.prompt_dataset(64),
    )


def move_policy_away_from_reference(trainer, seed=0):
    """The policy starts as the reference (KL 0): perturb its weights so that every KL is non-trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def generation_batch(trainer):
    """Two prompts, each repeated num_generations times, as TRL's sampler hands them over."""
    rows = [toy.prompt_dataset(64)[i] for i in (0, 1)]
    return [row for row in rows for _ in range(trainer.num_generations)]


def spy(monkeypatch, obj, name, seen):
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.setdefault(name, []).append((args, kwargs, out))
        return out

    monkeypatch.setattr(obj, name, wrapper)


def spied_scoring(monkeypatch, trainer):
    """One generation batch scored by TRL's own function, the policy first moved off the reference: its output, the
    rewards per function it computed, and the arguments of the one per-token KL at scoring time (term, logp, ref, mask,
    coef, statistic)."""
    move_policy_away_from_reference(trainer)
    trainer.model.train()
    seen = {}
    spy(monkeypatch, trainer, "_calculate_rewards", seen)
    spy(monkeypatch, KLTerm, "per_token", seen)
    torch.manual_seed(0)
    out = trainer._generate_and_score_completions(generation_batch(trainer))
    ((_, _, rewards_per_func),) = seen["_calculate_rewards"]
    ((args, _, _),) = seen["per_token"]
    return out, rewards_per_func, args


def plain_policy_logps(trainer, out):
    """The policy's log-probs of the sampled tokens from a plain forward (float64 log-softmax), not TRL's kernel."""
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
    length = out["completion_ids"].shape[1]
    with torch.no_grad():
        logits = trainer.model(input_ids=ids, attention_mask=mask).logits[:, -length - 1 : -1].double()
    return torch.log_softmax(logits, -1).gather(-1, out["completion_ids"].unsqueeze(-1)).squeeze(-1)


def user_kl64(logp, ref):
    return (logp - ref).abs() ** 1.5  # the user estimator registered below, in float64


def penalty64(method, estimator, logp, ref, mask, *, beta, clip_threshold, kl_target):
    """Float64 β · Σ_t shaped KL (or β · mean_t under length_normalized), written from the definitions."""
    if estimator != "my_kl":
        base = {"k1+": "k1", "k3+": "k3"}.get(estimator, estimator)  # straight-through: the value is k1's / k3's
        return reference.reward_penalty64(method, logp, ref, mask, estimator=base, beta=beta, clip_threshold=clip_threshold, kl_target=kl_target)
    raw = torch.where(mask.bool(), user_kl64(logp.double(), ref.double()), 0.0)
    shaped = torch.where(mask.bool(), reference.shaped64(raw, method, clip_threshold, kl_target), 0.0)
    per_completion = shaped.clamp(-reference.REWARD_KL_BOUND64, reference.REWARD_KL_BOUND64).sum(-1)
    if "length_normalized" in method.split("+"):
        per_completion = per_completion / mask.sum(-1).clamp(min=1)
    return beta * per_completion, raw


@pytest.fixture(scope="module")
def my_kl():
    @unsloth_adaptive_kl.register_estimator("my_kl")
    def my_kl(logp, ref_logp):
        return (logp - ref_logp).abs() ** 1.5

    yield "my_kl"
    unsloth_adaptive_kl.estimators.unregister_estimator("my_kl")


CASES = [
    ("none", "k1"),
    ("none", "k3"),
    ("clip", "k2"),
    ("soft_clip", "abs"),
    ("sigmoid", "k3+"),
    ("length_normalized", "k1"),
    ("clip+length_normalized", "k3"),
    ("ziegler+soft_clip", "my_kl"),
]


@pytest.mark.parametrize("method, estimator", CASES)
def test_reward_placement_lowers_each_reward_by_beta_times_its_summed_kl_before_the_group_normalisation(
    tiny_checkpoint, tmp_path, monkeypatch, my_kl, method, estimator
):
    trainer = make_trainer(
        tiny_checkpoint, tmp_path, kl_adaptation_method=method, kl_estimator=estimator, kl_clip_threshold=0.05, kl_target=0.02, kl_horizon=1000.0
    )
    out, rewards_per_func, args = spied_scoring(monkeypatch, trainer)
    logp, ref, mask = args[1], args[2], args[3]
    assert args[4] is None  # no importance ratio at scoring time: the policy is the sampling policy
    assert torch.equal(ref, out["ref_per_token_logps"]) and torch.equal(mask, out["completion_mask"])
    # The log-probs are the current policy's: a plain float64 forward gives the same on the valid tokens.
    valid = mask.bool()
    assert torch.allclose(logp.double()[valid], plain_policy_logps(trainer, out)[valid], atol=1e-4)
    assert "old_per_token_logps" not in out  # aligned generation: TRL computed none, so the loss is as stock TRL's

    penalty, raw = penalty64(method, estimator, logp, ref, mask, beta=BETA, clip_threshold=0.05, kl_target=0.02)
    rewards = rewards_per_func.double().sum(1)  # reward weights 1
    expected = reference.group_advantages64(rewards - penalty, trainer.num_generations)
    unpenalised = reference.group_advantages64(rewards, trainer.num_generations)
    assert torch.allclose(out["advantages"].double(), expected, rtol=1e-4, atol=1e-4)
    assert (out["advantages"].double() - unpenalised).abs().max() > 1e-2  # the penalty moved the advantages
    logged = trainer._metrics["train"][metrics.KL_PENALTY]
    assert logged == [pytest.approx(penalty.mean().item(), rel=1e-6)]
    assert trainer._metrics["train"]["reward"] == [pytest.approx(rewards.mean().item(), rel=1e-6)]  # TRL's reward: unpenalised
    # The scoring-time KL sums went to the step's controller update.
    sums = trainer._adaptive_kl._step_sums
    assert sums[metrics.RAW_SUM].item() == pytest.approx(raw.sum().item(), rel=1e-6)
    assert sums[metrics.TOKENS].item() == mask.sum().item() and sums[metrics.COMPLETIONS].item() == mask.shape[0]


def equal_reward(completions, **kwargs) -> list[float]:
    """Every completion the same reward: each group has no task signal (stock GRPO's advantage 0)."""
    return [1.0] * len(completions)


def tiny_length_reward(completions, **kwargs) -> list[float]:
    """Rewards that differ within a group by far less than β × the summed KL of a moved policy."""
    return [len(c) / 1e5 for c in completions]


@pytest.mark.parametrize("reward_funcs, counts", [("equal", (0, 2)), ("tiny", (2, 0)), ("varied", None)])
def test_a_real_scoring_call_logs_the_groups_the_kl_dominates_or_alone_orders(tiny_checkpoint, tmp_path, monkeypatch, reward_funcs, counts):
    """adaptive_kl/kl_dominated_groups and adaptive_kl/kl_only_groups from TRL's own scoring of one generation batch,
    against a float64 loop over its groups: with every reward equal, every group whose penalties differ is KL-only; with
    rewards that differ by 1e-5 a character, the KL's spread dominates every group."""
    funcs = {"equal": [equal_reward], "tiny": [tiny_length_reward], "varied": [toy.format_reward, length_reward]}[reward_funcs]
    trainer = make_trainer(tiny_checkpoint, tmp_path, reward_funcs=funcs, kl_adaptation_method="none", kl_estimator="k3")
    _, rewards_per_func, args = spied_scoring(monkeypatch, trainer)
    penalty, _raw = penalty64("none", "k3", args[1], args[2], args[3], beta=BETA, clip_threshold=0.05, kl_target=0.02)
    dominated, only = reference.group_counts64(rewards_per_func.double().sum(1).tolist(), penalty.tolist(), trainer.num_generations)
    if counts is not None:  # of the batch's two groups
        assert (dominated, only) == counts
    assert trainer._metrics["train"][metrics.KL_DOMINATED_GROUPS] == [float(dominated)]
    assert trainer._metrics["train"][metrics.KL_ONLY_GROUPS] == [float(only)]


def test_the_penalty_reuses_trls_old_log_probs_when_trl_computes_them(tiny_checkpoint, tmp_path, monkeypatch):
    # steps_per_generation=2 with one accumulation step: generation is not aligned with the optimizer step,
    # so TRL computes old_per_token_logps (the policy at scoring time); no second forward is made.
    trainer = make_trainer(tiny_checkpoint, tmp_path, per_device_train_batch_size=4, steps_per_generation=2)
    move_policy_away_from_reference(trainer)
    trainer.model.train()
    seen = {}
    spy(monkeypatch, trainer, "_get_per_token_logps_and_entropies", seen)
    spy(monkeypatch, KLTerm, "per_token", seen)
    torch.manual_seed(0)
    out = trainer._generate_and_score_completions(generation_batch(trainer))
    assert len(seen["_get_per_token_logps_and_entropies"]) == 2  # TRL's own: old policy, reference
    ((args, _, _),) = seen["per_token"]
    assert args[1] is out["old_per_token_logps"]


def test_aligned_generation_costs_one_more_policy_forward_at_scoring_time(tiny_checkpoint, tmp_path, monkeypatch):
    trainer = make_trainer(tiny_checkpoint, tmp_path)
    trainer.model.train()
    seen = {}
    spy(monkeypatch, trainer, "_get_per_token_logps_and_entropies", seen)
    torch.manual_seed(0)
    trainer._generate_and_score_completions(generation_batch(trainer))
    models = [call[0][0] for call in seen["_get_per_token_logps_and_entropies"]]
    assert models == [trainer.ref_model, trainer.model]  # the reference (TRL's), then the policy (ours)


@pytest.mark.parametrize("method", ["none", "clip", "length_normalized", "dynamic+sigmoid"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo"])
def test_under_reward_placement_the_loss_is_stock_trls_beta_zero_loss_bit_for_bit(tiny_checkpoint, tmp_path, method, loss_type):
    trainer = make_trainer(tiny_checkpoint, tmp_path, kl_adaptation_method=method, loss_type=loss_type, kl_estimator="k1")
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = reference.loss_inputs(trainer.model.config.vocab_size, pad_token_id=trainer.processing_class.pad_token_id)

    def loss_and_grads(compute):
        trainer.model.zero_grad(set_to_none=True)
        loss = compute(trainer, trainer.model, inputs)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]

    loss, grads = loss_and_grads(GRPOTrainer._compute_loss)
    assert trainer._metrics["train"][metrics.RAW_KL]  # the KL was measured (raw_kl as today) ...
    trainer.beta = 0.0  # ... but weighs nothing: the loss is stock TRL's at beta 0
    stock_loss, stock_grads = loss_and_grads(trl_backend.original(GRPOTrainer, "_compute_loss"))
    assert torch.equal(loss, stock_loss)
    assert len(grads) == len(stock_grads) > 0 and all(torch.equal(a, b) for a, b in zip(grads, stock_grads))
    trainer.beta = BETA
    trainer._adaptive_kl.term = dataclasses.replace(trainer._adaptive_kl.term, placement="loss")  # the KL in the loss: another loss
    assert not torch.equal(loss_and_grads(GRPOTrainer._compute_loss)[0], loss)


class RecordBeta(TrainerCallback):
    def __init__(self, trainer):
        self.trainer, self.betas = trainer, []

    def on_step_end(self, args, state, control, **kwargs):
        self.betas.append(self.trainer.beta)


def test_the_target_controller_acts_once_per_scored_generation_batch_on_its_kl(tiny_checkpoint, tmp_path, monkeypatch):
    # steps_per_generation=2, one micro-batch per step: a generation batch (8 completions) is scored at steps 1
    # and 3. Ziegler's update follows each, from that batch's token mean KL and n = 8; at steps 2 and 4 β stays.
    trainer = make_trainer(
        tiny_checkpoint, tmp_path, per_device_train_batch_size=4, steps_per_generation=2, max_steps=4,
        kl_adaptation_method="ziegler", kl_estimator="k3", kl_target=1e-4, kl_horizon=10.0, beta=0.04,
    )  # fmt: skip
    move_policy_away_from_reference(trainer)
    seen = {}
    spy(monkeypatch, trainer._adaptive_kl, "observe_scoring_sums", seen)
    recorder = RecordBeta(trainer)
    trainer.add_callback(recorder)
    trainer.train()
    scored = [out.tolist() for _, _, out in seen["observe_scoring_sums"]]
    assert len(scored) == 2 and all(s[metrics.COMPLETIONS] == 8 for s in scored)
    beta, expected = 0.04, []
    for step in range(4):
        if step % 2 == 0:
            kl = scored[step // 2][metrics.RAW_SUM] / scored[step // 2][metrics.TOKENS]
            beta *= 1 + min(max(kl / 1e-4 - 1, -0.2), 0.2) * 8 / 10.0
        expected.append(beta)
    assert recorder.betas == pytest.approx(expected, rel=1e-12)
    assert recorder.betas[0] != 0.04 and recorder.betas[1] == recorder.betas[0]
    penalties = [h[metrics.KL_PENALTY] for h in trainer.state.log_history if metrics.KL_PENALTY in h]
    assert len(penalties) == 2 and all(p > 0 for p in penalties)


def test_default_loss_placement_trains_as_stock_trl_bit_for_bit(tiny_checkpoint, tmp_path):
    def run(out):  # no kl_placement given, as a stock config is written
        fields = dict(
            output_dir=str(out), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=8, num_generations=4,
            max_completion_length=MAX_COMPLETION, max_steps=2, logging_steps=1, learning_rate=2e-2, beta=0.04, save_strategy="no", seed=0,
        )  # fmt: skip
        trainer = GRPOTrainer(
            model=tiny_checkpoint, reward_funcs=[toy.format_reward, length_reward], args=GRPOConfig(**fields), train_dataset=toy.prompt_dataset(64)
        )
        trainer.train()
        return trainer

    ours = run(tmp_path / "ours")
    assert ours.args.kl_placement == "loss" and ours._adaptive_kl.kl_in_loss
    unsloth_adaptive_kl.unpatch()
    try:
        stock = run(tmp_path / "stock")
    finally:
        unsloth_adaptive_kl.patch()
    assert not hasattr(stock, "_adaptive_kl")
    for key in ("loss", "kl", "reward"):
        mine = [h[key] for h in ours.state.log_history if key in h]
        theirs = [h[key] for h in stock.state.log_history if key in h]
        assert mine == theirs and len(mine) == 2, key
    for (name, a), (_, b) in zip(ours.model.named_parameters(), stock.model.named_parameters()):
        assert torch.equal(a, b), name


# -- refusals -------------------------------------------------------------------------------------------------
def test_a_bad_kl_placement_is_refused_naming_the_field_the_value_and_what_is_allowed(tmp_path):
    with pytest.raises(ValueError, match=r"kl_placement='rewards' is not valid; allowed: one of \['loss', 'reward'\]"):
        grpo_config(tmp_path, kl_placement="rewards")
    with pytest.raises(ValueError, match=r"kl_placement='reward' is not valid with beta=0.0"):
        grpo_config(tmp_path, beta=0.0)
    assert GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none").kl_placement == "loss"


def test_a_shaping_step_that_acts_on_the_aggregation_is_refused_by_name_in_the_reward(monkeypatch):
    from unsloth_adaptive_kl import config, shaping
    from unsloth_adaptive_kl.method import Method

    fake = shaping.ShapingMethod(**{**shaping.SHAPING["length_normalized"].__dict__, "name": "per_loss_type_mean"})
    monkeypatch.setitem(shaping.SHAPING, "per_loss_type_mean", fake)
    method = Method("fixed", ("per_loss_type_mean",))
    with pytest.raises(ValueError, match=r"kl_placement='reward' is not valid with the shaping method 'per_loss_type_mean'"):
        config.check_placement("reward", method, 0.1)
    assert config.check_placement("loss", method, 0.1) == "loss"
    for name in shaping.SHAPING:  # every registered method applies in the reward
        if name != "per_loss_type_mean":
            assert config.check_placement("reward", Method("fixed", (name,)), 0.1) == "reward"


def test_normalize_then_sum_is_refused_under_reward_placement(tiny_checkpoint, tmp_path):
    with pytest.raises(ValueError, match=r"kl_placement='reward' is not valid with multi_objective_aggregation='normalize_then_sum'"):
        make_trainer(tiny_checkpoint, tmp_path, multi_objective_aggregation="normalize_then_sum")


def test_a_trainer_class_whose_anchors_do_not_match_is_refused_naming_the_library_and_version(tiny_checkpoint, tmp_path, monkeypatch):
    class Unrelated:
        def _generate_and_score_completions(self, inputs):
            return inputs

    own = Unrelated._generate_and_score_completions
    reward_placement.install(Unrelated, reward_placement.TRL_PLAN, {"GRPOTrainer": Unrelated})
    try:
        reason = reward_placement.unavailable_reason(Unrelated)
        assert "trl 1." in reason and "expected the anchor" in reason
        assert Unrelated._generate_and_score_completions is own  # nothing was set
    finally:
        reward_placement._UNAVAILABLE.pop(Unrelated)
    monkeypatch.setitem(reward_placement._UNAVAILABLE, GRPOTrainer, "trl 9.9: expected the anchor ... (a test's reason)")
    with pytest.raises(PatchError, match=r"kl_placement='reward' cannot be applied to .*GRPOTrainer: trl 9.9"):
        make_trainer(tiny_checkpoint, tmp_path)
    make_trainer(tiny_checkpoint, tmp_path, kl_placement="loss")  # the loss placement is unaffected


def test_a_local_the_replacements_read_must_exist_in_the_library_function():
    class Renamed:
        def _generate_and_score_completions(self, inputs):
            mode = ref_per_token_logps = rewards = unscorable_mask = num_generations = torch = None  # noqa: F841
            if inputs:
                image_inputs = prompt_inputs = None
            image_inputs = super()._prepare_inputs(image_inputs)
            prompt_inputs = super()._prepare_inputs(prompt_inputs)
            if inputs:
                pass
            else:
                ref_per_token_logps = None
            rewards[unscorable_mask] = torch.nan
            mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
            return mean_grouped_rewards

    reward_placement.install(Renamed, reward_placement.TRL_PLAN, {"GRPOTrainer": Renamed})
    try:
        reason = reward_placement.unavailable_reason(Renamed)
        # _source_patch's free-name check (every rewrite gets it): the first name read that the function does not define
        assert "reads 'old_per_token_logps'" in reason and "does not define" in reason and f"trl {version_of('trl')}" in reason
    finally:
        reward_placement._UNAVAILABLE.pop(Renamed)


def zero_argument_super_calls(function) -> list[str]:
    """The lines of ``function``'s compiled source (the rewritten one, registered in linecache under its code's file
    name) that call ``super()`` with no argument: each raises RuntimeError when it runs, since a function compiled
    outside its class body has no ``__class__`` cell."""
    import ast

    source = inspect.getsource(function.__code__)
    calls = [n for n in ast.walk(ast.parse(inspect.cleandoc("\n" + source))) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "super"]
    return [ast.unparse(n) for n in calls if not n.args]


def test_the_rewritten_scoring_function_calls_super_with_its_class_as_the_library_does():
    """TRL 1.9-1.16's _generate_and_score_completions calls super()._prepare_inputs in its VLM and tool-image
    branches; the reward placement's copy, compiled outside the class, kept them as zero-argument super(), which
    raises "super(): __class__ cell not found" when such a branch runs (a VLM trained with kl_placement='reward')."""
    (rewritten,) = reward_placement.TRL_PLAN.build(trl_backend.owners()).values()
    assert "__class__" not in rewritten.__code__.co_freevars  # so a zero-argument super() in it could not work
    assert zero_argument_super_calls(rewritten) == []
    assert inspect_source(rewritten).count("super(GRPOTrainer, self)._prepare_inputs(") == len(reward_placement.SUPER_CALLS)
    original = inspect.getsource(trl_backend.owners()["GRPOTrainer"]._generate_and_score_completions)  # the installed one
    assert all(original.count(line) == 1 for line in reward_placement.SUPER_CALLS)  # the library's own, once each


def inspect_source(function) -> str:
    return inspect.getsource(function.__code__)


# -- GRPOTrainer(loss_class=...) --------------------------------------------------------------------------------
def test_loss_class_under_reward_placement_has_no_kl_term_and_liger_own_class_is_refused(tiny_checkpoint, tmp_path):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    from unsloth_adaptive_kl.backends import loss_class as loss_class_path

    with pytest.raises(ValueError, match=r"kl_placement='reward' is not valid with loss_class=LigerFusedLinearGRPOLoss"):
        GRPOTrainer(
            model=tiny_checkpoint, reward_funcs=[length_reward], args=grpo_config(tmp_path), train_dataset=toy.prompt_dataset(8),
            loss_class=LigerFusedLinearGRPOLoss,
        )  # fmt: skip
    trainer = GRPOTrainer(
        model=tiny_checkpoint, reward_funcs=[length_reward], args=grpo_config(tmp_path, kl_adaptation_method="clip", kl_estimator="k1"),
        train_dataset=toy.prompt_dataset(8), loss_class=AdaptiveFusedLinearGRPOLoss,
    )  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = reference.loss_inputs(trainer.model.config.vocab_size, pad_token_id=trainer.processing_class.pad_token_id)

    def loss_and_grads():
        trainer.model.zero_grad(set_to_none=True)
        loss = loss_class_path.compute_loss(trainer, trainer.model, inputs)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]

    loss, grads = loss_and_grads()
    assert trainer._metrics["train"][metrics.RAW_KL]  # measured, as today
    trainer._adaptive_kl.term = dataclasses.replace(trainer._adaptive_kl.term, placement="loss")
    with_kl, _ = loss_and_grads()
    trainer.beta = 0.0
    beta_zero, zero_grads = loss_and_grads()
    assert torch.equal(loss, beta_zero) and not torch.equal(loss, with_kl)
    assert len(grads) == len(zero_grads) > 0 and all(torch.equal(a, b) for a, b in zip(grads, zero_grads))


def test_loss_class_trains_with_reward_placement(tiny_checkpoint, tmp_path):
    trainer = GRPOTrainer(
        model=tiny_checkpoint, reward_funcs=[length_reward], train_dataset=toy.prompt_dataset(64), loss_class=AdaptiveFusedLinearGRPOLoss,
        args=grpo_config(tmp_path, kl_adaptation_method="ziegler", kl_target=0.01, kl_horizon=100.0),
    )  # fmt: skip
    trainer.train()
    logged = [h for h in trainer.state.log_history if metrics.KL_PENALTY in h]
    assert len(logged) == 2 and all(math.isfinite(h[metrics.KL_PENALTY]) for h in logged)


# -- resume ----------------------------------------------------------------------------------------------------
class RecordState(TrainerCallback):
    def __init__(self, trainer):
        self.trainer, self.states = trainer, {}

    def on_step_end(self, args, state, control, **kwargs):
        self.states[state.global_step] = json.loads(json.dumps(self.trainer._adaptive_kl.state_dict()))


def _train(checkpoint, out, resume_from=None, **overrides):
    trainer = make_trainer(
        checkpoint, out, per_device_train_batch_size=4, max_steps=5, save_strategy="steps", save_steps=2, beta=0.04,
        kl_adaptation_method="ziegler", kl_target=1e-4, kl_horizon=20.0, **overrides,
    )  # fmt: skip
    recorder = RecordState(trainer)
    trainer.add_callback(recorder)
    trainer.train(resume_from_checkpoint=resume_from)
    penalties = {h["step"]: h[metrics.KL_PENALTY] for h in trainer.state.log_history if metrics.KL_PENALTY in h}
    return recorder.states, penalties


@pytest.mark.parametrize("steps_per_generation", [1, 4])
def test_a_resumed_reward_placement_run_has_the_uninterrupted_controller_state(tiny_checkpoint, tmp_path, steps_per_generation):
    # steps_per_generation=4: the checkpoint (step 2) is inside a generation batch; TRL regenerates on resume,
    # and that batch's KL must not reach the controller (the uninterrupted run saw the original's at step 1).
    full, full_penalties = _train(tiny_checkpoint, tmp_path / "run", steps_per_generation=steps_per_generation)
    resumed, penalties = _train(
        tiny_checkpoint, tmp_path / "run", resume_from=str(tmp_path / "run" / "checkpoint-2"), steps_per_generation=steps_per_generation
    )
    betas = [full[s]["controller"]["beta"] for s in range(1, 6)]
    assert len(set(betas)) > 1, "β never changed: the test would not see a lost state"
    if steps_per_generation == 1:
        assert {s: resumed[s] for s in range(3, 6)} == {s: full[s] for s in range(3, 6)}
        assert {s: penalties[s] for s in range(3, 6)} == {s: full_penalties[s] for s in range(3, 6)}
    else:  # generations at steps 1 and 5: β moves after them only; the regenerated batch at step 3 is not observed
        assert betas[0] == betas[1] == betas[2] == betas[3] != 0.04
        assert [resumed[s]["controller"]["beta"] for s in (3, 4)] == betas[2:4]
        assert resumed[5]["controller"]["beta"] != betas[3]  # the step-5 batch was observed
