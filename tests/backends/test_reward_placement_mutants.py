"""kl_placement="reward" where the mutation run of backends/reward_placement.py (docs/reliability.md, "Mutation
testing"; one line each in docs/mutation-survivors.md) found no test: an evaluation batch's penalty, the tool-result
tokens TRL's tool_mask leaves out, and the Unsloth rewrite's left padding on a batch that is not text only."""

import pytest
import torch
from test_kl_placement import BETA, generation_batch, make_trainer, move_policy_away_from_reference, spied_scoring, spy

import reference
from unsloth_adaptive_kl import metrics
from unsloth_adaptive_kl.backends import reward_placement
from unsloth_adaptive_kl.config import build
from unsloth_adaptive_kl.kl_term import KLTerm


def _score(trainer, monkeypatch, seen):
    spy(monkeypatch, trainer, "_calculate_rewards", seen)
    spy(monkeypatch, KLTerm, "per_token", seen)
    torch.manual_seed(0)
    return trainer._generate_and_score_completions(generation_batch(trainer))


def _penalised_advantages(trainer, seen, mask, beta=BETA):
    """Float64 advantages of the rewards less β · Σ_t k1 over ``mask``, from the scoring's own log-probs."""
    ((_, _, rewards_per_func),) = seen["_calculate_rewards"]
    ((args, _, _),) = seen["per_token"]
    penalty, _ = reference.reward_penalty64("none", args[1], args[2], mask, estimator="k1", beta=beta, clip_threshold=0.05,
                                            kl_target=0.02)  # fmt: skip
    rewards = rewards_per_func.double().sum(1)
    return reference.group_advantages64(rewards - penalty, trainer.num_generations), penalty


def test_an_evaluation_batch_is_penalised_logs_its_penalty_under_eval_and_feeds_no_controller(tiny_checkpoint, tmp_path, monkeypatch):
    """TRL scores an evaluation batch with the same function (mode "eval"): its rewards are penalised as in training,
    the penalty is logged under eval, and the β controller sees nothing of it (it acts on training batches only)."""
    trainer = make_trainer(tiny_checkpoint, tmp_path, kl_adaptation_method="none", kl_estimator="k1")
    move_policy_away_from_reference(trainer)
    trainer.model.eval()
    seen = {}
    spy(monkeypatch, trainer._adaptive_kl, "observe_scoring_sums", seen)
    out = _score(trainer, monkeypatch, seen)
    expected, penalty = _penalised_advantages(trainer, seen, out["completion_mask"].double())
    assert torch.allclose(out["advantages"].double(), expected, rtol=1e-4, atol=1e-4)
    assert trainer._metrics["eval"][metrics.KL_PENALTY] == [pytest.approx(penalty.mean().item(), rel=1e-6)]
    assert metrics.KL_PENALTY not in trainer._metrics["train"]
    assert "observe_scoring_sums" not in seen and trainer._adaptive_kl._step_sums is None


def test_a_beta_of_one_penalises_the_rewards_like_any_other_nonzero_beta(tiny_checkpoint, tmp_path, monkeypatch):
    """Only β = 0 (TRL then computes no reference log-probs) leaves the rewards as they are; β = 1 subtracts Σ_t KL."""
    trainer = make_trainer(tiny_checkpoint, tmp_path, kl_adaptation_method="none", kl_estimator="k1", beta=1.0)
    move_policy_away_from_reference(trainer)
    trainer.model.train()
    seen = {}
    out = _score(trainer, monkeypatch, seen)
    expected, penalty = _penalised_advantages(trainer, seen, out["completion_mask"].double(), beta=1.0)
    assert torch.allclose(out["advantages"].double(), expected, rtol=1e-4, atol=1e-4)
    assert penalty.abs().max() > 1e-3
    assert trainer._metrics["train"][metrics.KL_PENALTY] == [pytest.approx(penalty.mean().item(), rel=1e-6)]


def test_the_penalty_leaves_out_the_tool_result_tokens_of_trls_tool_mask(tiny_checkpoint, tmp_path, monkeypatch):
    """With tools, TRL marks the tokens a tool returned with tool_mask 0 (its loss leaves them out); the penalty sums
    the KL over the model's own tokens only. Here _generate hands over a tool_mask whose tokens 1 and 2 are a tool's."""
    trainer = make_trainer(tiny_checkpoint, tmp_path, kl_adaptation_method="none", kl_estimator="k1")
    move_policy_away_from_reference(trainer)
    trainer.model.train()
    generate = trainer._generate

    def with_a_tool_result(*args, **kwargs):
        prompt_ids, completion_ids, _, *rest = generate(*args, **kwargs)
        return (prompt_ids, completion_ids, [[int(t not in (1, 2)) for t in range(len(ids))] for ids in completion_ids], *rest)

    monkeypatch.setattr(trainer, "_generate", with_a_tool_result)
    seen = {}
    out = _score(trainer, monkeypatch, seen)
    model_tokens = out["completion_mask"] * out["tool_mask"]
    assert (out["completion_mask"].bool() & ~out["tool_mask"].bool()).sum() >= 8  # the tool's tokens are valid completion tokens
    ((args, _, _),) = seen["per_token"]
    assert torch.equal(args[3], model_tokens)
    expected, _ = _penalised_advantages(trainer, seen, model_tokens.double())
    assert torch.allclose(out["advantages"].double(), expected, rtol=1e-4, atol=1e-4)
    with_tool_tokens, _ = _penalised_advantages(trainer, seen, out["completion_mask"].double())
    assert (expected - with_tool_tokens).abs().max() > 1e-3  # the tool's tokens would have moved the advantages


def _unsloth_scoring_call():
    """The statement the Unsloth rewrite adds after the reference log-probs (the replacement less its anchor)."""
    (rewrite,) = [r for r in reward_placement.UNSLOTH_PLAN.anchor_sets[0].rewrites if "ref_per_token_logps = None" in r.anchor]
    assert rewrite.replacement.startswith(rewrite.anchor)
    return "if True:\n" + rewrite.replacement[len(rewrite.anchor) :]


class _Recorder:
    def __init__(self):
        self.calls = []

    def scoring_penalty(self, *args, **kwargs):
        self.calls.append((args, kwargs))


class _Self:
    def __init__(self):
        self._adaptive_kl = _Recorder()
        self.processing_class = type("Tokenizer", (), {"pad_token_id": 7})()


@pytest.mark.parametrize("text_only", [True, False])
def test_the_unsloth_rewrite_hands_over_the_left_padding_only_where_unsloth_measured_it(text_only):
    """Unsloth's generated function measures the prompts' left padding (left_pad_tokens_per_prompt, max_left_pad) for
    a text-only batch; for a batch with images or video max_left_pad stays None and left_pad_tokens_per_prompt is never
    assigned (unsloth/models/rl_replacements.py, the head it adds before the old log-probs). The rewrite's statement,
    run with those locals, hands the padding over for the first and None for the second, reading no unassigned name."""
    names = dict(
        self=_Self(), ref_per_token_logps="ref", old_per_token_logps="old", completion_mask=torch.ones(2, 3), tool_mask=None,
        prompt_completion_ids=None, attention_mask=None, logits_to_keep=3, batch_size=2, num_images=None, num_tiles=None,
        forward_kwargs={}, mode="train", completion_ids="ids", max_left_pad=None,
    )  # fmt: skip
    if text_only:
        names.update(left_pad_tokens_per_prompt="pads", max_left_pad=2)
    exec(compile(_unsloth_scoring_call(), "<rewrite>", "exec"), {}, names)  # noqa: S102 -- the package's own replacement text
    ((args, kwargs),) = names["self"]._adaptive_kl.calls  # a keyword call (backends/hooks.py)
    assert args == () and (kwargs["ref_logps"], kwargs["old_logps"], kwargs["mode"]) == ("ref", "old", "train")
    assert {name: kwargs[name] for name in ("left_pad", "completion_ids")} == {
        "left_pad": ("pads", 2, "ids", 7) if text_only else None, "completion_ids": "ids",
    }  # fmt: skip


def _installed_with(wrap, monkeypatch):
    """A throwaway GRPOTrainer subclass with the reward placement installed through ``wrap`` (TRL's plan), and a
    stand-in trainer whose runtime has the KL out of the loss."""
    from types import SimpleNamespace

    from trl import GRPOTrainer

    from unsloth_adaptive_kl import _source_patch
    from unsloth_adaptive_kl.backends import trl as trl_backend

    monkeypatch.setattr(_source_patch, "_ORIGINALS", list(_source_patch._ORIGINALS))  # this throwaway class stays out of unpatch()
    cls = type("Installed", (GRPOTrainer,), {})
    reward_placement.install(cls, reward_placement.TRL_PLAN, trl_backend.owners(), wrap=wrap)
    runtime = SimpleNamespace(generation_edits=frozenset({reward_placement.FEATURE_NAME}), reward_placement=SimpleNamespace(rewards_penalized=False))
    return cls, SimpleNamespace(_adaptive_kl=runtime)


def test_install_runs_the_rewritten_scoring_inside_the_wrapper_it_is_given(monkeypatch):
    """Unsloth wraps its generated scoring function (optimizer parking during rollouts, the inference-mode restore):
    with install(wrap=...), a reward-placement trainer's scoring runs through that wrapper, around the function compiled
    from the rewritten source."""
    wrapped = []

    def wrap(rewritten):
        def around(self, *args, **kwargs):
            wrapped.append(rewritten)
            self._adaptive_kl.reward_placement.rewards_penalized = True  # as the rewritten function's sum_then_normalize branch does
            return "scored inside the wrapper"

        return around

    cls, trainer = _installed_with(wrap, monkeypatch)
    assert cls._generate_and_score_completions(trainer, []) == "scored inside the wrapper"
    (rewritten,) = wrapped
    assert {"scoring_penalty", "penalized_rewards"} <= set(rewritten.__code__.co_names)  # the rewritten function
    assert rewritten.__name__ == reward_placement.TARGET_NAME


def test_a_scoring_that_does_not_reach_the_group_normalisation_is_refused_every_time(monkeypatch):
    """The dispatch clears the runtime's flag before each scoring: a scoring whose rewritten function did not reach
    sum_then_normalize (no penalty applied) is refused, also after an earlier scoring that did reach it."""
    from unsloth_adaptive_kl._source_patch import PatchError

    reaches = [True, False]

    def wrap(rewritten):
        def scoring(self, *args, **kwargs):
            if reaches.pop(0):
                self._adaptive_kl.reward_placement.rewards_penalized = True
            return "scored"

        return scoring

    cls, trainer = _installed_with(wrap, monkeypatch)
    assert cls._generate_and_score_completions(trainer, []) == "scored"
    with pytest.raises(PatchError, match="did not reach the rewards' group normalisation"):
        cls._generate_and_score_completions(trainer, [])


@pytest.mark.parametrize("per_device, steps_per_generation, processes, iterations, accumulation",
                         [(4, 2, 3, 1, 5), (8, 1, 1, 2, 8), (2, 4, 2, 1, 1), (3, 3, 1, 2, 7), (6, 1, 2, 1, 2)])  # fmt: skip
def test_completions_per_update_is_the_most_completions_scored_within_one_optimizer_step(
    per_device, steps_per_generation, processes, iterations, accumulation
):
    """TRL generates a batch of per_device x steps_per_generation x processes completions every steps_per_generation
    x num_iterations micro-steps, and an optimizer step spans gradient_accumulation_steps micro-steps: counted here
    over TRL's schedule, the most completions the batches scored within one optimizer step hold."""
    from types import SimpleNamespace

    args = SimpleNamespace(per_device_train_batch_size=per_device, steps_per_generation=steps_per_generation,
                           gradient_accumulation_steps=accumulation)  # fmt: skip
    every = steps_per_generation * iterations
    scored = [sum(1 for micro in range(step * accumulation, (step + 1) * accumulation) if micro % every == 0) for step in range(200)]
    expected = max(scored) * per_device * steps_per_generation * processes
    got = reward_placement.completions_per_update(args, processes, iterations)
    assert type(got) is int and got == expected


def test_completion_columns_reads_a_completion_that_starts_with_a_sampled_pad_in_the_longest_padded_row():
    """Hand-made left-packed layout (completions of width 3, longest left padding 2, pad id 0). Row 0 has the longest
    prompt padding and its completion [0, 6, 7] starts with a sampled pad: Unsloth moves that pad to the row's end
    with the prompt's, so 6 and 7 sit at columns 0 and 1 and no column is left of the window. Row 1: no prompt pad,
    completion [5, 6, 0] at columns 2 and 3."""
    from unsloth_adaptive_kl.backends.reward_placement import completion_columns

    packed = torch.tensor([[60.0, 70.0, -1.0, -1.0, -1.0], [-1.0, -1.0, 50.0, 60.0, -1.0]], dtype=torch.float64)
    values, kept = completion_columns(packed, torch.tensor([2, 0]), 2, torch.tensor([[0, 6, 7], [5, 6, 0]]), 0)
    assert values.tolist() == [[0.0, 60.0, 70.0], [50.0, 60.0, 0.0]]
    assert kept.tolist() == [[False, True, True], [True, True, False]]


@pytest.mark.parametrize("wrong", ["policy", "reference"])
def test_log_probs_of_another_shape_than_the_mask_are_refused_whichever_of_the_two_it_is(tiny_checkpoint, tmp_path, wrong):
    """A library version whose scoring-time log-probs are laid out otherwise than the completion mask is refused,
    naming the versions, where either the policy's or the reference's log-probs do not match (the other may)."""
    from unsloth_adaptive_kl._source_patch import PatchError, version_of

    trainer = make_trainer(tiny_checkpoint, tmp_path, kl_adaptation_method="none", kl_estimator="k1")
    mask, right, wider = torch.ones(4, 5), torch.zeros(4, 5), torch.zeros(4, 6)
    policy, ref = (wider, right) if wrong == "policy" else (right, wider)
    with pytest.raises(PatchError, match=rf"trl {version_of('trl')}: at scoring time the policy's log-probs have shape"):
        trainer._adaptive_kl.scoring_penalty(ref, policy, mask, None, "train")


def test_the_scoring_sums_carry_the_raw_and_the_shaped_kl_each_in_its_slot(tiny_checkpoint, tmp_path, monkeypatch):
    """Under a shaping method the controller's and the metrics' sums of a scored batch hold the raw KL in the raw
    slot and the shaped (clipped) KL in the adapted one, each against float64 values from the definitions."""
    trainer = make_trainer(tiny_checkpoint, tmp_path, kl_adaptation_method="clip", kl_estimator="k3", kl_clip_threshold=0.002)
    move_policy_away_from_reference(trainer)
    trainer.model.train()
    seen = {}
    out = _score(trainer, monkeypatch, seen)
    ((args, _, _),) = seen["per_token"]
    mask = out["completion_mask"].double()
    raw, shaped = reference.raw_and_shaped_kl("clip", args[1], args[2], args[1], mask, estimator="k3", clip_threshold=0.002,
                                              kl_target=0.02, bias_correction=False)  # fmt: skip
    assert (raw.sum() - shaped.sum()).abs() > 1e-3  # the clip acts on this batch
    sums = trainer._adaptive_kl._step_sums.double()
    assert sums[metrics.RAW_SUM].item() == pytest.approx(raw.sum().item(), rel=1e-5)
    assert sums[metrics.ADAPTED_SUM].item() == pytest.approx(shaped.sum().item(), rel=1e-5)


def test_the_trl_rewrite_leaves_the_excluded_tokens_out_of_the_penalty_and_the_controllers_sums(tiny_checkpoint, tmp_path, monkeypatch):
    """Issue 52, finding 1: with kl_exclude_token_ids=[eos] the subtracted penalties were β·Σ k3 with EOS included and
    the target controller's sums counted every valid token. On TRL's trainer the penalty is β·Σ k3 over the tokens
    that are not EOS, the advantages follow from it, and the sums count the kept tokens."""
    trainer = make_trainer(tiny_checkpoint, tmp_path, kl_adaptation_method="target", kl_estimator="k3", kl_horizon=1000.0,
                           kl_target=0.02)  # fmt: skip
    eos = trainer.processing_class.eos_token_id
    trainer.args.kl_exclude_token_ids = [eos]
    trainer._adaptive_kl.term = build(trainer.args).term
    out, rewards_per_func, args = spied_scoring(monkeypatch, trainer)
    kept = out["completion_mask"].bool() & (out["completion_ids"] != eos)
    assert (out["completion_mask"].bool() & (out["completion_ids"] == eos)).sum() >= 2  # EOS was sampled: the case tells
    assert torch.equal(args[3].bool(), kept)
    penalty, raw = reference.reward_penalty64("none", args[1], args[2], kept.double(), estimator="k3", beta=BETA,
                                              clip_threshold=0.05, kl_target=0.02)  # fmt: skip
    expected = reference.group_advantages64(rewards_per_func.double().sum(1) - penalty, trainer.num_generations)
    assert torch.allclose(out["advantages"].double(), expected, rtol=1e-4, atol=1e-4)
    sums = trainer._adaptive_kl._step_sums
    assert sums[metrics.TOKENS].item() == kept.sum().item()
    assert sums[metrics.RAW_SUM].item() == pytest.approx(raw.sum().item(), rel=1e-6)
