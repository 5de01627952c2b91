"""Hypothesis fuzzing: random configurations × random inputs for every estimator, every shaping
combination and every registered β controller, against float64 references (written in this file, or in
tests/reference.py)."""

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reference
from reference import BUILTIN_SHAPING, shaped64
from test_adversarial import BUILTINS, adaptive, float64_kl
from unsloth_adaptive_kl.shaping import length_normalized_term
from unsloth_adaptive_kl.controllers import ControllerConfig, controller_names, make_controller

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def batches(draw):
    """(logp, ref, mask): float32 log-probs in [-30, 0], log-ratios up to ±40 (beyond k3's bound), ragged mask."""
    rows, width = draw(st.integers(1, 4)), draw(st.integers(0, 6))
    floats = lambda lo, hi: st.lists(st.floats(lo, hi, width=32), min_size=rows * width, max_size=rows * width)  # noqa: E731
    logp = torch.tensor(draw(floats(-30, 0)), dtype=torch.float32).view(rows, width)
    ref = logp + torch.tensor(draw(floats(-40, 40)), dtype=torch.float32).view(rows, width)
    lengths = draw(st.lists(st.integers(0, width), min_size=rows, max_size=rows))
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return logp, ref, mask


@st.composite
def configs(draw):
    shaping = draw(st.lists(st.sampled_from(list(BUILTIN_SHAPING)), unique=True))
    controller = draw(st.sampled_from([[], *([name] for name in controller_names())]))
    parts = draw(st.permutations(shaping + controller))  # any written order means the same method
    return dict(
        method="+".join(parts) or "none",
        estimator=draw(st.sampled_from(BUILTINS)),
        clip=draw(st.floats(0.01, 5.0)),
        target=draw(st.floats(0.01, 5.0)),
        q=draw(st.floats(0.05, 1.0)),
    )


@FUZZ
@given(configs(), batches(), st.booleans())
def test_per_token_and_length_normalised_term_match_float64(config, batch, with_coef):
    logp, ref, mask = batch
    state = adaptive(config["method"], config["estimator"], kl_clip_threshold=config["clip"], kl_target=config["target"], kl_bottom_q=config["q"])
    coef = torch.exp(torch.linspace(-1, 1, logp.numel()).view_as(logp)) if with_coef else None
    raw, adapted = state.per_token(logp, ref, mask, coef, statistic=state.batch_statistic(ref, mask))
    valid = mask.bool()
    raw64 = float64_kl(config["estimator"], logp, ref, q=config["q"], mask=mask)
    if coef is not None:
        raw64 = raw64 * coef.double()
    raw64 = torch.where(valid, raw64, 0.0)
    adapted64 = torch.where(valid, shaped64(raw64, config["method"], config["clip"], config["target"]), 0.0)
    torch.testing.assert_close(raw.double(), raw64, rtol=2e-5, atol=1e-4)
    torch.testing.assert_close(adapted.double(), adapted64, rtol=2e-5, atol=1e-4)
    term = length_normalized_term(adapted, mask, mask.shape[0])
    expected = (adapted64.sum(-1) / valid.sum(-1).clamp(min=1)).sum() / mask.shape[0]
    assert term.item() == pytest.approx(expected.item(), rel=2e-5, abs=1e-4)


# -- β controllers ----------------------------------------------------------------------------------
def dynamic64(cfg: ControllerConfig, steps):
    """The dynamic controller, written out: trailing mean of the last `reward_window` finite rewards;
    at most one decay per new finite reward (a step without one, reward None, reuses a generation batch)."""
    beta, window, out, new = cfg.beta if cfg.beta_schedule_steps > 0 else cfg.beta_min, [], [], False
    for step, (reward, _kl, _n) in enumerate(steps):
        if reward is not None and math.isfinite(reward):
            window, new = (window + [reward])[-cfg.reward_window :], True
        if beta != 0.0:
            if step + 1 >= cfg.beta_schedule_steps:
                beta = cfg.beta_min
            elif new:
                new = False
                if sum(window) / len(window) > cfg.reward_threshold:
                    beta = max(cfg.beta_min, beta * cfg.dynamic_beta_decay)
        out.append(beta)
    return out


def fixed64(cfg: ControllerConfig, steps):
    return [cfg.beta] * len(steps)


def target64(cfg: ControllerConfig, steps):
    beta, out = cfg.beta, []
    for _reward, kl, n in steps:
        if beta != 0.0 and kl is not None and math.isfinite(kl):
            error = min(max(kl / cfg.kl_target - 1, -0.2), 0.2)
            beta = max(cfg.beta_min, beta * (1 + error * n / cfg.kl_horizon))
        out.append(beta)
    return out


#: The exact references of this file (the same float operations as the controller, non-finite inputs included); every
#: other registered controller is checked against tests/reference.py's float64 step (:func:`stepwise64`).
EXACT64 = {"fixed": fixed64, "dynamic": dynamic64, "ziegler": target64}  # not a registry list: the exact ones written here


def stepwise64(name: str, cfg: ControllerConfig, steps):
    """β after each step from :func:`reference.stepper` (``name``'s float64 step), fed what the controller observes: the
    step's KL if finite (a non-finite one is skipped), the step's reward if finite (``latest``) and then the trailing
    mean of the last ``reward_window`` finite rewards (``reward``; None without a new one); β = 0 is final."""
    step64, beta, window, out = reference.stepper(name), cfg.beta, [], []
    for index, (reward, kl, n) in enumerate(steps):
        latest = reward if reward is not None and math.isfinite(reward) else None
        if latest is not None:
            window = (window + [latest])[-cfg.reward_window :]
        finite_kl = kl if kl is not None and math.isfinite(kl) else None
        trailing = sum(window) / len(window) if latest is not None else None
        if beta != 0.0:
            beta = step64(beta, cfg, finite_kl, trailing, n, step=index + 1, latest=latest)
        out.append(beta)
    return out


def skips(name: str, cfg: ControllerConfig, *, reward=None, kl=None) -> bool:
    """Whether a fresh ``name`` controller counts this one observation as skipped (a non-finite value it reads)."""
    controller = make_controller(name, cfg)
    if reward is not None:
        controller.observe_reward(reward)
    controller.update(global_step=1, kl=kl, num_completions=1)
    return controller.skipped_updates == 1


@st.composite
def controller_runs(draw):
    beta = draw(st.floats(1e-4, 1.0))
    cfg = ControllerConfig(
        beta=beta,
        beta_min=draw(st.sampled_from([0.0, beta * draw(st.floats(0, 1))])),
        dynamic_beta_decay=draw(st.floats(0.01, 1.0)),
        reward_threshold=draw(st.floats(-1, 1)),
        reward_window=draw(st.integers(1, 5)),
        beta_schedule_steps=draw(st.integers(0, 12)),
        beta_schedule=draw(st.sampled_from(["linear", "cosine"])),
        kl_target=draw(st.floats(1e-3, 1.0)),
        kl_horizon=draw(st.floats(50.0, 1e4)),
        reward_beta_midpoint=draw(st.floats(-1, 1)),
        reward_beta_width=draw(st.floats(0.05, 2.0)),
        target_warmup_steps=draw(st.integers(0, 4)),
        target_patience=draw(st.integers(1, 4)),
    )
    non_finite = st.sampled_from([float("nan"), float("inf"), float("-inf")])
    step = st.tuples(
        st.one_of(st.floats(-1, 1), non_finite, st.none()),  # None: no generation batch this step
        st.one_of(st.none(), st.floats(0, 3), non_finite),
        st.integers(1, 8),
    )
    return cfg, draw(st.lists(step, min_size=1, max_size=15))


@settings(FUZZ, max_examples=25 * (1 + len(controller_names())))  # about 25 runs per controller (and "fixed")
@given(controller_runs(), st.sampled_from(["fixed", *controller_names()]), st.data())
def test_controllers_follow_their_reference_and_resume_exactly(run, name, data):
    cfg, steps = run
    exact = name in EXACT64
    expected = EXACT64[name](cfg, steps) if exact else stepwise64(name, cfg, steps)
    split = data.draw(st.integers(0, len(steps)))
    controller = make_controller(name, cfg)
    betas = []
    for index, (reward, kl, n) in enumerate(steps):
        if index == split:  # a checkpoint: a fresh controller continues from the saved state
            state = controller.state_dict()
            controller = make_controller(name, cfg)
            controller.load_state_dict(state)
        if reward is not None:
            controller.observe_reward(reward)
        betas.append(controller.update(global_step=index + 1, kl=kl, num_completions=n))
    if exact:
        assert betas == expected  # exact: the same float operations in the same order
    else:
        assert betas == pytest.approx(expected, rel=1e-9, abs=1e-300)
    assert all(math.isfinite(b) and b >= 0 for b in betas)
    state = controller.state_dict()
    assert json.loads(json.dumps(state, allow_nan=False)) == state  # no NaN/inf anywhere in the state
    reads_reward, reads_kl = skips(name, cfg, reward=math.inf), skips(name, cfg, kl=math.nan)
    non_finite = sum(1 for r, kl, _ in steps if (reads_reward and r is not None and math.isinf(r)) or (reads_kl and kl is not None and not math.isfinite(kl)))
    if name != "fixed" and 0.0 not in betas[:-1]:  # updates stop counting once β is 0
        assert state["skipped_updates"] == non_finite
