"""kl_monitor with kl_placement="reward" on the TRL backend (issue 53; Unsloth's: test_unsloth.py, two processes:
test_multiprocess.py). At β = 0 the watched generation batches (kl_monitor_every) score the reference, the KL the reward
placement would use is computed (its sums reach the runaway alarm) and logged, and the rewards, advantages, loss and
weights are stock TRL's at β = 0, bit for bit. The edits of both features apply onto one copy of TRL's source."""

import copy
import inspect

import pytest
import torch
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

import reference
import unsloth_adaptive_kl
from unsloth_adaptive_kl import metrics

import toy  # examples/toy.py (tests/conftest.py puts examples/ on the path)
from unsloth_adaptive_kl._source_patch import PatchError, Rewrite
from unsloth_adaptive_kl.backends import _generation, reward_placement
from unsloth_adaptive_kl.backends import trl as trl_backend

EVERY = 2
STEPS = 4


def fields(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=8, num_generations=4,
        max_completion_length=reference.MAX_COMPLETION, max_steps=STEPS, logging_steps=1, learning_rate=2e-2, beta=0.0,
        save_strategy="no", seed=0,
    )  # fmt: skip
    base.update(overrides)
    return base


def perturb(model, seed=0):
    """The policy starts as the reference (KL 0 at the first step): move its weights so that every KL is non-trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def logps64(model, out):
    """The log-probs of the sampled tokens under ``model``, from a plain float64 forward (not TRL's kernel)."""
    model = copy.deepcopy(model).double()
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
    length = out["completion_ids"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, -length - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, out["completion_ids"].unsqueeze(-1)).squeeze(-1)


def run(checkpoint, folder, *, patched: bool, exclude=None):
    """A 4-step run at β = 0: watched by kl_monitor with kl_placement='reward' (``patched``), or stock TRL (unpatched).
    Returns its logs, what each generation returned, the float64 KL of each batch the reference scored, the steps whose
    reference forward ran, what the runaway alarm was fed, and the final weights."""
    ours = dict(kl_placement="reward", kl_monitor=True, kl_monitor_every=EVERY, kl_exclude_token_ids=exclude) if patched else {}
    trainer = GRPOTrainer(
        model=checkpoint, reward_funcs=[toy.format_reward, reference_length_reward], args=GRPOConfig(**fields(folder, **ours)),
        train_dataset=toy.prompt_dataset(64),
    )  # fmt: skip
    perturb(trainer.model)
    batches, ref_calls, fed = [], [], []
    generate = trainer._generate_and_score_completions

    def spy(*args, **kwargs):
        out = generate(*args, **kwargs)
        batch = {k: out[k].clone() for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")}
        if out.get("ref_per_token_logps") is not None:  # a watched batch: the float64 KL of the policy and the reference now
            batch["kl64"] = kl64(logps64(trainer.model, out), logps64(trainer.ref_model, out), out, exclude)
        batches.append(batch)
        return out

    trainer._generate_and_score_completions = spy
    if patched:
        trainer.ref_model.register_forward_hook(lambda *a: ref_calls.append(trainer.state.global_step))
        end_step = trainer._adaptive_kl.alarm.end_step
        trainer._adaptive_kl.alarm.end_step = lambda step, kl: (fed.append((step, kl)), end_step(step, kl))[1]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return logs, batches, sorted(set(ref_calls)), fed, [p.detach().clone() for p in trainer.model.parameters()]


def reference_length_reward(completions, **kwargs):
    """A reward with spread within every group (the toy task's rewards are mostly 0), so the advantages are not all 0."""
    return [len(c) / 10.0 for c in completions]


def kl64(logp, ref, out, exclude):
    """The token-weighted mean k3 KL (TRL's estimator) over the valid tokens not in ``exclude``, and over all valid
    tokens (the excluded ones counting 0, as TRL's own ``kl`` counts them), in float64."""
    valid = out["completion_mask"].bool()
    kept = valid & ~torch.isin(out["completion_ids"], torch.tensor(exclude or [], dtype=torch.long))
    r = ref - logp
    k3 = torch.where(kept, torch.exp(r) - r - 1, 0.0)
    full = torch.where(valid, torch.exp(r) - r - 1, 0.0)
    return {"kept": (k3.sum() / kept.sum()).item(), "trl_kl": (k3.sum() / valid.sum()).item(), "all_tokens": (full.sum() / valid.sum()).item(),
            "excluded": int((valid & ~kept).sum())}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tiny_checkpoint, tmp_path_factory):
    exclude = [toy.build_tokenizer().eos_token_id]
    watched = run(tiny_checkpoint, tmp_path_factory.mktemp("watched"), patched=True, exclude=exclude)
    unsloth_adaptive_kl.unpatch()
    try:
        stock = run(tiny_checkpoint, tmp_path_factory.mktemp("stock"), patched=False)
    finally:
        unsloth_adaptive_kl.patch()
    return watched, stock


def test_the_watched_batches_log_the_reward_placements_kl_against_float64_and_the_others_none(runs):
    """kl_monitor_every=2, one generation batch a step: the reference forward runs for batches 0 and 2 only; steps 1 and
    3 log adaptive_kl/raw_kl (and TRL's kl) equal to a float64 recomputation from the policy's and the reference's
    log-probs on the completion mask less the excluded EOS tokens; steps 2 and 4 log no KL; no penalty is logged."""
    (logs, batches, ref_calls, _, _), _ = runs
    assert ref_calls == [0, 2]
    assert ["kl64" in b for b in batches] == [True, False, True, False]
    assert [metrics.RAW_KL in h for h in logs] == [True, False, True, False]
    assert ["kl" in h for h in logs] == [True, False, True, False]
    assert not any(metrics.KL_PENALTY in h for h in logs)  # β·KL is 0: nothing is subtracted, no penalty to log
    for step in (0, 2):
        expected = batches[step]["kl64"]
        assert expected["excluded"] > 0 and abs(expected["kept"] - expected["all_tokens"]) > 1e-4  # the exclusion matters
        assert logs[step][metrics.RAW_KL] == pytest.approx(expected["kept"], rel=1e-4, abs=1e-7), step
        assert logs[step]["kl"] == pytest.approx(expected["trl_kl"], rel=1e-4, abs=1e-7), step
        assert logs[step][metrics.CURRENT_BETA] == 0.0


def test_the_runaway_alarm_gets_the_watched_batches_scoring_time_kl(runs):
    """What the reward placement measures at scoring (the policy's and the reference's log-probs before the step's
    update), excluded tokens left out, reaches the runaway alarm at each watched step; an unwatched step gives it None."""
    (_, batches, _, fed, _), _ = runs
    assert [step for step, _ in fed] == [1, 2, 3, 4]
    assert [kl is not None for _, kl in fed] == [True, False, True, False]
    for step in (0, 2):
        assert fed[step][1] == pytest.approx(batches[step]["kl64"]["kept"], rel=1e-4, abs=1e-7), step


def test_rewards_advantages_loss_and_weights_are_stock_trls_at_beta_zero_bit_for_bit(runs):
    (logs, batches, _, _, weights), (stock_logs, stock_batches, _, _, stock_weights) = runs
    assert len(batches) == len(stock_batches) == STEPS
    for ours, theirs in zip(batches, stock_batches):
        for key in ("completion_ids", "advantages"):
            assert torch.equal(ours[key], theirs[key]), key
    assert any(b["advantages"].abs().sum() > 0 for b in batches)  # the advantages carry a signal a penalty would move
    for key in ("loss", "reward", "reward_std", "rewards/reference_length_reward/mean"):
        assert [h[key] for h in logs] == [h[key] for h in stock_logs], key
    assert len(weights) == len(stock_weights) > 0 and all(torch.equal(a, b) for a, b in zip(weights, stock_weights))


class RecordBeta(TrainerCallback):
    def __init__(self, trainer):
        self.trainer, self.betas = trainer, []

    def on_step_end(self, args, state, control, **kwargs):
        self.betas.append(self.trainer.beta)


def test_a_controller_that_reaches_beta_zero_keeps_watching_the_kl_as_in_the_loss_placement(tiny_checkpoint, tmp_path):
    """kl_monitor with β > 0 (as in the loss placement): it acts once a controller takes β to 0 (dynamic, beta_min 0, after
    2 steps). Before, the rewards are penalised (kl_penalty logged); after, the reference forward still runs on the watched
    batches and the KL is logged, the rewards are left as they are (no kl_penalty)."""
    args = GRPOConfig(**fields(
        tmp_path, beta=0.04, kl_placement="reward", kl_monitor=True, kl_monitor_every=1, kl_adaptation_method="dynamic",
        reward_threshold=100.0, beta_min=0.0, beta_schedule_steps=2,
    ))  # fmt: skip
    trainer = GRPOTrainer(model=tiny_checkpoint, reward_funcs=[toy.format_reward, reference_length_reward], args=args, train_dataset=toy.prompt_dataset(64))
    calls = []
    trainer.ref_model.register_forward_hook(lambda *a: calls.append(trainer.state.global_step))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h[metrics.CURRENT_BETA] for h in logs] == [0.04, 0.04, 0.0, 0.0]
    assert sorted(set(calls)) == [0, 1, 2, 3]
    assert [metrics.KL_PENALTY in h for h in logs] == [True, True, False, False]
    assert all(metrics.RAW_KL in h and h["kl"] == pytest.approx(h[metrics.RAW_KL], rel=1e-6) for h in logs)
    assert logs[-1][metrics.RAW_KL] > 0


# -- the config ---------------------------------------------------------------------------------------------------
def test_kl_monitor_with_the_reward_placement_is_accepted_and_the_other_beta_zero_combinations_refused(tmp_path):
    GRPOConfig(**fields(tmp_path, kl_placement="reward", kl_monitor=True))  # β = 0: watched, rewards untouched
    GRPOConfig(**fields(tmp_path, kl_placement="reward", kl_monitor=True, kl_estimator="k1", kl_exclude_token_ids=[2]))
    GRPOConfig(**fields(tmp_path, beta=0.04, kl_placement="reward", kl_monitor=True, kl_adaptation_method="dynamic", beta_min=0.0))
    with pytest.raises(ValueError, match=r"kl_placement='reward' is not valid with beta=0.0: .*allowed: beta > 0, kl_monitor=True"):
        GRPOConfig(**fields(tmp_path, kl_placement="reward"))
    with pytest.raises(ValueError, match=r"beta=0.0 is not valid with kl_adaptation_method='clip'"):
        GRPOConfig(**fields(tmp_path, kl_placement="reward", kl_monitor=True, kl_adaptation_method="clip"))
    with pytest.raises(ValueError, match=r"kl_monitor_every=4 is not valid with kl_monitor=False"):
        GRPOConfig(**fields(tmp_path, beta=0.04, kl_placement="reward", kl_monitor_every=4))


def test_a_trainer_whose_generation_cannot_take_both_edits_is_refused_naming_the_combination(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setitem(reward_placement._UNAVAILABLE_WITH_MONITOR, GRPOTrainer, "trl 9.9: a test's reason")
    with pytest.raises(PatchError, match=r"kl_monitor=True with kl_placement='reward' cannot be applied to .*GRPOTrainer: trl 9.9"):
        GRPOTrainer(model=tiny_checkpoint, reward_funcs=[toy.format_reward], args=GRPOConfig(**fields(tmp_path, kl_placement="reward", kl_monitor=True)),
                    train_dataset=toy.prompt_dataset(8))  # fmt: skip
    for alone in (dict(kl_placement="reward", beta=0.04), dict(kl_monitor=True)):  # each feature alone is unaffected
        GRPOTrainer(model=tiny_checkpoint, reward_funcs=[toy.format_reward], args=GRPOConfig(**fields(tmp_path, **alone)), train_dataset=toy.prompt_dataset(8))


# -- the composition ------------------------------------------------------------------------------------------------
def test_each_combination_of_features_is_one_rewrite_of_trls_source_with_its_own_lines():
    """TRL's _generate_and_score_completions compiled once per combination: kl_monitor alone, the reward placement
    alone, both; the combined copy carries both features' edits (the explicit super() they share once), each copy has
    its own file name, so linecache shows its own source."""
    features = (trl_backend.MONITOR, reward_placement.feature(reward_placement.TRL_PLAN))
    functions, reasons = _generation.build(trl_backend.GENERATE, features, trl_backend.owners())
    assert reasons == {} and set(functions) == set(_generation.combinations(("kl_monitor", "kl_placement='reward'")))
    sources = {key: inspect.getsource(f.__code__) for key, f in functions.items()}
    both = sources[frozenset({"kl_monitor", "kl_placement='reward'"})]
    assert "self._adaptive_kl.runs_reference()" in both and "scoring_penalty" in both and "penalized_rewards" in both
    assert both.count("super(GRPOTrainer, self)") == 2 and "super()" not in both
    assert "scoring_penalty" not in sources[frozenset({"kl_monitor"})] and "runs_reference" not in sources[frozenset({"kl_placement='reward'"})]
    assert len({f.__code__.co_filename for f in functions.values()}) == 3


def test_composing_keeps_a_shared_edit_once_and_refuses_two_replacements_of_one_anchor():
    shared = Rewrite("A.f", "trl", "x = 1\n", "x = 2\n", "shared")
    other = Rewrite("A.f", "trl", "y = 1\n", "y = 3\n", "monitor's")
    assert _generation.compose({"kl_monitor": (shared, other), "reward": (shared,)}) == (shared, other)
    clash = Rewrite("A.f", "trl", "y = 1\n", "y = 4\n", "reward's")
    with pytest.raises(PatchError, match=r"kl_monitor and reward rewrite the same anchor 'y = 1' of A.f differently"):
        _generation.compose({"kl_monitor": (other,), "reward": (clash,)})
