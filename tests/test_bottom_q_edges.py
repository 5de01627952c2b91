"""bottom_q at its edges: the token count for every form of q's repr, the threshold of an empty or one-token batch,
the warning at exactly its level, its text, and the deferred count's copy on a GPU (issue 38: each test kills
mutants that survived the core tests)."""

import decimal
import math

import pytest
import torch

from unsloth_adaptive_kl import estimators
from unsloth_adaptive_kl.estimators import estimate_kl


@pytest.fixture
def fresh_warning(monkeypatch):
    """The once-per-process warning not yet given, and no deferred count."""
    monkeypatch.setattr(estimators, "_warned_bottom_q", False)
    monkeypatch.setattr(estimators, "_pending_selection", None)


def warnings_in(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "bottom_q selected" in r.getMessage()]


def k3_float64(logp: float, ref: float) -> float:
    return math.exp(ref - logp) - (ref - logp) - 1


@pytest.mark.parametrize(
    ("q", "n"),
    [
        (0.28, 25), (0.57, 100), (1.0, 7),  # the plain decimal reprs
        (1e-05, 300_000), (2.5e-05, 1_000_000), (1e-05, 10),  # reprs in exponent notation, below 1e-4
        (1e16, 7), (1.5e16, 10**9), (1e16, 10**9),  # reprs with a positive exponent: every token
    ],
)
def test_bottom_q_count_is_floor_of_q_as_written_times_n_clamped_to_one_and_n_for_every_repr_of_q(q, n):
    """floor(q * N) with q exactly as its repr writes it (decimal, not binary), at least 1 and at most N, also where
    the repr has an exponent ('1e-05', '1e+16'): the parse of the exponent and both branches of the power of ten."""
    expected = max(1, min(n, math.floor(decimal.Decimal(repr(q)) * n)))
    assert estimators.bottom_q_count(q, n) == expected


def test_bottom_q_on_one_valid_token_gives_it_k3_over_q(fresh_warning):
    """One valid token is the lowest of its batch: it gets k3 / q (count max(1, floor(q * 1)) = 1); padding gets 0."""
    logp = torch.tensor([[-1.25, -0.5, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[-2.0, -0.1, -3.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0]])
    out = estimate_kl("bottom_q", logp, ref, mask=mask, parameters={"kl_bottom_q": 0.5})
    assert out[0, 0].item() == pytest.approx(k3_float64(-1.25, -2.0) / 0.5, rel=1e-12)
    assert out[0, 1:].tolist() == [0.0, 0.0]


def test_bottom_q_on_a_batch_with_no_valid_token_selects_none_with_a_threshold_of_minus_inf_like_ref(fresh_warning):
    """No valid token: the threshold is -inf, in ``ref_logp``'s dtype and on its device (as any threshold, a value of
    ref_logp), also where torch's default device is another; the KL is 0 everywhere."""
    ref = torch.tensor([[-2.0, -1.0]], dtype=torch.float64)
    none_valid = torch.zeros(1, 2, dtype=torch.bool)
    with torch.device("meta"):  # a default device other than ref's: the threshold must not land there
        threshold = estimators.bottom_q_threshold(ref, none_valid, q=0.2)
    assert threshold.dtype == torch.float64 and threshold.device == ref.device
    assert threshold.item() == float("-inf")
    out = estimate_kl("bottom_q", ref - 0.3, ref, mask=none_valid, parameters={"kl_bottom_q": 0.2})
    assert out.tolist() == [[0.0, 0.0]]


def test_bottom_q_warns_at_the_call_whose_counts_alone_reach_the_warning_level_exactly(fresh_warning, caplog):
    """q = 2/3 and one valid token: 1 / (q * 1) is 1.5 exactly in float, the warning level (warned at >= 1.5). The
    counts alone make the warning certain, so it comes at this call, not deferred to the next."""
    q = 2 / 3
    assert estimators.bottom_q_inflation(1, 1, q) == estimators.BOTTOM_Q_INFLATION_WARNING
    ref = torch.tensor([[-2.0]])
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        estimators.bottom_q_threshold(ref, torch.ones_like(ref, dtype=torch.bool), q=q)
    assert len(warnings_in(caplog)) == 1 and estimators._pending_selection is None


def test_the_bottom_q_warning_comes_once_from_the_warning_level_up_and_never_below_it(fresh_warning, caplog):
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        estimators.warn_bottom_q_selection(20, 100, 0.2)  # exactly a fraction q: inflation 1
        estimators.warn_bottom_q_selection(29, 100, 0.2)  # 1.45, below the level
        assert warnings_in(caplog) == [] and not estimators._warned_bottom_q
        estimators.warn_bottom_q_selection(3, 10, 0.2)  # 3 / (0.2 * 10) = 1.5 exactly: the level itself warns
        estimators.warn_bottom_q_selection(32, 32, 0.2)  # inflation 5, but already warned
    assert len(warnings_in(caplog)) == 1 and "bottom_q selected 3 of 10 valid tokens" in warnings_in(caplog)[0]


@pytest.mark.parametrize(
    ("selected", "n", "q", "why"),
    [(1, 6, 0.01, "q * N = 0.06 < 1"), (32, 32, 0.2, "tied reference log-probs at the threshold")],
)
def test_the_bottom_q_warning_names_the_counts_the_cause_the_setting_and_the_remedy(selected, n, q, why, fresh_warning, caplog):
    """Its meaningful parts: where it comes from, the counts, why (too few tokens, or ties), the field and its value,
    the inflation, that the threshold is per loss call, what to change, and that it is said once."""
    inflation = selected / (q * n)
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        estimators.warn_bottom_q_selection(selected, n, q)
    (message,) = warnings_in(caplog)
    assert message.startswith(f"unsloth_adaptive_kl: bottom_q selected {selected} of {n} valid tokens ({why})")
    assert f"where kl_bottom_q={q} asks for a fraction {q}: scaled by 1/q, the batch's KL is {inflation:.3g} times the mean k3 of the selected tokens" in message
    assert "not on k3's scale. The threshold is taken per loss call (a micro-batch of one process)" in message
    assert message.endswith("use more tokens per micro-batch or a larger kl_bottom_q (warned once)")


def test_a_count_on_a_gpu_is_copied_to_the_host_without_waiting_its_event_on_the_copying_devices_stream(fresh_warning, monkeypatch, caplog):
    """The CUDA branch of the deferred count, reached on a CPU through stand-ins for torch.cuda's streams and events
    (tests/gpu/test_estimators_gpu.py runs it on a GPU). The count lives on cuda:1 while cuda:0 is current: it is
    copied to the CPU with non_blocking=True, the event is recorded on cuda:1's stream (the copy's, not the current
    device's), and the next call warns from the copy only once the event reports it done."""
    streams = {torch.device("cuda", 0): "stream of cuda:0", torch.device("cuda", 1): "stream of cuda:1"}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams[torch.device("cuda", 0) if device is None else torch.device(device)])

    class Event:
        def __init__(self):
            self.stream, self.done = "never recorded", False

        def record(self, stream=None):
            self.stream = streams[torch.device("cuda", 0)] if stream is None else stream

        def query(self):
            return self.done

    monkeypatch.setattr(torch.cuda, "Event", Event)
    host_count = torch.tensor(32)

    class CountOnCuda1:
        is_cuda = True
        device = torch.device("cuda", 1)
        copies = []

        def to(self, *args, **kwargs):
            self.copies.append((args, kwargs))
            return host_count if args and torch.device(args[0]) == torch.device("cpu") else self

    count = CountOnCuda1()
    estimators._defer_selection(count, 32, 0.2)
    (args, kwargs), = count.copies
    assert torch.device(args[0]) == torch.device("cpu") and kwargs == {"non_blocking": True}
    copied, event, n, q = estimators._pending_selection
    assert copied is host_count and isinstance(event, Event) and (n, q) == (32, 0.2)
    assert event.stream == "stream of cuda:1"
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        estimators._check_pending_selection()  # the copy is not done: kept, nothing read
        assert estimators._pending_selection is not None and warnings_in(caplog) == []
        event.done = True
        estimators._check_pending_selection()
    assert estimators._pending_selection is None
    assert len(warnings_in(caplog)) == 1 and "bottom_q selected 32 of 32 valid tokens (tied" in warnings_in(caplog)[0]
