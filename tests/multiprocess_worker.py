"""One rank of tests/test_multiprocess.py, run with ``accelerate launch --multi_gpu --num_processes 2`` (CPU, gloo).

    multiprocess_worker.py CHECKPOINT OUT_DIR

For each registered β controller, and ``halve``, a controller registered here as a user would (every
process runs this script, so every process registers it), it trains a few GRPO steps with the TRL backend and writes, per rank, what
it measured to OUT_DIR/rank{R}.json: β at every step, and for every micro-batch the local KL sums
(before the cross-process reduce) and the global values logged. Rank 1 masks out its first
completion entirely and truncates the others, so the ranks see different completion lengths and
an all-masked row. The assertions live in test_multiprocess.py.
"""

import json
import logging
import os
import sys
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import reference  # noqa: E402
import unsloth_adaptive_kl  # noqa: E402,F401
from unsloth_adaptive_kl import metrics  # noqa: E402
import toy  # noqa: E402
from unsloth_adaptive_kl.controllers import controller_names  # noqa: E402


from user_controllers import register_halve  # noqa: E402

register_halve()


CHECKPOINT, OUT = sys.argv[1:3]
#: Every controller with the settings of the backend tests (dynamic decays every step), but no step-indexed floor.
SETTINGS = {**reference.training_settings(), "beta_schedule_steps": 1000}
METHODS = {
    "none": dict(kl_adaptation_method="none"),
    **{name: dict(kl_adaptation_method=name, **SETTINGS) for name in controller_names()},  # halve among them
    "halve+clip": dict(kl_adaptation_method="halve+clip", kl_clip_threshold=0.05),
    "target-reward": dict(kl_adaptation_method="ziegler", kl_target=0.01, kl_horizon=20.0, kl_placement="reward"),
    # the sampled kl_monitor at β = 0: the reference forward on generation batches 0 and 2 of 3, on both ranks
    "monitor-sampled": dict(kl_adaptation_method="none", beta=0.0, kl_monitor=True, kl_monitor_every=2),
    # the same with the KL in the reward (issue 53): the scoring-time KL of batches 0 and 2 reduced, the rewards untouched
    "monitor-reward": dict(kl_adaptation_method="none", beta=0.0, kl_monitor=True, kl_monitor_every=2, kl_placement="reward"),
}


class RecordBeta(TrainerCallback):
    def __init__(self, trainer, betas):
        self.trainer, self.betas = trainer, betas

    def on_step_end(self, args, state, control, **kwargs):
        self.betas.append(self.trainer.beta)


def uneven_batches(trainer, rank):
    """On rank 1: the first completion fully masked, the others cut to 2 tokens."""
    original = trainer._generate_and_score_completions

    def generate(*args, **kwargs):
        out = original(*args, **kwargs)
        if rank == 1:
            mask = out["completion_mask"].clone()
            mask[0] = 0
            mask[1:, 2:] = 0
            out["completion_mask"] = mask
        return out

    trainer._generate_and_score_completions = generate


def record_sums(runtime, rows):
    original, original_record = runtime.record_sums, runtime.record
    valid_raw = []

    def record(raw, adapted, mask, **kwargs):
        valid_raw[:] = [] if raw is None else raw.detach().double()[mask.bool()].tolist()  # this rank's per-token raw KL
        return original_record(raw, adapted, mask, **kwargs)

    def record_sums(local_sums, *, training, beta):
        values = original(local_sums, training=training, beta=beta)
        if local_sums is not None:
            rows.append({
                "local": local_sums[: metrics.NUM_SUMS].tolist(), "logged_raw": values[metrics.RAW_KL],
                "logged_adapted": values[metrics.ADAPTED_KL], "valid_raw": list(valid_raw),
                "logged_tail": [values[name] for name in metrics.WINDOW_TAIL_METRICS],
            })  # fmt: skip
        return values

    runtime.record, runtime.record_sums = record, record_sums


def record_penalties(runtime, penalties, untouched):
    """kl_placement='reward': each generation batch's local penalties (before the gather), the rewards before and
    after, the logged kl_penalty, and the scoring-time KL sums (local, and reduced) the controller got. A batch that got
    no penalty (β = 0 under kl_monitor) goes to ``untouched``: whether the rewards came back as the same tensor."""
    penalized_rewards, observe = runtime.penalized_rewards, runtime.observe_scoring_sums

    def observe_scoring_sums(local_sums):
        totals = observe(local_sums)
        penalties.append({"local_sums": local_sums.tolist(), "total_sums": totals.tolist()})
        return totals

    def penalized(rewards, local_penalty, mode, num_generations=None):  # the rewritten scoring names its arguments
        out = penalized_rewards(rewards, local_penalty, mode, num_generations)
        if local_penalty is None:
            untouched.append(out is rewards)
            return out
        penalties[-1].update(
            local=local_penalty.tolist(), rewards=rewards.tolist(), penalized=out.tolist(),
            logged=runtime.trainer._metrics[mode][metrics.KL_PENALTY][-1],
        )  # fmt: skip
        return out

    runtime.observe_scoring_sums, runtime.penalized_rewards = observe_scoring_sums, penalized


def main():
    rank = int(os.environ.get("RANK", "0"))
    results = {"world_size": int(os.environ.get("WORLD_SIZE", "1")), "trainers": len(METHODS)}
    for name, fields in METHODS.items():
        args = GRPOConfig(
            output_dir=tempfile.mkdtemp(prefix=f"mp-{name}-"), use_cpu=True, bf16=False, report_to="none",
            per_device_train_batch_size=2, num_generations=4, max_completion_length=6, max_steps=3, logging_steps=1,
            learning_rate=2e-2, save_strategy="no", seed=0, **{"beta": 0.04, **fields},
        )  # fmt: skip
        trainer = GRPOTrainer(
            model=CHECKPOINT, reward_funcs=[toy.format_reward, toy.correctness_reward], args=args, train_dataset=toy.prompt_dataset(32)
        )
        betas, rows, penalties, untouched = [trainer.beta], [], [], []
        trainer.add_callback(RecordBeta(trainer, betas))
        uneven_batches(trainer, rank)
        record_sums(trainer._adaptive_kl, rows)
        record_penalties(trainer._adaptive_kl, penalties, untouched)
        ref_calls = []
        if trainer.ref_model is not None:
            trainer.ref_model.register_forward_hook(lambda *a, calls=ref_calls, t=trainer: calls.append(t.state.global_step))
        lines = []
        handler = logging.Handler()
        handler.emit = lambda record, lines=lines: lines.append(record.getMessage())
        logging.getLogger("unsloth_adaptive_kl").addHandler(handler)
        trainer.train()
        logging.getLogger("unsloth_adaptive_kl").removeHandler(handler)
        logged = [h for h in trainer.state.log_history if metrics.CURRENT_BETA in h]
        results[name] = {
            "betas": betas, "rows": rows, "logged_betas": [h[metrics.CURRENT_BETA] for h in logged], "penalties": penalties,
            "logged_tail": [[h.get(name) for name in metrics.WINDOW_TAIL_METRICS] for h in logged],
            "ref_calls": sorted(set(ref_calls)), "logged_raw_kl": [h.get(metrics.RAW_KL) for h in logged], "untouched": untouched,
            "logged_penalty": [h.get(metrics.KL_PENALTY) for h in logged],
            "course_lines": [line for line in lines if " of this run" in line],
        }  # fmt: skip
        torch.distributed.barrier()
    with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # here, not at exit, where gloo's threads can abort a rank
    # and without the interpreter's teardown at all (a rank of check_ranks.py's CPU run aborted in CI after both its
    # trainings, 2026-11-29): nothing is left to do
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
