import os

import torch  # noqa: E402  (torch does not import triton)

# TRL's fused log-prob kernel is Triton; on a machine with no GPU it only runs interpreted.
# This must be set before triton is first imported, and never on a GPU machine, where every
# Triton kernel (Unsloth's, Liger's, TRL's) would then run through the CPU interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A tokenizer and a tiny Llama, built here and saved (TRL loads the reference model by path)."""
    from unsloth_adaptive_kl import toy

    return toy.build_checkpoint(str(tmp_path_factory.mktemp("tiny")), hidden_size=32, layers=2)


# tests/reference.py is imported by name from every test folder (and by subprocess workers).
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
