"""A Liger-style GRPO loss variant that changes only the KL function, trained with
``GRPOTrainer(..., loss_class=...)``.

The workflow this supports: subclass the loss, override one method, pass the class. Everything
else (the chunked log-probs, the policy loss, β and its controller, shaping, the
``adaptive_kl/*`` metrics) stays as it is.

    python examples/custom_kl_variant.py --steps 3      # CPU, a few seconds, nothing downloaded
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")  # TRL's Triton log-prob kernel, interpreted on CPU

import torch

import unsloth_adaptive_kl  # noqa: F401  (patches GRPOTrainer: loss_class= and the adaptive-KL fields)
from unsloth_adaptive_kl.backends.liger import AdaptiveFusedLinearGRPOLoss
from trl import GRPOConfig, GRPOTrainer

import toy  # examples/toy.py, the offline task beside this script


class SymmetricKLLoss(AdaptiveFusedLinearGRPOLoss):
    """GRPO with a symmetric KL proxy: the mean of k3 in both directions, ``cosh(r) - 1``.

    With ``r = ref_logp - logp``, k3 of KL(pi || ref) is ``exp(r) - r - 1`` and k3 of
    KL(ref || pi) is ``exp(-r) + r - 1``; their mean is ``cosh(r) - 1`` (Schulman,
    "Approximating KL Divergence", 2020). It penalises the policy moving up or down alike.
    """

    def per_token_kl(self, logp, ref_logp, *, mask, statistic):
        return torch.cosh(ref_logp - logp) - 1


def train(output_dir: str, *, steps: int = 3, method: str = "clip") -> GRPOTrainer:
    model_dir = toy.build_checkpoint(os.path.join(output_dir, "model"), hidden_size=32, layers=2)
    config = GRPOConfig(
        output_dir=output_dir,
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        report_to="none",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=steps,
        logging_steps=1,
        learning_rate=1e-2,
        save_strategy="no",
        beta=0.04,
        kl_adaptation_method=method,
        kl_clip_threshold=0.05,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=[toy.format_reward, toy.correctness_reward],
        args=config,
        train_dataset=toy.prompt_dataset(64),
        loss_class=SymmetricKLLoss,
    )
    trainer.train()
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--method", default="clip")
    parser.add_argument("--output-dir", default=None)
    args = parser.parse_args()
    trainer = train(args.output_dir or tempfile.mkdtemp(prefix="custom-kl-"), steps=args.steps, method=args.method)
    print(f"{'step':>4} {'raw_kl':>9} {'adapted_kl':>10} {'beta':>7}")
    for h in trainer.state.log_history:
        if unsloth_adaptive_kl.CURRENT_BETA in h:
            print(f"{h['step']:>4} {h[unsloth_adaptive_kl.RAW_KL]:>9.5f} {h[unsloth_adaptive_kl.ADAPTED_KL]:>10.5f} {h[unsloth_adaptive_kl.CURRENT_BETA]:>7.4f}")


if __name__ == "__main__":
    main()
