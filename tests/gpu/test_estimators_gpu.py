"""bottom_q's deferred tie warning on a GPU: the count of selected tokens is copied to the host without a wait
(a CUDA event marks it), and the next call warns with the first call's numbers; one host sync per call (the
boolean indexing), none for the warning. The CPU test (tests/test_estimators.py) cannot reach the CUDA branch.

    export PYTHONPATH=$PWD/.gpu-site:$PWD; python -m pytest -q -s tests/gpu/test_estimators_gpu.py
"""

import warnings

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from unsloth_adaptive_kl import estimators  # noqa: E402


def test_a_tie_on_the_gpu_warns_at_the_next_call_with_the_first_calls_numbers(monkeypatch, caplog):
    monkeypatch.setattr(estimators, "_warned_bottom_q", False)
    monkeypatch.setattr(estimators, "_pending_selection", None)
    tied = torch.full((1, 32), -2.0, device="cuda")
    distinct = torch.linspace(-5.0, -0.1, 100, device="cuda")[None]
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        threshold = estimators.bottom_q_threshold(tied, torch.ones_like(tied, dtype=torch.bool), q=0.2)
        assert threshold.item() == -2.0
        pending = estimators._pending_selection
        assert pending is not None and isinstance(pending[1], torch.cuda.Event) and pending[0].device.type == "cpu"
        assert "bottom_q selected" not in caplog.text
        torch.cuda.synchronize()
        estimators.bottom_q_threshold(distinct, torch.ones_like(distinct, dtype=torch.bool), q=0.2)
    warnings = [r.getMessage() for r in caplog.records if "bottom_q selected" in r.getMessage()]
    assert len(warnings) == 1 and "bottom_q selected 32 of 32 valid tokens (tied" in warnings[0]


def syncs(fn) -> list[str]:
    """The synchronising CUDA operations ``fn`` runs (torch.cuda.set_sync_debug_mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [str(w.message) for w in record if "synchroniz" in str(w.message)]


def test_the_warning_adds_no_host_sync_to_what_the_threshold_itself_needs(monkeypatch):
    monkeypatch.setattr(estimators, "_warned_bottom_q", False)
    monkeypatch.setattr(estimators, "_pending_selection", None)
    ref = torch.linspace(-5.0, -0.1, 4096, device="cuda")[None]
    mask = torch.ones_like(ref, dtype=torch.bool)
    estimators.bottom_q_threshold(ref, mask, q=0.2)  # warm-up (kernels loaded)

    def threshold_alone():  # what the threshold needs: the valid tokens (boolean indexing), the k-th value
        valid = ref.detach()[mask.bool()]
        valid.kthvalue(estimators.bottom_q_count(0.2, valid.numel()))

    needed = syncs(threshold_alone)
    measured = syncs(lambda: estimators.bottom_q_threshold(ref, mask, q=0.2))
    print(f"host syncs: bottom_q_threshold {len(measured)}, the threshold alone {len(needed)}")
    assert len(needed) >= 1 and len(measured) == len(needed), (measured, needed)
