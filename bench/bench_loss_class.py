"""End to end through TRL: the training part of a GRPO step with ``GRPOTrainer(loss_class=AdaptiveFusedLinearGRPOLoss)``
against TRL's own loss, interleaved (issue 22).

Same method, model, fixed batch, timing and tables as ``bench/bench_trl.py`` (``bench/_common.py``;
docs/benchmarks.md): one ~1 B Llama built from a config (no download), full fine-tuning with a
separate frozen reference by default, 16 completions of 512-1024 tokens. A timed step is the
reference forward, ``trainer.compute_loss`` and backward, AdamW's step and the step-end callbacks.
Rows:

* ``stock TRL (unpatched)``: TRL 1.15's own loss (its chunked log-prob head + elementwise loss);
* ``loss_class (fused head)``: our module with the fused LM head (3 GEMMs, gradient in the forward);
* ``loss_class (log-prob kernel)``: our module with ``fused_head=False`` (TRL's kernel, 4 GEMMs);
* ``loss_class target (fused head)``: the same with a β controller moving β every step.

The raw timings (``--out.json``) record the LM-head path each module's last call ran (``head_path``).

    python bench/bench_loss_class.py --out /tmp/bench-loss-class.md          # GPU, ~1 B, full fine-tuning
    python bench/bench_loss_class.py --smoke --out /tmp/bench-loss-class.md  # CPU, tiny model
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import bench_trl  # noqa: E402

# name: (row key of _common, use loss_class, the module's fused_head)
ROWS = {
    bench_trl.STOCK: ("stock", False, None),
    "loss_class (fused head)": ("none", True, True),
    "loss_class (log-prob kernel)": ("none", True, False),
    "loss_class target (fused head)": ("target", True, True),
}


def parse_args(argv=None):
    args = bench_trl.parse_args(argv)
    if "--modes" not in (argv if argv is not None else sys.argv[1:]):
        args.modes = "full"
    return args


def build_rows(args, common) -> tuple[list, list]:
    from unsloth_adaptive_kl.backends.liger import AdaptiveFusedLinearGRPOLoss

    built = []
    for name, (key, with_module, fused_head) in ROWS.items():
        loss_class = AdaptiveFusedLinearGRPOLoss if with_module else None
        built.append(bench_trl.make_row(key, **common, loss_class=loss_class, fused_head=fused_head, name=name))
    return [row for row, _ in built], [trainer for _, trainer in built]


def main(argv=None) -> int:
    title = "TRL, GRPOTrainer(loss_class=AdaptiveFusedLinearGRPOLoss) vs TRL's own loss: training part of a GRPO step"
    return bench_trl.main(argv, args=parse_args(argv), script="bench_loss_class.py", title=title, build=build_rows)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
