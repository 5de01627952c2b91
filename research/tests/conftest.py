"""The research tests (issue 54: the studies, their harness and run lists, apart from the product suite in tests/).
Run them with ``bash scripts/test_research.sh``. As tests/conftest.py: Triton runs interpreted on a machine without a
GPU (set before triton is first imported), and the tokenizers' thread pool stays off in the subprocesses."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
