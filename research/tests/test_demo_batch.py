"""The demo trains, on both backends, the batch it says it trains: the completions per optimizer step are
read from the trainer after construction, kl_horizon is sized from them, and the CPU (TRL) and GPU (Unsloth)
defaults give the same batch and the same training arguments. The Unsloth trainer is generated on the CPU
(tests/backends/test_unsloth.py); each backend runs in its own process (demo_batch_worker.py)."""

import importlib.util
import json
import os
import statistics
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "research"))

from harness.batch import StepBatch  # noqa: E402
from harness.settings import Settings, method_fields  # noqa: E402
from harness.summary import trained_batch_lines  # noqa: E402

WORKER = os.path.join(HERE, "demo_batch_worker.py")
needs_unsloth = pytest.mark.skipif(importlib.util.find_spec("unsloth") is None, reason="unsloth is not installed")
_cache = {}


def build(backend: str, tmp_path_factory, **settings) -> dict:
    key = (backend, json.dumps(settings, sort_keys=True))
    if key not in _cache:
        work = tmp_path_factory.mktemp(f"batch-{backend}")
        out = work / "out.json"
        env = dict(os.environ, TRITON_INTERPRET="1", TOKENIZERS_PARALLELISM="false",
                   UNSLOTH_COMPILE_LOCATION=str(work / "unsloth_compiled_cache"))
        proc = subprocess.run([sys.executable, WORKER, backend, str(out), str(work), json.dumps(settings)],
                              capture_output=True, text=True, timeout=1200, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        _cache[key] = json.loads(out.read_text())
    return _cache[key]


def test_completions_per_step_counts_every_micro_batch_and_process():
    batch = StepBatch(per_device_train_batch_size=64, gradient_accumulation_steps=2, num_processes=2,
                      generation_batch_size=256, steps_per_generation=2, num_generations=8)
    assert batch.completions_per_step == 256 and batch.prompts_per_step == 32
    assert "256 completions per optimizer step (32 prompts x 8)" in batch.describe()


def test_kl_horizon_is_sized_from_the_completions_a_step_trains():
    settings = Settings(kl_horizon_steps=10.0)
    assert method_fields(settings, completions_per_step=128)["kl_horizon"] == 1280.0
    assert method_fields(settings, completions_per_step=64)["kl_horizon"] == 640.0


def test_accumulation_splits_the_step_instead_of_multiplying_it():
    assert Settings(gradient_accumulation_steps=2).per_device_train_batch_size == 32  # 8 prompts x 8 / 2
    with pytest.raises(ValueError, match="gradient_accumulation_steps=3"):
        Settings(gradient_accumulation_steps=3).check()
    with pytest.raises(ValueError, match="kl_horizon_steps=0.1"):
        Settings(kl_horizon_steps=0.1).check()


def test_the_summary_prints_what_trained_and_every_difference_from_the_settings():
    rows = lambda n: [{"completions_per_step": n, "gradient_accumulation_steps": n // 64, "per_device_train_batch_size": 64,  # noqa: E731
                       "generation_batch_size": n, "num_processes": 1, "kl_horizon": 640.0}]
    lines = trained_batch_lines({("none", 0, None): rows(64), ("target", 0, None): rows(128)}, planned=64)
    assert lines[0].startswith("Trained (read from each run's trainer): 64 completions per optimizer step") and "2 run" not in lines[0]
    assert "kl_horizon 640 (5 steps)" in lines[1]
    assert lines[2] == "DIFFERENCE: 1 run(s) trained 128 completions a step, the settings ask for 64: target/0."
    assert trained_batch_lines({("none", 0, None): [{}]}, 64)[0].startswith("Trained: not recorded")


def test_trl_trains_the_batch_the_settings_ask_for(tmp_path_factory):
    r = build("trl", tmp_path_factory, steps=0)
    assert r["trainer_class"] == "trl.trainer.grpo_trainer.GRPOTrainer"
    assert (r["completions_per_step"], r["gradient_accumulation_steps"], r["generation_batch_size"]) == (8, 1, 8)  # smoke: 2 x 4
    assert r["kl_horizon"] == 80.0


@needs_unsloth
def test_unsloth_trains_the_same_batch_and_arguments_as_trl(tmp_path_factory):
    trl, unsloth = build("trl", tmp_path_factory, steps=0), build("unsloth", tmp_path_factory, steps=0)
    assert unsloth["trainer_class"] == "UnslothGRPOTrainer.UnslothGRPOTrainer"
    assert unsloth["config_default_accumulation"] == 2 and trl["config_default_accumulation"] == 1  # the trap
    batch = ("completions_per_step", "per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size",
             "num_processes", "kl_horizon")
    assert {k: unsloth[k] for k in batch} == {k: trl[k] for k in batch}
    differ = {k: (trl["args"][k], unsloth["args"][k]) for k in trl["args"] if trl["args"][k] != unsloth["args"][k]}
    # Unsloth's CPU backend runs AdamW's fused kernel (the same update); on a GPU it keeps adamw_torch
    assert differ == {"optim": ("adamw_torch", "adamw_torch_fused")}


@needs_unsloth
def test_section_6_ran_twice_the_controller_gain_it_was_designed_for(tmp_path_factory):
    """docs/evidence/study26-beta-grid.md: Unsloth's accumulation of 2 doubled the completions of a step (the demo passed
    8 x 8 per micro-batch and sized kl_horizon for 64), so target (Ziegler's controller, now `ziegler`) moved β by x0.96 a step, not x0.98. The same
    proportions here: 16 completions a step, kl_horizon 80 = 5 steps; the KL starts at 0 (the LoRA starts at the
    reference), below 0.8 x kl_target, so the first update is the full step down: 1 - 0.2 x 16 / 80."""
    r = build("unsloth", tmp_path_factory, steps=2, gradient_accumulation_steps=2, prompts_per_step=4, kl_horizon_steps=5)
    assert (r["completions_per_step"], r["per_device_train_batch_size"], r["kl_horizon"]) == (16, 8, 80.0)
    rows = {row["step"]: row for row in r["rows"]}
    assert rows[1]["completions_per_step"] == 16 and rows[1]["adaptive_kl/current_beta"] == 0.1
    assert rows[1]["adaptive_kl/raw_kl"] < 0.8 * Settings.kl_target
    assert rows[2]["adaptive_kl/current_beta"] == pytest.approx(0.1 * 0.96, rel=1e-12)


# The settings of the section-6 test above: its Unsloth run is built once and read by both tests.
SECTION_6_SETTINGS = dict(steps=2, gradient_accumulation_steps=2, prompts_per_step=4, kl_horizon_steps=5)


@pytest.mark.parametrize("backend", ["trl", pytest.param("unsloth", marks=needs_unsloth)])
def test_each_step_records_the_median_length_of_the_completions_it_trained(backend, tmp_path_factory):
    """TRL logs a step's mean, min and max completion length; the demo adds the median (issue 51: a mean of short
    and truncated completions hides the split). Checked against the lengths of the completions TRL hands the
    reward functions that step, recorded by the worker from another hook, which must also give TRL's own mean,
    min and max: the median is of the same completions."""
    r = build(backend, tmp_path_factory, **SECTION_6_SETTINGS)
    assert [row["step"] for row in r["rows"]] == [1, 2]
    for row in r["rows"]:
        lengths = r["reward_lengths"][str(row["step"])]
        assert len(lengths) == row["completions_per_step"] == 16
        assert row["completions/median_length"] == statistics.median(lengths)
        assert (min(lengths), max(lengths)) == (row["completions/min_length"], row["completions/max_length"])
        assert statistics.fmean(lengths) == pytest.approx(row["completions/mean_length"], rel=1e-6)


class _FakeAccelerator:
    device = "cpu"

    def __init__(self, other_processes):
        self.other_processes = other_processes

    def gather(self, tensor):
        import torch

        return torch.cat([tensor, torch.tensor(self.other_processes)])


class _FakeTrainer:
    """The two things CompletionLengths uses: ``_generate`` returning TRL's 8-tuple (prompt_ids, completion_ids,
    tool_mask, ...) and ``accelerator.gather``."""

    def __init__(self, completion_ids, tool_mask=None, other_processes=()):
        self.accelerator = _FakeAccelerator(list(other_processes))
        self.completion_ids, self.tool_mask = completion_ids, tool_mask

    def _generate(self, prompts):
        return (None, self.completion_ids, self.tool_mask, None, None, {}, None, [])


def test_the_median_counts_every_process_and_only_the_models_tokens_under_a_tool_mask():
    from harness.worker import CompletionLengths

    trainer = _FakeTrainer([[5, 6, 2], [7, 2], [3, 4, 5, 6, 2]], other_processes=[10, 1])
    lengths = CompletionLengths(trainer)
    out = trainer._generate(["p"])
    assert out[1] == trainer.completion_ids  # the trainer's own output, untouched
    assert lengths.take() == 3.0  # median of 3, 2, 5 and the other process's 10, 1
    assert lengths.take() is None  # nothing generated since
    trainer._generate(["p"]), trainer._generate(["p"])  # two generation batches in one step: one median of both
    assert lengths.take() == 3.0  # 3, 2, 5, 10, 1, 3, 2, 5, 10, 1
    tools = _FakeTrainer([[5, 6, 2, 9], [7, 2]], tool_mask=[[1, 1, 0, 0], [1, 1]])
    with_tools = CompletionLengths(tools)
    tools._generate(["p"])
    assert with_tools.take() == 2.0  # the model's tokens only, as TRL counts completions/mean_length


def test_a_trainer_without_generate_is_refused_by_name():
    from harness.worker import CompletionLengths

    class Other:
        pass

    with pytest.raises(RuntimeError, match="Other .* has no _generate"):
        CompletionLengths(Other())
