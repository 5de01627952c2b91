"""Every combination of the features the config accepts (issue 52): placement × token exclusions × kl_monitor × each
registered β controller (and none) × each shaping method (and none) × each estimator with a closed form, generated
from the registries. Each combination runs two optimizer steps through the trainer-side runtime on tiny tensors and
is checked against float64 references written from the definitions (tests/reference.py): the per-token KL, the
metrics, the reward penalty and the penalised rewards (under "reward"), the length-normalised term, and β after each
step. A combination the config refuses is checked to be refused, naming the field. Runs in seconds (no model).

Not here: bottom_q (its batch threshold has its own tests: tests/test_bottom_q_edges.py), the backends' aggregation
of the loss (tests/backends/), and user-registered functions (tests/test_user_code.py)."""

import itertools
import math
from types import SimpleNamespace

import pytest
import reference
import torch
from one_process_trainer import OneProcessTrainer

from unsloth_adaptive_kl import metrics
from unsloth_adaptive_kl.config import DEFAULTS, PLACEMENTS, controller_config
from unsloth_adaptive_kl.controllers import CONTROLLERS, controller_names
from unsloth_adaptive_kl.estimators import ESTIMATORS, builtin_estimator_names
from unsloth_adaptive_kl.method import parse_method
from unsloth_adaptive_kl.shaping import SHAPING, shaping_names

CONTROLLER_CHOICES = ["fixed", *(n for n in controller_names() if CONTROLLERS[n].builtin)]
SHAPING_CHOICES = ["none", *(n for n in shaping_names() if SHAPING[n].builtin)]
#: The estimators with a float64 closed form here (straight-through ones: their value is the base's).
VALUE_OF = {"k1+": "k1", "k3+": "k3"}
ESTIMATOR_CHOICES = [n for n in builtin_estimator_names() if VALUE_OF.get(n, n) in reference.RAW64]
EXCLUDED_ID = 3
SETTINGS = dict(
    beta_min=0.01, kl_clip_threshold=0.3, kl_target=0.1, kl_horizon=40.0, dynamic_beta_decay=0.5, reward_threshold=0.0,
    reward_window=2, beta_schedule_steps=2, beta_schedule="cosine", reward_beta_midpoint=0.5, reward_beta_width=0.25,
)  # fmt: skip
REWARDS = [1.0, 0.2]  # each step's mean reward: dynamic decays after the first (above reward_threshold 0), not after both
GROUP = 3


def _method(controller, shaping):
    parts = [p for p in (controller, shaping) if p not in ("fixed", "none")]
    return "+".join(parts) or "none"


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    rows, length = 2 * GROUP, 5
    logp = -torch.rand(rows, length, generator=g) * 2 - 0.1
    ref = logp + torch.rand(rows, length, generator=g) * 2.4 - 1.2
    old = logp + torch.rand(rows, length, generator=g) * 0.2 - 0.1
    ids = torch.randint(0, 6, (rows, length), generator=g)
    lengths = torch.tensor([5, 4, 2, 5, 3, 1])
    mask = (torch.arange(length) < lengths[:, None]).long()
    return logp, ref, old, ids, mask


def _expected_refusal(placement, monitor, shaping):
    """Which field the config must name, written from docs/kl-placement.md and docs/metrics-tail.md (None: valid)."""
    if placement == "reward" and shaping != "none" and not SHAPING[shaping].per_token and shaping != "length_normalized":
        return "kl_placement"
    return None


@pytest.mark.parametrize("shaping", SHAPING_CHOICES)
@pytest.mark.parametrize("controller", CONTROLLER_CHOICES)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_combination_of_features_matches_its_float64_reference(placement, controller, shaping):
    method = _method(controller, shaping)
    checked = 0
    for excluded, monitor, estimator in itertools.product([False, True], [False, True], ESTIMATOR_CHOICES):
        # kl_monitor acts at β = 0, which only "none" allows, in either placement (with beta_min 0: it may not exceed β)
        beta = 0.0 if monitor and method == "none" else 0.2
        args = SimpleNamespace(**{
            **DEFAULTS, **SETTINGS, "beta": beta, "beta_min": min(SETTINGS["beta_min"], beta), "kl_adaptation_method": method, "kl_estimator": estimator,
            "kl_placement": placement, "kl_monitor": monitor, "kl_exclude_token_ids": [EXCLUDED_ID] if excluded else None,
        })  # fmt: skip
        case = (placement, method, estimator, excluded, monitor)
        refusal = _expected_refusal(placement, monitor, shaping)
        if refusal is not None:
            with pytest.raises(ValueError, match=refusal):
                OneProcessTrainer(args)
            continue
        runtime = OneProcessTrainer(args)._adaptive_kl
        settings = controller_config(args, parse_method(method))
        if placement == "loss":
            _run_loss_placement(runtime, args, settings, controller, case)
        else:
            _run_reward_placement(runtime, args, settings, controller, case)
        checked += 1
    assert checked >= len(ESTIMATOR_CHOICES) * 2  # the case tells: every valid combination ran


def _kept(mask, ids, excluded):
    return mask.bool() & ~(ids == EXCLUDED_ID) if excluded else mask.bool()


def _next_beta(next_beta, beta, settings, kl, step, rewards, n):
    """``next_beta``: the run's float64 β step (``reference.stepper``: a fresh state for a stateful controller)."""
    trailing = sum(rewards) / len(rewards)
    return next_beta(beta, settings, kl, trailing, n, step=step, latest=rewards[-1])


def _run_loss_placement(runtime, args, settings, controller, case):
    _, method, estimator, excluded, monitor = case
    beta, next_beta = runtime.beta, reference.stepper(controller)
    assert beta == (reference.NEXT_BETA["schedule"](None, settings, None, None, 0, step=0) if controller == "schedule" else args.beta)
    for step, reward in enumerate(REWARDS, start=1):
        logp, ref, old, ids, mask = _batch(step)
        kept = _kept(mask, ids, excluded)
        kl_mask = runtime.term.kl_mask(mask, ids)
        assert torch.equal(kl_mask.bool(), kept), case
        assert runtime.monitor == monitor and runtime.beta == beta, case
        coef = torch.exp(logp - old)  # use_bias_correction_kl: the importance ratio
        raw, adapted = runtime.per_token(logp, ref, kl_mask, coef)
        raw64, shaped64 = reference.raw_and_shaped_kl(method, logp, ref, old, kept, estimator=VALUE_OF.get(estimator, estimator),
                                                      clip_threshold=args.kl_clip_threshold, kl_target=args.kl_target)  # fmt: skip
        torch.testing.assert_close(raw.double(), raw64, rtol=2e-5, atol=1e-6, msg=lambda m: f"{case}: {m}")
        torch.testing.assert_close(adapted.double(), shaped64, rtol=2e-5, atol=1e-6, msg=lambda m: f"{case}: {m}")
        values = runtime.record(raw, adapted, kl_mask, training=True, beta=beta)
        raw_mean, adapted_mean = reference.metric_reference(method, raw64, shaped64, kept)
        assert values[metrics.RAW_KL] == pytest.approx(raw_mean, rel=2e-5, abs=1e-7), case
        assert values[metrics.ADAPTED_KL] == pytest.approx(adapted_mean, rel=2e-5, abs=1e-7), case
        assert values[metrics.TOKEN_KL_MAX] == pytest.approx(raw64[kept].max().item(), rel=2e-5, abs=1e-7), case
        assert values[metrics.CURRENT_BETA] == beta
        if runtime.length_normalized:
            term = runtime.term.length_normalized_loss(adapted, kl_mask, beta=beta, num_completions=mask.shape[0])
            expected = beta * (shaped64.sum(-1) / kept.sum(-1).clamp(min=1)).mean()
            assert term.item() == pytest.approx(expected.item(), rel=2e-5, abs=1e-8), case
        runtime.observe_reward(reward)
        beta64 = _next_beta(next_beta, beta, settings, raw_mean, step, REWARDS[:step], mask.shape[0])
        beta = runtime.end_step(step)
        assert beta == pytest.approx(beta64, rel=1e-9, abs=1e-15), (case, step)


def _run_reward_placement(runtime, args, settings, controller, case):
    _, method, estimator, excluded, _ = case
    beta, next_beta = runtime.beta, reference.stepper(controller)
    alarm = _alarm_feed(runtime)
    for step, reward in enumerate(REWARDS, start=1):
        logp, ref, _, ids, mask = _batch(step)
        kept = _kept(mask, ids, excluded)
        penalty = runtime.scoring_penalty(ref, logp, mask, None, "train", completion_ids=ids)
        penalty64, raw64 = reference.reward_penalty64(method, logp, ref, kept.long(), estimator=VALUE_OF.get(estimator, estimator),
                                                      beta=beta, clip_threshold=args.kl_clip_threshold, kl_target=args.kl_target)  # fmt: skip
        rewards = torch.tensor([reward + 0.1 * i for i in range(mask.shape[0])])
        penalized = runtime.penalized_rewards(rewards, penalty, "train", GROUP)
        if beta == 0:  # kl_monitor at β = 0: no penalty, the rewards untouched (the same tensor)
            assert penalty is None and penalized is rewards, case
        else:
            torch.testing.assert_close(penalty, penalty64, rtol=2e-5, atol=1e-7, msg=lambda m: f"{case}: {m}")
            torch.testing.assert_close(penalized.double(), rewards.double() - penalty64, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case}: {m}")
        runtime.observe_reward(reward)
        kl = raw64.sum().item() / kept.sum().item()  # the controller (and the alarm) steer on the raw KL of the kept tokens
        beta64 = _next_beta(next_beta, beta, settings, kl, step, REWARDS[:step], mask.shape[0])
        beta = runtime.end_step(step)
        assert beta == pytest.approx(beta64, rel=1e-9, abs=1e-15), (case, step)
        assert alarm[-1][0] == step and alarm[-1][1] == pytest.approx(kl, rel=2e-5, abs=1e-9), (case, step)
    logged = runtime.trainer._metrics["train"]
    if runtime.beta == 0:
        assert metrics.KL_PENALTY not in logged and metrics.NONFINITE_PENALTIES not in logged, case
    else:
        assert len(logged[metrics.KL_PENALTY]) == len(REWARDS) and logged[metrics.NONFINITE_PENALTIES] == [0.0]


def _alarm_feed(runtime):
    """What the runaway alarm is fed at each step: ``(step, kl)``."""
    fed, end_step = [], runtime.alarm.end_step

    def record(step, kl):
        fed.append((step, kl))
        return end_step(step, kl)

    runtime.alarm.end_step = record
    return fed


def test_the_matrix_reads_every_registry():
    assert set(CONTROLLER_CHOICES) == {"fixed", *(n for n in CONTROLLERS if CONTROLLERS[n].builtin)}
    assert set(SHAPING_CHOICES) - {"none"} == {n for n in SHAPING if SHAPING[n].builtin}
    assert {VALUE_OF.get(n, n) for n in ESTIMATOR_CHOICES} == set(reference.RAW64)
    assert set(builtin_estimator_names()) - set(ESTIMATOR_CHOICES) <= {n for n in ESTIMATORS if ESTIMATORS[n].batch_statistic}
    assert math.prod(len(c) for c in (PLACEMENTS, CONTROLLER_CHOICES, SHAPING_CHOICES, ESTIMATOR_CHOICES)) * 4 >= 400
