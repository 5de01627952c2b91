"""How far the sampled kl_monitor's KL can be from the KL it stands for, measured on study 33's streams.

    python research/monitor/sampled_kl.py            # kl_monitor_every 4, 8, 16 (the default), 32
    python research/monitor/sampled_kl.py --every 16

The sampled monitor (``kl_monitor_every=N``) logs on every N-th step exactly the KL the full monitor logs on that
step (tests/backends/test_kl_diagnostics.py). As a reading of the KL over its N steps, it is one step's KL standing
for N. Study 33's runs at beta > 0 logged the KL of every step (research/data/study33-p[12]-*: 88 copies of 200
steps or fewer; the monitor does not change training, so keeping every N-th of their values is what the sampled
monitor would have logged in the same run). For each copy, phase and cycle of N steps (the cycle's first step
logged), printed: the logged value over the mean KL of the cycle's N steps (the full monitor's mean over the same
steps), as quantiles of |ratio - 1|, over the calm copies (no runaway in section 7's definition) and over all.
A cycle cut by the end of a run is left out.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from research.harness import analysis
from unsloth_adaptive_kl import metrics

STREAMS = "research/data/study33-p[12]-*/*-stream.jsonl.gz"
K_NAT = 0.0247  # section 7's natural KL; its runaway threshold is 10 x K_NAT


def kl_series(pattern: str = STREAMS) -> list[tuple[bool, list[float]]]:
    """(calm, the KL of every step) of every copy with a KL at every step."""
    out = []
    for cells in analysis.read_copies(sorted(glob.glob(os.path.join(ROOT, pattern)))).values():
        for runs in cells.values():
            for rows in runs:
                if float(rows[0]["beta0"]) == 0:
                    continue
                kl = [row.get(metrics.RAW_KL) for row in rows]
                if any(v is None or math.isnan(v) for v in kl) or [r["step"] for r in rows] != list(range(1, len(rows) + 1)):
                    continue
                out.append((analysis.runaway_step(rows, 10 * K_NAT) is None, kl))
    return out


def errors(series: list[float], every: int) -> list[float]:
    """|logged / cycle mean - 1| for every full cycle of every phase."""
    out = []
    for phase in range(every):
        for start in range(phase, len(series) - every + 1, every):
            cycle = series[start : start + every]
            mean = sum(cycle) / every
            if mean > 0:
                out.append(abs(cycle[0] / mean - 1))
    return out


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=int, nargs="*", default=[4, 8, 16, 32])
    args = parser.parse_args(argv)
    data = kl_series()
    print(f"copies with a KL at every step: {len(data)} ({sum(calm for calm, _ in data)} calm)")
    print("| kl_monitor_every | copies | cycles | |logged / cycle mean - 1|: median | 90 % | 99 % | max |")
    print("|---|---|---|---|---|---|---|")
    for every in args.every:
        for label, chosen in (("calm", [s for calm, s in data if calm]), ("all", [s for _, s in data])):
            e = [x for s in chosen for x in errors(s, every)]
            print(f"| {every} | {label} ({len(chosen)}) | {len(e)} | {quantile(e, 0.5):.3f} | {quantile(e, 0.9):.3f} | "
                  f"{quantile(e, 0.99):.3f} | {max(e):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
