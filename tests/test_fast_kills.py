"""Fast unit tests for what only slow or distant tests caught in issue 52's mutation run, and for its surviving
mutants outside the reward placement and the controllers: the tail metrics' cross-process reduction, the max over
masked tokens, abs's gradient at a log-ratio of 0, the Unsloth fused loss's statistics slots, and a bool refused for
an integer parameter. Each against a reference written here from the definitions (Python, float64)."""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from unsloth_adaptive_kl import metrics, tail
from unsloth_adaptive_kl.adaptation import AdaptiveKL
from unsloth_adaptive_kl.config import DEFAULTS, build, registered_parameters, validate
from unsloth_adaptive_kl.estimators import estimate_kl


def _config(**fields):
    return SimpleNamespace(**{**DEFAULTS, "beta": 0.1, **fields})


def _shard(seed, scale):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(3, 5, generator=g) - 0.1
    ref = logp + (torch.rand(3, 5, generator=g) * 2 - 1) * scale
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[2, 3:] = 0
    return logp, ref, mask


def test_the_tail_metrics_are_reduced_across_processes_with_the_sums():
    """Two processes (ranks 0 and 1): rank 1 holds the largest KL. Its shard reaches rank 0's statistics only
    through the one reduce; a reduce that left out the tail would log rank 0's own max and share."""
    shards = [_shard(1, 0.3), _shard(2, 2.0)]
    captured = {}
    other = AdaptiveKL(_config(), reduce=lambda t: captured.setdefault("rank1", t.clone()), process_index=1, num_processes=2)
    other.record(*other.per_token(*shards[1]), shards[1][2], training=True, beta=0.1)
    state = AdaptiveKL(_config(), reduce=lambda t: t + captured["rank1"], process_index=0, num_processes=2)
    values = state.record(*state.per_token(*shards[0]), shards[0][2], training=True, beta=0.1)
    kl = []
    for logp, ref, mask in shards:
        r = ref.double() - logp.double()
        kl += [v for v, m in zip((torch.exp(r) - r - 1).flatten().tolist(), mask.flatten().tolist()) if m]
    kl.sort()
    assert values[metrics.TOKEN_KL_MAX] == pytest.approx(kl[-1], rel=1e-6)
    shard0_max = max(v for v, m in zip(state.per_token(*shards[0])[0].flatten().tolist(), shards[0][2].flatten().tolist()) if m)
    assert kl[-1] > 2 * shard0_max  # the case tells: rank 0 alone has a much smaller max
    assert values[metrics.RAW_KL] == pytest.approx(sum(kl) / len(kl), rel=1e-5)
    share = kl[-1] / sum(kl)  # 28 tokens: the top 1 % is one token
    assert abs(values[metrics.TOKEN_KL_TOP1PCT_SHARE] - share) <= tail.SHARE_RELATIVE_ERROR * share + 1e-9


def test_the_tail_max_leaves_out_masked_tokens_when_every_valid_kl_is_negative():
    """A masked position holds 0 after masking: a max taken over it would be 0, not the valid tokens' -0.2."""
    raw = torch.tensor([[-0.5, -0.2, 0.0, 0.0], [-0.9, -0.3, -0.4, 0.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    local = tail.local_tail(raw, mask)
    assert local[-2].item() == pytest.approx(-0.2) and local[-1].item() == pytest.approx(-0.9)
    stats = tail.statistics(tail.TailTotals.from_reduced(tail.spread(local, 0, 1)))
    assert stats.maximum == pytest.approx(-0.2) and stats.tokens == 5


def test_abs_has_a_finite_gradient_where_the_policy_equals_the_reference():
    """|x| at x = 0: torch's abs gives the subgradient 0 there; a formulation such as sqrt(x²) gives NaN, which would
    reach every parameter through the backward pass."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.5, -0.5]])
    kl = estimate_kl("abs", logp, ref, mask=torch.ones(1, 3))
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad.tolist() == [[0.0, -1.0, 0.0]]  # d|logp - ref|/dlogp = sign(logp - ref), 0 at 0


@pytest.mark.parametrize("value", [True, False])
@pytest.mark.parametrize("field", [p.name for p in registered_parameters(builtin=True) if p.type in (int, float)])
def test_a_bool_is_refused_for_an_integer_parameter(field, value):
    """A surviving mutant (issue 52): with the check of declarations.checked_number dropped, reward_window=True and
    beta_schedule_steps=False passed (a bool is an int in Python). Every numeric parameter of the registries."""
    if field not in DEFAULTS:
        pytest.skip(f"{field} is not a field here")
    with pytest.raises(ValueError, match=rf"{field}={value!r} is not valid; allowed:"):
        validate(_config(**{field: value}))


def test_the_unsloth_fused_statistics_carry_unsloths_kl_first_then_the_metric_sums():
    """Unsloth's fused loss returns ``[unsloth_kl, local sums...]`` in its mean_kl slot; the trainer logs the sums
    and hands back Unsloth's kl. A swap of the two would log Unsloth's kl as a sum (and the other way round)."""
    from unsloth_adaptive_kl.backends._trainer import TrainerAdaptiveKL
    from unsloth_adaptive_kl.backends.unsloth import STATS_SIZE, FusedKLInputs, UnslothAdaptiveKL

    term = build(_config(kl_estimator="k3")).term
    logp, ref, mask = _shard(3, 0.8)
    raw, adapted = term.per_token(logp, ref, mask)
    inputs = FusedKLInputs(term=term, beta=torch.tensor(0.1), num_completions=torch.tensor(3.0), statistic=None,
                           tail_edges=tail.edges_on(raw.device))  # fmt: skip
    loss, stats = inputs.finish(torch.tensor(1.5), torch.tensor(0.123), raw, adapted, mask, None, 1)
    assert stats.shape == (STATS_SIZE,) and stats[0].item() == pytest.approx(0.123) and loss.item() == 1.5
    expected = metrics.local_metric_sums(raw, adapted, mask, tail.edges_on(raw.device))
    assert torch.equal(stats[1:], expected)

    class _Trainer:
        args = _config(kl_estimator="k3")
        accelerator = SimpleNamespace(reduce=lambda t, reduction: t, gather=lambda t: t, process_index=0, num_processes=1)
        _metrics = {"train": defaultdict(list), "eval": defaultdict(list)}

        @property
        def beta(self):
            return self._adaptive_kl.beta

    trainer = _Trainer()
    trainer._adaptive_kl = UnslothAdaptiveKL(trainer)
    trainer._adaptive_kl.fused_computes_kl = True  # what the fused loss's β gate records where the runtime tracks it
    assert isinstance(trainer._adaptive_kl, TrainerAdaptiveKL)
    assert trainer._adaptive_kl.record_fused(stats, "train") == pytest.approx(0.123)
    r = ref.double() - logp.double()
    k3 = [v for v, m in zip((torch.exp(r) - r - 1).flatten().tolist(), mask.flatten().tolist()) if m]
    assert trainer._metrics["train"][metrics.RAW_KL] == [pytest.approx(sum(k3) / len(k3), rel=1e-6)]
    assert trainer._metrics["train"][metrics.TOKEN_KL_MAX] == [pytest.approx(max(k3), rel=1e-6)]
    assert math.isclose(trainer._metrics["train"][metrics.CURRENT_BETA][0], 0.1)
