"""Build the tiny offline model and data set that examples/grpo_recipe.yaml trains.

    python examples/prepare_toy.py toy      # writes toy/model (tokenizer + tiny Llama) and toy/data/train.jsonl

Nothing is downloaded: the tokenizer is trained on a synthetic arithmetic corpus and the model is
built from a config, then warm-started (see examples/toy.py).
"""

from __future__ import annotations

import argparse
import os

import toy  # examples/toy.py, beside this script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="where to write model/ and data/")
    parser.add_argument("--warm-start-steps", type=int, default=150)
    parser.add_argument("--prompts", type=int, default=1024)
    args = parser.parse_args()

    model_dir = toy.build_checkpoint(os.path.join(args.directory, "model"), warm_start_steps=args.warm_start_steps)
    data_dir = os.path.join(args.directory, "data")
    os.makedirs(data_dir, exist_ok=True)
    toy.prompt_dataset(args.prompts).to_json(os.path.join(data_dir, "train.jsonl"))
    print(f"model: {model_dir}\ndata:  {data_dir}")


if __name__ == "__main__":
    main()
