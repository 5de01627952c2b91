"""Unsloth backend on a GPU: real GRPO runs, 16-bit LoRA and 4-bit QLoRA, for every method,
and a dynamic β over 30+ steps with the compiled fused loss. Skipped without CUDA.

Run on the GPU machine (see docs/gpu-verification.md for the recorded command and output):

    UAKL_GPU_REPORT=$OUT/gpu-report.json python -m pytest -q -s tests/gpu
"""

import importlib.util
import json
import math
import os
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("unsloth")

import unsloth  # noqa: E402,F401  (first, as Unsloth asks; generates its GRPO trainer)
from unsloth import FastLanguageModel  # noqa: E402

import unsloth_adaptive_kl  # noqa: E402
import toy  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import reference  # noqa: E402

METHODS = reference.METHODS
REPORT = {}


@pytest.fixture(scope="module")
def checkpoint():
    size = dict(hidden_size=int(os.environ.get("UAKL_GPU_HIDDEN", "256")), layers=4)
    path = toy.build_checkpoint(tempfile.mkdtemp(prefix="gpu-tiny-"), warm_start_steps=150, **size)
    yield path
    report = os.environ.get("UAKL_GPU_REPORT")
    if report:
        with open(report, "w") as f:
            json.dump(REPORT, f, indent=1)


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# "fast": Unsloth's FastLanguageModel (what most Unsloth users write); "peft": transformers +
# bitsandbytes + peft, trained by the same generated Unsloth GRPO trainer.
LOADER = os.environ.get("UAKL_GPU_LOADER", "fast")


def lora_model(path, load_in_4bit):
    if load_in_4bit and importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("4-bit QLoRA needs bitsandbytes, which this site lacks")
    if LOADER == "fast":
        model, tokenizer = FastLanguageModel.from_pretrained(
            model_name=path, max_seq_length=128, load_in_4bit=load_in_4bit, dtype=None if load_in_4bit else torch.bfloat16
        )
        model = FastLanguageModel.get_peft_model(
            model, r=16, lora_alpha=32, target_modules=LORA_TARGETS, use_gradient_checkpointing="unsloth", random_state=0
        )
        return model, tokenizer
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_type="nf4") if load_in_4bit else None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=quantization, device_map={"": 0})
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"))
    model.for_training = lambda *a, **k: None  # the generated trainer calls these (FastLanguageModel adds them)
    model.for_inference = lambda *a, **k: None
    return model, AutoTokenizer.from_pretrained(path)


def train(path, *, load_in_4bit, steps, **fields):
    from torch._dynamo.utils import counters

    model, tokenizer = lora_model(path, load_in_4bit)
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="gpu-out-"), report_to="none", per_device_train_batch_size=8, num_generations=8,
        max_completion_length=16, max_steps=steps, logging_steps=1, learning_rate=5e-4, warmup_steps=0, save_strategy="no",
        beta=0.04, bf16=True, seed=0, gradient_accumulation_steps=1, **fields,
    )
    trainer = GRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[toy.format_reward, toy.correctness_reward], args=args,
        train_dataset=toy.prompt_dataset(512),
    )
    graphs = []

    from transformers import TrainerCallback

    class GraphCounter(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            graphs.append(counters["stats"]["unique_graphs"])

    trainer.add_callback(GraphCounter())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "adaptive_kl/current_beta" in h]
    return trainer, logs, graphs


@pytest.mark.parametrize("load_in_4bit", [False, True], ids=["lora16", "qlora4"])
@pytest.mark.parametrize("method", METHODS)
def test_unsloth_grpo_run_on_gpu(checkpoint, method, load_in_4bit):
    trainer, logs, _ = train(
        checkpoint, load_in_4bit=load_in_4bit, steps=6, kl_adaptation_method=method, reward_threshold=0.3, reward_window=2,
        kl_clip_threshold=0.02, kl_target=0.01, kl_horizon=200.0,
        target_warmup_steps=0,  # target: its KL starts at ~0, below kl_target; with the default warm-up (20) β holds for 6 steps
    )
    assert type(trainer).__name__ == "UnslothGRPOTrainer" and type(trainer._adaptive_kl).__name__ == "UnslothAdaptiveKL"
    assert len(logs) == 6
    for h in logs:
        assert math.isfinite(h["adaptive_kl/raw_kl"]) and math.isfinite(h["adaptive_kl/adapted_kl"]) and math.isfinite(h["loss"])
    betas = [h["adaptive_kl/current_beta"] for h in logs]
    if method in ("none", *reference.BUILTIN_SHAPING):
        assert betas == [0.04] * 6
    else:
        assert betas[0] == 0.04 and len(set(betas)) > 1  # the controller acted
    if "clip" in method:
        assert all(h["adaptive_kl/adapted_kl"] <= 0.02 + 1e-6 for h in logs)
    REPORT[f"{method}/{'qlora4' if load_in_4bit else 'lora16'}"] = [
        {k: h.get(k) for k in ("step", "loss", "reward", "kl", "adaptive_kl/raw_kl", "adaptive_kl/adapted_kl", "adaptive_kl/current_beta", "completions/mean_length", "step_time")}
        for h in logs
    ]


def test_dynamic_beta_over_30_steps_never_recompiles(checkpoint):
    """A β that changes every step adds no compiled graph to what the same run at a fixed β compiles on
    this Unsloth line. (A flat count is not the claim: Unsloth 2026.9 compiles more graphs as a run goes
    on at a fixed β too, 7 -> 9 -> 11 over 32 steps; /work/shared/gpu/README.md, issue 21.)"""
    from importlib.metadata import version

    from torch._dynamo.utils import counters

    def run(method):
        torch._dynamo.reset()  # each run compiles from nothing and counts its own graphs
        counters.clear()
        # Completions of a fixed length keep every tensor shape constant, so the two runs differ only in β.
        _, logs, graphs = train(
            checkpoint, load_in_4bit=False, steps=32, kl_adaptation_method=method, reward_threshold=-1.0, dynamic_beta_decay=0.95,
            generation_kwargs={"min_new_tokens": 16},
        )
        return [h["adaptive_kl/current_beta"] for h in logs], graphs, [h.get("step_time") for h in logs]

    fixed_betas, fixed_graphs, fixed_times = run("none")
    betas, graphs, times = run("dynamic")
    REPORT["dynamic_32_steps"] = {
        **{d: version(d) for d in ("unsloth", "unsloth_zoo", "trl", "transformers", "torch")},
        "betas": betas, "graphs_per_step": graphs, "step_time": times,
        "fixed_beta_graphs_per_step": fixed_graphs, "fixed_beta_step_time": fixed_times,
    }  # fmt: skip
    assert fixed_betas == [0.04] * 32
    assert betas == pytest.approx([0.04 * 0.95**k for k in range(32)], rel=1e-9)
    # After the first step (compilation), a new β every step adds no graph to the fixed-β run's.
    assert graphs[1:] == fixed_graphs[1:], {"dynamic": graphs, "fixed": fixed_graphs}
