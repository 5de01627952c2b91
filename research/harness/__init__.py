"""The study harness's parts (the demo's before issue 54); research/study_cli.py is its entry (see its docstring
and docs/demo.md)."""

import os
import sys

# The offline task (examples/toy.py, shared with the examples; issue 54 took it out of the package), imported as
# ``toy`` by settings.py and tasks.py wherever the demo's package is imported from.
_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)
