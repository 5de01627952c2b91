"""``AdaptiveKL`` across a step's micro-batches: what ``per_token`` passes on to the term, what ``record`` returns,
which micro-batches feed the β controller, the tail windows, ``kl_monitor`` and the non-finite warning. Each
against a value written by hand or a float64 reference (tests/reference.py). Found by mutation testing
(docs/reliability.md, "Mutation testing")."""

import math
from types import SimpleNamespace

import pytest
import reference
import torch

from unsloth_adaptive_kl import FIELDS, AdaptiveKL, BetaController, metrics, register_controller, unregister_controller

BETA, CLIP, Q = 0.2, 0.1, 0.5


def _adaptive(**fields) -> AdaptiveKL:
    values = {f.name: f.default for f in FIELDS}
    values.update({"beta": BETA, "kl_clip_threshold": CLIP, **fields})
    return AdaptiveKL(SimpleNamespace(**values))


def _masked_token_mean(values, mask) -> float:
    pairs = [(v, m) for row, mrow in zip(values.tolist(), mask.tolist()) for v, m in zip(row, mrow)]
    return sum(v for v, m in pairs if m) / sum(m for _, m in pairs)


# -- per_token: every argument reaches the term ----------------------------------------------------------------------
LOGP = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, -3.0]])
REF = torch.tensor([[-1.4, -3.0, -2.5], [-0.5, -4.0, -1.5]])
OLD = torch.tensor([[-1.1, -1.8, -0.7], [-1.2, -0.4, -3.3]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])  # the masked position has a large log-ratio: its KL would not be 0


def test_per_token_applies_the_mask_and_the_importance_ratio_then_the_shaping():
    state = _adaptive(kl_adaptation_method="clip", kl_estimator="k3")
    coef = torch.exp(LOGP - OLD)
    raw, adapted = state.per_token(LOGP, REF, MASK, coef)
    raw64, shaped64 = reference.raw_and_shaped_kl(
        "clip", LOGP, REF, OLD, MASK, estimator="k3", clip_threshold=CLIP, kl_target=0.0, bias_correction=True
    )
    torch.testing.assert_close(raw.double(), raw64, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(adapted.double(), shaped64, rtol=1e-6, atol=1e-7)
    assert raw[0, 2] == 0.0 and adapted[0, 2] == 0.0


def test_per_token_uses_the_given_batch_statistic_and_the_given_estimator():
    """``statistic``: the whole batch's (bottom_q's threshold), not the chunk's own; ``estimator``: a loss module's
    own KL function, which replaces the configured one."""
    state = _adaptive(kl_estimator="bottom_q", kl_bottom_q=Q)
    statistic = torch.tensor(-3.0)  # the chunk's own threshold is -2.5 (its 3rd lowest of 6): it would select 3 tokens
    raw, _ = state.per_token(LOGP, REF, torch.ones_like(MASK), statistic=statistic)
    r = (REF - LOGP).double()
    expected = torch.where(REF <= -3.0, (torch.exp(r) - r - 1) / Q, 0.0)  # the tokens with ref -3.0 and -4.0
    torch.testing.assert_close(raw.double(), expected, rtol=1e-6, atol=1e-7)
    assert int((raw != 0).sum()) == 2

    def squared_log_ratio(logp, ref_logp, *, mask, statistic):
        return torch.where(mask.bool(), (ref_logp - logp) ** 2, 0.0)

    raw, adapted = _adaptive(kl_adaptation_method="clip").per_token(LOGP, REF, MASK, estimator=squared_log_ratio)
    expected = torch.where(MASK.bool(), r**2, 0.0)
    torch.testing.assert_close(raw.double(), expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(adapted.double(), torch.clamp(expected, max=CLIP), rtol=1e-6, atol=1e-7)


# -- record: the metric values ---------------------------------------------------------------------------------------
RAW = torch.tensor([[0.5, 1.5, 9.0, 9.0], [2.0, 0.25, 0.75, 1.0], [4.0, 9.0, 9.0, 9.0]])
ADAPTED = torch.tensor([[0.5, 1.0, 9.0, 9.0], [1.0, 0.25, 0.5, 0.5], [1.0, 9.0, 9.0, 9.0]])
RECORD_MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])  # lengths 2, 4, 1


@pytest.mark.parametrize("method", ["clip", "length_normalized"])
def test_record_returns_the_token_mean_raw_kl_and_the_adapted_kl_beta_multiplies(method):
    state = _adaptive(kl_adaptation_method=method)
    values = state.record(RAW, ADAPTED, RECORD_MASK, training=True, beta=0.3)
    assert values[metrics.CURRENT_BETA] == 0.3
    assert values[metrics.RAW_KL] == pytest.approx(_masked_token_mean(RAW, RECORD_MASK), rel=1e-12)  # 9.0 / 7
    if method == "length_normalized":  # the mean over completions of each completion's mean
        expected = ((0.5 + 1.0) / 2 + (1.0 + 0.25 + 0.5 + 0.5) / 4 + 1.0 / 1) / 3
    else:
        expected = _masked_token_mean(ADAPTED, RECORD_MASK)
    assert values[metrics.ADAPTED_KL] == pytest.approx(expected, rel=1e-12)
    assert values[metrics.NONFINITE_KL_BATCHES] == 0.0


def test_a_micro_batch_without_kl_reports_only_beta_and_feeds_the_controller_nothing(recording):
    """β = 0 (no reference log-probs): ``record(None, ...)`` logs ``current_beta``, the KL metrics as missing, and the
    step's controller update gets no KL."""
    state = _adaptive(kl_adaptation_method="recording")
    values = state.record(None, None, RECORD_MASK, training=True, beta=0.0)
    assert values[metrics.CURRENT_BETA] == 0.0
    assert math.isnan(values[metrics.RAW_KL]) and math.isnan(values[metrics.ADAPTED_KL])
    assert set(values) == {metrics.CURRENT_BETA, metrics.RAW_KL, metrics.ADAPTED_KL}
    state.end_step(1)
    assert recording == [(1, None, 0)]


@pytest.fixture
def recording():
    """A user β controller that records what each update is told: ``(global_step, kl, num_completions)``."""
    calls = []

    @register_controller("recording")
    class Recording(BetaController):
        def update(self, *, global_step, kl, num_completions):
            calls.append((global_step, kl, num_completions))
            return self.beta

    yield calls
    unregister_controller("recording")


def test_only_the_training_micro_batches_of_the_step_feed_the_controller(recording):
    """Evaluation micro-batches are logged, never steered on; a step with nothing recorded, or with no valid token,
    gives the controller no KL (``None``, not 0) and the completions counted (0 when none was recorded)."""
    state = _adaptive(kl_adaptation_method="recording")
    state.record(RAW, ADAPTED, RECORD_MASK, training=False, beta=BETA)  # evaluation: raw KL mean 9/7
    train_raw, train_mask = torch.tensor([[0.5, 0.25], [1.0, 5.0]]), torch.tensor([[1, 1], [1, 0]])
    state.record(train_raw, train_raw, train_mask, training=True, beta=BETA)
    state.end_step(1)
    state.end_step(2)  # nothing recorded in this step
    state.record(train_raw, train_raw, torch.zeros_like(train_mask), training=True, beta=BETA)  # every token masked
    state.end_step(3)
    assert recording == [(1, pytest.approx((0.5 + 0.25 + 1.0) / 3, rel=1e-12), 2), (2, None, 0), (3, None, 2)]


# -- record: the tail metrics ----------------------------------------------------------------------------------------
def test_the_tail_max_of_one_process_is_its_largest_raw_kl_also_when_every_kl_is_negative():
    """By default one process (rank 0 of 1): the max travels in that process's one slot, so a negative max (k1's KL
    is negative where the policy is below the reference) is not raised to the 0 of an empty slot."""
    state = _adaptive(kl_estimator="k1")
    raw = torch.tensor([[-0.5, -0.2, 7.0], [-1.5, -0.75, -3.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    values = state.record(raw, raw, mask, training=True, beta=BETA)
    assert values[metrics.TOKEN_KL_MAX] == pytest.approx(-0.2, rel=1e-7)


def test_the_training_and_the_evaluation_tail_windows_are_kept_apart():
    state = _adaptive()

    def window_max(largest_kl, training):
        """The logged max after recording a micro-batch of two tokens, ``largest_kl`` and 0.5."""
        values = state.record(torch.tensor([[largest_kl, 0.5]]), torch.zeros(1, 2), torch.ones(1, 2), training=training, beta=BETA)
        return values[metrics.TOKEN_KL_MAX]

    assert window_max(3.0, training=True) == 3.0
    assert window_max(1.0, training=False) == 1.0  # not the training window's 3.0
    assert window_max(2.0, training=True) == 3.0  # the training window pools its micro-batches
    state.restart_tail_window(True)
    assert window_max(2.0, training=True) == 2.0
    assert window_max(0.5, training=False) == 1.0  # the evaluation window was not restarted


# -- kl_monitor ------------------------------------------------------------------------------------------------------
def test_the_sampled_monitor_watches_every_nth_training_batch_the_first_included_and_every_evaluation_batch():
    sampled = _adaptive(beta=0.0, kl_monitor=True, kl_monitor_every=3)
    assert [sampled.monitors_batch(i) for i in range(7)] == [True, False, False, True, False, False, True]
    assert all(sampled.monitors_batch(i, training=False) for i in range(4))
    assert all(_adaptive(beta=0.0, kl_monitor=True, kl_monitor_every=1).monitors_batch(i) for i in range(4))
    assert not any(_adaptive(beta=0.0).monitors_batch(i, training=t) for i in range(4) for t in (True, False))


def test_a_micro_batch_computes_the_kl_at_beta_zero_only_when_its_batch_carries_reference_logps():
    ref = torch.zeros(2, 3)
    monitored, unmonitored = _adaptive(beta=0.0, kl_monitor=True), _adaptive(beta=0.0)
    assert monitored.computes_kl_with(ref) and not monitored.computes_kl_with(None)
    assert not unmonitored.computes_kl_with(ref)
    assert _adaptive(beta=0.1).computes_kl_with(None)  # β != 0: the loss asks for them (and refuses their absence)


@pytest.mark.parametrize(
    "accumulation, per_generation, iterations, expected",
    [
        (1, 1, 1, [0, 1, 2, 3]),  # TRL's defaults: a generation batch an optimizer step
        (2, 2, 1, [0, 1, 2, 3]),  # two micro-steps a step, one generation batch for both
        (1, 2, 1, [0, 0, 1, 1]),  # a generation batch trains two optimizer steps
        (2, 2, 2, [0, 0, 1, 1]),  # each batch trained twice (num_iterations)
    ],
)
def test_the_generation_index_counts_trls_generation_batches_from_the_optimizer_step(accumulation, per_generation, iterations, expected):
    """The index the sampled monitor decides on, at each optimizer step's first micro-step (TRL generates there, when
    it generates), as TRL's own schedule counts batches (``_step // (steps_per_generation * num_iterations)``); after
    a resume TRL's ``_step`` restarts at 0 and the optimizer step keeps the count."""
    from unsloth_adaptive_kl.backends._trainer import TrainerAdaptiveKL

    args = SimpleNamespace(gradient_accumulation_steps=accumulation, steps_per_generation=per_generation)
    trainer = SimpleNamespace(args=args, num_iterations=iterations, state=SimpleNamespace(global_step=0), _step=0)
    runtime = SimpleNamespace(trainer=trainer)
    seen = []
    for step in range(4):
        trainer.state.global_step, trainer._step = step, step * accumulation
        seen.append(TrainerAdaptiveKL.generation_index(runtime))
        assert seen[-1] == trainer._step // (per_generation * iterations)
        trainer._step = 0  # resumed here: TRL's counter starts again
        assert TrainerAdaptiveKL.generation_index(runtime) == seen[-1]
    assert seen == expected


# -- the non-finite warning ------------------------------------------------------------------------------------------
def test_a_micro_batch_with_a_non_finite_kl_is_warned_about_once_with_its_values(caplog):
    state = _adaptive()
    caplog.clear()  # creation warns of the shared config's settings other methods read: not this test's subject
    mask = torch.tensor([[1, 1], [1, 0]])
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        adapted = torch.full((2, 2), 0.25)
        finite = state.record(torch.tensor([[0.5, 1.0], [2.0, 0.0]]), adapted, mask, training=True, beta=BETA)
        assert finite[metrics.NONFINITE_KL_BATCHES] == 0.0 and not caplog.records
        bad = torch.tensor([[0.5, math.inf], [2.0, 0.0]])  # inf on a valid token; the adapted KL stays finite
        for _ in range(2):
            values = state.record(bad, adapted, mask, training=True, beta=BETA)
            assert values[metrics.NONFINITE_KL_BATCHES] == 1.0
    (message,) = [r.getMessage() for r in caplog.records]  # the second bad micro-batch is counted, not warned about
    assert message == (
        "unsloth_adaptive_kl: a micro-batch's KL was NaN or inf on a valid token (raw_kl=inf, adapted_kl=0.25; e.g. a "
        "NaN or inf log-prob from the model): it is left out of adaptive_kl/raw_kl and adaptive_kl/adapted_kl, and each "
        "logging window counts such micro-batches in adaptive_kl/nonfinite_kl_batches (this warning is shown once)"
    )
