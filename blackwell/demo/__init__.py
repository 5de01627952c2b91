"""The adaptive-KL GRPO demo's parts; blackwell/test_adaptive_kl_grpo.py is its entry (see its docstring
and docs/demo.md)."""

import os
import sys

# The offline task (examples/toy.py, shared with the examples; issue 54 took it out of the package), imported as
# ``toy`` by settings.py and tasks.py wherever the demo's package is imported from.
_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)
