"""A user estimator or shaping step that makes a finite KL NaN or inf: where ``KLTerm.estimator_faults`` blames the
estimator (as Unsloth's compiled loss counts it), and ``AdaptiveKL`` refusing the micro-batch by name and count,
even for one token. Counts written by hand from the definitions (docs: "a finite value wherever logp and ref_logp
are finite"). Found by mutation testing (docs/reliability.md, "Mutation testing")."""

import math
from types import SimpleNamespace

import pytest
import torch

from unsloth_adaptive_kl import FIELDS, AdaptiveKL, metrics
from unsloth_adaptive_kl.estimators import register_estimator, unregister_estimator
from unsloth_adaptive_kl.config import build

INF, NAN = math.inf, math.nan


def _config(**fields):
    values = {f.name: f.default for f in FIELDS}
    values.update({"beta": 0.1, **fields})
    return SimpleNamespace(**values)


@pytest.fixture
def nan_past_five():
    """A user estimator, ``(ref - logp)^2 / 2``, that is NaN where the log-ratio exceeds 5: finite on the probe it is
    checked with when the term is built, faulty on a token that goes past 5."""
    register_estimator("nan_past_five")(lambda logp, ref: torch.where(ref - logp > 5.0, NAN, 0.5 * (ref - logp) ** 2))
    yield "nan_past_five"
    unregister_estimator("nan_past_five")


def test_a_built_in_estimator_is_never_blamed():
    term = build(_config(kl_estimator="k3")).term
    assert term.estimator_faults(torch.full((1, 2), NAN), torch.zeros(1, 2), torch.zeros(1, 2)) is None


def test_a_user_estimators_one_nan_on_finite_log_probs_is_blamed_and_refuses_the_micro_batch(nan_past_five):
    """As Unsloth's compiled loss does: the estimator called unchecked, its faults counted in the metric sums, the
    micro-batch refused when they are read, naming the estimator and the count (here 1)."""
    state = AdaptiveKL(_config(kl_estimator=nan_past_five))
    logp = torch.tensor([[-1.0, -7.0, -INF], [-0.5, -2.0, -9.0]])
    ref = torch.tensor([[-1.5, -0.5, -1.0], [-1.0, -2.5, -0.5]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # (0,1): log-ratio 6.5 on finite log-probs: the estimator's fault. (0,2): logp is -inf (the model's fault, not
    # the estimator's). (1,2): log-ratio 8.5 but masked: the estimator sees 0 there.
    kl = state.term.estimate(logp, ref, mask, check=False)
    faults = state.term.estimator_faults(kl, logp, ref)
    assert faults.tolist() == [[False, True, False], [False, False, False]]
    sums = metrics.local_metric_sums(kl, state.term.shape(kl), mask, estimator_faults=faults)
    assert sums[metrics.ESTIMATOR_FAULTS].item() == 1.0
    with pytest.raises(ValueError) as error:
        state.record_sums(sums, training=True, beta=state.beta)
    assert str(error.value) == (
        "KL estimator 'nan_past_five' returned NaN or inf on valid tokens whose log-probs were finite (1 of them): the "
        "bug is in the estimator; allowed: a finite value wherever logp and ref_logp are finite"
    )


def test_a_user_shaping_steps_one_nan_on_a_finite_kl_refuses_the_micro_batch(user_shaping):
    name = user_shaping("nan_past_fifty", lambda kl: torch.where(kl > 50.0, NAN, kl))  # finite on the probe (KL <= 30)
    state = AdaptiveKL(_config(kl_adaptation_method=name))
    raw = torch.tensor([[0.5, 60.0, INF], [70.0, 2.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    # (0,1): a finite 60 made NaN: the step's fault. (0,2): the KL itself is inf. (1,0): masked.
    with pytest.raises(ValueError) as error:
        state.record(raw, state.term.shape(raw), mask, training=True, beta=state.beta)
    assert str(error.value) == (
        "shaping method 'nan_past_fifty' returned NaN or inf on valid tokens whose KL was finite (1 of them) in "
        "kl_adaptation_method='nan_past_fifty': the bug is in that function; allowed: a finite value for every finite KL"
    )


def test_no_fault_counted_refuses_nothing(nan_past_five, user_shaping):
    state = AdaptiveKL(_config(kl_estimator=nan_past_five, kl_adaptation_method=user_shaping("same", lambda kl: kl)))
    assert state.refuse_user_faults(0.0, 0.0) is None
    with pytest.raises(ValueError, match=r"KL estimator 'nan_past_five' .*\(1 of them\).*; after the step"):
        state.refuse_user_faults(1.0, 1.0, when="; after the step")  # the estimator first: its NaN reaches the shaping
    with pytest.raises(ValueError, match=r"shaping method 'same' .*\(1 of them\)"):
        state.refuse_user_faults(0.0, 1.0)
