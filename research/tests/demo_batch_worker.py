"""Builds the demo's trainer for one backend on the CPU and reports what its optimizer step trains, then
(optionally) trains a few steps: run by research/tests/test_demo_batch.py in a fresh process, since ``import unsloth``
rebinds TRL's classes process-wide.

    python research/tests/demo_batch_worker.py BACKEND OUT.json WORKDIR [SETTINGS_JSON]
"""

import json
import os
import sys
from dataclasses import asdict, replace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "research"))

from harness import worker  # noqa: E402
from harness.settings import SMOKE, Settings  # noqa: E402

import toy  # noqa: E402


def record_lengths_given_to_rewards(trainer) -> dict:
    """{step: [the token count of every completion TRL hands the reward functions that step]}: a reference for
    the demo's median length taken from another place than the demo's own hook (``_calculate_rewards`` receives
    the completions' ids after generation). One process here, so nothing to gather."""
    by_step = {}
    calculate = trainer._calculate_rewards

    def recorded(inputs, prompts, completions, completion_ids_list):
        by_step.setdefault(trainer.state.global_step + 1, []).extend(len(ids) for ids in completion_ids_list)
        return calculate(inputs, prompts, completions, completion_ids_list)

    trainer._calculate_rewards = recorded
    return by_step


def main(backend: str, out_path: str, workdir: str, overrides: dict) -> None:
    settings = replace(Settings(), **{**SMOKE, "warm_start_steps": 0, **overrides})
    settings.check()
    model = toy.build_scratchpad_checkpoint(os.path.join(workdir, "model"), seed=0, hidden_size=settings.hidden_size,
                                            layers=settings.layers, warm_start_steps=0)["path"]
    run_dir = os.path.join(workdir, f"run-{backend}")
    os.makedirs(run_dir, exist_ok=True)
    spec = dict(method="ziegler", seed=0, backend=backend, model=model, dataset=None, settings=asdict(settings),
                run_dir=run_dir, metrics_path=os.path.join(run_dir, "metrics.jsonl"), max_seq_length=settings.max_seq_length,
                tag="batch-test", stream=None)
    GRPOConfig, _ = worker.import_trainer(backend, cuda=False)
    # what the backend's config makes of no gradient_accumulation_steps (before the trainer: a config built
    # after it resets accelerate's state under it)
    default_accumulation = GRPOConfig(output_dir=run_dir, use_cpu=True, report_to="none").gradient_accumulation_steps
    trainer, trained = worker.build_trainer(spec, cuda=False)
    result = {"trainer_class": f"{type(trainer).__module__}.{type(trainer).__name__}", **trained.fields(),
              "args": worker.trained_args(trainer),
              "kl_horizon": trainer.args.kl_horizon,
              "config_default_accumulation": default_accumulation}
    if settings.steps:
        trainer.add_callback(worker.step_logger(spec["metrics_path"], spec, {**trained.fields(), "kl_horizon": trainer.args.kl_horizon},
                                                lengths=worker.CompletionLengths(trainer)))
        result["reward_lengths"] = record_lengths_given_to_rewards(trainer)
        trainer.train()
        with open(spec["metrics_path"]) as f:
            result["rows"] = [json.loads(line) for line in f]
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]) if len(sys.argv) > 4 else {})
