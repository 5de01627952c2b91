"""Design 2's rejected variant (L in compare.py: below the target β may halve again after ``target_patience`` frozen
updates) on the lagged, drifting plant of tests/test_target_controller.py, whose KL does not respond to β for its
first 100 steps: the plant the issue asks ``target`` to hold without wind-up. Prints docs/simulator.md's table.

    PYTHONPATH=. python research/controller_sim/lagged_check.py
"""

from __future__ import annotations

import logging
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from research.controller_sim.compare import DesignOne, FallsAgain  # noqa: E402
from test_target_controller import LaggedDriftingPlant, run, trailing  # noqa: E402
from unsloth_adaptive_kl.controllers import ControllerConfig  # noqa: E402
from unsloth_adaptive_kl.target_controller import HeldTargetKL  # noqa: E402

TARGET, BETA0 = 0.03, 0.02  # the tests' settings


def main():
    logging.getLogger("unsloth_adaptive_kl").setLevel(logging.ERROR)
    print("| controller | seed | least β in the dead phase (steps 1-100) | highest 10-step KL after it / target | "
          "final-50-step KL / target |")
    print("|---|---|---|---|---|")
    for name, cls in (("design 1", DesignOne), ("design 2 (target)", HeldTargetKL), ("L: design 2 + falls again", FallsAgain)):
        for seed in range(3):
            betas, kls = run(cls(ControllerConfig(BETA0, kl_target=TARGET)), LaggedDriftingPlant(seed=seed))
            print(f"| {name} | {seed} | {min(betas[:100]):.4f} | {max(trailing(kls[100:])) / TARGET:.2f} | "
                  f"{sum(kls[-50:]) / 50 / TARGET:.2f} |")


if __name__ == "__main__":
    main()
