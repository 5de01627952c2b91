"""A stand-in for a GRPO trainer with what the adaptive-KL runtime reads of one: ``args``, an accelerator of one
process, the metrics and ``beta``. Imported by name from the tests (tests/ is on sys.path, see conftest.py)."""

from collections import defaultdict
from types import SimpleNamespace

from unsloth_adaptive_kl.backends._trainer import TrainerAdaptiveKL


class OneProcessTrainer:
    def __init__(self, args):
        self.args = args
        self.accelerator = SimpleNamespace(reduce=lambda t, reduction: t, gather=lambda t: t, process_index=0, num_processes=1)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._adaptive_kl = TrainerAdaptiveKL(self)

    @property
    def beta(self):
        return self._adaptive_kl.beta
