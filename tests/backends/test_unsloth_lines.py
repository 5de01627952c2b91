"""The installed Unsloth line's fused loss on CPU, also where Unsloth cannot generate its trainer
without CUDA (2026.8, 2026.9): every anchor of this package's set for that line matches its
unsloth_zoo functions exactly once, ``none`` + k3 is bit-identical to the stock loss and its
gradient, and ``clip`` shapes the KL part as the float64 reference says. The trainer-level tests
are test_unsloth.py (CPU, from 2026.10) and tests/gpu (every line, on a GPU)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("unsloth") is None, reason="unsloth is not installed")
WORKER = os.path.join(os.path.dirname(__file__), "unsloth_lines_worker.py")


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("unsloth-lines") / "out.json"
    proc = subprocess.run([sys.executable, WORKER, str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def test_every_anchor_of_the_installed_lines_set_matches_its_functions_once(measured):
    from unsloth_adaptive_kl._source_patch import version_of

    line = ".".join(version_of("unsloth_zoo").split(".")[:2])
    assert measured["family"] == f"unsloth {line}"
    assert measured["mismatches"] == []
    assert measured["built"] == ["UnslothEfficientGRPO.forward", "grpo_accumulated_loss", "grpo_compute_loss"]
    assert measured["template_anchor_counts"] == [1]  # UnslothGRPOTrainer.compute_loss, from Unsloth's template


def test_method_none_with_k3_is_bit_identical_to_the_lines_stock_loss_and_gradient(measured):
    assert measured["none_identical"]


def test_clip_shapes_the_kl_part_as_the_float64_reference(measured):
    assert measured["clip_kl_part"] == pytest.approx(measured["clip_reference"], rel=2e-4, abs=1e-7)
    assert abs(measured["clip_reference"] - measured["none_reference"]) > 1e-4  # the clip changed the loss


def test_the_fused_loss_reports_the_raw_and_the_clipped_kl_in_their_own_slots(measured):
    """The rewritten loss's mean_kl slot, ``[unsloth_kl, local sums...]``: the adapted sum is the clipped KL's, the
    raw sum the unclipped one's (logging the raw KL as the adapted one fails here, issue 38)."""
    from unsloth_adaptive_kl import metrics

    stats, expected = measured["clip_stats"][1:], measured["clip_sums_reference"]
    assert len(stats) == metrics.SUMS_SIZE  # the KL sums, then the tail histogram (metrics.local_metric_sums)
    assert stats[metrics.RAW_SUM] == pytest.approx(expected["raw"], rel=1e-5)
    assert stats[metrics.ADAPTED_SUM] == pytest.approx(expected["adapted"], rel=1e-5)
    assert stats[metrics.TOKENS] == expected["tokens"]
    assert expected["adapted"] < expected["raw"] - 1e-3  # the clip acted, so the two slots differ



def test_rollout_rejection_removes_the_rejected_tokens_from_the_adapted_kl_of_the_metrics_and_of_length_normalization(measured):
    """Unsloth 2026.10's rollout rejection (``rs_keep``, verl's token_k1 here): a rejected token leaves the adapted KL
    as it leaves Unsloth's own kl, both in the metric sums and in length_normalized's term, whose normaliser keeps every
    valid token (the rewritten loss passing ``None`` for ``rs_keep`` fails here; issue 38's backend mutants)."""
    from unsloth_adaptive_kl import metrics

    if "rejection" not in measured:
        pytest.skip("this Unsloth line has no rollout rejection (before 2026.10)")
    r = measured["rejection"]
    assert 0 < r["kept"] < r["valid"] and r["margin"] > 1e-4  # some tokens rejected, none on the bound
    sums = r["stats"][1:]
    assert sums[metrics.RAW_SUM] == pytest.approx(r["raw"], rel=1e-5)
    assert sums[metrics.ADAPTED_SUM] == pytest.approx(r["adapted"], rel=1e-5)
    assert sums[metrics.TOKENS] == r["valid"]
    assert abs(r["adapted_without_rejection"] - r["adapted"]) > 1e-3  # the rejection changes the expected sum
    assert r["length_normalized_kl_part"] == pytest.approx(r["length_normalized_reference"], rel=2e-4, abs=1e-7)
    assert abs(r["length_normalized_without_rejection"] - r["length_normalized_reference"]) > 1e-4


def test_the_fused_forward_carries_the_losss_float64_sums_out_unchanged(measured):
    """``UnslothEfficientGRPO.forward``'s mean_kl accumulator, rewritten to hold ``[unsloth_kl, sums...]``: float64,
    and equal bit for bit to the sums its one chunk's loss returned (the clip case above), as the metrics'
    float64 sums are documented (metrics.local_kl_sums); a float32 accumulator rounds them to 24 bits."""
    forward = measured["forward_stats"]
    assert forward["dtype"] == "torch.float64"
    # Bit for bit on the 2026.10 line only: on 2026.9.14 the forward's chunk computes the per-token KL along another
    # path than a direct call of the loss (its sums differ from the direct call's by 1e-7 to 3e-6 relative; cause
    # not isolated, 2026-11-26), so there the carry is checked by its dtype above.
    if measured["family"] == "unsloth 2026.10":
        assert forward["values"] == measured["clip_stats"]

def _installed_config_compat():
    """The installed line's unsloth/models/rl_config_compat.py (stdlib only), loaded from its file
    under a private name: importing it as a package module would run ``import unsloth`` here."""
    import importlib.util

    (package_dir,) = importlib.util.find_spec("unsloth").submodule_search_locations
    path = os.path.join(package_dir, "models", "rl_config_compat.py")
    spec = importlib.util.spec_from_file_location("_installed_rl_config_compat", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_lines_memo_of_accepted_config_arguments_is_emptied_and_a_missing_one_refused(monkeypatch):
    import types
    from dataclasses import dataclass

    from unsloth_adaptive_kl._source_patch import PatchError
    from unsloth_adaptive_kl.backends import unsloth_hooks as backend

    @dataclass
    class Config:
        beta: float = 0.0

    compat = _installed_config_compat()
    monkeypatch.setitem(sys.modules, backend.COMPAT_MODULE, compat)
    assert compat._accepted_parameters(Config)[0] == {"beta"}
    assert Config in compat._ACCEPTED_CACHE
    backend.forget_accepted_config_arguments()
    assert compat._ACCEPTED_CACHE == {}
    monkeypatch.setitem(sys.modules, backend.COMPAT_MODULE, types.ModuleType(backend.COMPAT_MODULE))
    with pytest.raises(PatchError, match="_ACCEPTED_CACHE"):
        backend.forget_accepted_config_arguments()
