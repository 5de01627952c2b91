"""The table of the `unsloth-lines` stage (scripts/gpu/verify.sh): per Unsloth line, the compiled graphs
per step of the 32-step run at a fixed β and with a dynamic β, from tests/gpu's records.

    python scripts/gpu/lines_table.py OUT STACK...     # reads OUT/gpu-report-STACK.json
"""

import json
import sys

VERSIONS = ("unsloth", "unsloth_zoo", "trl", "transformers", "torch")


def main(out: str, stacks: list[str]) -> None:
    print("| line | versions | graphs per step, fixed β | graphs per step, dynamic β | equal from step 2 on |")
    print("|---|---|---|---|---|")
    for stack in stacks:
        try:
            with open(f"{out}/gpu-report-{stack}.json") as f:
                record = json.load(f)["dynamic_32_steps"]
        except (OSError, KeyError, ValueError) as error:
            print(f"| {stack} | no record ({type(error).__name__}: {error}) | | | |")
            continue
        versions = ", ".join(f"{d} {record[d]}" for d in VERSIONS)
        fixed, dynamic = record["fixed_beta_graphs_per_step"], record["graphs_per_step"]
        print(f"| {stack} | {versions} | {fixed} | {dynamic} | {fixed[1:] == dynamic[1:]} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
