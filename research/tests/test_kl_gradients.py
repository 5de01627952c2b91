"""The cases of the exact KL-gradient study (research/kl_gradient_study.py) that theory settles.

The references here are written independently of the script's sum over completions: the sequence
KL by its chain rule over states, ``KL(pi || ref) = sum_s d(s) KL(pi_s || ref_s)`` with ``d(s)`` the
probability that a completion passes through prefix ``s``, and per-state divergences. Every
identity is checked with a case that must fail it (the estimator or the placement swapped).
"""

from __future__ import annotations

import importlib.util
import itertools
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("kl_gradient_study", ROOT / "research" / "kl_gradient_study.py")
study_module = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = study_module  # dataclasses look their module up by name
_spec.loader.exec_module(study_module)

EXACT = 1e-10  # float64 sums of a few hundred terms
BIASED = 0.02  # every biased case here is above it (the closest: abs in the loss, one-token completions, 0.046)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tensors of a few thousand elements: threads only add overhead
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def study():
    return study_module.make_study()


def visitation(logits, study):
    """d(s): the probability that a completion passes through prefix s (a product over the prefix's tokens)."""
    logp = torch.log_softmax(logits, -1)
    index = {p: i for i, p in enumerate(study.completions.prefixes)}
    return torch.stack([sum((logp[index[p[:t]], p[t]] for t in range(len(p))), torch.zeros((), dtype=torch.float64)).exp() for p in study.completions.prefixes])


def state_kls(logits, ref_logits, direction):
    logp, ref = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    if direction == "reverse":  # KL(pi_s || ref_s)
        return (logp.exp() * (logp - ref)).sum(-1)
    return (ref.exp() * (ref - logp)).sum(-1)  # forward: KL(ref_s || pi_s)


def grad_of(fn, study):
    theta = study.logits.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(fn(theta), theta)
    return grad.flatten()


def sequence_kl_gradient(study):
    """grad of sum_s d(s) KL_s: the sequence KL by its chain rule."""
    return grad_of(lambda th: (visitation(th, study) * state_kls(th, study.ref_logits, "reverse")).sum(), study)


def state_part(study, direction="reverse", visits=None):
    """sum_s d(s) grad D_s with d frozen (the current policy's, or ``visits``)."""
    d = visitation(study.logits, study) if visits is None else visits
    return grad_of(lambda th: (d * state_kls(th, study.ref_logits, direction)).sum(), study)


def visitation_part(study):
    """sum_s KL_s grad d(s) with the state KLs frozen."""
    kls = state_kls(study.logits, study.ref_logits, "reverse")
    return grad_of(lambda th: (visitation(th, study) * kls).sum(), study)


def rel(g, target):
    return float((g - target).norm() / target.norm())


def loss(study, estimator, correction, loss_type="luspo", **kw):
    return study_module.loss_placement_gradient(study, estimator, loss_type, bias_correction=correction, **kw)[0]


def reward(study, estimator, loss_type="luspo", **kw):
    return study_module.reward_placement_gradient(study, estimator, loss_type, **kw)[0]


def test_the_truth_is_the_chain_rule_sum_and_splits_into_a_state_part_and_a_visitation_part(study):
    truth = study_module.true_gradient(study)
    assert rel(truth, sequence_kl_gradient(study)) < EXACT
    assert rel(truth, state_part(study) + visitation_part(study)) < EXACT
    assert float(visitation_part(study).norm()) > BIASED * float(truth.norm())  # the part every per-token loss misses is not 0 here


@pytest.mark.parametrize("placement, estimator, unbiased", [
    ("reward", "k1", True),
    ("reward", "k1+", True),  # same value as k1; the straight-through gradient is detached in the reward
    ("reward", "k3", False),
    ("reward", "k2", False),
    ("loss", "k1", False),
    ("loss", "k2", False),
])
@pytest.mark.parametrize("loss_type", ["luspo", "dr_grpo"])
def test_on_policy_only_k1_in_the_reward_gives_the_sequence_kl_gradient(study, placement, estimator, unbiased, loss_type):
    truth = study_module.true_gradient(study)
    scale = 1.0 if loss_type == "luspo" else 1.0 / study.completions.max_length
    grad = reward(study, estimator, loss_type) if placement == "reward" else loss(study, estimator, False, loss_type)
    assert (rel(grad, scale * truth) < EXACT) is unbiased


@pytest.mark.parametrize("loss_type", study_module.LOSS_TYPES)
def test_on_policy_the_reward_placement_is_the_same_with_the_token_or_the_sequence_ratio(study, loss_type):
    token, sequence = (reward(study, "k3", loss_type, level=level) for level in ("token", "sequence"))
    assert rel(sequence, token) < EXACT
    assert rel(loss(study, "k3", True, loss_type, level="sequence"), loss(study, "k3", True, loss_type)) > BIASED  # unlike the KL loss term


@pytest.mark.parametrize("estimator, correction, is_state_part", [
    ("k2", False, True),
    ("k1+", False, True),
    ("k3+", False, True),
    ("k3", True, True),  # TRL's default: k3 times the (undetached) ratio has k2's gradient on-policy
    ("k1", True, True),
    ("k3", False, False),
    ("k2", True, False),
    ("k1+", True, False),  # the ratio's gradient times k1's value adds a second k2 gradient
    ("k3+", True, False),
    ("k3", "sequence", False),  # TRL's sequence-level ratio: its gradient is the mean score, broadcast
])
def test_on_policy_per_token_losses_give_at_most_the_state_part(study, estimator, correction, is_state_part):
    level = correction if correction == "sequence" else "token"
    grad = loss(study, estimator, bool(correction), level=level)
    assert (rel(grad, state_part(study)) < EXACT) is is_state_part
    assert rel(grad, study_module.true_gradient(study)) > BIASED  # never the whole gradient at max length 3


@pytest.mark.parametrize("estimator, expected", [("k1+", "2S"), ("k3+", "2S-F"), ("k2", None)])
def test_straight_through_estimators_with_the_bias_correction_add_their_value_to_the_k2_gradient(study, estimator, expected):
    """With TRL's correction, grad(k * ratio) = (k' + k) grad log pi: k1+ gives 2S, k3+ gives 2S - sum d grad F."""
    grad = loss(study, estimator, True)
    s_part, f_part = state_part(study), state_part(study, "forward")
    assert (rel(grad, 2 * s_part) < EXACT) is (expected == "2S")
    assert (rel(grad, 2 * s_part - f_part) < EXACT) is (expected == "2S-F")


def test_on_policy_k1_in_the_loss_has_zero_expected_gradient(study):
    assert float(loss(study, "k1", False).norm()) < 1e-12
    assert float(loss(study, "k2", False).norm()) > 1e-3


@pytest.mark.parametrize("placement, correction, direction", [("loss", False, "forward"), ("loss", True, "reverse")])
def test_k3_in_the_loss_without_correction_is_the_forward_kl_per_state_and_k3_in_the_reward_misses_it(study, placement, correction, direction):
    grad = loss(study, "k3", correction)
    forward = state_part(study, "forward")
    assert (rel(grad, forward) < EXACT) is (direction == "forward")
    truth = study_module.true_gradient(study)
    assert rel(reward(study, "k3"), truth - forward) < EXACT
    assert rel(reward(study, "k3"), truth - state_part(study, "reverse")) > BIASED


@pytest.mark.parametrize("max_length, exact", [(1, True), (3, False)])
# not a registry list: the cases the claim is about (docs/kl-gradients.md)
@pytest.mark.parametrize("estimator, correction", [("k2", False), ("k3", True), ("k3+", False)])
def test_per_token_losses_are_unbiased_only_for_one_token_completions(max_length, exact, estimator, correction):
    s = study_module.make_study(max_length=max_length)
    assert (rel(loss(s, estimator, correction), study_module.true_gradient(s)) < EXACT) is exact


# not a registry list: the cases the claim is about (docs/kl-gradients.md)
@pytest.mark.parametrize("estimator, correction", [("k3", False), ("abs", False), ("k2", True), ("k1+", True)])
def test_other_losses_are_biased_even_for_one_token_completions(estimator, correction):
    s = study_module.make_study(max_length=1)
    assert rel(loss(s, estimator, correction), study_module.true_gradient(s)) > BIASED


def test_k2_of_the_sequence_log_ratio_in_the_loss_is_unbiased_and_per_token_k2_is_not(study):
    truth = study_module.true_gradient(study)
    assert rel(study_module.sequence_k2_loss_gradient(study)[0], truth) < EXACT
    assert rel(loss(study, "k2", False), truth) > BIASED


@pytest.mark.parametrize("level, estimator, correction, old_state_part", [
    ("token", "k3", True, True),
    ("token", "k1", True, True),
    ("sequence", "k3", True, False),  # TRL's exp(mean log-ratio) broadcast over the tokens
    ("token", "k3", False, False),
    ("token", "k2", False, False),
])
def test_off_policy_the_token_ratio_corrects_each_state_but_not_the_visitation(study, level, estimator, correction, old_state_part):
    grad = loss(study, estimator, correction, level=level, on_policy=False)
    old_visits = visitation(study.old_logits, study)
    assert (rel(grad, state_part(study, visits=old_visits)) < EXACT) is old_state_part
    assert rel(grad, state_part(study)) > 1e-3  # the old policy's visitation, not the current one's


@pytest.mark.parametrize("estimator, correction, exact", [("k3", True, True), ("k1", True, True), ("k3", False, False), ("k2", False, False)])
def test_off_policy_one_token_completions_need_the_importance_ratio(estimator, correction, exact):
    s = study_module.make_study(max_length=1)
    grad = loss(s, estimator, correction, on_policy=False)
    assert (rel(grad, study_module.true_gradient(s)) < EXACT) is exact


def kl_gradient_to(study, other_logits):
    """grad KL(pi || other) of the sequence distributions, by the chain rule over states."""
    return grad_of(lambda th: (visitation(th, study) * state_kls(th, other_logits, "reverse")).sum(), study)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("estimator, old_penalty", [("k1", True), ("k3", False)])
def test_off_policy_k1_in_the_reward_also_pulls_towards_the_old_policy_whose_log_probs_made_the_penalty(level, estimator, old_penalty):
    """One-token completions, where TRL's ratios are the exact ratio: grad KL(pi||ref) - grad KL(pi||pi_old)."""
    s = study_module.make_study(max_length=1)
    grad = reward(s, estimator, level=level, on_policy=False)
    target = kl_gradient_to(s, s.ref_logits) - kl_gradient_to(s, s.old_logits)
    assert (rel(grad, target) < EXACT) is old_penalty
    assert rel(grad, study_module.true_gradient(s)) > BIASED


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_dapo_weights_are_the_exact_expectation_of_the_batch_token_normaliser(study, batch):
    """Against a brute-force sum over every batch: E[sum_i S(y_i) / sum_i |y_i|] = sum_y p(y) w(y) S(y) for any S."""
    c = study.completions
    probs = study_module.sequence_probs(study.logits, c)
    values = torch.randn(probs.numel(), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    batches = torch.cartesian_prod(*[torch.arange(probs.numel())] * batch).view(-1, batch)
    brute = (probs[batches].prod(-1) * values[batches].sum(-1) / c.lengths[batches].sum(-1)).sum()
    weights, _ = study_module.completion_weights("dapo", c.lengths, probs, c.max_length, batch=batch)
    assert abs(float((probs * weights * values).sum() - brute)) < 1e-12
    grpo, _ = study_module.completion_weights("grpo", c.lengths, probs, c.max_length)
    assert (batch == 1) is bool(torch.allclose(weights, grpo))  # one completion: dapo's normaliser is its own length


@pytest.mark.parametrize("scale_rewards", ["none", "group"])
def test_group_advantage_weights_match_every_ordered_group(scale_rewards):
    """Against TRL's formula written out over every ordered group (a smaller problem: 7 completions, groups of 3)."""
    s = study_module.make_study(vocab_size=3, max_length=2)
    probs = study_module.sequence_probs(s.logits, s.completions)
    penalty = torch.rand(probs.numel(), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    task = torch.rand(probs.numel(), generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    weights = study_module.group_advantage_weights(penalty, probs, group=3, scale_rewards=scale_rewards, beta=0.5, task_reward=task)
    reward_of = task - 0.5 * penalty
    brute = torch.zeros_like(probs)
    for members in itertools.product(range(probs.numel()), repeat=3):
        rewards = reward_of[list(members)]
        advantage = rewards[0] - rewards.mean()
        if scale_rewards == "group":
            advantage = advantage / (rewards.std() + 1e-4)
        brute[members[0]] += probs[list(members[1:])].prod() * advantage
    assert torch.allclose(weights, brute, rtol=0, atol=1e-12)


@pytest.mark.parametrize("scale_rewards, estimator, scaled_truth", [("none", "k1", True), ("group", "k1", False), ("none", "k3", False)])
def test_mean_centred_group_advantages_keep_k1_in_the_reward_unbiased_up_to_one_minus_one_over_g(study, scale_rewards, estimator, scaled_truth):
    group = 3
    grad = study_module.group_gradient(study, estimator, scale_rewards=scale_rewards, beta=0.1, group=group)
    target = (1 - 1 / group) * 0.1 * study_module.true_gradient(study)
    assert (rel(grad, target) < EXACT) is scaled_truth


def test_the_study_covers_every_built_in_estimator_but_bottom_q():
    names = set(study_module.study_estimators())
    from unsloth_adaptive_kl.estimators import ESTIMATORS, builtin_estimator_names

    assert {name for name in builtin_estimator_names() if ESTIMATORS[name].batch_statistic is None} <= names
    assert "bottom_q" not in names


def test_docs_hold_the_tables_the_script_prints():
    text = study_module.DOC.read_text()
    generated = study_module.report()
    assert study_module.replace_generated(text, generated) == text, "run: python research/kl_gradient_study.py --write"
