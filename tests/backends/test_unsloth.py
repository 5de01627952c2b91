"""Unsloth backend on CPU, through Unsloth's private entry point for generating its GRPO trainer.

Each scenario runs in a process of its own (unsloth_worker.py, forked after the imports it shares with its group):
``import unsloth`` rebinds TRL's classes process-wide. The worker measures; the assertions are here. The compiled path is
checked with TorchInductor on CPU; the GPU runs are recorded in docs/gpu-verification.md.
"""

import importlib.util
import json
import re
import os
import subprocess
import sys

import pytest
import reference
from unsloth_adaptive_kl import versions



def _generates_on_this_machine() -> bool:
    """Unsloth before 2026.10 has no CPU backend: without CUDA it cannot generate its GRPO trainer
    (test_unsloth_lines.py checks those lines' fused loss on CPU; tests/gpu their trainer)."""
    import torch
    from packaging.version import Version

    from unsloth_adaptive_kl._source_patch import version_of

    return torch.cuda.is_available() or Version(version_of("unsloth_zoo")) >= Version("2026.10")


pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("unsloth") is None, reason="unsloth is not installed"),
    pytest.mark.skipif(
        importlib.util.find_spec("unsloth") is not None and not _generates_on_this_machine(),
        reason="this Unsloth line cannot generate its GRPO trainer without CUDA (no CPU backend before 2026.10)",
    ),
]
WORKER = os.path.join(os.path.dirname(__file__), "unsloth_worker.py")
LOSS_TYPES = list(versions.ALL_LOSS_TYPES)
#: The scenarios of one worker process, by (import order, compiled): the process imports and lets Unsloth generate its
#: trainer once (~20 s of CPU), then runs each scenario in a child forked from that state (unsloth_worker.py). The first
#: test that needs a scenario runs its whole group; ``-k`` on one test still runs its group. ``unpatch`` runs in the
#: stock-first order: forked before the process imports this package (unsloth_worker.STOCK_FIRST).
GROUPS = [
    ("unsloth-first", ["unpatch", "config", "identity", "all_masked", "kl_part", "diagnostics", "subclass", "user_code", "renamed", "reward_placement", "monitor_reward"]),
    ("unsloth-first", ["compiled", "compiled_loop"]),
    ("ours-first", ["config", "train", "resume"]),
    ("config-before-unsloth", ["early_config"]),
]
_cache = {}


def run_worker(order, scenario, tmp_path_factory):
    key = (order, scenario)
    if key not in _cache:
        (names,) = [names for o, names in GROUPS if o == order and scenario in names]
        out = tmp_path_factory.mktemp("unsloth")
        proc = subprocess.run([sys.executable, WORKER, order, ",".join(names), str(out)], capture_output=True, text=True, timeout=2400)
        for name in names:
            if (out / f"{name}.json").exists():
                _cache[order, name] = json.loads((out / f"{name}.json").read_text())
            else:
                error = (out / f"{name}.error").read_text() if (out / f"{name}.error").exists() else "no result"
                _cache[order, name] = AssertionError(f"{order} {name}: {error}\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}")
    if isinstance(_cache[key], AssertionError):
        raise _cache[key]
    return _cache[key]


@pytest.mark.parametrize("order", ["unsloth-first", "ours-first"])
def test_either_import_order_patches_the_generated_trainer_and_config(order, tmp_path_factory):
    r = run_worker(order, "config", tmp_path_factory)
    assert r["trainer_class"] == "UnslothGRPOTrainer.UnslothGRPOTrainer"
    assert r["config_values"] == ["dynamic+clip", 0.5, 0.3, 123.0]
    assert r["to_dict"] == {"kl_adaptation_method": "dynamic+clip", "kl_clip_threshold": 0.5, "kl_horizon": 123.0}
    assert r["cli_method"] == "ziegler"
    assert "IGNORED" not in r["printed"]
    assert "kl_adaptation_method" in r["bad_method_error"] and "bogus" in r["bad_method_error"]


def test_unpatch_restores_stock_config_arguments_and_patch_restores_ours(tmp_path_factory):
    # Unsloth memoises the arguments a config accepts: a stale memo raised a TypeError after unpatch().
    r = run_worker("unsloth-first", "unpatch", tmp_path_factory)  # stock-first: a config built before this package's import
    stock, seq = r["never_patched"], r["sequence"]
    assert stock["value"] is None and len(stock["printed"]) == 1 and "will be IGNORED" in stock["printed"][0], stock
    patched = {"value": "ziegler", "printed": []}
    assert seq == {"imported": patched, "unpatched": stock, "patched_again": patched, "unpatched_again": stock}


def test_a_config_created_before_unsloth_generates_its_trainer_gets_the_patched_trainer(tmp_path_factory):
    # import unsloth_adaptive_kl, a GRPOConfig, then import unsloth: nothing of ours runs between that config
    # and the trainer, so the generated module is patched when Unsloth generates it (it used to stay stock).
    r = run_worker("config-before-unsloth", "early_config", tmp_path_factory)["early_config"]
    assert r["config_class"] == "trl.trainer.grpo_config.GRPOConfig"  # TRL's own: created before Unsloth's existed
    assert r["runtime"] == "UnslothAdaptiveKL" and r["method"] == "clip" and r["stock"] is False and r["loss_patched"]
    (line,) = r["backend_lines"]
    assert "backend: Unsloth fused loss (UnslothGRPOTrainer.UnslothGRPOTrainer, grpo_compute_loss)" in line, line


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_method_none_with_k3_is_identical_to_stock_unsloth(loss_type, tmp_path_factory):
    r = run_worker("unsloth-first", "identity", tmp_path_factory)
    case = r["identity"][loss_type]
    assert case["loss_equal"] and case["grads_equal"], case
    assert r["patched_again"]


def _kl_cases(tmp_path_factory):
    return run_worker("unsloth-first", "kl_part", tmp_path_factory)["kl_part"]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_kl_part_of_the_fused_loss_matches_float64_reference_for_every_method(loss_type, tmp_path_factory):
    cases = [c for c in _kl_cases(tmp_path_factory) if c["loss_type"] == loss_type]
    assert len(cases) == 9 and cases[0]["method"] == "half_kl"  # registered by the worker, outside the package
    for c in cases:
        assert c["got"] == pytest.approx(c["expected"], rel=2e-4, abs=1e-6), c
        length_only_on_sequence_mean = c["method"] == "length_normalized" and loss_type in ("grpo", "sapo")
        if c["method"] != "none" and not length_only_on_sequence_mean:  # the shaping reached the loss
            assert abs(c["got"] - c["unshaped"]) > 1e-4, c


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_metrics_are_exact_against_float64_on_the_same_logps(loss_type, tmp_path_factory):
    for c in [c for c in _kl_cases(tmp_path_factory) if c["loss_type"] == loss_type]:
        assert c["logged_raw"] == [pytest.approx(c["raw_ref"], rel=1e-5)], c
        assert c["logged_adapted"] == [pytest.approx(c["adapted_ref"], rel=1e-5)], c
        assert c["logged_beta"] == [0.3]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_tail_metrics_from_the_compiled_fused_loss_match_float64(loss_type, tmp_path_factory):
    """The histogram made inside the fused loss (the mean_kl slot) gives the exact max and a p99 and top-1 % share
    within their bounds of the float64 references sorted from the same per-token raw KL (float32 in the loss)."""
    import torch
    from test_tail import exact_tail

    from unsloth_adaptive_kl import tail

    for c in [c for c in _kl_cases(tmp_path_factory) if c["loss_type"] == loss_type]:
        maximum, p99, share = exact_tail(torch.tensor(c["valid_raw"], dtype=torch.float64))
        (got_max,), (got_p99,), (got_share,) = c["logged_tail"]
        assert got_max == pytest.approx(maximum, rel=1e-6), c
        assert abs(got_p99 - p99) <= tail.P99_RELATIVE_ERROR * abs(p99) * 1.0001 + tail.ABSOLUTE_ERROR, c
        assert abs(got_share - share) <= tail.SHARE_RELATIVE_ERROR * share * 1.0001 + 1e-6, c


@pytest.mark.parametrize("method", reference.METHODS)
def test_unsloth_grpo_trains_with_each_method(method, tmp_path_factory):
    run = run_worker("ours-first", "train", tmp_path_factory)["train"][method]
    logs = run["logs"]
    assert run["runtime"] == "UnslothAdaptiveKL" and not run["ignored_printed"]
    (line,) = run["backend_lines"]  # one line, at creation, naming the backend actually patched in
    assert "backend: Unsloth fused loss (UnslothGRPOTrainer.UnslothGRPOTrainer, grpo_compute_loss)" in line, line
    assert run["batch"][:2] == [4, 1]  # 4 completions per optimizer step, one micro-batch
    assert len(logs) == 3
    betas = [h["adaptive_kl/current_beta"] for h in logs]
    # dynamic: the reward is always above its threshold, so beta decays at every optimizer step
    assert betas == pytest.approx(reference.expected_betas(method, logs), rel=1e-9)
    reference.assert_course_logged(run["course_lines"], method, betas)  # the line logged when train() ends
    for h in logs:
        assert h["adaptive_kl/raw_kl"] is not None and h["adaptive_kl/adapted_kl"] is not None
        assert h["adaptive_kl/token_kl_max"] >= h["adaptive_kl/token_kl_p99"] >= 0  # k3: no negative token
    assert all(0 < h["adaptive_kl/token_kl_top1pct_share"] <= 1 for h in logs[1:])
    moved = [h for h in logs if h["adaptive_kl/raw_kl"] > 0.06]
    if method in reference.PER_TOKEN_SHAPING:
        assert all(h["adaptive_kl/adapted_kl"] < h["adaptive_kl/raw_kl"] for h in moved)
        assert any(h["adaptive_kl/adapted_kl"] < h["adaptive_kl/raw_kl"] for h in logs[1:])


def test_a_method_registered_outside_the_package_trains_and_halves_the_adapted_kl(tmp_path_factory):
    logs = run_worker("ours-first", "train", tmp_path_factory)["train"]["half_kl"]["logs"]
    assert len(logs) == 3 and logs[-1]["adaptive_kl/raw_kl"] > 0
    for h in logs:
        assert h["adaptive_kl/adapted_kl"] == pytest.approx(0.5 * h["adaptive_kl/raw_kl"], rel=1e-6)


def test_changing_beta_never_recompiles_the_fused_loss(tmp_path_factory):
    r = run_worker("unsloth-first", "compiled", tmp_path_factory)
    fixed, dynamic, to_zero = r["compiled_fixed"], r["compiled_dynamic"], r["compiled_dynamic_to_zero"]
    assert fixed["betas"] == [0.04] * 5
    assert dynamic["betas"] == pytest.approx([0.04 * 0.9**k for k in range(5)])
    assert to_zero["betas"] == pytest.approx([0.04, 0.036, 0.0324, 0.0, 0.0])
    # A beta that changes every step compiles exactly the graphs a fixed beta does, step by step. (Each run counts from
    # its own start, after the worker's warm-up, which compiles transformers' mask and not the fused loss: the first
    # step compiles the fused loss.)
    assert fixed["graphs"][0] >= 1 and dynamic["graphs"] == fixed["graphs"], (fixed, dynamic)
    # The switch to 0 is one new constant (the gate): at most one graph more than the fixed run
    # at each step; and once beta is 0 no KL is computed.
    extra = [z - f for z, f in zip(to_zero["graphs"], fixed["graphs"])]
    assert extra[:3] == [0, 0, 0] and max(extra) <= 1, (to_zero["graphs"], fixed["graphs"])
    assert to_zero["raw_kl"][3:] == [None, None]
    # kl_monitor: β reaching 0 compiles nothing new (the gate stays 1.0; a tensor flag keeps the KL out of the
    # loss), and the KL is still logged at β = 0.
    monitored = r["compiled_monitor_to_zero"]
    assert monitored["betas"] == pytest.approx(to_zero["betas"]) and monitored["graphs"] == fixed["graphs"], (monitored, fixed)
    assert all(kl is not None and kl > 0 for kl in monitored["raw_kl"][3:]), monitored


def test_a_loop_with_changing_shapes_compiles_no_more_than_stock_unsloth(tmp_path_factory):
    """Issue 22: completion lengths, valid-token counts and num_items_in_batch changing every call (β too, patched):
    after the first two calls no method compiles a graph, and no call compiles more than stock Unsloth's. (The first
    length, 6, equals the stats accumulator's: before it was marked static, duck sizing specialised the length to it
    and the second call compiled one graph more than stock.)"""
    runs = run_worker("unsloth-first", "compiled_loop", tmp_path_factory)["compiled_loop"]
    stock, stock_again = runs.pop("stock")["graphs"], runs.pop("stock_again")["graphs"]
    # Each loop runs in a child forked from the same state, so its position among the loops cannot change dynamo's
    # state; stock_again, after the patched loops, checks that what they left (the scenario's TorchInductor cache on
    # disk, the one thing passed from loop to loop) changes nothing.
    assert stock[0] >= 1 and stock_again == stock
    for method, run in runs.items():
        graphs = run["graphs"]
        assert graphs[0] >= 1 and sum(graphs[2:]) == 0, (method, graphs, stock, run["recompile_reasons"])
        assert all(ours <= theirs for ours, theirs in zip(graphs[1:], stock[1:])), (method, graphs, stock, run["recompile_reasons"])


@pytest.mark.parametrize("method", reference.controller_names())
def test_resume_from_checkpoint_continues_beta_and_controller_state(method, tmp_path_factory):
    r = run_worker("ours-first", "resume", tmp_path_factory)["resume"][method]
    assert len(r["full"]) == 5 and len(r["resumed_after_2"]) == 3
    assert r["resumed_after_2"] == pytest.approx(r["full"][2:], rel=1e-12)
    assert r["resumed_after_2"][0] != 0.04  # the controller's state came back, not the configured beta
    assert r["resumed_state"] == r["full_state"]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_a_micro_batch_with_no_valid_token_logs_stock_unsloths_kl_and_no_adaptive_kl_metric(loss_type, tmp_path_factory):
    """Every completion truncated and masked (mask_truncated_completions=True): stock Unsloth's ``kl`` is the mean
    over kept rows with 0 kept rows, so 0.0 (not NaN), its loss 0 and its gradients zero. Method none + k3 logs and
    computes exactly that (stock is the reference, unpatched in place on the same trainer and input); with any
    method the adaptive_kl/* KL metrics observed no token and get no entry, not 0 and not NaN
    (docs/reliability.md), while current_beta is still logged."""
    case = run_worker("unsloth-first", "all_masked", tmp_path_factory)["all_masked"][loss_type]
    assert case["fused_tokens"] == [0, 0], case  # Unsloth reapplied TRL's zeroed rows: the fused loss saw no token
    stock, ours = case["stock_logged"], case["logged"]
    assert stock["kl"] == [0.0] and stock["completion_length"] == [0.0], stock
    assert case["stock_loss"] == 0.0 and case["stock_grads"] > 0 and case["stock_grads_zero"], case
    assert ours["kl"] == stock["kl"] and case["loss_equal"] and case["grads_equal"], case
    assert {k: v for k, v in ours.items() if not k.startswith("adaptive_kl/")} == stock
    runs = {"none": {"logged": ours, "loss": case["loss"], "grads_finite": True}, **case["adaptive"]}
    for method, run in runs.items():
        logged = run["logged"]
        assert logged["kl"] == [0.0] and run["loss"] == 0.0 and run["grads_finite"], (method, run)
        assert "adaptive_kl/raw_kl" not in logged and "adaptive_kl/adapted_kl" not in logged, (method, logged)
        assert logged["adaptive_kl/current_beta"] == [0.04], (method, logged)


def test_excluded_tokens_leave_the_fused_kl_term_and_metrics_and_not_the_policy_term(tmp_path_factory):
    import torch
    from test_tail import exact_tail

    cases = run_worker("unsloth-first", "diagnostics", tmp_path_factory)["diagnostics"]
    assert len(cases) == 6
    for c in cases:
        excluded, every = c["excluded"], c["all"]
        assert c["excluded_count"] > 0 and excluded["policy"] == every["policy"], c  # the policy term is untouched
        assert excluded["kl_part"] == pytest.approx(c["expected"], rel=2e-4, abs=1e-7), c
        assert abs(excluded["kl_part"] - every["kl_part"]) > 1e-6, c
        logged = excluded["logged"]
        assert logged["adaptive_kl/raw_kl"] == [pytest.approx(c["raw_ref"], rel=1e-5)], c
        maximum, _, _ = exact_tail(torch.tensor(c["valid_raw"], dtype=torch.float64))
        assert logged["adaptive_kl/token_kl_max"] == [pytest.approx(maximum, rel=1e-6)], c


def test_kl_monitor_at_beta_zero_keeps_stock_unsloths_loss_and_gradients_and_logs_the_kl(tmp_path_factory):
    """kl_monitor with beta = 0 on the generated trainer: the reference model is made, and on each loss type (method none,
    a shaping method with the length-normalised term, and a NaN reference log-prob) the loss and every gradient equal
    stock Unsloth's beta = 0 ones (torch.equal; unpatched in place, with no reference log-probs), while the raw KL, its
    tail and Unsloth's own kl are logged: the first against float64, the kl against stock Unsloth's at beta = 0.04."""
    import math

    import torch
    from test_tail import exact_tail

    r = run_worker("unsloth-first", "diagnostics", tmp_path_factory)["monitor"]
    assert r["args_beta"] == 0.0 and r["beta"] == 0.0 and r["has_ref_model"], r
    assert len(r["cases"]) == 3 * len(LOSS_TYPES)
    for c in r["cases"]:
        ours_finite, stock_finite = c["grads_finite"]
        assert c["loss_equal"] and c["grads_equal"] and ours_finite == stock_finite, c  # a NaN reference changes nothing
        logged, stock = c["logged"], c["stock_logged"]
        assert "adaptive_kl/raw_kl" not in stock and stock["kl"] == [0.0], stock  # stock logs no KL at beta = 0
        assert logged["adaptive_kl/current_beta"] == [0.0], c
        if c["nan_ref"]:  # the KL is not finite: not logged, counted; the loss is untouched all the same
            assert "adaptive_kl/raw_kl" not in logged and logged["adaptive_kl/nonfinite_kl_batches"] == [1.0], c
            continue
        assert logged["adaptive_kl/raw_kl"] == [pytest.approx(c["raw_ref"], rel=1e-5)], c
        assert logged["kl"] == [pytest.approx(c["stock_kl"][0], rel=1e-6)] and c["stock_kl"][0] > 0, c
        maximum, _, _ = exact_tail(torch.tensor(c["valid_raw"], dtype=torch.float64))
        assert logged["adaptive_kl/token_kl_max"] == [pytest.approx(maximum, rel=1e-6)], c
        assert math.isfinite(logged["adaptive_kl/token_kl_p99"][0]), c


def test_kl_monitor_trains_one_step_exactly_as_stock_unsloth_at_beta_zero(tmp_path_factory):
    """One full training step (generation, the reference forward, loss, optimizer) with kl_monitor at beta = 0 against
    stock Unsloth's at beta = 0, same seed: the same logged loss and the same weights afterwards; the KL is logged."""
    r = run_worker("unsloth-first", "diagnostics", tmp_path_factory)["monitor_train"]["one_step"]
    assert r["stock_runtime"] and set(r["ref_calls"]) == {0}, r  # the reference forward ran (stock's has no reference)
    assert r["weights_equal"], r
    stock, monitored = r["stock_log"], r["monitored_log"]
    assert monitored["loss"] == stock["loss"] and monitored["reward"] == stock["reward"], r
    assert "adaptive_kl/raw_kl" not in stock and monitored["adaptive_kl/raw_kl"] >= 0 and monitored["adaptive_kl/current_beta"] == 0.0, r


@pytest.mark.parametrize("run", ["zero", "dynamic_to_zero"])
def test_kl_monitor_runs_the_reference_forward_and_logs_the_kl_at_beta_zero_in_training(run, tmp_path_factory):
    """beta = 0 from the start, or reached by the dynamic controller after 2 steps: every step's reference forward
    runs and adaptive_kl/raw_kl, the tail and Unsloth's kl are logged, with β 0 where it is 0."""
    import math

    r = run_worker("unsloth-first", "diagnostics", tmp_path_factory)["monitor_train"][run]
    logs = r["logs"]
    assert [h["adaptive_kl/current_beta"] for h in logs] == ([0.0] * 4 if run == "zero" else [0.04, 0.04, 0.0, 0.0]), logs
    assert r["ref_calls"] == [0, 1, 2, 3], r
    for h in logs:
        assert math.isfinite(h["adaptive_kl/raw_kl"]) and math.isfinite(h["kl"]), h
        assert h["adaptive_kl/token_kl_max"] >= h["adaptive_kl/token_kl_p99"] >= 0, h
    assert logs[-1]["adaptive_kl/raw_kl"] > 0 and logs[-1]["kl"] > 0, logs  # the policy moved, and the log shows it


def test_sampled_kl_monitor_runs_the_reference_forward_on_every_second_batch_and_logs_the_full_monitors_kl_there(tmp_path_factory):
    """kl_monitor_every=2 at beta = 0 (4 steps, one generation batch a step): the reference forward runs for batches 0 and
    2 only; steps 1 and 3 log the KL the full monitor logged at those steps (the same training: both losses are stock
    Unsloth's beta = 0 loss), steps 2 and 4 no adaptive_kl KL, and Unsloth's own kl its stock beta = 0 value, 0."""
    monitor = run_worker("unsloth-first", "diagnostics", tmp_path_factory)["monitor_train"]
    sampled, full = monitor["sampled"], monitor["zero"]
    assert sampled["ref_calls"] == [0, 2] and full["ref_calls"] == [0, 1, 2, 3], monitor
    assert ["adaptive_kl/raw_kl" in h for h in sampled["logs"]] == [True, False, True, False], sampled
    assert [sampled["logs"][step]["kl"] for step in (1, 3)] == [0.0, 0.0], sampled
    for step in (0, 2):
        for name in ("adaptive_kl/raw_kl", "kl", "adaptive_kl/token_kl_max"):
            assert sampled["logs"][step][name] == full["logs"][step][name], (step, name, monitor)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_kl_part_of_the_fused_loss_under_gradient_accumulation_matches_float64_for_every_method(loss_type, tmp_path_factory):
    """3 accumulation steps: the fused loss divides every method's KL part as Unsloth divides its loss (issue 38);
    length_normalized's term, added by this package in the fused loss, by the accumulation steps too."""
    cases = [c for c in run_worker("unsloth-first", "kl_part", tmp_path_factory)["kl_part_accumulation"] if c["loss_type"] == loss_type]
    assert [c["method"] for c in cases] == reference.ACCUMULATION_METHODS
    for c in cases:
        assert c["accumulation"] == 3, c  # the divisor reached the fused loss
        assert c["got"] == pytest.approx(c["expected"], rel=2e-4, abs=1e-7), c


# -- fast: the fused loss's statistics, without the generated trainer (issue 38) -----------------------------------------
@pytest.mark.parametrize("rejection", [False, True])
@pytest.mark.parametrize("method", reference.ACCUMULATION_METHODS)
def test_the_fused_losss_sums_hold_the_raw_and_the_adapted_kl_each_in_its_slot(method, rejection):
    """``FusedKLInputs.finish`` (the fused loss's last line): ``[unsloth_kl, raw sum, adapted sum, tokens, sum of
    per-completion adapted means, completions]`` against float64, and length_normalized's term divided by the
    accumulation steps. Rollout rejection (``rs_keep``) removes tokens from the adapted KL. Milliseconds: no worker."""
    from types import SimpleNamespace

    import torch

    from unsloth_adaptive_kl import FIELDS, AdaptiveKL, metrics
    from unsloth_adaptive_kl.backends.unsloth import STATS_SIZE, FusedKLInputs
    from unsloth_adaptive_kl.shaping import SHAPING

    beta, clip_threshold, kl_target, accumulation = 0.3, 0.4, 0.2, 3
    config = SimpleNamespace(**{f.name: f.default for f in FIELDS})
    config.__dict__.update(beta=beta, kl_adaptation_method=method, kl_clip_threshold=clip_threshold, kl_target=kl_target)
    term = AdaptiveKL(config).term
    inputs = reference.loss_inputs(64, seed=5)
    mask = inputs["completion_mask"]
    logp = inputs["old_per_token_logps"] + 0.5 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(6))
    raw64, _ = reference.raw_and_shaped_kl("none", logp, inputs["ref_per_token_logps"], logp, mask, estimator="k3", clip_threshold=clip_threshold, kl_target=kl_target, bias_correction=False)
    raw = raw64.float()
    rs_keep = (torch.arange(mask.shape[1]) % 3 != 1).expand_as(mask) if rejection else None
    fused = FusedKLInputs(term, torch.tensor(beta), torch.tensor(float(mask.shape[0])), None)
    loss, stats = fused.finish(torch.tensor(0.0), torch.tensor(0.125), raw, term.shape(raw), mask, rs_keep, accumulation)

    kept = mask.bool() if rs_keep is None else mask.bool() & rs_keep
    adapted64 = torch.where(kept, reference.shaped64(raw.double(), method, clip_threshold, kl_target), 0.0)
    sequence_means = adapted64.sum(-1) / mask.sum(-1).clamp(min=1)
    assert stats.shape == (STATS_SIZE,) and stats[0].item() == 0.125  # Unsloth's own kl, passed through
    sums = stats[1:]
    assert sums[metrics.RAW_SUM].item() == pytest.approx(raw64.sum().item(), rel=1e-6)
    assert sums[metrics.ADAPTED_SUM].item() == pytest.approx(adapted64.sum().item(), rel=1e-6)
    assert sums[metrics.TOKENS].item() == mask.sum().item() and sums[metrics.COMPLETIONS].item() == mask.shape[0]
    assert sums[metrics.ADAPTED_SEQ_MEAN_SUM].item() == pytest.approx(sequence_means.sum().item(), rel=1e-6)
    expected_loss = beta * sequence_means.mean().item() / accumulation if "length_normalized" in method.split("+") else 0.0
    assert loss.item() == pytest.approx(expected_loss, rel=1e-6)
    shaped_per_token = any(SHAPING[part].per_token for part in method.split("+") if part in SHAPING)
    if shaped_per_token or rejection:  # the case can tell the adapted KL from the raw one
        assert abs(adapted64.sum().item() - raw64.sum().item()) > 1e-3


# -- issue 39: user code on the fused loss (tests/test_user_code.py has the core, test_user_code_in_trainers.py TRL's)
def test_user_shaping_methods_are_refused_by_name_on_the_fused_loss(tmp_path_factory):
    """The probe's methods, registered as a user would: refused when the trainer is created (the fused loss is
    compiled, so the term is checked once eagerly then); the faults only real batches show are refused during
    training, before their optimizer step, with the weights still finite."""
    r = run_worker("unsloth-first", "user_code", tmp_path_factory)["user_code"]
    assert "shaping method 'cap_in_place' changed its input in place" in r["created_cap_in_place"]
    assert "shaping method 'detached' returned a tensor with no gradient" in r["created_detached"]
    assert "shaping method 'float64' returned dtype torch.float64" in r["created_float64"]
    assert "shaping method 'nan' returned NaN or inf for a finite KL" in r["created_nan"]
    in_place = r["trained_cap_in_place_on_real_batches"]
    assert "shaping method 'cap_in_place_on_real_batches' changed its input in place" in in_place["error"], in_place
    assert in_place["global_step"] == 0 and in_place["weights_finite"]
    power = r["trained_power"]
    assert "shaping method 'power' returned NaN or inf on valid tokens whose KL was finite" in power["error"], power
    assert power["global_step"] < 4 and power["weights_finite"]


def test_a_user_estimator_returning_nan_on_real_log_probs_is_refused_by_name_on_the_fused_loss(tmp_path_factory):
    """The fused loss calls the estimator unchecked (no host read in the compiled region): its NaN on finite
    log-probs is counted in the metric sums, whose read refuses it by name before the optimizer step (before the
    fix: counted as a non-finite KL batch and warned about, the run went on)."""
    shaky = run_worker("unsloth-first", "user_code", tmp_path_factory)["user_code"]["trained_shaky"]
    assert "KL estimator 'shaky' returned NaN or inf on valid tokens whose log-probs were finite" in (shaky["error"] or ""), shaky
    assert shaky["global_step"] < 4 and shaky["weights_finite"]  # refused at the first micro-batch with such a token


def test_the_compiled_fused_lines_count_a_user_estimators_nan_on_finite_inputs_and_the_sums_refuse_it_by_name():
    """``FusedKLInputs.estimate`` and ``finish`` as the patched grpo_compute_loss runs them, in one
    ``torch.compile(fullgraph=True)`` region (no graph break, no host read): the estimator-fault slot counts the valid
    tokens where the estimator was NaN on finite log-probs, against a count made by hand; a NaN reference log-prob
    (the model's) and padding are not counted; the sums' read raises naming the estimator."""
    from types import SimpleNamespace

    import torch

    from unsloth_adaptive_kl import FIELDS, AdaptiveKL, metrics, register_estimator, unregister_estimator
    from unsloth_adaptive_kl.backends.unsloth import FusedKLInputs

    register_estimator("shaky")(lambda logp, ref: (logp - ref) * torch.sqrt(logp + 3.5))
    try:
        config = SimpleNamespace(**{f.name: f.default for f in FIELDS})
        config.__dict__.update(beta=0.1, kl_adaptation_method="clip", kl_estimator="shaky")
        state = AdaptiveKL(config)  # the check at creation passes: its log-probs are in [-3, 0]
        fused = FusedKLInputs(state.term, torch.tensor(0.1), torch.tensor(3.0), None)

        def patched_lines(new, ref, mask):  # grpo_compute_loss's KL lines as rewritten (unsloth_zoo 2026.10)
            keep = mask.bool()
            new, ref = torch.where(keep, new, 0.0), torch.where(keep, ref, 0.0)
            kl_log_ratio = torch.clamp(ref - new, min=-20.0, max=20.0)
            kl_i = torch.expm1(kl_log_ratio) - kl_log_ratio
            kl_i, faults = fused.estimate(kl_i, new, ref, kl_log_ratio, mask)
            kl_i = torch.clamp(kl_i, min=-10.0, max=10.0)
            return fused.finish(torch.zeros(()), torch.zeros(()), kl_i, fused.term.shape(kl_i), mask, None, 1, estimator_faults=faults)[1]

        new = torch.tensor([[-1.0, -4.0, -5.0, -4.5], [-2.0, -3.9, -0.5, -6.0], [-1.0, -1.0, -1.0, -1.0]])
        ref = new - 0.3
        ref[1, 1] = float("nan")  # the model's NaN: not the estimator's fault
        mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
        stats = torch.compile(patched_lines, fullgraph=True, backend="aot_eager")(new, ref, mask)
        blamed = (new < -3.5) & mask.bool() & ~torch.isnan(ref)  # (0,1), (0,2), (1,3)
        assert stats[1 + metrics.ESTIMATOR_FAULTS].item() == blamed.sum().item() == 3
        assert stats[1 + metrics.SHAPING_FAULTS].item() == 0
        with pytest.raises(ValueError, match=r"KL estimator 'shaky' returned NaN or inf on valid tokens whose log-probs were finite \(3 of them\)"):
            state.record_sums(stats[1:], training=True, beta=0.1)
        clean = torch.compile(patched_lines, fullgraph=True, backend="aot_eager")(new.clamp(min=-3.0), ref, mask)
        assert clean[1 + metrics.ESTIMATOR_FAULTS].item() == 0
        state.record_sums(clean[1:], training=True, beta=0.1)  # the model's NaN alone: counted as a NaN batch, not refused
    finally:
        unregister_estimator("shaky")


@pytest.mark.parametrize("method", ["sigmoid", "halve"])
def test_a_nan_reference_on_the_fused_loss_is_counted_not_blamed_and_both_kl_means_leave_it_out(method, tmp_path_factory):
    """Two micro-batches of one logging window, the first with a NaN reference log-prob (the model's, not the
    user method's): not refused; counted in nonfinite_kl_batches; raw_kl and adapted_kl both hold only the second."""
    run = run_worker("unsloth-first", "user_code", tmp_path_factory)["user_code"][f"nan_reference_{method}"]
    logged = run["logged"]
    assert run["errors"] == [None, None], run
    assert logged["adaptive_kl/nonfinite_kl_batches"] == [1.0], logged
    assert len(logged["adaptive_kl/raw_kl"]) == len(logged["adaptive_kl/adapted_kl"]) == 1, logged
    assert 0 < logged["adaptive_kl/adapted_kl"][0] < logged["adaptive_kl/raw_kl"][0], logged

def test_a_subclass_overriding_compute_loss_trains_with_the_adaptation_when_it_calls_super_and_is_refused_when_not(tmp_path_factory):
    # issue 39, item 4. Before the fix both were refused when the trainer was created ("would not reach its loss").
    r = run_worker("unsloth-first", "subclass", tmp_path_factory)["subclass"]
    plain, inherited, own = r["plain"], r["super"], r["own"]
    assert plain["error"] is None and inherited["error"] is None
    assert inherited["logs"] == plain["logs"] and len(plain["logs"]) == 3  # the same losses, β and KL metrics
    assert len({h["adaptive_kl/current_beta"] for h in plain["logs"]}) == 3  # target moved β
    assert inherited["calls"] == 3
    assert "OwnLoss overrides compute_loss of UnslothGRPOTrainer" in own["error"], own["error"]
    assert "did not go through UnslothGRPOTrainer.compute_loss" in own["error"] and "super().compute_loss(model, inputs" in own["error"]
    assert own["global_step"] == 0 and own["weights_unchanged"]


RENAMED = ["grpo_compute_loss:" + n for n in ("new", "ref", "mask", "rs_keep", "current_gradient_accumulation_steps")]
RENAMED += ["grpo_accumulated_loss:" + n for n in ("ref_logps", "completion_mask")]


@pytest.mark.parametrize("case", RENAMED)
def test_an_unsloth_release_that_renames_a_variable_a_replacement_reads_is_refused_at_patch_time_naming_it(case, tmp_path_factory):
    # issue 39, item 10: every anchor still matches such a release; before the check the plan built, and the
    # rewritten loss would have failed with a NameError inside torch.compile(fullgraph=True) at the first step.
    from unsloth_adaptive_kl._source_patch import version_of

    r = run_worker("unsloth-first", "renamed", tmp_path_factory)["renamed"]
    assert r["unchanged_targets"] == ["UnslothEfficientGRPO.forward", "UnslothGRPOTrainer.compute_loss", "grpo_accumulated_loss", "grpo_compute_loss"]
    function, name = case.split(":")
    error = r["errors"][case]
    assert error is not None, f"the plan built on a copy where {function} renamed {name!r}"
    prefix = f"unsloth_zoo {version_of('unsloth_zoo')}: "
    if error.startswith(prefix + "expected the anchor"):  # the renamed name is in an anchor line: that check fires first
        anchor = error.split("expected the anchor ", 1)[1].split(" exactly once", 1)[0]
        assert re.search(rf"\b{name}\b", anchor) and f"in {function}, found it 0 times" in error, error
    else:
        assert error.startswith(f"{prefix}the rewrite of {function} reads {name!r}"), error
        assert f"{function} does not define" in error


def _reward_placement(tmp_path_factory):
    return run_worker("unsloth-first", "reward_placement", tmp_path_factory)["reward_placement"]


def test_reward_placement_lowers_each_reward_by_beta_times_its_summed_kl_on_the_generated_trainer(tmp_path_factory):
    import torch

    scored = _reward_placement(tmp_path_factory)["scored"]
    logp, ref, mask = (torch.tensor(scored[k], dtype=torch.float64) for k in ("logp", "ref", "mask"))
    valid = mask.bool()
    assert scored["coef_is_none"] and scored["ref_is_trls"]  # Unsloth's reference log-probs, at scoring time
    # The policy's log-probs by the function Unsloth computes its old and reference log-probs with, so the KL is
    # taken between two log-probs of the same computation. (They are not a plain float32 forward's: measured here,
    # Unsloth's differ from one, and treat a sampled pad token as padding; docs/kl-placement.md.)
    assert scored["logp_is_unsloths_own"]
    assert (logp[valid] != 0).sum() > 10  # a real batch of log-probs
    penalty, _ = reference.reward_penalty64("clip", logp, ref, mask, estimator="k1", beta=0.5, clip_threshold=0.05, kl_target=0.02)
    rewards = torch.tensor(scored["rewards_per_func"], dtype=torch.float64).sum(1)
    advantages = torch.tensor(scored["advantages"], dtype=torch.float64)
    assert torch.allclose(advantages, reference.group_advantages64(rewards - penalty, scored["num_generations"]), rtol=1e-4, atol=1e-4)
    assert (advantages - reference.group_advantages64(rewards, scored["num_generations"])).abs().max() > 1e-2
    assert scored["kl_penalty"] == [pytest.approx(penalty.mean().item(), rel=1e-6)]
    # the groups the KL dominates, or alone orders (equal rewards), by a float64 loop over the batch's groups
    dominated, only = reference.group_counts64(rewards.tolist(), penalty.tolist(), scored["num_generations"])
    assert (scored["kl_dominated_groups"], scored["kl_only_groups"]) == ([float(dominated)], [float(only)])


def test_reward_placement_reads_each_completions_own_log_probs_when_unsloth_left_packs_the_prompts(tmp_path_factory):
    """Prompts of two lengths: Unsloth scores on its left-packed layout (every pad token moved to the row's end),
    wider than the completion mask by the longest left padding. The penalty reads, token for token, the log-probs
    Unsloth's own loss reads for each completion (the columns unsloth_zoo's create_completion_attention_mask keeps),
    for the policy and the reference; a sampled pad token, which Unsloth scores as padding, is left out. Before the
    fix the scoring crashed on the width mismatch."""
    import torch

    left = _reward_placement(tmp_path_factory)["scored"]["left_padded"]
    assert max(left["prompt_pads"]) > 0 and left["own_width"] == left["mask_width"] + max(left["prompt_pads"])
    mask, zoo_mask, trl_mask = (torch.tensor(left[k]).bool() for k in ("mask", "zoo_mask", "trl_mask"))
    ids = torch.tensor(left["completion_ids"])
    assert torch.equal(mask, trl_mask & (ids != left["pad_token_id"]))
    assert mask.sum() > 10 and ((ids == left["pad_token_id"]) & trl_mask).any()  # the batch has a sampled pad token
    for seen, unsloths in (("logp", "own"), ("ref", "trl_ref")):
        got, want = torch.tensor(left[seen]), torch.tensor(left[unsloths])
        for row in range(got.shape[0]):
            assert got[row][mask[row]].tolist() == want[row][zoo_mask[row]].tolist(), (seen, row)
    penalty, _ = reference.reward_penalty64("clip", torch.tensor(left["logp"], dtype=torch.float64),
                                            torch.tensor(left["ref"], dtype=torch.float64), mask.double(),
                                            estimator="k1", beta=0.5, clip_threshold=0.05, kl_target=0.02)
    rewards = torch.tensor(left["rewards_per_func"], dtype=torch.float64).sum(1)
    advantages = torch.tensor(left["advantages"], dtype=torch.float64)
    assert torch.allclose(advantages, reference.group_advantages64(rewards - penalty, 4), rtol=1e-4, atol=1e-4)


def test_completion_columns_takes_each_rows_completion_from_the_left_packed_layout():
    import torch

    from unsloth_adaptive_kl._source_patch import PatchError
    from unsloth_adaptive_kl.backends.reward_placement import completion_columns

    # completions of width 3, longest left padding 2 (pad id 0). Row 0: 2 prompt pads, completion [5, 6, 7] at
    # columns 0-2. Row 1: no prompt pad, completion [5, 0, 7]: its sampled pad moved to the end, so 5 and 7 are at
    # columns 2 and 3. Row 2: no prompt pad, completion [5, 6, 0] (a trailing pad): columns 2-3.
    packed = torch.tensor([[10.0, 11.0, 12.0, -1.0, -1.0], [-1.0, -1.0, 20.0, 22.0, -1.0], [-1.0, -1.0, 30.0, 31.0, -1.0]])
    ids = torch.tensor([[5, 6, 7], [5, 0, 7], [5, 6, 0]])
    values, kept = completion_columns(packed, torch.tensor([2, 0, 0]), 2, ids, 0)
    assert values.tolist() == [[10.0, 11.0, 12.0], [20.0, 0.0, 22.0], [30.0, 31.0, 0.0]]
    assert kept.tolist() == [[True, True, True], [True, False, True], [True, True, False]]
    with pytest.raises(PatchError, match="unsloth_zoo .*5 columns, expected the completion's 4 plus the longest left padding 2"):
        completion_columns(packed, torch.tensor([2, 0, 0]), 2, torch.ones(3, 4, dtype=torch.long), 0)


def test_the_rewritten_scoring_function_of_the_generated_trainer_calls_super_with_its_class(tmp_path_factory):
    """Unsloth's copy of TRL's _generate_and_score_completions calls super()._prepare_inputs in its VLM branches; the
    reward placement's rewrite, compiled outside the class (no __class__ cell), makes them name the class."""
    rewritten = _reward_placement(tmp_path_factory)["rewritten_super"]
    assert rewritten["calls"] == ["super(_UnslothGRPOTrainer, self)"] * 2 and "__class__" not in rewritten["freevars"], rewritten


def test_under_reward_placement_the_fused_loss_carries_no_kl_term(tmp_path_factory):
    loss = _reward_placement(tmp_path_factory)["loss"]
    assert loss["equal"] and loss["grads_equal"], loss  # the same trainer's loss and gradients at beta 0
    assert loss["with_kl_in_loss"] != loss["loss"]  # and the KL in the loss would have changed it
    assert len(loss["logged_raw"]) == 1 and loss["logged_raw"][0] > 0  # the KL is still measured (raw_kl as today)


def test_the_generated_trainer_trains_with_reward_placement_and_the_target_controller(tmp_path_factory):
    r = _reward_placement(tmp_path_factory)
    assert r["runtime"] == "UnslothAdaptiveKL"
    logs = r["logs"]
    assert len(logs) == 3 and all("adaptive_kl/kl_penalty" in h for h in logs)
    betas = [h["adaptive_kl/current_beta"] for h in logs]
    assert betas[0] == 0.04 and len(set(betas)) == 3  # the controller acted on the scoring-time KL after each step


def _monitor_reward(tmp_path_factory):
    return run_worker("unsloth-first", "monitor_reward", tmp_path_factory)["monitor_reward"]


def test_kl_monitor_with_the_reward_placement_logs_the_watched_batches_kl_against_float64_on_the_generated_trainer(tmp_path_factory):
    """kl_monitor_every=2, kl_placement='reward', beta = 0, EOS excluded (4 steps, one generation batch a step): the
    reference forward runs for batches 0 and 2 only; steps 1 and 3 log adaptive_kl/raw_kl equal to the float64 KL of the
    log-probs the fused loss saw (Unsloth's clamps, the completion mask less the EOS tokens); steps 2 and 4 log no
    adaptive_kl KL and Unsloth's own kl its stock beta = 0 value, 0; no penalty is logged anywhere."""
    import torch

    r = _monitor_reward(tmp_path_factory)
    logs = r["logs"]
    assert r["ref_calls"] == [0, 2] and r["scored_reference"] == [True, False, True, False], r["ref_calls"]
    assert ["adaptive_kl/raw_kl" in h for h in logs] == [True, False, True, False], logs
    assert [logs[step]["kl"] for step in (1, 3)] == [0.0, 0.0] and all(logs[step]["kl"] > 0 for step in (0, 2)), logs
    assert not any("adaptive_kl/kl_penalty" in h for h in logs) and all(h["adaptive_kl/current_beta"] == 0.0 for h in logs), logs
    assert [f["ref"] is not None for f in r["fused"]] == [True, False, True, False]
    for step in (0, 2):
        f = r["fused"][step]
        new, ref, mask, ids = (torch.tensor(f[k], dtype=torch.float64) for k in ("new", "ref", "mask", "input_ids"))
        valid = mask.bool()
        kept = valid & (ids != r["eos"])
        assert (valid & ~kept).any(), step  # the batch has an EOS token, which the KL leaves out
        raw, _ = reference.raw_and_shaped_kl("none", new, ref, new, kept, estimator="k3", clip_threshold=1, kl_target=1, unsloth_clamps=True)
        assert logs[step]["adaptive_kl/raw_kl"] == pytest.approx((raw.sum() / kept.sum()).item(), rel=1e-5), step
        with_eos, _ = reference.raw_and_shaped_kl("none", new, ref, new, valid, estimator="k3", clip_threshold=1, kl_target=1, unsloth_clamps=True)
        assert abs((with_eos.sum() / valid.sum()).item() - logs[step]["adaptive_kl/raw_kl"]) > 1e-4  # the exclusion mattered


def test_kl_monitor_with_the_reward_placement_feeds_the_runaway_alarm_the_scoring_time_kl_on_the_generated_trainer(tmp_path_factory):
    """The reward placement's KL of a watched batch (at scoring, from Unsloth's own log-probs of the policy and the
    reference, EOS left out) reaches the runaway alarm at that step, in float64; an unwatched step feeds it None."""
    import torch

    r = _monitor_reward(tmp_path_factory)
    assert [step for step, _ in r["fed"]] == [1, 2, 3, 4] and [kl is not None for _, kl in r["fed"]] == [True, False, True, False], r["fed"]
    assert len(r["scored"]) == 2  # the scoring-time KL was computed for the two watched batches only
    for (step, kl), scored, batch in zip((r["fed"][0], r["fed"][2]), r["scored"], r["watched_batches"]):
        logp, ref, mask = (torch.tensor(scored[k], dtype=torch.float64) for k in ("logp", "ref", "mask"))
        ids, valid = torch.tensor(batch["completion_ids"]), torch.tensor(batch["completion_mask"]).bool()
        assert ((ids == r["eos"]) & valid).any() and not ((ids == r["eos"]) & mask.bool()).any(), step  # EOS left out
        assert bool((mask.bool() <= valid).all()), step
        k3 = torch.where(mask.bool(), torch.exp(ref - logp) - (ref - logp) - 1, 0.0)
        assert kl == pytest.approx((k3.sum() / mask.sum()).item(), rel=1e-5) and kl > 0, step


def test_kl_monitor_with_the_reward_placement_trains_exactly_as_stock_unsloth_at_beta_zero(tmp_path_factory):
    """Against stock Unsloth at beta = 0 (unpatched, no reference): the same completions, advantages (torch.equal, and
    not all 0: a penalty would have moved them), logged loss and reward at every step, and the same weights after 4 steps."""
    r = _monitor_reward(tmp_path_factory)
    assert r["stock_runtime"] and r["completions_equal"] == [True] * 4 and r["advantages_equal"] == [True] * 4, r
    assert r["advantages_nonzero"] and r["weights_equal"], r
    for key in ("loss", "reward"):
        assert [h[key] for h in r["logs"]] == [h[key] for h in r["stock_logs"]], key


# -- fast: kl_monitor's checks, without the generated trainer ------------------------------------------------------
def test_kl_monitor_is_refused_on_the_unsloth_lines_generated_from_trl_0_24_naming_the_version():
    """2026.8 and 2026.9 generate their trainer from TRL 0.24's source: MONITOR_PLAN has no family for them, and
    the reason names the installed version (UnslothAdaptiveKL.check_monitor raises a ValueError with it)."""
    from unsloth_adaptive_kl._source_patch import PatchError
    from unsloth_adaptive_kl.backends import unsloth as backend

    for version in ("2026.8.17", "2026.9.9"):
        with pytest.raises(PatchError, match=rf"unsloth {version}: no anchor set of the unsloth \(kl_monitor\) backend covers"):
            backend.MONITOR_PLAN.select({}, installed=lambda distribution, v=version: v)
    assert backend.MONITOR_PLAN.select({}, installed=lambda distribution: "2026.10.9").family == "unsloth 2026.10"


@pytest.mark.parametrize("case", ["beta", "no_kept_set", "kept_set", "kept_set_refused_before"])
def test_the_reference_forward_at_beta_zero_latches_unscored_precision_and_refuses_kept_set_scoring(case, monkeypatch):
    """Before kl_monitor's reference forward at β = 0: Unsloth's unscored precision latch (what its β = 0 loss latches),
    and a refusal where Unsloth would score the reference over the rollouts' kept set (it drops the set only at β != 0;
    one it already dropped stays dropped). At β != 0 nothing is done: that forward is Unsloth's own."""
    import types

    from unsloth_adaptive_kl.backends.unsloth import UnslothAdaptiveKL

    trainer = types.SimpleNamespace(beta=0.04 if case == "beta" else 0.0)
    if case == "kept_set_refused_before":
        trainer._unsloth_truncated_support_refused = True
    kept_set = {"support_top_k": 20} if case.startswith("kept_set") else {}
    zoo = types.ModuleType("unsloth_zoo")
    zoo.rl_replacements = types.ModuleType("unsloth_zoo.rl_replacements")
    zoo.rl_replacements.grpo_truncated_support_kwargs = lambda t: kept_set if t is trainer else None
    monkeypatch.setitem(sys.modules, "unsloth_zoo", zoo)
    monkeypatch.setitem(sys.modules, "unsloth_zoo.rl_replacements", zoo.rl_replacements)
    latched = []
    runtime = types.SimpleNamespace(trainer=trainer)
    if case == "kept_set":
        with pytest.raises(ValueError, match="kl_monitor=True at beta = 0 is not valid with Unsloth's kept-set scoring .*UNSLOTH_GRPO_TRUNCATED_SUPPORT=0"):
            UnslothAdaptiveKL.before_reference_forward(runtime, latched.append)
        assert latched == []
        return
    UnslothAdaptiveKL.before_reference_forward(runtime, latched.append)
    assert latched == ([] if case == "beta" else [trainer])
