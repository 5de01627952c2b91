"""The ziegler controller's saturation warning (Ziegler et al.'s controller, `target` before issue 49): a run of updates whose error ``kl / kl_target - 1`` was clipped at the
same bound (+0.2: "above", -0.2: "below") is warned about once per direction, at the update where the product of
the run's full-rate factors ``1 ± 0.2 * n / kl_horizon`` first reaches 2 (or falls to 1/2).

The expected update comes from :func:`first_doubling`, a float64 loop over the logs of the factors written here
from that definition (not the controller's product), and, for a constant ``n``, from the closed form
``ceil(ln 2 / ±ln(1 ± 0.2 n / kl_horizon))``, which the tests check the loop against."""

import math

import pytest

from unsloth_adaptive_kl.controllers import ControllerConfig, make_controller

#: Far from every target: the error clips at +0.2 ("above") or -0.2 ("below").
RATIO = {"above": 5.0, "below": 0.1}
#: (completions per step, kl_horizon): fast, slow and an odd rate.
RATES = [(8, 40.0), (16, 1000.0), (3, 7.0)]


def first_doubling(direction: str, completions: list[int], kl_horizon: float) -> int:
    """The 1-based update at which β, moving at its full rate (error ±0.2) with ``completions[i]`` completions at
    update i, would first have doubled ("above") or halved ("below"): sum of ln(1 ± 0.2 n / H) reaching ±ln 2."""
    sign = 1.0 if direction == "above" else -1.0
    total = 0.0
    for update, n in enumerate(completions, start=1):
        total += math.log1p(sign * 0.2 * n / kl_horizon)
        if sign * total >= math.log(2.0):
            return update
    raise AssertionError("the sequence is too short to double or halve β")


def closed_form(direction: str, n: int, kl_horizon: float) -> int:
    """The brief's count for a constant n: ceil(ln 2 / ln(1 + 0.2 n / H)) up, ceil(ln 2 / -ln(1 - 0.2 n / H)) down."""
    if direction == "above":
        return math.ceil(math.log(2.0) / math.log(1.0 + 0.2 * n / kl_horizon))
    return math.ceil(math.log(2.0) / -math.log(1.0 - 0.2 * n / kl_horizon))


def controller(beta=0.1, *, kl_target=0.05, kl_horizon=40.0, beta_min=0.0):
    return make_controller("ziegler", ControllerConfig(beta, kl_target=kl_target, kl_horizon=kl_horizon, beta_min=beta_min))


def saturation_warnings(caplog) -> list[str]:
    return [m for m in (r.getMessage() for r in caplog.records if r.name == "unsloth_adaptive_kl") if "ziegler: the KL has stayed" in m]


def drive(c, kls, completions, caplog) -> list[int]:
    """Update ``c`` once per (kl, n); the 1-based indices of the updates after which a saturation warning appeared."""
    warned_at = []
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        for update, (kl, n) in enumerate(zip(kls, completions, strict=True), start=1):
            before = len(saturation_warnings(caplog))
            c.update(global_step=update, kl=kl, num_completions=n)
            warned_at += [update] * (len(saturation_warnings(caplog)) - before)
    return warned_at


@pytest.mark.parametrize("direction", list(RATIO))
@pytest.mark.parametrize(("n", "kl_horizon"), RATES)
def test_the_reference_loop_agrees_with_the_closed_form_for_a_constant_step_size(direction, n, kl_horizon):
    assert first_doubling(direction, [n] * 10_000, kl_horizon) == closed_form(direction, n, kl_horizon)


@pytest.mark.parametrize("direction", list(RATIO))
@pytest.mark.parametrize(("n", "kl_horizon"), RATES)
def test_a_saturated_run_warns_exactly_at_the_update_where_full_rate_beta_would_have_doubled_or_halved(direction, n, kl_horizon, caplog):
    expected = first_doubling(direction, [n] * 10_000, kl_horizon)
    c = controller(kl_horizon=kl_horizon)
    assert drive(c, [RATIO[direction] * 0.05] * expected, [n] * expected, caplog) == [expected]


def test_a_long_saturated_run_warns_once(caplog):
    expected = closed_form("above", 8, 40.0)
    c = controller(beta=0.001)  # β stays finite over the run
    assert drive(c, [0.25] * (20 * expected), [8] * (20 * expected), caplog) == [expected]


@pytest.mark.parametrize("interruption", [0.055, 0.001], ids=["unclipped", "clipped-the-other-way"])
def test_one_update_not_clipped_in_the_runs_direction_restarts_the_count(interruption, caplog):
    """k - 1 saturated updates, one that is not (within 20 % of the target, or below it), k - 1 again: an unreset
    count would warn at the interruption's k-th; a reset one first warns k saturated updates after it."""
    k = closed_form("above", 8, 40.0)
    kls = [0.25] * (k - 1) + [interruption] + [0.25] * k
    assert drive(controller(), kls, [8] * len(kls), caplog) == [2 * k]


def test_each_direction_warns_once_in_one_controller(caplog):
    up, down = closed_form("above", 8, 40.0), closed_form("below", 8, 40.0)
    kls = [0.25] * (3 * up) + [0.005] * (3 * down) + [0.25] * (3 * up)
    warned_at = drive(controller(), kls, [8] * len(kls), caplog)
    assert warned_at == [up, 3 * up + down]
    above, below = saturation_warnings(caplog)
    assert "20 % above kl_target=0.05" in above
    assert "20 % below kl_target=0.05" in below


def test_a_beta_held_at_beta_min_with_the_kl_below_target_is_saturated(caplog):
    """β cannot fall below beta_min: the updates are counted by their clipped error, not by β's movement."""
    c = controller(beta=0.02, beta_min=0.02)
    k = closed_form("below", 8, 40.0)
    assert drive(c, [0.005] * (2 * k), [8] * (2 * k), caplog) == [k]
    assert c.beta == 0.02
    (message,) = saturation_warnings(caplog)
    assert "went from 0.02 to beta_min=0.02: the target may be above the KL this run reaches; beta is held there" in message


def test_a_controller_tracking_its_target_never_warns(caplog):
    """The KL within 20 % of the target over many steps, never clipped: around it either side (errors up to
    ±0.19), then 19 % above and 19 % below it for long stretches, where β moves at 19/20 of its full rate."""
    kls = [0.05 * (1.0 + 0.19 * math.sin(0.37 * step)) for step in range(3000)] + [0.0595] * 1000 + [0.0405] * 1000
    assert drive(controller(beta=0.001), kls, [8] * len(kls), caplog) == []


@pytest.mark.parametrize("no_observation", [math.nan, math.inf, -math.inf, None])
def test_non_finite_and_missing_kls_neither_count_nor_restart_the_run(no_observation, caplog):
    """One such update before every saturated one: counted, the warning would come early; resetting, never."""
    k = closed_form("above", 8, 40.0)
    kls = [no_observation, 0.25] * k
    assert drive(controller(), kls, [8] * len(kls), caplog) == [2 * k]


def test_a_changing_step_size_counts_each_updates_own_full_rate_factor(caplog):
    """Valid-token counts and batch sizes change every step in a real run: each update's own n sets its factor."""
    sizes = [8, 3, 16, 5, 12, 1, 7] * 20
    expected = first_doubling("above", sizes, 40.0)
    assert expected not in (closed_form("above", sizes[0], 40.0), closed_form("above", 7, 40.0))
    assert drive(controller(), [0.25] * len(sizes), sizes, caplog) == [expected]


def test_a_beta_of_zero_never_warns(caplog):
    """β = 0 is absorbing: the controller no longer moves, so nothing saturates."""
    kls = [0.25] * 100 + [0.005] * 100
    assert drive(controller(beta=0.0), kls, [8] * len(kls), caplog) == []


def test_the_run_is_not_checkpointed_and_restarts_after_a_resume(caplog):
    """The checkpoint format is unchanged; a resumed controller (load + resume_at) counts its run from 0."""
    k = closed_form("above", 8, 40.0)
    c = controller()
    drive(c, [0.25] * (k - 1), [8] * (k - 1), caplog)
    assert c.state_dict().keys() == make_controller("fixed", ControllerConfig(0.1)).state_dict().keys()
    resumed = controller()
    resumed.load_state_dict(c.state_dict())
    resumed.resume_at(k)
    assert drive(resumed, [0.25] * k, [8] * k, caplog) == [k]
    c.resume_at(k)  # in place too
    caplog.clear()
    assert drive(c, [0.25] * k, [8] * k, caplog) == [k]


def test_the_warnings_name_the_direction_target_kl_steps_and_beta_word_for_word(caplog):
    c = controller(beta=0.1, kl_target=0.05, kl_horizon=40.0, beta_min=0.001)
    up, down = closed_form("above", 8, 40.0), closed_form("below", 8, 40.0)
    drive(c, [0.25] * up + [0.005] * down, [8] * (up + down), caplog)
    risen = 0.1 * 1.04**up
    fallen = risen * 0.96**down
    assert saturation_warnings(caplog) == [
        f"unsloth_adaptive_kl: ziegler: the KL has stayed more than 20 % above kl_target=0.05 for {up} updates in a row "
        f"(optimizer steps 1-{up}; this step's KL: 0.25) while beta rose from 0.1 to {risen:.4g}: the target may be below what any beta "
        "reaches on this task (docs/evidence.md §7 found the KL rising with beta past ~0.1-0.3); consider a higher "
        "kl_target or a fixed beta (shown once per direction)",
        f"unsloth_adaptive_kl: ziegler: the KL has stayed more than 20 % below kl_target=0.05 for {down} updates in a row "
        f"(optimizer steps {up + 1}-{up + down}; this step's KL: 0.005) while beta fell from {risen:.4g} to {fallen:.4g}: the target may be above the KL "
        "this run reaches; beta will keep falling toward beta_min=0.001; consider a lower kl_target or a beta_min "
        "(shown once per direction)",
    ]


@pytest.mark.parametrize("direction", list(RATIO))
def test_the_warning_changes_no_beta(direction, caplog):
    # β, update by update through and past the warning, is Ziegler's update in float64 (the warning only logs)
    n, kl_horizon, kl_target = 8, 40.0, 0.05
    c = controller(beta=0.1, kl_target=kl_target, kl_horizon=kl_horizon)
    kls = [RATIO[direction] * kl_target] * 3 * first_doubling(direction, [n] * 100, kl_horizon)
    reference = 0.1
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        for update, kl in enumerate(kls, start=1):
            reference *= 1.0 + min(max(kl / kl_target - 1.0, -0.2), 0.2) * n / kl_horizon
            assert c.update(global_step=update, kl=kl, num_completions=n) == pytest.approx(reference, rel=1e-12)
    assert len(saturation_warnings(caplog)) == 1
