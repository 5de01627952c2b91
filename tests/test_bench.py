"""bench/_common.py's statistics, bench_liger.py's kernel tiles and GEMM floor, and bench_trl.py's CPU smoke
path (TRITON_INTERPRET=1): the scripts the GPU run (scripts/gpu/verify.sh, stage bench-1b) depends on."""

import json
import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)

import _common  # noqa: E402
import bench_liger  # noqa: E402


def test_ratio_interval_of_a_scaled_sample_is_exactly_the_scale():
    stock = [1.0, 1.1, 0.9, 1.05, 0.95, 1.2, 0.8]
    point, low, high = _common.ratio_interval([2 * t for t in stock], stock)
    # resampling both with the same draws is not what happens, so the interval is wide, but it holds 2
    assert point == pytest.approx(2.0)
    assert low <= 2.0 <= high and low > 1.0 and high < 4.0


def test_ratio_interval_narrows_with_tight_samples_and_separates_a_2_percent_slowdown():
    stock = [1.0 + 0.001 * (i % 5) for i in range(40)]
    row = [1.02 * t for t in stock]
    point, low, high = _common.ratio_interval(row, stock)
    assert point == pytest.approx(1.02, abs=1e-9)
    assert 1.01 < low <= point <= high < 1.03


def test_gemm_floor_is_three_gemms_at_the_peak():
    # 8192 x 4096 x 128256 at 989 TFLOP/s: 3 * 2 * N * H * V / peak
    assert bench_liger.gemm_floor_ms(8192, 4096, 128256, 989.0) == pytest.approx(3 * 2 * 8192 * 4096 * 128256 / 989e12 * 1e3)
    assert bench_liger.peak_tflops("NVIDIA H100 80GB HBM3", None) == 989.0
    assert bench_liger.peak_tflops("NVIDIA H200", None) == 989.0
    assert bench_liger.peak_tflops("Some GPU", None) is None and bench_liger.peak_tflops("Some GPU", 500.0) == 500.0


def test_a_smaller_kernel_tile_gives_the_same_loss_and_gradients(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from trl.kernels import chunked_logprob

    from unsloth_adaptive_kl.backends import _liger_parts, liger

    args = bench_liger.parse_args(["--smoke"])
    x = bench_liger.make_inputs(args, torch.device("cpu"))
    module = liger.AdaptiveFusedLinearGRPOLoss(compiled=False, beta=0.04, loss_type="dapo", kl_adaptation_method="clip")
    results = []
    for tile in (None, (16, 128)):  # 64 tokens x 300 vocabulary: 4 token tiles x 3 vocabulary tiles
        x["hidden"].grad = x["weight"].grad = None
        with bench_liger.tiled(tile):
            if tile is not None:
                assert (chunked_logprob.TOKEN_CHUNK_SIZE, _liger_parts.VOCAB_TILE) == tile
            loss = bench_liger.module_path(module)(x, args)
            loss.backward()
        results.append((loss.detach(), x["hidden"].grad.clone(), x["weight"].grad.clone()))
    assert (chunked_logprob.TOKEN_CHUNK_SIZE, _liger_parts.VOCAB_TILE) == (4096, 32768)  # restored
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bench_trl_smoke_times_interleaved_rows_and_moves_beta_only_where_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import bench_trl

    import unsloth_adaptive_kl

    out = tmp_path / "trl.md"
    try:
        assert bench_trl.main(["--smoke", "--modes", "full", "--rows", "stock,dynamic,zero", "--rounds", "2", "--steps", "2", "--out", str(out)]) == 0
    finally:
        unsloth_adaptive_kl.patch()  # the stock row unpatches; leave the suite patched, as it started
    text = out.read_text()
    assert "| stock TRL (unpatched) | 4 |" in text and "| dynamic | 4 |" in text and "rounds completed: 2 of 2" in text
    (raw,) = json.loads((tmp_path / "trl.md.json").read_text()).values()
    rows = {r["name"]: r for r in raw}
    assert all(len(r["times_s"]) == 4 and min(r["times_s"]) > 0 for r in rows.values())
    assert rows["stock TRL (unpatched)"]["beta_now"] == rows["stock TRL (unpatched)"]["beta_start"] == 0.04
    # the dynamic controller ran at every step end: 0.04 * 0.9 ** (2 rounds x (1 warm-up + 2 timed))
    assert rows["dynamic"]["beta_now"] == pytest.approx(0.04 * 0.9**6)
    assert rows["beta -> 0 (dynamic, beta_min=0)"]["beta_now"] == 0.0
