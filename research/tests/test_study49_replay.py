"""research/study49/replay.py (study 49, Amendment 1): design 1 of ``target`` reproduces every committed GPU run's β
from its logged KL, runs of one seed train alike until their β differs, and the replay names exactly the runs that
design 2 would train differently."""

import glob
import gzip
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from research.controller_sim.compare import DesignOne  # noqa: E402
from research.study49 import replay  # noqa: E402
from unsloth_adaptive_kl.controllers import ControllerConfig  # noqa: E402

DIRS = sorted(glob.glob(os.path.join(ROOT, "research", "data", "study49-seed*-?")))


def test_design_one_reproduces_every_committed_target_run_bit_for_bit():
    runs = replay.target_runs(DIRS)
    assert len(runs) >= 21  # seeds 0-2: 21 target runs, and more as lists land
    for key, rows in runs.items():
        assert len(rows) == 200, key
        same, *_ = replay.compare_designs(rows)
        assert same, key


def test_runs_of_one_seed_train_bit_identically_until_their_beta_differs():
    pairs = replay.determinism(replay.target_runs(DIRS))
    assert pairs and all(identical for *_, identical in pairs)
    assert max(same for *_, same, _ in pairs) >= 150  # long stretches, across lists and calls


def synthetic_stream(path, beta0, kl_target, kls, seed):
    """A stream as the harness writes it for one ``target`` run that ran design 1 on the KL series ``kls``."""
    controller = DesignOne(ControllerConfig(beta0, kl_target=kl_target))
    with gzip.open(path, "wt") as f:
        for step, kl in enumerate(kls, start=1):
            row = {"method": "target", "beta0": beta0, "kl_target": kl_target, "seed": seed, "copy": "c", "step": step,
                   "completions_per_step": 64, "adaptive_kl/current_beta": controller.beta, "adaptive_kl/raw_kl": kl}
            f.write(json.dumps(row) + "\n")
            controller.update(global_step=step, kl=kl, num_completions=64)


def test_the_replay_names_the_run_design_two_trains_differently_and_no_other(tmp_path, capsys):
    # the tests' GPU case: β at the top of its range (5 × 0.1), the KL in the band, then 3 × the target (open loop:
    # the KL is the one design 1's β produced, 0.05 × 0.1 / β for 100 steps, then 0.03)
    controller, kls = DesignOne(ControllerConfig(0.1, kl_target=0.01)), []
    for step in range(1, 201):
        kls.append(0.05 * (0.1 / controller.beta) if step <= 100 else 0.03)
        controller.update(global_step=step, kl=kls[-1], num_completions=64)
    data = tmp_path / "study49-seed7-a"
    data.mkdir()
    synthetic_stream(data / "a-stream.jsonl.gz", 0.1, 0.01, kls, seed=7)
    synthetic_stream(data / "b-stream.jsonl.gz", 0.1, 0.01, [0.01] * 200, seed=8)  # held: the designs agree
    assert replay.main([str(data)]) == 0
    out = capsys.readouterr().out
    assert "| 0.1 | 0.01 | 7 | 200 | yes | 112 | 111 | 0.4558 | — |" in out  # declared at 111: step 112 trains at the cap
    assert "| 0.1 | 0.01 | 8 | 200 | yes | — | — |" in out
    assert out.rstrip().endswith("(rerun under Amendment 1): target@0.1:kt=0.01 seed 7.")
