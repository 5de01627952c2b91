"""``kl_placement="reward"`` at its seams (issue 52, findings 1, 5 and 7, and a surviving mutant): token exclusions
at scoring time, a NaN or inf penalty, the per-token bound, the warning when the KL outweighs a group's task rewards,
and ``kl_penalty`` over the scored completions only. Fast: the placement's own methods on a stand-in trainer (the
rewrite's calls are tested on TRL's and Unsloth's trainers in tests/backends/), against float64 references written
here from docs/kl-placement.md."""

import logging
import math
from types import SimpleNamespace

import pytest
import reference
import torch
from one_process_trainer import OneProcessTrainer

from unsloth_adaptive_kl import metrics
from unsloth_adaptive_kl import kl_term
from unsloth_adaptive_kl.config import DEFAULTS


class _Trainer(OneProcessTrainer):
    """The placement's trainer: kl_placement='reward', k3, β 0.1, the config's defaults otherwise."""

    def __init__(self, **fields):
        super().__init__(SimpleNamespace(**{**DEFAULTS, "beta": 0.1, "kl_placement": "reward", "kl_estimator": "k3", **fields}))


def _k3_64(logp, ref):
    d = ref.double() - logp.double()
    return torch.exp(d) - d - 1


def _batch(seed=0, rows=4, length=6, eos=1):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, length, generator=g) * 2 - 0.2
    ref = logp + torch.rand(rows, length, generator=g) * 1.6 - 0.8
    ids = torch.randint(2, 9, (rows, length), generator=g)
    lengths = torch.tensor([6, 4, 5, 3])[:rows]
    mask = (torch.arange(length) < lengths[:, None]).long()
    ids[torch.arange(rows), lengths - 1] = eos  # each completion ends with EOS
    return logp, ref, mask, ids


def test_excluded_tokens_get_no_penalty_and_leave_the_controllers_sums():
    """Finding 1: with kl_exclude_token_ids=[eos] the penalties were β·Σ k3 with EOS included, and the controller's
    sums counted every valid token. The penalty is β·Σ k3 over the kept tokens, and so are the sums."""
    trainer = _Trainer(kl_exclude_token_ids=[1], kl_adaptation_method="target", kl_target=0.05, kl_horizon=1000.0)
    runtime = trainer._adaptive_kl
    logp, ref, mask, ids = _batch()
    penalty = runtime.scoring_penalty(ref, logp, mask, None, "train", completion_ids=ids)
    kept = mask.bool() & (ids != 1)
    kl = torch.where(kept, _k3_64(logp, ref), 0.0)
    assert torch.allclose(penalty, 0.1 * kl.sum(-1), rtol=1e-6, atol=1e-9)
    with_eos = 0.1 * torch.where(mask.bool(), _k3_64(logp, ref), 0.0).sum(-1)
    assert (penalty - with_eos).abs().min() > 5e-5  # every completion's EOS carried KL: the case tells
    sums = runtime._step_sums
    assert sums[metrics.TOKENS].item() == kept.sum().item() == mask.sum().item() - 4
    assert sums[metrics.RAW_SUM].item() == pytest.approx(kl.sum().item(), rel=1e-6)


def test_a_scoring_call_without_the_token_ids_under_exclusions_is_refused():
    trainer = _Trainer(kl_exclude_token_ids=[1])
    logp, ref, mask, _ = _batch()
    with pytest.raises(Exception, match=r"kl_exclude_token_ids=\[1\] needs the completion tokens.*got None \(the sampled token ids at scoring time"):
        trainer._adaptive_kl.scoring_penalty(ref, logp, mask, None, "train")


def test_each_tokens_kl_enters_the_penalty_clamped_to_ten_as_verls_k3_and_the_clamp_is_said_once(caplog):
    """Finding 5: one token at log-ratio +8 has k3 = e^8 - 9 = 2,972 and erased its group's task signal. Each token's
    KL enters the penalty clamped to [-10, 10] (verl's clamp of k3's value); a warning says so once."""
    trainer = _Trainer(kl_estimator="k3")
    logp = torch.full((2, 3), -1.0)
    ref = logp.clone()
    ref[0, 1] += 8.0  # k3 = e^8 - 8 - 1
    ref[1, 0] += 0.5
    mask = torch.ones(2, 3, dtype=torch.long)
    with caplog.at_level(logging.WARNING, logger="unsloth_adaptive_kl"):
        penalty = trainer._adaptive_kl.scoring_penalty(ref, logp, mask, None, "eval", completion_ids=torch.zeros(2, 3))
        trainer._adaptive_kl.scoring_penalty(ref, logp, mask, None, "eval", completion_ids=torch.zeros(2, 3))
    assert math.exp(8) - 9 > 2900
    assert penalty.tolist() == pytest.approx([0.1 * 10.0, 0.1 * (math.exp(0.5) - 1.5)], rel=1e-6)  # float32 log-probs
    (warning,) = [r.getMessage() for r in caplog.records if "clamped" in r.getMessage()]
    assert "1 token(s)" in warning and "2972" in warning


def test_a_nan_or_inf_penalty_makes_its_completion_unscored_is_counted_and_warned_once_and_the_rest_is_logged(caplog):
    """Finding 7: a NaN penalty silently zeroed its completion's advantage and kl_penalty vanished for the whole batch.
    Now it is counted, warned about once, and the finite penalties are still logged; an inf penalty is treated alike
    (subtracted, it would have made its group's mean -inf)."""
    trainer = _Trainer()
    runtime = trainer._adaptive_kl
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, math.nan, 0.2, 0.1])
    penalty = torch.tensor([0.1, math.nan, 0.3, 0.2, math.inf, 0.4, 0.05, 0.15], dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="unsloth_adaptive_kl"):
        out = runtime.penalized_rewards(rewards, penalty, "train", 4)
        runtime.penalized_rewards(rewards, penalty, "train", 4)
    expected = [1.0 - 0.1, math.nan, 1.0 - 0.3, 0.0 - 0.2, math.nan, math.nan, 0.2 - 0.05, 0.1 - 0.15]
    assert out.dtype == rewards.dtype
    assert [v if v == v else "nan" for v in out.tolist()] == [pytest.approx(v) if v == v else "nan" for v in expected]
    logged = trainer._metrics["train"]
    assert logged[metrics.KL_PENALTY] == [pytest.approx((0.1 + 0.3 + 0.2 + 0.05 + 0.15) / 5)] * 2
    assert logged[metrics.NONFINITE_PENALTIES] == [4.0]  # 2 a batch, summed over the logging window
    assert len([r for r in caplog.records if "NaN or inf KL penalty" in r.getMessage()]) == 1


def test_kl_penalty_is_the_mean_over_the_scored_completions_only():
    """A surviving mutant (issue 52): averaging over the completions no reward function scored (NaN reward) too."""
    trainer = _Trainer()
    rewards = torch.tensor([1.0, math.nan, 0.0, math.nan])
    penalty = torch.tensor([0.1, 0.9, 0.3, 0.7], dtype=torch.float64)
    trainer._adaptive_kl.penalized_rewards(rewards, penalty, "eval", 2)
    assert trainer._metrics["eval"][metrics.KL_PENALTY] == [pytest.approx(0.2)]


def test_a_group_whose_penalties_spread_wider_than_its_rewards_is_counted_and_warned_once(caplog):
    """Finding 5: the issue's case, one completion of a group of 4 right and 4 wrong answers with a penalty of 119 at
    β 0.04 (one token at log-ratio +8): seven completions then got the same advantage. Such a group is counted and
    warned about; a group of equal rewards (no task signal to lose) and a group the KL does not outweigh are not."""
    rewards = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0] + [0.5] * 8 + [1.0, 0.0] * 4
    penalty = [119.0] + [0.08] * 7 + [0.3, 5.0] + [0.1] * 6 + [0.1, 0.2] * 4
    spreads = reference.group_spreads64(rewards, penalty, 8)
    expected = [p > r > 0 for p, r in spreads]
    assert expected == [True, False, False]
    trainer = _Trainer()
    with caplog.at_level(logging.WARNING, logger="unsloth_adaptive_kl"):
        trainer._adaptive_kl.penalized_rewards(torch.tensor(rewards), torch.tensor(penalty, dtype=torch.float64), "train", 8)
        trainer._adaptive_kl.penalized_rewards(torch.tensor(rewards), torch.tensor(penalty, dtype=torch.float64), "train", 8)
    assert trainer._metrics["train"][metrics.KL_DOMINATED_GROUPS] == [2.0]
    (warning,) = [r.getMessage() for r in caplog.records if "spread wider" in r.getMessage()]
    assert "in 1 of 3 groups" in warning and "penalties over 118.9" in warning and "rewards over 1" in warning


@pytest.mark.parametrize("seed", range(5))
def test_the_dominated_groups_match_a_python_loop_on_random_batches_with_unscored_and_nonfinite_entries(seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (24,), generator=g).double() / 2
    rewards[torch.rand(24, generator=g) < 0.15] = math.nan
    penalty = torch.rand(24, generator=g).double() * 1.5
    penalty[torch.rand(24, generator=g) < 0.1] = math.inf
    spreads = reference.group_spreads64(rewards.tolist(), penalty.tolist(), 4)
    count, worst = kl_term.kl_dominated_groups(rewards, penalty, 4)
    assert count == sum(p > r > 0 for p, r in spreads)
    if count:
        assert worst == max(((p, r) for p, r in spreads if p > r > 0), key=lambda s: s[0] / s[1])


def test_a_group_of_equal_task_rewards_whose_penalties_differ_is_counted_and_warned_once(caplog):
    """An audit's finding: a group whose task rewards are all equal gets advantage 0 in stock GRPO; with the KL in the
    reward its advantages come from the KL alone, which TRL's group std scales to unit size at any β, while
    kl_dominated_groups (groups whose rewards differ) counted none of them."""
    rewards = [1.0] * 4 + [1.0, 0.0, 1.0, 0.0] + [0.5] * 4 + [0.0, 0.0, math.nan, 0.0]
    penalty = [0.01, 0.02, 0.01, 0.03] + [0.01] * 4 + [0.2] * 4 + [0.1, 0.1, 0.5, 0.1]
    # equal rewards and differing penalties: group 0 only (group 2's penalties are equal; group 3's differ only where unscored)
    assert kl_term.kl_only_groups(torch.tensor(rewards), torch.tensor(penalty, dtype=torch.float64), 4) == 1
    trainer = _Trainer()
    with caplog.at_level(logging.WARNING, logger="unsloth_adaptive_kl"):
        for _ in range(2):
            trainer._adaptive_kl.penalized_rewards(torch.tensor(rewards), torch.tensor(penalty, dtype=torch.float64), "train", 4)
    assert trainer._metrics["train"][metrics.KL_ONLY_GROUPS] == [2.0]  # summed over the logging window
    (warning,) = [r.getMessage() for r in caplog.records if "same task reward" in r.getMessage()]
    assert "in 1 of 4 groups" in warning and metrics.KL_ONLY_GROUPS in warning


@pytest.mark.parametrize("seed", range(5))
def test_the_kl_only_groups_match_a_python_loop_on_random_batches(seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (32,), generator=g).double()
    rewards[torch.rand(32, generator=g) < 0.15] = math.nan
    penalty = torch.randint(0, 2, (32,), generator=g).double() / 10
    penalty[torch.rand(32, generator=g) < 0.1] = math.inf
    expected = 0
    for start in range(0, 32, 4):
        kept = [i for i in range(start, start + 4) if rewards[i] == rewards[i] and math.isfinite(penalty[i])]
        r, p = {rewards[i].item() for i in kept}, {penalty[i].item() for i in kept}
        expected += len(kept) >= 2 and len(r) == 1 and len(p) > 1
    assert kl_term.kl_only_groups(rewards, penalty, 4) == expected
