"""bench/_common.py's statistics, schedule and patch switch, bench_liger.py's kernel tiles and GEMM floor, and
the CPU smoke paths of bench_trl.py and bench_unsloth.py (TRITON_INTERPRET=1): the scripts the GPU run
(scripts/gpu/verify.sh, stage bench-1b) depends on."""

import contextlib
import importlib.util
import json
import os
import subprocess
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


def loss_and_grads_per_setting(fused_head, settings, context):
    """bench_liger's module path on the smoke inputs, once inside ``context(setting)`` for each of ``settings``."""
    from unsloth_adaptive_kl.backends import liger

    args = bench_liger.parse_args(["--smoke"])
    x = bench_liger.make_inputs(args, torch.device("cpu"))
    module = liger.AdaptiveFusedLinearGRPOLoss(compiled=False, beta=0.04, loss_type="dapo", kl_adaptation_method="clip", fused_head=fused_head)
    results = []
    for setting in settings:
        x["hidden"].grad = x["weight"].grad = None
        with context(setting):
            loss = bench_liger.module_path(module)(x, args)
            loss.backward()
        results.append((loss.detach(), x["hidden"].grad.clone(), x["weight"].grad.clone()))
    assert module.head_path == ("fused" if fused_head else "log-prob kernel")
    return results


def test_a_smaller_kernel_tile_gives_the_same_loss_and_gradients(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from trl.kernels import chunked_logprob

    from unsloth_adaptive_kl.backends import _liger_parts

    @contextlib.contextmanager
    def tile_checked(tile):
        with bench_liger.tiled(tile):
            if tile is not None:
                assert (chunked_logprob.TOKEN_CHUNK_SIZE, _liger_parts.VOCAB_TILE) == tile
            yield

    # 64 tokens x 300 vocabulary: 4 token tiles x 3 vocabulary tiles
    results = loss_and_grads_per_setting(False, (None, (16, 128)), tile_checked)
    assert (chunked_logprob.TOKEN_CHUNK_SIZE, _liger_parts.VOCAB_TILE) == (4096, 32768)  # restored
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_narrower_fused_block_gives_the_same_loss_and_gradients(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from unsloth_adaptive_kl.backends import _fused_head

    results = loss_and_grads_per_setting(True, (None, 64), bench_liger.fused_block)  # 300 columns: 1 block, then 5
    assert _fused_head.BLOCK == 1024  # restored
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_paired_ratio_cancels_a_drift_that_widens_the_unpaired_interval():
    # the machine slows down by 1 % per round; the row is always exactly 1.02x stock within a round
    stock = [1.0 + 0.01 * r for r in range(20)]
    row = [1.02 * t for t in stock]
    rounds = list(range(20))
    ratios = _common.round_ratios(row, rounds, stock, rounds)
    assert ratios == pytest.approx([1.02] * 20)
    point, low, high = _common.paired_interval(ratios)
    assert point == low == high == pytest.approx(1.02)
    u_point, u_low, u_high = _common.ratio_interval(row, stock)
    assert u_point == pytest.approx(1.02) and u_high - u_low > 0.05  # the drift is in the unpaired interval


def test_round_ratios_pair_block_medians_of_the_same_round_only():
    stock, stock_rounds = [1.0, 3.0, 2.0, 10.0], [0, 0, 1, 2]
    row, row_rounds = [2.0, 2.0, 5.0, 4.0], [0, 0, 1, 3]
    # round 0: 2 / median(1, 3) = 1; round 1: 5 / 2; rounds 2 and 3 have no pair
    assert _common.round_ratios(row, row_rounds, stock, stock_rounds) == [1.0, 2.5]


def test_run_rounds_interleaves_warms_up_first_blocks_and_stops_before_a_round_past_the_deadline():
    import time

    log = []
    rows = [_common.Row(name=n, step=lambda n=n: log.append(n)) for n in "abc"]
    blocks = []
    done = _common.run_rounds(
        rows, rounds=4, steps=2, warmup=1, first_warmup=3, device=torch.device("cpu"), deadline=time.monotonic() + 60,
        on_block=lambda r, finished: blocks.append((r, finished)),
    )  # fmt: skip
    assert done == 4
    for r in rows:
        assert len(r.times) == 8 and r.rounds == [0, 0, 1, 1, 2, 2, 3, 3]
        assert log.count(r.name) == 3 + 2 + 3 * (1 + 2)  # first block: 3 untimed; later blocks: 1 untimed
    assert [f for _, f in blocks] == [False, False, True] * 4
    assert log[:5] != ["a"] * 5 or log[5:10] != ["b"] * 5  # shuffled order (seeded): not always a, b, c
    # a deadline already past: no round starts
    late = [_common.Row(name="x", step=lambda: None)]
    assert _common.run_rounds(late, rounds=3, steps=1, warmup=0, first_warmup=1, device=torch.device("cpu"), deadline=0.0, on_block=lambda *a: None) == 0
    assert late[0].times == []


def test_a_slow_first_warm_up_does_not_stop_the_rounds_that_fit():
    # A simulated clock (the wall clock made this test flaky on a loaded machine): a step advances it.
    now = [0.0]
    calls = {"a": 0, "b": 0}

    def step(name):
        calls[name] += 1
        now[0] += 0.4 if calls[name] == 1 else 0.01  # compilation in the first (untimed) step

    rows = [_common.Row(name=n, step=lambda n=n: step(n)) for n in "ab"]
    # round 0 takes 0.82 s, 0.8 of it warm-up; later rounds take 0.02 s: they fit in the 0.68 s left.
    # Counting the warm-up as part of a round would stop after round 0 (0.82 + 0.82 > 1.5).
    done = _common.run_rounds(
        rows, rounds=5, steps=1, warmup=0, first_warmup=1, device=torch.device("cpu"), deadline=1.5,
        on_block=lambda *a: None, clock=lambda: now[0],
    )  # fmt: skip
    assert done == 5 and all(len(r.times) == 5 for r in rows)


def test_patch_switch_restores_exactly_what_unpatch_and_patch_set():
    import trl

    import unsloth_adaptive_kl
    from unsloth_adaptive_kl import _source_patch

    watched = [(owner, name) for owner, name, _, _ in _source_patch._ORIGINALS]
    assert watched, "the suite runs patched"
    trl.GRPOConfig(output_dir="/tmp/unused", use_cpu=True, report_to="none")  # the config hook may patch more
    watched = [(owner, name) for owner, name, _, _ in _source_patch._ORIGINALS]

    def state():
        return [(name in owner.__dict__, owner.__dict__.get(name)) for owner, name in watched]

    unsloth_adaptive_kl.unpatch()
    stock = state()
    unsloth_adaptive_kl.patch()
    trl.GRPOConfig(output_dir="/tmp/unused", use_cpu=True, report_to="none")
    patched = state()
    switch = _common.PatchSwitch()
    try:
        assert [s is p for (_, s), (_, p) in zip(stock, patched)].count(False) > 0  # patching changed something
        for _ in range(2):
            switch.stock()
            assert all(a[0] == b[0] and a[1] is b[1] for a, b in zip(state(), stock))
            switch.patched()
            assert all(a[0] == b[0] and a[1] is b[1] for a, b in zip(state(), patched))
    finally:
        switch.patched()
    assert _source_patch.is_patched()


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
    assert all(len(r["times_s"]) == 4 and min(r["times_s"]) > 0 and r["rounds"] == [0, 0, 1, 1] for r in rows.values())
    assert rows["stock TRL (unpatched)"]["beta_now"] == rows["stock TRL (unpatched)"]["beta_start"] == 0.04
    # the dynamic controller ran at every step end: 0.04 * 0.9 ** (1 first warm-up + 2 rounds x 2 timed)
    assert rows["dynamic"]["beta_now"] == pytest.approx(0.04 * 0.9**5)
    assert rows["beta -> 0 (dynamic, beta_min=0)"]["beta_now"] == 0.0


def test_bench_loss_class_smoke_times_the_module_through_trl_on_each_head(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import bench_loss_class

    import unsloth_adaptive_kl

    out = tmp_path / "loss-class.md"
    try:
        assert bench_loss_class.main(["--smoke", "--rounds", "2", "--out", str(out)]) == 0
    finally:
        unsloth_adaptive_kl.patch()  # the stock row unpatches; leave the suite patched, as it started
    text = out.read_text()
    assert "### full: full fine-tuning" in text and "rounds completed: 2 of 2" in text
    (raw,) = json.loads((tmp_path / "loss-class.md.json").read_text()).values()
    rows = {r["name"]: r for r in raw}
    assert list(rows) == list(bench_loss_class.ROWS)
    assert all(r["rounds"] == [0, 1] and min(r["times_s"]) > 0 for r in rows.values())
    # each module ran the head its row names; the stock row has no module
    assert "head_path" not in rows["stock TRL (unpatched)"]
    assert rows["loss_class (fused head)"]["head_path"] == rows["loss_class target (fused head)"]["head_path"] == "fused"
    assert rows["loss_class (log-prob kernel)"]["head_path"] == "log-prob kernel"
    assert rows["loss_class target (fused head)"]["beta_now"] != rows["loss_class target (fused head)"]["beta_start"]


def test_bench_liger_recompile_loop_smoke_counts_graphs_per_call(capsys):
    assert bench_liger.main(["--recompile-loop", "--smoke", "--loop-calls", "3"]) == 0
    text = capsys.readouterr().out
    assert "| dapo | fused | 2+0 | 2+0 |" in text and "| luspo | log-prob kernel | 1+0 | 1+0 |" in text
    assert "recompiles after warm-up: none" in text


#: The two bench_unsloth.py smokes the Unsloth tests below read: the interleaving test's and the monitor test's.
UNSLOTH_RUNS = {
    "unsloth.md": ["--smoke", "--rows", "stock,dynamic,zero"],
    "unsloth-monitor.md": ["--smoke", "--modes", "full", "--rows", "stock_beta0,monitor,monitor_sampled"],
}


@pytest.fixture(scope="module")
def unsloth_smokes(tmp_path_factory):
    """Both runs of :data:`UNSLOTH_RUNS`, one after the other in ONE fresh process (``bench_unsloth.main`` each; importing
    Unsloth and generating its trainer is half a run's cost): ``{out name: (Markdown report, raw sections)}``.
    A fresh process: ``import unsloth`` rebinds TRL's classes process-wide."""
    out = tmp_path_factory.mktemp("bench-unsloth")
    # --budget: the default 190 s (import and model included) can cut a mode's rounds short on a loaded machine; the
    # tests count the rounds, and the timeout is what catches a hang
    runs = [[*argv, "--budget", "3600", "--out", str(out / name)] for name, argv in UNSLOTH_RUNS.items()]
    code = (
        "import sys\n"
        "sys.argv = ['bench_unsloth.py', '--smoke']  # bench_unsloth sets its smoke environment on import, from sys.argv\n"
        f"sys.path.insert(0, {BENCH!r})\n"
        "import bench_unsloth\n"
        f"for argv in {runs!r}:\n"
        "    assert bench_unsloth.main(argv) == 0, argv\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(BENCH), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {name: ((out / name).read_text(), json.loads((out / f"{name}.json").read_text())) for name in UNSLOTH_RUNS}


@pytest.mark.skipif(importlib.util.find_spec("unsloth") is None, reason="unsloth is not installed")
def test_bench_unsloth_smoke_runs_the_generated_trainer_interleaved_with_stock_and_patched_rows(unsloth_smokes):
    text, sections = unsloth_smokes["unsloth.md"]
    assert "| stock Unsloth (unpatched) | 3 |" in text and "| dynamic | 3 |" in text and text.count("rounds completed: 3 of 3") == 2
    assert list(sections) == ["lora: LoRA r=16 (FastLanguageModel.get_peft_model)", "full: full fine-tuning (full_finetuning=True), separate reference model"]
    for raw in sections.values():
        rows = {r["name"]: r for r in raw}
        assert all(r["rounds"] == [0, 1, 2] and min(r["times_s"]) > 0 for r in rows.values())
        # stock ran Unsloth's own loss (β never moves); dynamic ran the patched one at every step:
        # 0.04 * 0.9 ** (2 first warm-up steps + 3 timed); beta -> 0 reached 0 after its first step
        assert rows["stock Unsloth (unpatched)"]["beta_now"] == rows["stock Unsloth (unpatched)"]["beta_start"] == 0.04
        assert rows["dynamic"]["beta_now"] == pytest.approx(0.04 * 0.9**5)
        assert rows["beta -> 0 (dynamic, beta_min=0)"]["beta_now"] == 0.0
        # the fused loss was compiled (TorchInductor on the CPU) in the first blocks, and never again in
        # a timed step, although blocks switched between Unsloth's functions and ours (the seeded
        # order puts dynamic right after stock in round 2; switching there with unpatch()/patch()
        # instead of PatchSwitch compiled 1 graph in the timed steps of dynamic and beta -> 0, checked)
        assert sum(r["graphs_in_warmup"] for r in rows.values()) > 0
        assert [r["graphs"] for r in rows.values()] == [0, 0, 0]


@pytest.mark.skipif(importlib.util.find_spec("unsloth") is None, reason="unsloth is not installed")
def test_bench_unsloth_smoke_times_kl_monitor_against_stock_at_beta_zero(unsloth_smokes):
    """The monitor row on Unsloth's generated trainer (full fine-tuning, its separate reference model): it runs the
    reference forward at β = 0, compiles nothing in a timed step, and the note pairs it with stock at β = 0."""
    import _common

    text, sections = unsloth_smokes["unsloth-monitor.md"]
    assert f"{_common.MONITOR} vs {_common.STOCK_BETA0} (the reference forward and the logged KL): paired" in text
    (raw,) = sections.values()
    rows = {r["name"]: r for r in raw}
    assert f"{_common.MONITOR_SAMPLED} vs {_common.STOCK_BETA0} (per step" in text
    assert list(rows) == [_common.STOCK_BETA0, _common.MONITOR, _common.MONITOR_SAMPLED]
    assert all(min(r["times_s"]) > 0 and r["graphs"] == 0 for r in rows.values()), rows
    assert rows[_common.MONITOR]["beta_now"] == rows[_common.STOCK_BETA0]["beta_now"] == rows[_common.MONITOR_SAMPLED]["beta_now"] == 0.0


def test_bench_fused_head_parts_smoke_times_every_part_and_the_whole_on_the_fused_head(capsys):
    import bench_fused_head_parts

    assert bench_fused_head_parts.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "the whole ran the fused head" in out
    for part in ("whole: fused head", "queued: a GEMM 1", "GEMM 1: logits", "row pass", "gradient pass", "GEMM 2: grad_h",
                 "GEMM 3: grad_W", "GEMM 3 variant: reduced-precision reduction allowed", "GEMM 3 variant: layout (hᵀ G)ᵀ"):
        assert f"| {part}" in out, part
    assert "measured GEMM floor (GEMMs 1-3 as cuBLAS runs them here)" in out



def test_bench_trl_smoke_times_kl_monitor_against_stock_at_beta_zero_and_the_exclusions(tmp_path, monkeypatch):
    """Issue 36's rows: stock at β = 0, kl_monitor at β = 0, and
    method none with kl_exclude_token_ids; the note pairs the monitor with stock at β = 0."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import _common
    import bench_trl

    import unsloth_adaptive_kl

    out = tmp_path / "trl.md"
    try:
        rows = "stock_beta0,monitor,monitor_sampled,exclude"
        assert bench_trl.main(["--smoke", "--modes", "full", "--rows", rows, "--rounds", "2", "--out", str(out)]) == 0
    finally:
        unsloth_adaptive_kl.patch()  # the stock rows unpatch; leave the suite patched, as it started
    text = out.read_text()
    assert f"{_common.MONITOR} vs {_common.STOCK_BETA0} (the reference forward and the logged KL): paired" in text
    assert f"{_common.MONITOR_SAMPLED} vs {_common.STOCK_BETA0} (per step, over cycles of kl_monitor_every steps, kl_monitor_every=16): paired" in text
    (raw,) = json.loads((tmp_path / "trl.md.json").read_text()).values()
    rows = {r["name"]: r for r in raw}
    assert list(rows) == [_common.STOCK_BETA0, _common.MONITOR, _common.MONITOR_SAMPLED, _common.EXCLUDE]
    assert all(r["rounds"] == [0, 1] and min(r["times_s"]) > 0 for r in rows.values())
    assert [r["steps_per_call"] for r in rows.values()] == [1, 1, 16, 1]
    assert rows[_common.MONITOR]["beta_now"] == rows[_common.STOCK_BETA0]["beta_now"] == rows[_common.MONITOR_SAMPLED]["beta_now"] == 0.0


def test_the_sampled_monitor_row_runs_the_reference_forward_once_per_cycle(monkeypatch):
    """A call of the sampled row is kl_monitor_every steps, the reference forward in the first only (counted)."""
    import types

    import _common

    runtime = types.SimpleNamespace(monitor=True, monitor_every=4, observe_reward=lambda r: None)
    runtime.monitors_batch = lambda index: index % 4 == 0
    trainer = types.SimpleNamespace(
        _adaptive_kl=runtime, beta=0.0, state=types.SimpleNamespace(global_step=0), args=None, _metrics={"train": {}},
        callback_handler=types.SimpleNamespace(on_step_end=lambda *a: None), control=None,
    )  # fmt: skip
    seen = []
    trainer.compute_loss = lambda model, inputs: seen.append("ref_per_token_logps" in inputs) or _Loss()
    monkeypatch.setattr(_common, "reference_logps", lambda *a: "ref")
    optimizer = types.SimpleNamespace(step=lambda: None, zero_grad=lambda set_to_none: None)
    assert _common.steps_per_call(trainer) == 4
    step = _common.training_step(trainer, None, optimizer, {})
    step()
    step()
    assert seen == [True, False, False, False] * 2 and trainer.state.global_step == 8


class _Loss:
    def backward(self):
        pass
