"""estimate_kl's treatment of padding, k3's bit-for-bit agreement with TRL's loss under a mask, and its errors
(issue 38: each test kills mutants that survived the core tests)."""

import pytest
import torch

from unsloth_adaptive_kl.estimators import estimate_kl, register_estimator, unregister_estimator


def test_a_user_estimator_sees_0_at_padding_whatever_the_padding_holds_and_its_output_there_is_0():
    """Padding may hold NaN or inf: the estimator receives 0 there in both logp and ref_logp (and the valid values
    unchanged), and its result is 0 there."""
    seen = []

    def recorder(logp, ref_logp):
        seen.append((logp.detach().clone(), ref_logp.clone()))
        return logp - ref_logp

    register_estimator("test_padding_recorder")(recorder)
    try:
        logp = torch.tensor([[-1.0, float("nan")], [-2.0, float("-inf")]], requires_grad=True)
        ref = torch.tensor([[-1.5, float("inf")], [-0.5, float("nan")]])
        mask = torch.tensor([[1, 0], [1, 0]])
        out = estimate_kl("test_padding_recorder", logp, ref, mask=mask)
    finally:
        unregister_estimator("test_padding_recorder")
    (logp_seen, ref_seen), = seen
    assert logp_seen.tolist() == [[-1.0, 0.0], [-2.0, 0.0]]
    assert ref_seen.tolist() == [[-1.5, 0.0], [-0.5, 0.0]]
    assert out.tolist() == [[0.5, 0.0], [-1.5, 0.0]]


def _trl_loss_gradient(per_token_kl, loss_type: str, seed: int) -> torch.Tensor:
    """d loss / d logp of TRL 1.15's GRPO loss (``GRPOTrainer._compute_loss``), float32, its graph built in TRL's
    order: the ratio, then the KL from ``per_token_kl(logp, ref, mask)``, then the policy term ('grpo': the clipped
    ratio; 'cispo': the detached clipped ratio times logp, a use of logp made after the KL's), β times the KL, and
    the masked mean per sequence."""
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(4, 33, generator=g) * 4).requires_grad_(True)
    ref = logp.detach() + torch.randn(4, 33, generator=g)
    old = logp.detach() + 0.1 * torch.randn(4, 33, generator=g)
    advantages = torch.randn(4, 1, generator=g)
    mask = (torch.rand(4, 33, generator=g) > 0.2).int()
    coef_1 = torch.exp(logp - old)
    kl = per_token_kl(logp, ref, mask)
    if loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=1.28).detach() * advantages * logp
    else:
        coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.2)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    per_token_loss = per_token_loss + 0.04 * kl
    loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    loss.backward()
    return logp.grad


@pytest.mark.parametrize("loss_type", ["grpo", "cispo"])
@pytest.mark.parametrize("seed", range(3))
def test_k3_under_a_mask_gives_trls_loss_gradient_bit_for_bit(loss_type, seed):
    """TRL writes k3 as exp(ref - logp) - (ref - logp) - 1 straight on logp; estimate_kl('k3', mask=...) must give logp
    the same gradient to the last bit: no node between logp and the two subtractions, which would change the order in
    which autograd sums logp's gradients where logp is used again after the KL (CISPO's policy term)."""
    trl = _trl_loss_gradient(lambda logp, ref, mask: torch.exp(ref - logp) - (ref - logp) - 1, loss_type, seed)
    ours = _trl_loss_gradient(lambda logp, ref, mask: estimate_kl("k3", logp, ref, mask=mask), loss_type, seed)
    assert torch.equal(ours, trl)


def test_an_estimator_parameter_without_a_value_is_refused_naming_it():
    logp, ref = torch.zeros(1, 4), torch.full((1, 4), -1.0)
    mask = torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"KL estimator 'bottom_q' needs a value for \['kl_bottom_q'\]; allowed: parameters=\{name: value\}"):
        estimate_kl("bottom_q", logp, ref, mask=mask, parameters={"kl_bottom_q": None})


def test_an_estimator_with_a_batch_statistic_given_neither_it_nor_a_mask_is_refused_naming_it():
    with pytest.raises(ValueError, match="KL estimator 'bottom_q' needs the completion mask for its batch statistic"):
        estimate_kl("bottom_q", torch.zeros(1, 4), torch.full((1, 4), -1.0))


def test_a_user_estimators_nan_on_finite_log_probs_is_refused_with_its_name_the_count_and_what_is_allowed():
    register_estimator("test_nan_twice")(lambda logp, ref_logp: torch.where(ref_logp < -2, float("nan"), logp - ref_logp))
    try:
        ref = torch.tensor([[-1.0, -3.0, -4.0, -0.5]])
        with pytest.raises(ValueError) as raised:
            estimate_kl("test_nan_twice", torch.zeros(1, 4), ref, mask=torch.ones(1, 4))
    finally:
        unregister_estimator("test_nan_twice")
    assert str(raised.value) == (
        "KL estimator 'test_nan_twice' returned NaN or inf on valid tokens whose log-probs were finite (2 of them): the "
        "bug is in the estimator; allowed: a finite value wherever logp and ref_logp are finite"
    )
