"""Two processes (``accelerate launch --multi_gpu --num_processes 2`` on CPU: torchrun, gloo) training GRPO with each β
controller on the TRL backend: β is the same on every rank at every step, the logged adaptive_kl
metrics are the global token-weighted means of both ranks' local sums, the tail metrics those of both
ranks' tokens pooled (max exact, p99 and share within their bounds), and ranks that see
different completion lengths and an all-masked row neither deadlock nor disagree. A deadlock
fails through the subprocess timeout."""

import json
import os
import socket
import subprocess
import sys

import pytest
import reference

from unsloth_adaptive_kl.controllers import controller_names

WORKER = os.path.join(os.path.dirname(__file__), "multiprocess_worker.py")
#: ``accelerate launch`` as its module: the console script imports every accelerate command (transformers' auto classes
#: among them) before it launches, ~4 s of CPU here; the module runs the same launch_command
ACCELERATE_LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]
TIMEOUT_S = 240


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STDERR: list[str] = []  # what the two processes wrote (the ranks fixture's run)


@pytest.fixture(scope="module")
def ranks(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("multiprocess")
    # --multi_gpu selects accelerate's torchrun launcher; with no GPU and use_cpu=True the ranks use gloo.
    # (--cpu with 2 processes would need MPI and silently runs one process.)
    command = [
        *ACCELERATE_LAUNCH, "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--main_process_port", str(free_port()), WORKER, tiny_checkpoint, str(out),
    ]  # fmt: skip
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"2-process training did not finish in {TIMEOUT_S} s (deadlock?): {str(error.stderr)[-3000:]}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    STDERR.append(proc.stderr)
    results = []
    for rank in (0, 1):
        with open(out / f"rank{rank}.json") as f:
            results.append(json.load(f))
    assert [r["world_size"] for r in results] == [2, 2]
    return results


#: Every registered controller, and the user controller ``halve`` the worker registers (as each process does).
METHODS = ["none", *sorted({*controller_names(), "halve"}), "halve+clip"]


@pytest.mark.parametrize("method", METHODS)
def test_beta_is_identical_on_every_rank_at_every_step(ranks, method):
    zero, one = ranks[0][method], ranks[1][method]
    assert len(zero["betas"]) == 4  # initial + 3 optimizer steps
    assert zero["betas"] == one["betas"] and zero["logged_betas"] == one["logged_betas"]
    if method == "none":
        assert zero["betas"] == [0.04] * 4
    elif method == "dynamic":
        assert zero["betas"] == pytest.approx([0.04, 0.036, 0.0324, 0.02916])
    elif method.startswith("halve"):
        assert zero["betas"] == [0.04, 0.02, 0.01, 0.005]  # the user controller, joined with shaping or not
    elif method == "target":  # its float64 reference fed the global KL both ranks logged (4 completions a step)
        logs = [{"adaptive_kl/raw_kl": row["logged_raw"], "reward": None} for row in zero["rows"]] + [{}]
        assert zero["betas"] == pytest.approx(reference.expected_betas("target", logs, completions=4), rel=1e-9)
        assert len(set(zero["betas"])) > 1
    else:
        assert len(set(zero["betas"])) > 1  # the controller moved, from global statistics


@pytest.mark.parametrize("method", METHODS)
def test_the_line_said_when_training_ends_is_said_once_by_the_main_process(ranks, method):
    """What β did (the line logged when train() ends) is rank 0's alone, from the β every rank logged."""
    zero, one = ranks[0][method], ranks[1][method]
    reference.assert_course_logged(zero["course_lines"], method, zero["logged_betas"],
                                   adapts=True if method.split("+")[0] == "halve" else None)
    assert one["course_lines"] == []


@pytest.mark.parametrize("method", METHODS)
def test_logged_metrics_are_global_means_of_both_ranks_local_sums(ranks, method):
    from unsloth_adaptive_kl import metrics

    zero, one = ranks[0][method]["rows"], ranks[1][method]["rows"]
    assert len(zero) == len(one) == 3  # one reduce per micro-batch on each rank, in step
    for a, b in zip(zero, one):
        assert a["local"][metrics.TOKENS] != b["local"][metrics.TOKENS]  # the ranks saw different lengths
        total = [x + y for x, y in zip(a["local"], b["local"])]
        expected_raw = total[metrics.RAW_SUM] / total[metrics.TOKENS]  # what one process would log on both shards
        expected_adapted = total[metrics.ADAPTED_SUM] / total[metrics.TOKENS]
        for row in (a, b):
            assert row["logged_raw"] == pytest.approx(expected_raw, rel=1e-12)
            assert row["logged_adapted"] == pytest.approx(expected_adapted, rel=1e-12)
        assert a["local"][metrics.COMPLETIONS] == b["local"][metrics.COMPLETIONS] == 2


@pytest.mark.parametrize("method", METHODS)
def test_tail_metrics_are_those_of_both_ranks_tokens_pooled(ranks, method):
    """One micro-batch per step and a log every step: the logged max is the exact max over both ranks' valid
    tokens, the p99 and top-1 % share within their documented bounds of the pooled float64 references (not
    one rank's), the same on both ranks, and what the trainer's log shows."""
    import torch
    from test_tail import exact_tail

    from unsloth_adaptive_kl import tail

    zero, one = ranks[0][method], ranks[1][method]
    assert zero["logged_tail"] == one["logged_tail"] and len(zero["logged_tail"]) == 3
    local_only, shares = 0, 0
    for a, b, logged in zip(zero["rows"], one["rows"], zero["logged_tail"]):
        assert a["logged_tail"] == b["logged_tail"]
        # the log shows what was recorded (a NaN is not logged)
        assert logged == [None if value != value else value for value in a["logged_tail"]]
        pooled = a["valid_raw"] + b["valid_raw"]
        maximum, p99, share = exact_tail(torch.tensor(pooled, dtype=torch.float64))
        got_max, got_p99, got_share = a["logged_tail"]
        assert got_max == maximum
        assert abs(got_p99 - p99) <= tail.P99_RELATIVE_ERROR * abs(p99) + tail.ABSOLUTE_ERROR
        if sum(pooled) > 0:
            shares += 1
            assert abs(got_share - share) <= tail.SHARE_RELATIVE_ERROR * share + tail.ABSOLUTE_ERROR / sum(pooled)
        else:  # every token's KL is 0 (step 1: policy == reference): the top k of n equal values carry k / n (issue 52)
            assert got_share == tail.top_count(len(pooled)) / len(pooled)
        local_only += got_max != max(a["valid_raw"]) or got_max != max(b["valid_raw"])
    assert local_only > 0 and shares >= 2  # some step's max was on one rank only: the other rank logged it too


def test_reward_placement_penalties_are_gathered_in_process_order_and_the_metric_is_global(ranks):
    zero, one = ranks[0]["target-reward"], ranks[1]["target-reward"]
    assert zero["betas"] == one["betas"] and len(set(zero["betas"])) > 1  # the same β on both ranks, and it moved
    assert len(zero["penalties"]) == len(one["penalties"]) == 3  # one generation batch per step
    # each rank scored its own completions (the first batch is scored before any step: policy = reference, KL 0)
    assert all(a["local"] != b["local"] for a, b in zip(zero["penalties"][1:], one["penalties"][1:]))
    for a, b in zip(zero["penalties"], one["penalties"]):
        every = a["local"] + b["local"]  # rank 0's completions first, as TRL gathers the rewards
        for row in (a, b):
            assert row["rewards"] == a["rewards"]  # TRL's rewards are already global
            assert row["penalized"] == pytest.approx([r - p for r, p in zip(row["rewards"], every)], rel=1e-6, abs=1e-7)
            assert row["logged"] == pytest.approx(sum(every) / len(every), rel=1e-12)  # the mean over all completions
            # the controller got the sum of both ranks' scoring-time KL sums
            assert row["total_sums"] == pytest.approx([x + y for x, y in zip(a["local_sums"], b["local_sums"])], rel=1e-12)


def test_the_sampled_monitor_takes_the_same_decision_on_every_rank(ranks):
    """kl_monitor_every=2 at β = 0, 3 steps: both ranks run the reference forward for generation batches 0 and 2 (a
    collective inside it would deadlock otherwise), and both log the same global KL on steps 1 and 3, none on step 2."""
    zero, one = ranks[0]["monitor-sampled"], ranks[1]["monitor-sampled"]
    assert zero["ref_calls"] == one["ref_calls"] == [0, 2]
    assert zero["logged_raw_kl"] == one["logged_raw_kl"]
    assert [value is not None for value in zero["logged_raw_kl"]] == [True, False, True]
    assert zero["logged_betas"] == one["logged_betas"] == [0.0, 0.0, 0.0]


def test_the_sampled_monitor_with_the_kl_in_the_reward_watches_the_same_batches_on_every_rank(ranks):
    """kl_monitor_every=2 at β = 0 with kl_placement='reward' (issue 53), 3 steps: both ranks score the reference for
    generation batches 0 and 2, compute the reward placement's KL there (the sums both reduce to the same totals, the
    controller's and the runaway alarm's input) and log the same global KL on steps 1 and 3, none on step 2; no batch is
    penalised (the rewards come back as the same tensor) and no penalty is logged."""
    zero, one = ranks[0]["monitor-reward"], ranks[1]["monitor-reward"]
    assert zero["ref_calls"] == one["ref_calls"] == [0, 2]
    assert zero["logged_raw_kl"] == one["logged_raw_kl"] and [v is not None for v in zero["logged_raw_kl"]] == [True, False, True]
    assert len(zero["penalties"]) == len(one["penalties"]) == 2  # the scoring-time KL of the two watched batches
    for a, b in zip(zero["penalties"], one["penalties"]):
        both = [x + y for x, y in zip(a["local_sums"], b["local_sums"])]
        assert a["total_sums"] == b["total_sums"] == pytest.approx(both, rel=1e-12)
    assert zero["penalties"][1]["local_sums"] != one["penalties"][1]["local_sums"]  # each rank scored its own completions
    assert zero["untouched"] == one["untouched"] == [True, True, True]
    assert zero["logged_penalty"] == one["logged_penalty"] == [None, None, None]
    assert zero["logged_betas"] == one["logged_betas"] == [0.0, 0.0, 0.0]


def test_an_info_line_is_said_by_the_process_that_logs_only(ranks):
    """Each trainer's "backend: ..." line is INFO: the replica (rank 1) leaves it to rank 0, as transformers' own logger
    does (log_level_replica, WARNING by default). Before, every process said it."""
    (stderr,) = STDERR
    said = [line for line in stderr.splitlines() if line.startswith("unsloth_adaptive_kl: backend: ")]
    assert len(said) == ranks[0]["trainers"] == ranks[1]["trainers"], said  # one per trainer each rank made (was 2 per)
