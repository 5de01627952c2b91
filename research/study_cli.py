"""The study harness (issue 54 moved it here from blackwell/; the user's demo is now blackwell/test_adaptive_kl_grpo.py).

Adaptive-KL GRPO on one starting model, one method after another: does fixed-β GRPO drift to
longer completions once the reward saturates, and what does each adaptive method change?

Offline by default: it builds a character-level tokenizer and a small Llama for a synthetic
task (sums written with a free-length scratchpad, then ">" and the answer; format reward plus
correctness reward, 0.5 each), warm-starts the model with a short supervised phase, and trains a
LoRA adapter on it with GRPO under every method, from the same checkpoint. Runs go to
subprocesses, several at a time (--jobs): a tiny model leaves the GPU mostly idle.

    python research/study_cli.py                   # all methods, one seed
    python research/study_cli.py --seeds 3         # mean ± std across seeds
    python research/study_cli.py --smoke           # CPU, tiny, every method, ~1 min
    python research/study_cli.py --task medium --loss-type grpo --beta 0.04 --steps 300 --seeds 3
    python research/study_cli.py --model smollm2   # SmolLM2-135M-Instruct, pretrained: chat a + b
    python research/study_cli.py --analyze out/metrics.jsonl   # length slopes, paired intervals

Under --output-dir: metrics.jsonl (one line per run and step), summary.md (the header and the
table), curves.png (reward, completion length, KL, β against step), runs/*/log.txt.

Backend: Unsloth's GRPO trainer when unsloth is installed and CUDA is available, TRL's
otherwise (--backend overrides). On a GPU it first checks that the torch build supports the
card (Blackwell: sm_100 / sm_120 need a build for CUDA >= 12.8) and that bf16 works.
See docs/demo.md (its second part, "The research harness").
"""

# The harness's code is in research/harness/, a module per part:
#   settings.py   Settings, the tasks, the methods and the adaptive-KL fields every run gets
#   gpu.py        the GPU check (unsloth_adaptive_kl.gpu_support's rule, as doctor uses it) and the backend
#   tasks.py      the offline task and its warm-started starting model; SmolLM2's addition task; the hub data set and model
#   worker.py     one training run, in its own process (--worker SPEC)
#   scheduler.py  one subprocess per (method, seed), several at a time, with progress lines
#   summary.py    the table; analysis.py the --analyze drift tables; plot.py the curves
#   cli.py        the options, the header and main
# The names below are imported here so that this file still offers them (research/tests/demo_script.py
# loads it and uses them).

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # the harness package next to this file (already there when run as a script)
    sys.path.insert(0, HERE)

from harness.analysis import (  # noqa: E402
    CORRECT, T975, analyze, fmt_interval, ols_slope, paired_differences, read_rows, second_half_slope, t_interval,
)
from harness.cli import main, parse_args  # noqa: E402
from harness.gpu import GpuCheck, check_gpu, choose_backend, probe_gpu  # noqa: E402
from harness.plot import plot, plot_analysis  # noqa: E402
from harness.settings import ALL_METHODS, HUB, SMOKE, TASKS, Settings, method_fields  # noqa: E402
from harness.summary import cell, markdown_table, summarize_run  # noqa: E402

__all__ = [
    "ALL_METHODS", "CORRECT", "HUB", "SMOKE", "T975", "TASKS", "GpuCheck", "Settings", "analyze", "cell", "check_gpu",
    "choose_backend", "fmt_interval", "main", "markdown_table", "method_fields", "ols_slope", "paired_differences",
    "parse_args", "plot", "plot_analysis", "probe_gpu", "read_rows", "second_half_slope", "summarize_run", "t_interval",
]

if __name__ == "__main__":
    main(description=__doc__)
