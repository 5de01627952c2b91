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


def test_configured_type_reads_the_launcher_config():
    assert check_ranks.configured_type(os.path.join(EXAMPLE, "ddp.yaml"), cpu=True) == "MULTI_CPU"
    assert check_ranks.configured_type(os.path.join(EXAMPLE, "ddp.yaml"), cpu=False) == "MULTI_GPU"
    assert check_ranks.configured_type(os.path.join(EXAMPLE, "fsdp2.yaml"), cpu=False) == "FSDP"
    assert check_ranks.configured_type(os.path.join(EXAMPLE, "deepspeed_zero2.yaml"), cpu=False) == "DEEPSPEED"


def test_ddp_on_two_cpu_processes_passes_every_check(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, os.path.join(EXAMPLE, "check_ranks.py"), "--config", os.path.join(EXAMPLE, "ddp.yaml"), "--cpu",
               "--out", str(tmp_path), "--steps", "2", "--methods", "target,clip", "--timeout", "240"]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] and report["distributed_type"] == "DistributedType.MULTI_CPU"
    for method in ("target", "clip"):
        r = report["methods"][method]
        assert r["betas_rank0"] == r["betas_rank1"] and len(r["betas_rank0"]) == 3
        assert r["tokens_per_rank"][0] != r["tokens_per_rank"][1]
        assert r["loss_one_process"] == pytest.approx(r["loss_mean_of_ranks"], rel=1e-5, abs=1e-6)
    assert report["methods"]["target"]["betas_rank0"][2] != 0.04  # the controller moved, identically on both ranks
