"""The Unsloth side of test_agreement.py, run in a fresh process: ``import unsloth`` rebinds TRL's
classes process-wide, so it must not happen inside the main test process.

    python agreement_worker.py IN_PT OUT_PT

IN_PT (``torch.save``) holds the shared batch and the cases; for each case this script calls the
rewritten ``grpo_compute_loss`` of Unsloth's generated module directly, with the kwargs a real
call has (``UnslothAdaptiveKL.fused_beta_gate`` fills the adaptive one), at β and at β = 0, and
writes the KL part of the loss, its gradient w.r.t. the log-probs and the ``adaptive_kl/*``
metrics that ``record_fused`` logs from the returned 6-vector.
"""

import contextlib
import io
import os
import sys
import tempfile

IN, OUT = sys.argv[1:3]
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", tempfile.mkdtemp(prefix="unsloth-cache-"))
os.environ["UNSLOTH_COMPILE_DISABLE"] = "1"  # the fused loss runs eagerly: exact comparisons on CPU

with contextlib.redirect_stdout(io.StringIO()):
    import unsloth  # noqa: F401
    from unsloth.models.rl import _patch_trl_rl_trainers

    _patch_trl_rl_trainers("grpo_trainer")
    import unsloth_adaptive_kl

import torch  # noqa: E402
import trl  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from unsloth_adaptive_kl import metrics  # noqa: E402

import toy  # noqa: E402
from unsloth_adaptive_kl.backends.unsloth import UnslothAdaptiveKL  # noqa: E402

generated = sys.modules["UnslothGRPOTrainer"]
spec = torch.load(IN)
batch, fields = spec["batch"], spec["fields"]
assert generated.grpo_compute_loss is not unsloth_adaptive_kl.backends.trl.original(generated, "grpo_compute_loss")


def make_trainer():
    model = AutoModelForCausalLM.from_pretrained(toy.build_checkpoint(tempfile.mkdtemp(prefix="tiny-"), hidden_size=32))
    model.for_training = lambda *a, **k: None  # what FastLanguageModel adds; a plain model lacks them
    model.for_inference = lambda *a, **k: None
    args = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="out-"), use_cpu=True, bf16=False, report_to="none",
        per_device_train_batch_size=4, num_generations=4, max_completion_length=spec["max_completion_length"],
        max_steps=1, save_strategy="no", gradient_accumulation_steps=1, **fields,
    )  # fmt: skip
    return trl.GRPOTrainer(
        model=model, reward_funcs=[toy.format_reward], args=args, train_dataset=toy.prompt_dataset(8),
        processing_class=toy.build_tokenizer(),
    )  # fmt: skip


def set_method(t, method, estimator, loss_type):
    t.args.kl_adaptation_method, t.args.kl_estimator, t.args.loss_type = method, estimator, loss_type
    t.loss_type = loss_type
    t._adaptive_kl = UnslothAdaptiveKL(t)
    t.beta = t._adaptive_kl.beta


def fused_loss(t, loss_type):
    """One call of the rewritten grpo_compute_loss; returns (loss, its grad w.r.t. the log-probs, 6-vector)."""
    logps = batch["logps"].clone().requires_grad_(True)
    mask, ref = batch["mask"], batch["ref"]
    kwargs = dict(
        loss_type=loss_type, epsilon_low=t.epsilon_low, epsilon_high=t.epsilon_high,
        num_items_in_batch=batch["num_items_in_batch"], current_gradient_accumulation_steps=1, steps_per_generation=1,
        num_processes=1, max_completion_length=spec["max_completion_length"], importance_sampling_level="token",
        use_bias_correction_kl=True,
    )  # fmt: skip
    gate = t._adaptive_kl.fused_beta_gate(kwargs, ref, mask)
    loss, _, stats, *_ = generated.grpo_compute_loss(
        ref, logps, batch["old"], None, batch["completion_ids"], mask, gate, batch["advantages"], **kwargs
    )
    (grad,) = torch.autograd.grad(loss, logps)
    return loss.detach().double(), grad, stats


def main():
    t = make_trainer()
    t.model.train()
    results = {}
    for loss_type, method, estimator in spec["cases"]:
        set_method(t, method, estimator, loss_type)
        t._metrics["train"].clear()
        with_kl, grad_with, stats = fused_loss(t, loss_type)
        t._adaptive_kl.record_fused(stats, "train")  # as the trainer's compute_loss does
        logged = t._metrics["train"]
        beta = t.beta
        t.beta = 0.0
        without_kl, grad_without, _ = fused_loss(t, loss_type)
        results[loss_type, method, estimator] = dict(
            kl_part=(with_kl - without_kl).item(),
            grad=grad_with - grad_without,
            raw_kl=logged[metrics.RAW_KL][-1],
            adapted_kl=logged[metrics.ADAPTED_KL][-1],
            current_beta=logged[metrics.CURRENT_BETA][-1],
            beta=beta,
        )
    torch.save(results, OUT)


main()
