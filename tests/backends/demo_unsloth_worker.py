"""The user's demo (blackwell/test_adaptive_kl_grpo.py) with Unsloth's trainer, on a CPU, in a fresh process (``import
unsloth`` rebinds TRL's classes process-wide). Run by test_demo_unsloth.py:

    python demo_unsloth_worker.py OUT_DIR

On a GPU with unsloth installed the demo imports unsloth, so ``trl.GRPOTrainer`` is Unsloth's generated trainer, and
loads its model with Unsloth's ``FastLanguageModel``. A CPU has neither: here Unsloth generates its trainer through its
private entry point (../shared/upstream-map.md), the demo's switch ``USE_UNSLOTH`` is set, and
``unsloth.FastLanguageModel`` is replaced by a CPU loader (transformers' model and tokenizer, with the two no-op
methods FastLanguageModel adds) that records how the demo called it. The demo then runs as ``main`` with the tiny
model. Writes OUT_DIR/result.json: the loader's calls, what the demo printed, and its exit (or its traceback).
What this cannot show: Unsloth's own loader and kernels (only a GPU run does: scripts/gpu/verify.sh user-demo)."""

import contextlib
import importlib.util
import io
import json
import os
import sys
import tempfile
import traceback

OUT = sys.argv[1]
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", tempfile.mkdtemp(prefix="unsloth-cache-"))
os.environ["UNSLOTH_COMPILE_DISABLE"] = "1"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

with contextlib.redirect_stdout(io.StringIO()):
    import unsloth
    from unsloth.models.rl import _patch_trl_rl_trainers

    _patch_trl_rl_trainers("grpo_trainer")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

calls = []


class CpuFastLanguageModel:
    """What the demo calls of FastLanguageModel, on a CPU: the calls are recorded, the model loaded by transformers."""

    @staticmethod
    def from_pretrained(model_name, **kwargs):
        calls.append(dict(call="from_pretrained", model_name=str(model_name),
                          **{k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in kwargs.items()}))
        model = AutoModelForCausalLM.from_pretrained(model_name, dtype=kwargs.get("dtype") or torch.float32)
        model.for_training = lambda *a, **k: None
        model.for_inference = lambda *a, **k: None
        return model, AutoTokenizer.from_pretrained(model_name)

    @staticmethod
    def get_peft_model(model, **kwargs):
        calls.append(dict(call="get_peft_model", **kwargs))
        raise AssertionError("the tiny model trains in full: no adapter")


unsloth.FastLanguageModel = CpuFastLanguageModel
spec = importlib.util.spec_from_file_location("user_demo", os.path.join(ROOT, "blackwell", "test_adaptive_kl_grpo.py"))
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)
demo.USE_UNSLOTH = True

printed = io.StringIO()
result = dict(calls=calls)
try:
    with contextlib.redirect_stdout(printed):
        demo.main(["--methods", "none,ziegler", "--steps", "2", "--output-dir", os.path.join(OUT, "demo")])
    result["exit"] = "ok"
except BaseException:  # noqa: BLE001 - the test reads the traceback
    result["exit"] = traceback.format_exc()
result["printed"] = printed.getvalue()
with open(os.path.join(OUT, "result.json"), "w") as f:
    json.dump(result, f)
