"""The research tests (issue 54: the studies, their harness and run lists, apart from the product suite in tests/).
Run them with ``bash scripts/test_research.sh``. As tests/conftest.py: Triton runs interpreted on a machine without a
GPU (set before triton is first imported), the tokenizers' thread pool stays off in the subprocesses, and the offline
task examples/toy.py is importable as ``toy`` here and in the subprocesses."""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
sys.path.insert(0, EXAMPLES)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (EXAMPLES, os.environ.get("PYTHONPATH")) if p)
