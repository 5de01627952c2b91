"""``GRPOTrainer(loss_class=AdaptiveFusedLinearGRPOLoss)`` for a few real GRPO steps per loss type,
with real padding (sampled completions of different lengths) and old log-probs (``num_iterations=2``:
an importance ratio that is not 1), each micro-batch's loss checked
finite and equal to TRL's own loss on the same inputs (TRL's ``_compute_loss`` with the module
unset, under no_grad) within bf16 tolerance. A stage of scripts/gpu/verify.sh; on a machine with
no GPU it runs in float32 on the CPU (TRITON_INTERPRET=1), slowly.

    python scripts/gpu/liger_loss_class_check.py [--steps 3] [--loss-types grpo,dapo,...]

Prints one line per loss type and exits 1 on any non-finite or mismatched loss, or when no
micro-batch had padded completions of different lengths.
"""

import argparse
import math
import os
import sys
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import unsloth_adaptive_kl  # noqa: E402,F401  (patches TRL's GRPOTrainer: loss_class=)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"))
import toy  # noqa: E402  (examples/toy.py)
from unsloth_adaptive_kl.backends.liger import AdaptiveFusedLinearGRPOLoss  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
ATOL, RTOL = 5e-3, 1.6e-2  # bf16: 8 bits of mantissa in the hidden states both paths start from


def run(checkpoint, loss_type, steps, out_dir, cuda):
    args = GRPOConfig(
        output_dir=out_dir, use_cpu=not cuda, bf16=cuda, report_to="none", per_device_train_batch_size=8,
        num_generations=4, max_completion_length=8, max_steps=steps, logging_steps=1, learning_rate=1e-3,
        beta=0.04, save_strategy="no", seed=0, loss_type=loss_type, temperature=1.0, use_bias_correction_kl=True,
        epsilon_high=5.0 if loss_type == "cispo" else None, gradient_accumulation_steps=2, steps_per_generation=2,
        num_iterations=2,  # TRL then computes old log-probs: the importance ratio is not 1
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=checkpoint, reward_funcs=[toy.format_reward, toy.correctness_reward], args=args,
        train_dataset=toy.prompt_dataset(256), loss_class=AdaptiveFusedLinearGRPOLoss,
    )  # fmt: skip
    assert isinstance(trainer._adaptive_loss_module, AdaptiveFusedLinearGRPOLoss)
    rows = []
    patched = type(trainer)._compute_loss

    def compute_and_compare(model, inputs):
        loss = patched(trainer, model, inputs)  # the loss_class path
        module, trainer._adaptive_loss_module = trainer._adaptive_loss_module, None
        try:
            with torch.no_grad():
                reference = patched(trainer, model, inputs)  # TRL's own loss
        finally:
            trainer._adaptive_loss_module = module
        assert inputs.get("old_per_token_logps") is not None
        lengths = inputs["completion_mask"].sum(1).tolist()
        rows.append((loss.item(), reference.item(), lengths))
        return loss

    trainer._compute_loss = compute_and_compare
    trainer.train()
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--loss-types", default=",".join(LOSS_TYPES))
    options = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else "cpu (float32)"
    checkpoint = toy.build_checkpoint(tempfile.mkdtemp(prefix="liger-check-"), hidden_size=128, layers=2, warm_start_steps=60)
    print(f"GRPOTrainer(loss_class=AdaptiveFusedLinearGRPOLoss) vs TRL's own loss, {options.steps} steps, {device}")
    failures, padded = 0, False
    for loss_type in options.loss_types.split(","):
        rows = run(checkpoint, loss_type, options.steps, tempfile.mkdtemp(), cuda)
        worst = 0.0
        for ours, theirs, lengths in rows:
            padded |= min(lengths) < max(lengths)
            ok = math.isfinite(ours) and abs(ours - theirs) <= ATOL + RTOL * abs(theirs)
            failures += not ok
            worst = max(worst, abs(ours - theirs))
        lengths = sorted({n for _, _, ls in rows for n in ls})
        print(f"{loss_type:8s} {len(rows)} micro-batches, completion lengths {lengths}, max |loss - trl| = {worst:.2e}, "
              f"first loss {rows[0][0]:+.6f} (trl {rows[0][1]:+.6f}): {'ok' if all(math.isfinite(r[0]) for r in rows) else 'NOT FINITE'}")  # fmt: skip
    if not padded:
        print("FAIL: no micro-batch had completions of different lengths (no real padding)")
        failures += 1
    print("PASS" if failures == 0 else f"FAIL: {failures} mismatched or non-finite micro-batch losses")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
