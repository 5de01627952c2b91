"""The user's demo with Unsloth's trainer (demo_unsloth_worker.py, a fresh process on the CPU).

Its first run on a GPU (2 H200s, 2026-11-29, docs/gpu-verification.md) stopped in the tiny model's first trainer:
the demo handed Unsloth's trainer the model's path, as it does TRL's, and Unsloth's trainer reads ``model.config``
(``AttributeError: 'str' object has no attribute 'config'``). Here Unsloth's generated trainer gets what the demo
loads under Unsloth, and trains."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

# Looked up, not imported: `import unsloth` in this process would rebind TRL's classes for every later test here
if importlib.util.find_spec("unsloth") is None:
    pytest.skip("unsloth is not installed", allow_module_level=True)
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_unsloth_worker.py")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo-unsloth")
    proc = subprocess.run([sys.executable, WORKER, str(out)], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


def test_the_demo_trains_the_tiny_model_with_unsloths_trainer(result):
    assert result["exit"] == "ok", result["exit"][-3000:]
    for method in ("none", "ziegler"):
        line = next(l for l in result["printed"].splitlines() if l.startswith(f"  {method}: trainer="))
        assert line.startswith(f"  {method}: trainer='UnslothGRPOTrainer'"), line
        # TRL's values, passed: for loss_type "dapo" Unsloth's config would otherwise set 0.28 and True
        assert "loss_type='dapo'" in line and "epsilon_high=0.2," in line and "mask_truncated_completions=False" in line, line


def test_each_method_loads_the_tiny_model_afresh_in_full_and_in_float32(result):
    assert [c["call"] for c in result["calls"]] == ["from_pretrained", "from_pretrained"]
    for call in result["calls"]:
        assert call["model_name"].endswith("start-model")
        assert call["full_finetuning"] is True and call["dtype"] == "torch.float32" and call["load_in_4bit"] is False
        # no longer than the model's positions (a longer max_seq_length makes Unsloth's Llama loader scale RoPE)
        config = json.load(open(os.path.join(call["model_name"], "config.json")))
        assert call["max_seq_length"] == config["max_position_embeddings"] == 128


def test_ziegler_moved_beta_under_unsloths_trainer(result):
    lines = [line for line in result["printed"].splitlines() if line.strip().startswith(("none:", "ziegler:"))]
    assert "none: beta stayed 0.04 for 2 steps" in result["printed"]
    assert any(line.strip().startswith("ziegler: beta 0.04 ->") for line in lines), lines
