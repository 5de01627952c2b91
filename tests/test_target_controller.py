"""``target`` (issue 49) on synthetic plants that are not the fitted simulator of research/controller_sim: a KL that
lags β, drifts upward and does not respond to β at first is held without wind-up (where Ziegler's controller, on the
same plant, winds up); a target below every KL the plant can reach is declared unreachable within the stated number
of updates, once, with β capped; a run resumed from its state mid-way gives the identical β series; and ``ziegler``
(Ziegler et al.'s controller, ``target`` before issue 49) is bit-identical to that controller's formula, with an old
``target`` checkpoint resuming under it and refused by the new ``target`` with the fix named."""

import json
import logging
import math
import random

import pytest
import reference

from unsloth_adaptive_kl.controllers import CONTROLLERS, ControllerConfig, TargetKLBeta, make_controller
from unsloth_adaptive_kl.metrics import TARGET_REACHABLE
from unsloth_adaptive_kl.target_controller import HeldTargetKL

N = 64  # completions per optimizer step
STEPS = 200


class LaggedDriftingPlant:
    """ln KL = ln D(t) - (z_t - ln 0.02), z_t following ln β with a lag of `tau` steps, D(t) = 0.01 (1 + 2 t / 200)
    (the KL triples over the run at a fixed β); before step `dead` the KL does not respond to β at all (it is
    0.3 D(t)); multiplicative noise e^(0.1 w), w standard normal from a seeded generator."""

    def __init__(self, seed=0, tau=6.0, dead=100):
        self.rng, self.tau, self.dead, self.t, self.z = random.Random(seed), tau, dead, 0, None

    def step(self, beta):
        self.t += 1
        self.z = math.log(beta) if self.z is None else self.z + (math.log(beta) - self.z) / self.tau
        drift = 0.01 * (1 + 2 * self.t / STEPS)
        level = 0.3 * drift if self.t < self.dead else drift * math.exp(-(self.z - math.log(0.02)))
        return level * math.exp(0.1 * self.rng.gauss(0.0, 1.0))


def run(controller, plant, steps=STEPS):
    betas, kls = [], []
    for step in range(1, steps + 1):
        betas.append(controller.beta)
        kls.append(plant.step(controller.beta))
        controller.update(global_step=step, kl=kls[-1], num_completions=N)
    return betas, kls


def trailing(values, window=10):
    return [sum(values[i - window:i]) / window for i in range(window, len(values) + 1)]


def test_a_lagged_drifting_kl_that_does_not_respond_at_first_is_held_without_wind_up():
    """Target 0.03 (β_need 0.02 at the end, 0.0067-0.013 over the run). For 100 steps the KL is 0.3 D(t), far below
    the target whatever β: `target` stops lowering β once it has halved without a response (never below β0 / 2),
    and when the KL starts responding it holds it (the final 50 steps' mean within ±25 %, no 10-step mean above
    1.6 × the target). Ziegler's controller, fed the same plant, lowers β at its full rate for the whole dead
    phase, and the KL overshoots past 3 × the target when it responds: the plant exercises wind-up."""
    target, beta0 = 0.03, 0.02
    betas, kls = run(make_controller("target", ControllerConfig(beta0, kl_target=target)), LaggedDriftingPlant())
    final = sum(kls[-50:]) / 50
    assert abs(math.log(final / target)) <= math.log(1.25), final
    assert min(betas[:100]) >= beta0 / 2  # the freeze: while the KL does not respond, β falls at most ×1/2
    assert max(trailing(kls[100:])) <= 1.6 * target

    z_betas, z_kls = run(make_controller("ziegler", ControllerConfig(beta0, kl_target=target, kl_horizon=640.0)), LaggedDriftingPlant())
    assert min(z_betas) < beta0 / 4 and max(trailing(z_kls[100:])) > 3 * target


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_held_target_survives_other_noise_draws(seed):
    betas, kls = run(make_controller("target", ControllerConfig(0.02, kl_target=0.03)), LaggedDriftingPlant(seed=seed))
    assert abs(math.log(sum(kls[-50:]) / 50 / 0.03)) <= math.log(1.25)


def stated_updates(ratio, cfg):
    """The stated number of updates within which a KL staying at ``ratio`` × kl_target, not responding to β, is
    declared unreachable: β must first move ×2 or reach the top of its range, whichever is nearer (at the step ln β
    rises by, ``min(gain · min(ln ratio, 1), ln max_rise)``; at least the one update that starts the episode), then
    stay frozen for ``target_patience`` updates (docs/methods.md)."""
    rise = min(cfg.target_gain * min(math.log(ratio), 1.0), math.log(cfg.target_max_rise))
    return max(1, math.ceil(min(math.log(2.0), math.log(cfg.target_beta_range)) / rise)) + cfg.target_patience


@pytest.mark.parametrize("ratio", [1.3, 1.6, 3.0, 10.0])
def test_a_kl_that_does_not_respond_is_declared_unreachable_within_the_stated_updates_once_and_beta_is_capped(ratio, caplog):
    cfg = ControllerConfig(0.1, kl_target=0.01)
    c = make_controller("target", cfg)
    assert c.metrics() == {TARGET_REACHABLE: 1.0}
    betas, declared = [], None
    with caplog.at_level(logging.WARNING, logger="unsloth_adaptive_kl"):
        for step in range(1, 301):
            c.update(global_step=step, kl=ratio * 0.01, num_completions=N)
            betas.append(c.beta)
            if declared is None and c.metrics()[TARGET_REACHABLE] == 0.0:
                declared = step
    assert declared is not None and declared <= stated_updates(ratio, cfg), (declared, stated_updates(ratio, cfg))
    (message,) = [r.getMessage() for r in caplog.records if "not reachable" in r.getMessage()]
    assert "kl_target=0.01 is not reachable" in message and "did not fall by a fifth over 10 updates" in message
    # the least KL above the target was seen at the start, at β0
    assert f"Its least smoothed value above the target was {ratio * 0.01:.4g}, at beta=0.1." in message
    assert "A KL still growing with training looks the same to this test" in message
    assert set(betas[declared - 1:]) == {0.1} and max(betas) < 0.2  # capped where it stopped; never pushed to ×2


class DesignOne(HeldTargetKL):
    """``target`` as study 49's first design ran it on the GPU: a push the range's bound blocks is not frozen."""

    freeze_at_bounds = False


@pytest.mark.parametrize("beta_range, ratio", [(1.5, 3.0), (1.2, 1.6), (1.0, 10.0)])
def test_a_kl_above_the_target_with_beta_at_the_top_of_its_range_is_declared_within_the_stated_updates(beta_range, ratio):
    """Design 2 (study 49, Amendment 1). With β's range narrower than ×2 the push is blocked at the range's top before
    β has moved ×2; the blocked updates count as frozen, so a KL that does not respond is declared unreachable within
    the updates to the top plus ``target_patience``. Design 1, fed the same KL, never declares it: the failure seen on
    the GPU (β at 5 × β0 for 130 updates, the KL 2-14 × a target below every KL the run reached, never declared)."""
    cfg = ControllerConfig(0.1, kl_target=0.01, target_beta_range=beta_range)
    for cls, should_declare in ((HeldTargetKL, True), (DesignOne, False)):
        c, declared = cls(cfg), None
        for step in range(1, 301):
            c.update(global_step=step, kl=ratio * 0.01, num_completions=N)
            assert c.beta <= 0.1 * beta_range * (1 + 1e-12)
            if declared is None and c.metrics()[TARGET_REACHABLE] == 0.0:
                declared = step
        if should_declare:
            assert declared is not None and declared <= stated_updates(ratio, cfg), (declared, stated_updates(ratio, cfg))
            assert c.beta == c.ceiling == 0.1  # the least KL (the first) was seen at β0
        else:
            assert declared is None and c.beta == pytest.approx(0.1 * beta_range)


def test_a_kl_that_wanders_into_the_band_while_beta_sits_at_its_top_is_still_declared():
    """The GPU's case: the KL answers β at first (0.05 × 0.1 / β: β climbs, each ×2 freeze sees a response), reaches
    the target with β at the top of its range (5 × β0 = 0.5; the KL in the ±25 % band ends the episode), then grows
    to 3 × the target (the run's own growth, from step 101). The new episode's anchor is the top, so β can never move
    ×2 from it. Design 2 freezes there and declares the target within ``target_patience`` + 2 updates of the KL's
    jump (the smoothed KL leaves the band at the 2nd); design 1 never does."""
    for cls, should_declare in ((HeldTargetKL, True), (DesignOne, False)):
        c, declared = cls(ControllerConfig(0.1, kl_target=0.01)), None
        for step in range(1, 201):
            c.update(global_step=step, kl=0.05 * (0.1 / c.beta) if step <= 100 else 0.03, num_completions=N)
            assert c.beta <= 0.5
            if step == 100:
                assert c.beta == 0.5 and c.episode is None and c.reachable  # at the top, held: no episode
            if declared is None and not c.reachable:
                declared = step
        if should_declare:
            assert 100 < declared <= 100 + c.config.target_patience + 2, declared
            assert c.beta == c.ceiling < 0.5
        else:
            assert declared is None and c.beta == 0.5


def test_a_target_below_a_non_monotone_kl_caps_beta_where_the_kl_was_least():
    """KL = 0.02 (1 + 0.5 ln(β / 0.05)^2), least (0.02) at β 0.05, target 0.005: from β0 0.02 raising β first lowers
    the KL, then raises it past 0.05. The cap is the β at which the smoothed KL was least, near 0.05; β never
    exceeds 1.5 × that afterwards and ends at the cap."""
    c = make_controller("target", ControllerConfig(0.02, kl_target=0.005))
    betas = []
    for step in range(1, 301):
        kl = 0.02 * (1 + 0.5 * math.log(c.beta / 0.05) ** 2)
        c.update(global_step=step, kl=kl, num_completions=N)
        betas.append(c.beta)
    assert c.reachable is False
    assert 0.03 <= c.ceiling <= 0.08 and betas[-1] == c.ceiling and max(betas) <= 0.1


def open_loop_kls(seed=3, steps=160):
    """A KL series for the resume tests: near the target, then above it (an unreachable stretch), then below."""
    rng = random.Random(seed)
    levels = [0.012] * 40 + [0.05] * 70 + [0.004] * (steps - 110)
    return [level * math.exp(0.5 * rng.gauss(0.0, 1.0)) for level in levels]


@pytest.mark.parametrize("split", [15, 45, 70, 125])
def test_a_run_resumed_from_its_json_state_gives_the_identical_beta_series(split):
    """Mid warm-up, mid-episode, frozen, and after the target was declared unreachable."""
    cfg = ControllerConfig(0.1, kl_target=0.01)
    kls = open_loop_kls()
    whole = make_controller("target", cfg)
    series = [whole.update(global_step=s, kl=kl, num_completions=N) for s, kl in enumerate(kls, start=1)]
    first = make_controller("target", cfg)
    resumed_series = [first.update(global_step=s, kl=kl, num_completions=N) for s, kl in enumerate(kls[:split], start=1)]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = make_controller("target", cfg)
    resumed.load_state_dict(state)
    resumed.resume_at(split + 1)
    resumed_series += [resumed.update(global_step=s, kl=kl, num_completions=N) for s, kl in enumerate(kls[split:], start=split + 1)]
    assert resumed_series == series  # exactly
    assert resumed.state_dict() == whole.state_dict()
    assert whole.reachable is False  # the series covers a declaration


@pytest.mark.parametrize("settings", [dict(beta_min=0.03), dict(target_beta_range=1.5)])  # the second sits at its top
def test_target_matches_its_float64_reference_step_by_step(settings):
    cfg = ControllerConfig(0.1, kl_target=0.01, **settings)
    c, step, beta = make_controller("target", cfg), reference.stepper("target"), 0.1
    for s, kl in enumerate(open_loop_kls(seed=5), start=1):
        beta = step(beta, cfg, kl, None, N, step=s)
        assert c.update(global_step=s, kl=kl, num_completions=N) == pytest.approx(beta, rel=1e-12), s


@pytest.mark.parametrize(
    "state, words",
    [
        ({"updates": -1}, "updates=-1"),
        ({"kl_mean": float("nan")}, "kl_mean=nan"),
        ({"episode": [2, 0.1, 0.01, 0, 0.0]}, "episode=[2, 0.1, 0.01, 0, 0.0]"),
        ({"ceiling": 0.0}, "ceiling=0.0"),
        ({"reachable": 1}, "reachable=1"),
    ],
)
def test_a_checkpoint_with_an_invalid_target_state_is_refused_and_nothing_is_loaded(state, words):
    c = make_controller("target", ControllerConfig(0.1, kl_target=0.01))
    good = c.state_dict()
    with pytest.raises(ValueError, match="allowed") as info:
        c.load_state_dict({**good, **state, "beta": 0.2})
    assert words in str(info.value) and c.state_dict() == good


# -- ziegler: today's target, kept by name ---------------------------------------------------------------------------
def test_ziegler_is_the_unchanged_class_and_its_beta_series_is_bit_identical_to_ziegler_s_formula():
    """The formula written in float64 with the operations of the controller `target` was before issue 49
    (``e = clip(kl / kl_target - 1, ±0.2)``, ``beta = max(beta_min, beta * (1 + e * n / kl_horizon))``): equal, not
    approximately, over 1,000 steps of KLs around the target and varying step sizes."""
    assert CONTROLLERS["ziegler"].cls is TargetKLBeta
    cfg = ControllerConfig(0.05, kl_target=0.02, kl_horizon=640.0, beta_min=1e-4)
    c, beta, rng = make_controller("ziegler", cfg), 0.05, random.Random(7)
    for step in range(1, 1001):
        kl, n = 0.02 * math.exp(rng.gauss(0.0, 0.6)), rng.choice([16, 64, 100])
        beta = reference.NEXT_BETA["ziegler"](beta, cfg, kl, None, n)
        assert c.update(global_step=step, kl=kl, num_completions=n) == beta, step


def old_target_state():
    """A state as the 'target' of before issue 49 wrote it: Ziegler's controller's, named 'target'."""
    old = TargetKLBeta(ControllerConfig(0.05, kl_target=0.02, kl_horizon=640.0))
    for step in range(1, 11):
        old.update(global_step=step, kl=0.03, num_completions=N)
    return {**old.state_dict(), "name": "target"}, old


def test_an_old_target_checkpoint_resumes_under_ziegler_exactly():
    state, old = old_target_state()
    resumed = make_controller("ziegler", ControllerConfig(0.05, kl_target=0.02, kl_horizon=640.0))
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert resumed.beta == old.beta
    assert [resumed.update(global_step=s, kl=0.01, num_completions=N) for s in range(11, 31)] == [
        old.update(global_step=s, kl=0.01, num_completions=N) for s in range(11, 31)
    ]


def test_the_new_target_refuses_an_old_target_checkpoint_and_names_the_fix():
    from types import SimpleNamespace

    from unsloth_adaptive_kl import FIELDS, AdaptiveKL

    state, _ = old_target_state()
    config = SimpleNamespace(**{**{f.name: f.default for f in FIELDS}, "beta": 0.05, "kl_adaptation_method": "target+clip"})
    runtime = AdaptiveKL(config)
    with pytest.raises(ValueError) as info:
        runtime.load_state_dict({"controller": state, "kl_adaptation_method": "target+clip"})
    message = str(info.value)
    assert "written by 'target' before issue 49" in message
    assert "kl_adaptation_method='ziegler'" in message and "restart_beta_controller=True" in message
    assert runtime.beta == 0.05 and runtime.controller.updates == 0  # nothing loaded
    runtime.load_state_dict({"controller": state, "kl_adaptation_method": "target+clip"}, restart=True)  # the named fix
    assert runtime.beta == 0.05
    ziegler = AdaptiveKL(SimpleNamespace(**{**vars(config), "kl_adaptation_method": "ziegler+clip"}))
    ziegler.load_state_dict({"controller": state, "kl_adaptation_method": "target+clip"})  # the other named fix
    assert ziegler.beta == state["beta"]


def test_the_new_targets_own_checkpoint_is_not_taken_for_an_old_one():
    c = make_controller("target", ControllerConfig(0.1, kl_target=0.01))
    with pytest.raises(ValueError, match="cannot load β-controller state of 'target' into a 'ziegler' controller"):
        make_controller("ziegler", ControllerConfig(0.1)).load_state_dict(c.state_dict())


def _stop_updates(cfg):
    """The update at which a KL far below the target, never rising, has kept β stopped ``target_patience`` updates:
    no fall in the ``target_warmup_steps`` updates, then ×``target_max_fall`` an update while the next step stays
    within ×1/2 of β0 (the episode began at update 1, at β0), then ``target_patience`` frozen updates."""
    falls = math.floor(math.log(0.5) / math.log(cfg.target_max_fall))  # β0 · fall^k >= β0 / 2
    if cfg.target_max_fall ** falls * cfg.beta <= cfg.beta / 2 + 1e-15:
        falls -= 1
    return cfg.target_warmup_steps + falls + cfg.target_patience, cfg.beta * cfg.target_max_fall ** falls


@pytest.mark.parametrize("beta0, kl", [(1.0, 0.005), (0.02, 1e-4)])
def test_a_kl_far_below_the_target_that_never_rises_is_said_once_when_beta_stops(beta0, kl, caplog):
    """Study 51's run from β0 1: the KL 30 times below the target; β stops at half its start and stays. The warning
    comes once, at the stated update, with β where it stopped; β's path is the formula's (the warning changes no β)."""
    cfg = ControllerConfig(beta0, kl_target=0.15)
    c = make_controller("target", cfg)
    at, stopped = _stop_updates(c.config)
    warned, betas = [], []
    with caplog.at_level(logging.WARNING, logger="unsloth_adaptive_kl"):
        for step in range(1, 121):
            before = len(caplog.records)
            c.update(global_step=step, kl=kl, num_completions=N)
            betas.append(c.beta)
            warned += [step for r in caplog.records[before:] if "lowers beta no further" in r.getMessage()]
    assert warned == [at]
    (message,) = [r.getMessage() for r in caplog.records if "lowers beta no further" in r.getMessage()]
    assert f"beta stopped at {stopped:.4g}, half the beta where this fall began ({beta0:.4g})" in message
    assert "for 10 updates" in message and "kl_target=0.15" in message
    expected = [beta0] * c.config.target_warmup_steps + [
        max(beta0 * c.config.target_max_fall ** k, stopped) for k in range(1, 121 - c.config.target_warmup_steps)]
    assert betas == pytest.approx(expected, rel=1e-12)
    assert c.metrics() == {TARGET_REACHABLE: 1.0}  # below the target nothing is declared


def test_beta_stopped_at_its_range_floor_below_the_target_names_the_bound(caplog):
    cfg = ControllerConfig(0.02, kl_target=0.15, target_beta_range=1.5, target_warmup_steps=0)
    c = make_controller("target", cfg)
    with caplog.at_level(logging.WARNING, logger="unsloth_adaptive_kl"):
        for step in range(1, 80):
            c.update(global_step=step, kl=1e-4, num_completions=N)
    (message,) = [r.getMessage() for r in caplog.records if "lowers beta no further" in r.getMessage()]
    assert c.beta == pytest.approx(0.02 / 1.5) and "its lower bound (0.01333: beta / target_beta_range" in message
