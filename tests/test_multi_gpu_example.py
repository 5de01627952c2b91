"""examples/multi_gpu/check_ranks.py: its consistency checks catch what they name, and its DDP path passes on
CPU (2 processes over gloo: β per rank, adaptive_kl vs gathered per-token means, step-2 loss vs one process)."""

import json
import os
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "multi_gpu")
sys.path.insert(0, EXAMPLE)

import check_ranks  # noqa: E402


def record(betas, rows):
    return {"betas": betas, "rows": rows}


def row(raw, adapted, logged_raw, logged_adapted):
    return {"raw": raw, "adapted": adapted, "logged_raw": logged_raw, "logged_adapted": logged_adapted}


def test_rank_consistency_accepts_global_token_weighted_means():
    a = row([0.1, 0.3, 0.2], [0.1, 0.2, 0.2], 0.2, 0.15)
    b = row([0.2], [0.1], 0.2, 0.15)
    failures, error = check_ranks.rank_consistency(record([0.04, 0.036], [a]), record([0.04, 0.036], [b]), steps=1)
    assert failures == [] and error < 1e-12


def test_rank_consistency_catches_a_beta_mismatch_a_local_mean_and_even_lengths():
    a = row([0.1, 0.3], [0.1, 0.3], 0.2, 0.2)
    b = row([0.2], [0.2], 0.2, 0.2)  # 0.2 is also the global mean (0.6 / 3): only β is wrong
    failures, _ = check_ranks.rank_consistency(record([0.04, 0.036], [a]), record([0.04, 0.04], [b]), steps=1)
    assert failures == ["beta differs between ranks: [0.04, 0.036] vs [0.04, 0.04]"]
    same_lengths = row([0.1, 0.2], [0.1, 0.2], 0.15, 0.15)
    failures, _ = check_ranks.rank_consistency(record([0.04], [same_lengths]), record([0.04], [same_lengths]), steps=0)
    assert failures == ["the ranks did not see different numbers of valid tokens"]
    uneven = row([0.1, 0.2, 0.3], [0.1, 0.2, 0.3], 0.2, 0.2)  # logs its own mean; the global one is 1.1 / 4
    failures, _ = check_ranks.rank_consistency(record([0.04], [uneven]), record([0.04], [row([0.5], [0.5], 0.2, 0.2)]), steps=0)
    assert any("global token-weighted mean 0.275" in f for f in failures)


def sums_row(raw, adapted, logged_raw, logged_adapted):
    """A row as the worker records it under --backend unsloth: the rank's local sums (metrics.local_kl_sums' layout)."""
    from unsloth_adaptive_kl import metrics

    sums = [0.0] * metrics.NUM_SUMS
    sums[metrics.RAW_SUM], sums[metrics.ADAPTED_SUM], sums[metrics.TOKENS] = sum(raw), sum(adapted), float(len(raw))
    return {"sums": sums, "logged_raw": logged_raw, "logged_adapted": logged_adapted}


def test_rank_consistency_from_local_sums_checks_the_global_token_weighted_mean():
    """Unsloth's fused loss hands out only each rank's sums: the global mean is (sum_0 + sum_1) / (tokens_0 + tokens_1),
    not the mean of the two ranks' means."""
    a, b = sums_row([0.1, 0.3, 0.2], [0.1, 0.2, 0.2], 0.2, 0.15), sums_row([0.2], [0.1], 0.2, 0.15)
    failures, error = check_ranks.rank_consistency(record([0.04, 0.036], [a]), record([0.04, 0.036], [b]), steps=1)
    assert failures == [] and error < 1e-12
    mean_of_means = (0.6 / 3 + 0.2) / 2, (0.5 / 3 + 0.1) / 2  # 0.2, 0.1333: right for raw by chance, wrong for adapted
    a, b = sums_row([0.1, 0.3, 0.2], [0.1, 0.2, 0.2], *mean_of_means), sums_row([0.2], [0.1], *mean_of_means)
    failures, _ = check_ranks.rank_consistency(record([0.04], [a]), record([0.04], [b]), steps=0)
    assert failures == ["adaptive_kl logged 0.13333333333333333, global token-weighted mean 0.15"] * 2
    same = sums_row([0.1, 0.2], [0.1, 0.2], 0.15, 0.15)
    failures, _ = check_ranks.rank_consistency(record([0.04], [same]), record([0.04], [same]), steps=0)
    assert failures == ["the ranks did not see different numbers of valid tokens"]


def test_configured_type_reads_the_launcher_config():
    assert check_ranks.configured_type(os.path.join(EXAMPLE, "ddp.yaml"), cpu=True) == "MULTI_CPU"
    assert check_ranks.configured_type(os.path.join(EXAMPLE, "ddp.yaml"), cpu=False) == "MULTI_GPU"
    assert check_ranks.configured_type(os.path.join(EXAMPLE, "fsdp2.yaml"), cpu=False) == "FSDP"
    assert check_ranks.configured_type(os.path.join(EXAMPLE, "deepspeed_zero2.yaml"), cpu=False) == "DEEPSPEED"


def test_every_config_loads_in_accelerate_and_verify_sh_runs_it():
    import re

    from accelerate.commands.config.config_args import load_config_from_file

    configs = sorted(name[: -len(".yaml")] for name in os.listdir(EXAMPLE) if name.endswith(".yaml"))
    assert configs == ["ddp", "deepspeed_zero2", "deepspeed_zero3", "fsdp2"]
    loaded = {name: load_config_from_file(os.path.join(EXAMPLE, f"{name}.yaml")) for name in configs}
    assert loaded["deepspeed_zero3"].deepspeed_config["zero_stage"] == 3
    assert loaded["deepspeed_zero3"].deepspeed_config["zero3_save_16bit_model"] is True  # get_state_dict gathers under ZeRO-3
    assert loaded["fsdp2"].fsdp_config["fsdp_version"] == 2
    for name, config in loaded.items():
        assert str(config.distributed_type).endswith("." + check_ranks.configured_type(os.path.join(EXAMPLE, f"{name}.yaml"), cpu=False))
    with open(os.path.join(os.path.dirname(os.path.dirname(EXAMPLE)), "scripts", "gpu", "verify.sh")) as f:
        runs = re.search(r'^MULTI_GPU_RUNS="([^"]*)"', f.read(), re.M).group(1).split()
    assert {run.split(":")[1] for run in runs} == set(configs)  # every config runs in the multi-gpu stage
    assert "fsdp2-lora:fsdp2:--lora" in runs and "unsloth-ddp:ddp:--backend=unsloth" in runs
    for run in runs:  # the flags each run passes parse
        check_ranks.parse_args(["--config", "x.yaml", "--out", "x", *run.split(":")[2:]])


def run_checker(argv, capsys, monkeypatch) -> None:
    """check_ranks.py's main in this process (its two ranks and its one-process reference are still processes of their
    own: ``accelerate launch`` and a child): the checker's own process would only import what this one has imported
    already. Exit status 0, or the report it printed."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    status = check_ranks.main(argv)
    assert status == 0, capsys.readouterr().out[-3000:]


def test_ddp_on_two_cpu_processes_passes_every_check(tmp_path, capsys, monkeypatch):
    run_checker(["--config", os.path.join(EXAMPLE, "ddp.yaml"), "--cpu", "--out", str(tmp_path), "--steps", "2", "--methods", "target,clip", "--timeout", "240"],
                capsys, monkeypatch)  # fmt: skip
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] and report["distributed_type"] == "DistributedType.MULTI_CPU" and report["trainable_fraction"] == 1.0
    for method in ("target", "clip"):
        r = report["methods"][method]
        assert r["betas_rank0"] == r["betas_rank1"] and len(r["betas_rank0"]) == 3
        assert r["tokens_per_rank"][0] != r["tokens_per_rank"][1]
        assert r["loss_one_process"] == pytest.approx(r["loss_mean_of_ranks"], rel=1e-5, abs=1e-6)
    assert report["methods"]["target"]["betas_rank0"][2] != 0.04  # the controller moved, identically on both ranks
    for method in ("target", "clip"):  # step 2's micro-batch (one per step here) is the second row of each rank
        r = report["methods"][method]
        assert r["compared_rows"] == [[1], [1]] and all(sums[1] > 0 for sums in r["compared_kl_sums"])
    assert report["reference_device"] == {"CUDA_VISIBLE_DEVICES": "", "cuda_device_count": 0}


def test_fsdp2_with_lora_in_bf16_on_two_cpu_processes_passes_every_check(tmp_path, capsys, monkeypatch):
    """FSDP2 (torch's fully_shard over gloo) with a LoRA adapter and accelerate's bf16 policy: TRL's per-token KL
    is bf16 there, the case whose bf16 sums made clip's logged adapted_kl 5.9e-4 off on 2 GPUs (issue 24)."""
    run_checker(["--config", os.path.join(EXAMPLE, "fsdp2.yaml"), "--cpu", "--precision", "bf16", "--lora", "--out", str(tmp_path), "--steps", "2",
                 "--methods", "clip", "--timeout", "240"], capsys, monkeypatch)  # fmt: skip
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] and report["distributed_type"] == "DistributedType.FSDP"
    assert report["wrapped_model"].startswith("FSDP")  # fully_shard's class, not DDP
    assert 0 < report["trainable_fraction"] < 0.5  # the LoRA adapter trains, the base model is frozen
    r = report["methods"]["clip"]
    assert r["betas_rank0"] == r["betas_rank1"] and r["max_metric_rel_error"] <= 1e-6
    assert r["tokens_per_rank"][0] != r["tokens_per_rank"][1]


# -- the launcher: a teardown abort is relaunched once and reported; any other failure says why -------------------
TEARDOWN_ABORT = """{'train_runtime': '1.3'}
terminate called without an active exception
Fatal Python error: Aborted
  File "/x/check_ranks.py", line 305 in worker
[0]:
  exitcode  : -6 (pid: 30435)  (SIGABRT)
  traceback : Signal 6 (SIGABRT) received by PID 30435
"""


def fake_runs(monkeypatch, tmp_path, outcomes):
    """check_ranks.launch with each launch's (exit status, output, whether both ranks wrote their results) given."""
    calls = []

    def run(command, env, timeout, log_path):
        rc, output, results = outcomes[len(calls)]  # results: the methods each rank wrote
        calls.append(command)
        for rank in (0, 1):
            if results:
                (tmp_path / f"rank{rank}.json").write_text(json.dumps({"world_size": 2, "rank": rank, **{m: {} for m in results}}))
        return rc, output

    monkeypatch.setattr(check_ranks, "run_shown_and_kept", run)
    args = check_ranks.parse_args(["--config", os.path.join(EXAMPLE, "ddp.yaml"), "--cpu", "--out", str(tmp_path), "--methods", "target,clip"])
    return args, calls


BOTH = ["target", "clip"]


def test_a_rank_aborting_after_both_results_is_relaunched_once_and_reported(tmp_path, monkeypatch):
    args, calls = fake_runs(monkeypatch, tmp_path, [(1, TEARDOWN_ABORT, BOTH), (0, "", BOTH)])
    relaunches = check_ranks.launch(args, "ckpt")
    assert len(calls) == 2 and len(relaunches) == 1
    assert "terminate called without an active exception" in relaunches[0] and "SIGABRT" in relaunches[0]


def test_a_second_abort_fails_with_the_lines_that_say_why(tmp_path, monkeypatch):
    args, calls = fake_runs(monkeypatch, tmp_path, [(1, TEARDOWN_ABORT, BOTH), (1, TEARDOWN_ABORT, BOTH)])
    with pytest.raises(SystemExit) as error:
        check_ranks.launch(args, "ckpt")
    assert len(calls) == 2
    message = str(error.value)
    assert message.startswith("the 2-process run failed (exit status 1)")
    assert "Fatal Python error: Aborted" in message and 'File "/x/check_ranks.py", line 305 in worker' in message


def test_an_abort_before_the_results_and_an_ordinary_error_are_not_relaunched(tmp_path, monkeypatch):
    for written in ([], ["target"]):  # a rank died before both had written every method's results: a real failure
        args, calls = fake_runs(monkeypatch, tmp_path, [(1, TEARDOWN_ABORT, written)])
        with pytest.raises(SystemExit, match="terminate called without an active exception"):
            check_ranks.launch(args, "ckpt")
        assert len(calls) == 1
    error = "Traceback (most recent call last):\nValueError: beta\n[1]:\n  exitcode  : 1 (pid: 7)\n"
    args, calls = fake_runs(monkeypatch, tmp_path, [(1, error, BOTH)])
    with pytest.raises(SystemExit, match="ValueError: beta"):
        check_ranks.launch(args, "ckpt")
    assert len(calls) == 1  # not killed by a signal: an error of the run itself


def test_a_stale_results_file_does_not_count_as_this_launchs(tmp_path, monkeypatch):
    for rank in (0, 1):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps({m: {} for m in BOTH}))
    args, calls = fake_runs(monkeypatch, tmp_path, [(1, TEARDOWN_ABORT, [])])
    with pytest.raises(SystemExit):
        check_ranks.launch(args, "ckpt")
    assert len(calls) == 1 and not (tmp_path / "rank0.json").exists()


# -- the one-process reference (issue 24): one visible GPU, and its exception in the report ------------------
DATAPARALLEL = "ValueError: GRPOTrainer does not support nn.DataParallel"


def fake_reference_run(seen, returncode=1, stderr=f"Traceback (most recent call last):\n  File \"check_ranks.py\"\n{DATAPARALLEL}\n"):
    def run(command, env, **kwargs):
        seen.append({"command": command, "CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES")})
        return subprocess.CompletedProcess(command, returncode, stdout="", stderr=stderr)

    return run


@pytest.mark.parametrize(
    "visible, cpu, expected",
    [("0,1", False, "0"), ("3, 5", False, "3"), (None, False, "0"), ("1", False, "1"), ("0,1", True, "")],
)
def test_the_reference_run_is_started_with_one_visible_device(tmp_path, monkeypatch, visible, cpu, expected):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    seen = []
    monkeypatch.setattr(check_ranks.subprocess, "run", fake_reference_run(seen))
    args = check_ranks.parse_args(["--config", os.path.join(EXAMPLE, "ddp.yaml"), "--out", str(tmp_path)] + (["--cpu"] if cpu else []))
    results = check_ranks.reference_losses(args, "CHECKPOINT", {"clip": 0.04, "none": 0.04})
    assert [s["CUDA_VISIBLE_DEVICES"] for s in seen] == [expected]  # one child for every method, one device (none on CPU)
    assert seen[0]["command"][seen[0]["command"].index("--reference") + 1] == "CHECKPOINT"
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == visible  # the checker's own environment is left alone
    for method in ("clip", "none"):
        assert "exited with status 1" in results[method]["error"] and DATAPARALLEL in results[method]["error"]


def rank_record(tokens, loss, kl=0.01):
    rows = [row([kl] * tokens, [kl] * tokens, kl, kl)]
    return {"betas": [0.04, 0.04], "rows": rows, "loss": loss, "loss_beta": 0.04, "loss_rows": [0]}


def test_a_failed_reference_run_shows_its_exception_in_the_report(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(check_ranks.subprocess, "run", fake_reference_run(seen))
    args = check_ranks.parse_args(["--config", os.path.join(EXAMPLE, "ddp.yaml"), "--out", str(tmp_path), "--methods", "clip", "--steps", "2"])
    args.steps = 1
    ranks = [{"clip": rank_record(5, 0.1)}, {"clip": rank_record(3, 0.3)}]
    report = check_ranks.check(args, "CHECKPOINT", ranks)
    report.update(distributed_type="DistributedType.MULTI_GPU", wrapped_model="DistributedDataParallel")
    text = check_ranks.format_report(args, report)
    assert not report["passed"] and report["methods"]["clip"]["loss_mean_of_ranks"] == pytest.approx(0.2)
    assert DATAPARALLEL in text and "step-2 loss on one process failed" in text and "SOME CHECKS FAILED" in text


def test_a_reference_result_is_compared_with_the_mean_of_the_ranks(tmp_path, monkeypatch):
    """The child's loss (written to its result file) is what the check compares, with the precision's tolerance."""

    def run(command, env, **kwargs):
        with open(tmp_path / check_ranks.REFERENCE_RESULT, "w") as f:
            json.dump({"device": {"CUDA_VISIBLE_DEVICES": env["CUDA_VISIBLE_DEVICES"], "cuda_device_count": 1}, "clip": {"loss": 0.2001}}, f)
        return subprocess.CompletedProcess(command, 0, stdout="", stderr="")

    monkeypatch.setattr(check_ranks.subprocess, "run", run)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    ranks = [{"clip": rank_record(5, 0.1)}, {"clip": rank_record(3, 0.3)}]
    for precision, passed in (("bf16", True), ("fp32", False)):  # |0.2001 - 0.2| = 1e-4: within bf16's 2e-4 + 2e-3 rel, not fp32's
        args = check_ranks.parse_args(["--config", os.path.join(EXAMPLE, "ddp.yaml"), "--out", str(tmp_path), "--methods", "clip", "--precision", precision])
        args.steps = 1
        report = check_ranks.check(args, "CHECKPOINT", ranks)
        assert report["passed"] is passed and report["methods"]["clip"]["loss_one_process"] == 0.2001
        assert report["reference_device"] == {"CUDA_VISIBLE_DEVICES": "0", "cuda_device_count": 1}


# -- the one-process reference's normaliser: the accumulation divisor the ranks' training loop had -----------
def two_rank_parts(vocab_size, pad_token_id):
    """Two ranks' micro-batches (same prompt length, different completion lengths) with the global token count."""
    import reference

    parts = [reference.loss_inputs(vocab_size, seed=s, pad_token_id=pad_token_id, ref_spread=2.0) for s in (1, 2)]
    parts[1]["completion_mask"][:, 2:] = 0  # rank 1's completions are shorter: the ranks' sums differ
    total = sum(p["completion_mask"].sum() for p in parts).float()
    for p in parts:
        del p["old_per_token_logps"]  # the policy is its own old policy: the importance ratio is 1
        p["completion_ids"] = p["completion_ids"].masked_fill(p["completion_mask"] == 0, pad_token_id)
        p["num_items_in_batch"] = total  # gathered over both ranks, as TRL counts it
    return parts


def test_the_one_process_reference_uses_the_configured_accumulation_divisor(tmp_path, monkeypatch):
    """dapo normalises by num_items_in_batch / processes x current_gradient_accumulation_steps / steps_per_generation.
    The training loop sets current_gradient_accumulation_steps to gradient_accumulation_steps; a reference that set it
    to 1 gave 2x the loss with gradient_accumulation_steps = 2 (Unsloth's GRPOConfig default): the Unsloth DDP run's
    one-process loss was exactly the sum of the two ranks' losses, not their mean."""
    import torch
    from transformers import AutoModelForCausalLM

    import toy

    checkpoint = toy.build_checkpoint(str(tmp_path / "checkpoint"), hidden_size=32, layers=1)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    torch.save(model.state_dict(), tmp_path / "none-weights.pt")
    args = check_ranks.parse_args(["--config", os.path.join(EXAMPLE, "ddp.yaml"), "--out", str(tmp_path), "--cpu", "--methods", "none"])
    parts = two_rank_parts(model.config.vocab_size, toy.build_tokenizer().pad_token_id)
    advantages = torch.cat([p["advantages"] for p in parts]).double()
    lengths = torch.cat([p["completion_mask"].sum(-1) for p in parts]).double()
    # β = 0 and an importance ratio of 1: every valid token's loss is -advantage
    expected = -(advantages * lengths).sum().item() / parts[0]["num_items_in_batch"].item()
    losses = {}
    for accumulation in (1, 2):
        monkeypatch.setitem(check_ranks.METHODS, "none", dict(kl_adaptation_method="none", gradient_accumulation_steps=accumulation))
        losses[accumulation] = {beta: check_ranks.single_process_loss("none", args, checkpoint, parts, beta) for beta in (0.0, 0.04)}
    assert losses[1][0.0] == pytest.approx(expected, rel=1e-6)
    assert losses[2][0.0] == pytest.approx(expected, rel=1e-6)  # was 2 x expected
    assert losses[2][0.04] == pytest.approx(losses[1][0.04], rel=1e-6) and losses[1][0.04] != pytest.approx(expected, rel=1e-3)


# -- the loss check must see the KL term (issue 39, item 9) ------------------------------------------------
def reference_returning(tmp_path, monkeypatch, loss):
    def run(command, env, **kwargs):
        with open(tmp_path / check_ranks.REFERENCE_RESULT, "w") as f:
            json.dump({"device": {"CUDA_VISIBLE_DEVICES": "0", "cuda_device_count": 1}, "clip": {"loss": loss}}, f)
        return subprocess.CompletedProcess(command, 0, stdout="", stderr="")

    monkeypatch.setattr(check_ranks.subprocess, "run", run)


def zero_kl_at_the_compared_step(kl_rank0, kl_rank1, sums=False):
    """Two ranks whose step 1 has a KL and whose compared step (step 2, the second row) has ``kl_rank*``."""
    make = sums_row if sums else row
    ranks = []
    for tokens, kl in ((5, kl_rank0), (3, kl_rank1)):
        rows = [make([0.02] * tokens, [0.02] * tokens, 0.02, 0.02), make([kl] * tokens, [kl] * tokens, 0.0, 0.0)]
        ranks.append({"clip": {"betas": [0.04, 0.04, 0.04], "rows": rows, "loss": 0.2, "loss_beta": 0.04, "loss_rows": [1]}})
    for r in ranks:  # the logged means are the global ones, so only the KL-visibility check can fail
        glob = check_ranks.global_means(ranks[0]["clip"]["rows"][1], ranks[1]["clip"]["rows"][1])
        r["clip"]["rows"][1].update(logged_raw=glob[0], logged_adapted=glob[1])
    return ranks


@pytest.mark.parametrize("sums", [False, True], ids=["trl-rows", "unsloth-sums"])
def test_the_checker_fails_when_the_compared_steps_kl_is_zero_on_every_rank(tmp_path, monkeypatch, sums):
    # Before the fix every check passed here: the losses agree, but a KL of 0 means they could not show a wrong KL term.
    reference_returning(tmp_path, monkeypatch, 0.2)
    args = check_ranks.parse_args(["--config", os.path.join(EXAMPLE, "ddp.yaml"), "--out", str(tmp_path), "--methods", "clip", "--steps", "2"])
    report = check_ranks.check(args, "CHECKPOINT", zero_kl_at_the_compared_step(0.0, 0.0, sums))
    (failure,) = report["methods"]["clip"]["failures"]
    assert not report["passed"] and "step 2's KL is 0 on every rank" in failure and "cannot see the KL term" in failure
    report = check_ranks.check(args, "CHECKPOINT", zero_kl_at_the_compared_step(0.0, 0.003, sums))  # one rank has a KL
    assert report["passed"], report["methods"]["clip"]["failures"]
    assert report["methods"]["clip"]["compared_kl_sums"][1] == pytest.approx((0.009, 0.009))


def test_the_compared_kl_is_read_from_the_rows_the_captured_micro_batch_recorded(tmp_path, monkeypatch):
    """Step 1 had a KL and step 2 none: a checker reading the first row (or any row but the captured one) passes."""
    reference_returning(tmp_path, monkeypatch, 0.2)
    args = check_ranks.parse_args(["--config", os.path.join(EXAMPLE, "ddp.yaml"), "--out", str(tmp_path), "--methods", "clip", "--steps", "2"])
    ranks = zero_kl_at_the_compared_step(0.0, 0.0)
    for r in ranks:
        r["clip"]["loss_rows"] = []  # the captured micro-batch recorded no KL row (β was 0 there)
    (failure,) = check_ranks.check(args, "CHECKPOINT", ranks)["methods"]["clip"]["failures"]
    assert "no KL recorded for step 2's compared micro-batch" in failure
