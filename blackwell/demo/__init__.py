"""The adaptive-KL GRPO demo's parts; blackwell/test_adaptive_kl_grpo.py is its entry (see its docstring
and docs/demo.md)."""
