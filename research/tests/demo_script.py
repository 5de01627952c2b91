"""The demo script research/study_cli.py loaded as a module (``demo``), and its ``--smoke`` run with extra
options (``run_smoke``), for the research tests that drive the demo's study options."""

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "research", "study_cli.py")
_spec = importlib.util.spec_from_file_location("adaptive_kl_demo", SCRIPT)
demo = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = demo  # dataclasses look their module up by name
_spec.loader.exec_module(demo)


def run_smoke(out, *args: str):
    """The demo's ``--smoke`` run with ``args``, its stream in OUT/stream.jsonl: (out, stdout); a failed run fails."""
    env = dict(os.environ, TRITON_INTERPRET="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", *args, "--stream", str(out / "stream.jsonl"), "--output-dir",
                           str(out)], capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout
