"""The study harness (research/study_cli.py, the demo before issue 54; its parts in research/harness/): its --smoke
run end to end on the CPU, and the pure parts (GPU check, backend choice, summary) on made-up values. Moved from
tests/test_blackwell_demo.py, tests/test_tail.py and tests/test_gpu_support.py when the harness left blackwell/
(issue 54); the user's demo, blackwell/test_adaptive_kl_grpo.py, is tests/test_blackwell_demo.py's."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from demo_script import ROOT, SCRIPT, demo
from unsloth_adaptive_kl.gpu_support import kernel_support

CUDA_124_ARCHS = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
CUDA_128_ARCHS = CUDA_124_ARCHS + ["sm_100", "sm_120"]


# -- the GPU check -------------------------------------------------------------------------------
def test_blackwell_with_a_cuda_128_build_passes():
    check = demo.check_gpu("NVIDIA B200", (10, 0), CUDA_128_ARCHS, None)
    assert check.ok and check.blackwell
    assert "sm_100" in check.report and "Blackwell check passed" in check.report


def test_blackwell_with_a_build_that_lacks_its_arch_stops_with_the_fix():
    check = demo.check_gpu("NVIDIA GeForce RTX 5090", (12, 0), CUDA_124_ARCHS, None)
    assert not check.ok and check.blackwell
    assert "no kernels for sm_120" in check.report
    assert "CUDA >= 12.8" in check.fix and "uv pip install unsloth --torch-backend=auto" in check.fix


def test_a_later_minor_version_runs_on_the_same_major_arch():
    check = demo.check_gpu("NVIDIA GB10", (12, 1), CUDA_128_ARCHS, None)
    assert check.ok and check.blackwell and "sm_121" in check.report


def test_a_newer_major_is_not_covered_by_an_older_one():
    assert not demo.check_gpu("NVIDIA B200", (10, 0), ["sm_90", "compute_90"], None).ok


def test_a_failing_bf16_matmul_stops_the_run():
    check = demo.check_gpu("NVIDIA RTX PRO 6000", (12, 0), CUDA_128_ARCHS, "RuntimeError: no kernel image is available")
    assert not check.ok and "bf16" in check.report and "CUDA >= 12.8" in check.fix


def test_hopper_runs_and_says_it_is_not_blackwell():
    check = demo.check_gpu("NVIDIA H100 80GB HBM3", (9, 0), CUDA_124_ARCHS, None)
    assert check.ok and not check.blackwell
    assert "not a Blackwell GPU" in check.report


def test_no_gpu_runs_on_the_cpu():
    check = demo.check_gpu(None, None, [], None)
    assert check.ok and not check.blackwell and "CPU" in check.report


# -- backend choice -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "requested, installed, cuda, expected",
    [("auto", True, True, "unsloth"), ("auto", True, False, "trl"), ("auto", False, True, "trl"),
     ("trl", True, True, "trl"), ("unsloth", True, False, "unsloth")],
)
def test_backend_choice(requested, installed, cuda, expected):
    assert demo.choose_backend(requested, unsloth_installed=installed, cuda=cuda) == expected


def test_asking_for_unsloth_without_it_says_how_to_install():
    with pytest.raises(SystemExit, match="unsloth is not installed"):
        demo.choose_backend("unsloth", unsloth_installed=False, cuda=True)


# -- the summary ----------------------------------------------------------------------------------
def _rows(rewards, lengths, betas, raw_kl=0.01):
    return [
        {"step": i + 1, "reward": r, "completions/mean_length": n, "adaptive_kl/current_beta": b,
         "adaptive_kl/raw_kl": raw_kl if b > 0 else None, "adaptive_kl/adapted_kl": raw_kl if b > 0 else None,
         "step_time": 0.5 + i}
        for i, (r, n, b) in enumerate(zip(rewards, lengths, betas))
    ]


def test_summary_uses_the_first_and_last_tenth_of_the_steps():
    rows = _rows([0.1 * i for i in range(20)], [10] * 2 + [15] * 16 + [30] * 2, [0.1] * 20)
    s = demo.summarize_run(rows, window=0.1)
    assert s["length_start"] == 10 and s["length_end"] == 30
    assert s["final_reward"] == pytest.approx((1.8 + 1.9) / 2) and s["peak_reward"] == pytest.approx(1.9)
    assert s["median_step_s"] == pytest.approx(10.0)


def test_kl_is_missing_once_beta_reached_zero():
    s = demo.summarize_run(_rows([1.0] * 10, [5] * 10, [0.1] * 5 + [0.0] * 5), window=0.1)
    assert math.isnan(s["raw_kl_end"]) and s["final_beta"] == 0.0
    assert demo.cell([s["raw_kl_end"]], ".4f") == "—"


def test_cells_show_mean_and_sample_std_across_seeds():
    assert demo.cell([1.0, 2.0, 3.0], ".2f") == "2.00 ± 1.00"
    assert demo.cell([0.5], ".3f") == "0.500"


# -- the smoke run ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    env = dict(os.environ, TRITON_INTERPRET="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--output-dir", str(out)], capture_output=True,
                          text=True, env=env, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_smoke_reports_the_backend_and_the_gpu_check(smoke):
    _, stdout = smoke
    assert "backend: trl (TRL GRPOTrainer)" in stdout
    assert "GPU: no CUDA GPU: running on the CPU, not on Blackwell" in stdout
    # the backends' environment switches the run trained with (here the interpreted Triton kernel)
    assert "environment (the backends' switches): " in stdout and "TRITON_INTERPRET=1" in stdout


def test_smoke_writes_every_step_of_every_method(smoke):
    out, _ = smoke
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    steps = demo.SMOKE["steps"]
    for method in demo.ALL_METHODS:
        mine = [r for r in rows if r["method"] == method]
        assert [r["step"] for r in mine] == list(range(1, steps + 1)), method
        for r in mine:
            assert 0.0 <= r["reward"] <= 1.0 and r["completions/mean_length"] > 0 and r["step_time"] > 0
            assert r["adaptive_kl/current_beta"] > 0 and r["adaptive_kl/raw_kl"] >= 0
            # the rollouts are timed inside the step: one generate call per optimizer step (steps_per_generation 1)
            assert r["generate_calls"] == 1 and 0 < r["generation_time"] < r["step_time"]
    betas = {r["method"]: r["adaptive_kl/current_beta"] for r in rows if r["step"] == steps}
    # Ziegler's controller moved β (the new target does not lower β in its 20-update warm-up, longer than the smoke)
    assert betas["none"] == 0.1 and betas["ziegler"] != 0.1
    # every row records what its trainer trained: 2 prompts x 4 completions, one micro-batch, kl_horizon 10 steps
    assert {(r["completions_per_step"], r["gradient_accumulation_steps"], r["kl_horizon"]) for r in rows} == {(8, 1, 80.0)}


def test_smoke_prints_the_batch_each_run_trained(smoke):
    out, stdout = smoke
    assert "per optimizer step: 2 prompts x 4 = 8 completions in 1 micro-batch(es) of 8" in stdout
    assert "Trained (read from each run's trainer): 8 completions per optimizer step" in stdout
    assert "DIFFERENCE" not in stdout
    log = (out / "runs" / "target-seed0" / "log.txt").read_text()
    assert "trained: 8 completions per optimizer step (2 prompts x 4)" in log and "kl_horizon 80" in log
    trained = json.loads((out / "runs" / "target-seed0" / "trained.json").read_text())
    assert trained["completions_per_step"] == 8 and trained["kl_horizon"] == 80.0
    assert trained["args"]["optim"] == "adamw_torch" and trained["args"]["mask_truncated_completions"] is False


def test_smoke_writes_the_table_with_every_method(smoke):
    out, stdout = smoke
    table = (out / "summary.md").read_text()
    assert "backend: trl" in table and "command: python" in table
    for method in demo.ALL_METHODS:
        assert f"| `{method}` |" in table and f"| `{method}` |" in stdout


def test_smoke_writes_the_plot_or_says_why_not(smoke):
    out, stdout = smoke
    if importlib.util.find_spec("matplotlib") is None:
        assert "PNG skipped: matplotlib is not installed" in stdout
    else:
        png = (out / "curves.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000


# -- the warm start's learning rate ------------------------------------------------------------------
@pytest.mark.parametrize("task", ["easy", "hard"])
def test_warm_start_lr_reaches_the_optimizer_and_names_the_setting(task, tmp_path, monkeypatch):
    from harness import settings as demo_settings
    from harness import tasks as demo_tasks

    import toy

    seen = []
    monkeypatch.setattr(toy, "supervised_warm_start", lambda *a, lr, **k: seen.append(lr) or 1.0)
    args = demo.parse_args(["--task", task, "--warm-start-lr", "1e-3", "--hidden-size", "16", "--layers", "1",
                            "--warm-start-steps", "1", "--output-dir", str(tmp_path)])
    settings = demo_settings.settings_from(args)
    demo_tasks.starting_model(args, settings, seed=0, device="cpu")
    assert seen == [1e-3]
    assert demo_settings.default_tag(settings).endswith("-wlr0.001")
    default = demo_settings.settings_from(demo.parse_args(["--task", task]))
    assert default.warm_start_lr == 3e-3 and "wlr" not in demo_settings.default_tag(default)


# -- the generation clock -----------------------------------------------------------------------------
def test_the_generation_clock_times_each_generate_call_and_sums_unsloths_decode_graph_counters():
    import time
    from types import SimpleNamespace

    import torch

    from harness.worker import GenerationClock

    class Policy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(1, 1)

        def generate(self, seconds):
            time.sleep(seconds)
            return seconds

    policy = Policy()
    clock = GenerationClock(policy, cuda=False)
    assert clock.decode_graphs() == {}  # no Unsloth decode state: nothing reported
    assert policy.generate(0.05) == 0.05 and policy.generate(0.02) == 0.02  # the wrapper returns what generate did
    seconds, calls = clock.take()
    assert calls == 2 and 0.07 <= seconds < 1.0
    assert clock.take() == (0.0, 0)  # read once: the next step starts from zero
    # Unsloth keeps its counters on the CausalLM under any wrapper: summed over the modules that hold them
    policy.__dict__["_unsloth_decode_graphs"] = SimpleNamespace(captures=1, replays=130, eager_steps=1, disabled=None)
    policy.inner.__dict__["_unsloth_decode_graphs"] = SimpleNamespace(captures=2, replays=5, eager_steps=3,
                                                                       disabled="model type")
    assert clock.decode_graphs() == {"decode_graph_captures": 3, "decode_graph_replays": 135,
                                     "decode_graph_eager_steps": 4, "decode_graph_disabled": "model type"}


# -- the summary's token-KL column (from tests/test_tail.py) ---------------------------------------------
def test_the_demo_summary_shows_the_last_logged_token_kl_max_beside_the_mean_kl():
    from harness import summary

    rows = [
        {"reward": 0.0, "completions/mean_length": 5, "adaptive_kl/current_beta": 0.1, "step_time": 1.0,
         "adaptive_kl/raw_kl": kl, "adaptive_kl/adapted_kl": kl, "adaptive_kl/token_kl_max": peak}
        for kl, peak in ((0.01, 0.5), (0.02, 3.0), (0.03, None))
    ]  # fmt: skip
    s = summary.summarize_run(rows, window=0.5)
    assert s["token_kl_max_final"] == 3.0 and s["raw_kl_end"] == pytest.approx(0.025)
    headers = [h for h, _, _ in summary.COLUMNS]
    assert headers.index("token KL max final") == headers.index("raw KL end") + 1


# -- the GPU check over the product's table of cases (from tests/test_gpu_support.py) ------------------------
def _product_gpu_cases():
    """tests/test_gpu_support.py's CASES: one table of (capability, arch list, cubin, PTX) for doctor and the harness."""
    spec = importlib.util.spec_from_file_location("product_gpu_support_cases", os.path.join(ROOT, "tests", "test_gpu_support.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CASES


CASES = _product_gpu_cases()


@pytest.mark.parametrize("capability, arch_list, cubin, ptx", CASES)
def test_demo_gpu_check_runs_where_a_cubin_runs(capability, arch_list, cubin, ptx):
    check = demo.check_gpu("Test GPU", capability, arch_list, None)
    assert check.ok == bool(cubin), check.report
    assert check.blackwell == (capability[0] in (10, 11, 12))
    assert kernel_support(capability, arch_list).reason in check.report
    if ptx and not cubin:
        assert "the demo needs machine code" in check.report
