"""The Unsloth fused loss of the installed Unsloth line, without its generated trainer, in a fresh
process (``import unsloth`` patches torch and transformers process-wide).

    python unsloth_lines_worker.py OUT_JSON

Unsloth before 2026.10 has no CPU backend: it cannot generate its GRPO trainer without CUDA. Its
loss functions live in unsloth_zoo as plain torch code, which the generated module copies by
source; so this worker builds this package's anchor set for the installed line on those functions
(and on Unsloth's ``compute_loss`` template), and calls the stock and the rewritten
``grpo_compute_loss`` on the same hand-made batch. It writes what it measured; the assertions are
in test_unsloth_lines.py.
"""

import dataclasses
import json
import os
import sys
import types

import torch

OUT = sys.argv[1]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for reference.py
import importlib.metadata  # noqa: E402

from packaging.version import Version  # noqa: E402

if not torch.cuda.is_available() and Version(importlib.metadata.version("unsloth_zoo")) < Version("2026.10"):
    os.environ["UNSLOTH_ALLOW_CPU"] = "1"  # these lines' import-only CPU switch (unsloth_zoo/device_type.py)
os.environ.setdefault("UNSLOTH_COMPILE_DISABLE", "1")
import unsloth  # noqa: E402,F401  (unsloth_zoo refuses to be imported without it)
import unsloth.models.rl_replacements as unsloth_rl  # noqa: E402
import unsloth_zoo.rl_replacements as zoo  # noqa: E402

import reference  # noqa: E402
import unsloth_adaptive_kl  # noqa: E402,F401
from unsloth_adaptive_kl.adaptation import AdaptiveKL  # noqa: E402
from unsloth_adaptive_kl.backends import unsloth as unsloth_backend  # noqa: E402
from unsloth_adaptive_kl.config import FIELDS  # noqa: E402

owners = {"": zoo, "UnslothEfficientGRPO": zoo.UnslothEfficientGRPO}
anchor_set = unsloth_backend.PLAN.select(owners)
zoo_part = dataclasses.replace(anchor_set, rewrites=tuple(r for r in anchor_set.rewrites if r.library == "unsloth_zoo"))
built = unsloth_backend.PLAN.build(owners, namespace=dict(zoo.__dict__), anchor_set=zoo_part)
# The trainer's compute_loss is Unsloth's source template, which the generated module executes as it is.
template = unsloth_rl.grpo_trainer_compute_loss("compute_loss", "")
results = {
    "family": anchor_set.family,
    "built": sorted(built),
    "mismatches": unsloth_backend.PLAN.mismatches(zoo_part, owners),
    "template_anchor_counts": [template.count(r.anchor) for r in anchor_set.rewrites if r.library == "unsloth"],
}

BETA, CLIP = 0.04, 0.05
# Unsloth 2026.10 applies TRL's use_bias_correction_kl; the older lines run with TRL 0.24, which has no such field.
bias_correction = anchor_set.family == "unsloth 2026.10"
inputs = reference.loss_inputs(64, seed=0, ref_spread=2.0, ref_offset=3.0)  # narrow log-ratios: Unsloth's clamps inactive
mask = inputs["completion_mask"]
advantages = torch.tensor([1.0, -0.5, 0.25, -1.0])
new0 = inputs["old_per_token_logps"] + 0.3 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
common = dict(loss_type="grpo", current_gradient_accumulation_steps=1, use_bias_correction_kl=bias_correction)


def fused_inputs(method, beta):
    config = types.SimpleNamespace(**{f.name: f.default for f in FIELDS}, beta=BETA)
    config.kl_adaptation_method, config.kl_clip_threshold = method, CLIP
    term = AdaptiveKL(config).term
    if beta == 0.0:
        return unsloth_backend.FusedKLInputs(term, None, None, None)
    return unsloth_backend.FusedKLInputs(term, torch.tensor(beta), torch.tensor(float(mask.shape[0])), None)


def run(function, beta, **kwargs):
    new = new0.clone().requires_grad_(True)
    out = function(inputs["ref_per_token_logps"], new, inputs["old_per_token_logps"], None, inputs["completion_ids"], mask, beta, advantages, **common, **kwargs)
    out[0].backward()
    return out[0].detach(), new.grad, out[2]  # out[2]: the mean_kl slot, [unsloth_kl, local sums...] when patched


stock_loss, stock_grad, _ = run(zoo.grpo_compute_loss, BETA)
ours_loss, ours_grad, _ = run(built["grpo_compute_loss"], 1.0, adaptive_kl=fused_inputs("none", BETA))
results["none_identical"] = bool(torch.equal(stock_loss, ours_loss) and torch.equal(stock_grad, ours_grad))
with_kl, _, clip_stats = run(built["grpo_compute_loss"], 1.0, adaptive_kl=fused_inputs("clip", BETA))
without_kl, _, _ = run(built["grpo_compute_loss"], 0.0, adaptive_kl=fused_inputs("clip", 0.0))
results["clip_kl_part"] = (with_kl.double() - without_kl.double()).item()
results["clip_stats"] = clip_stats.tolist()
raw, shaped = reference.raw_and_shaped_kl(
    "clip", new0, inputs["ref_per_token_logps"], inputs["old_per_token_logps"], mask, estimator="k3", clip_threshold=CLIP,
    kl_target=0.1, bias_correction=bias_correction, unsloth_clamps=True,
)  # fmt: skip
results["clip_sums_reference"] = {"raw": raw.sum().item(), "adapted": shaped.sum().item(), "tokens": mask.sum().item()}
for method in ("clip", "none"):
    expected, _, _ = reference.kl_part(
        method, new0, inputs, "grpo", beta=BETA, estimator="k3", clip_threshold=CLIP, kl_target=0.1,
        bias_correction=bias_correction, unsloth_clamps=True,
    )
    results[f"{method}_reference"] = expected.item()


# Unsloth's rollout rejection (2026.10; verl's token_k1 with bounds [1/e^0.3, e^0.3] on pi_old / pi_rollout, the rollout's
# log-probs standing in as old): a rejected token leaves the adapted KL of the metrics and of length_normalized's term.
if anchor_set.family == "unsloth 2026.10":
    BOUND = 0.3
    rejection = dict(rollout_rs=(("token_k1", -BOUND, BOUND),), rollout_logps_as_old=True)
    gap = (new0 - inputs["old_per_token_logps"]).abs()
    kept = mask.bool() & (gap <= BOUND)  # written from verl's rule, not from Unsloth's code
    _, _, rejected_stats = run(built["grpo_compute_loss"], 1.0, adaptive_kl=fused_inputs("clip", BETA), **rejection)
    with_kl, _, _ = run(built["grpo_compute_loss"], 1.0, adaptive_kl=fused_inputs("length_normalized", BETA), **rejection)
    without_kl, _, _ = run(built["grpo_compute_loss"], 0.0, adaptive_kl=fused_inputs("length_normalized", 0.0), **rejection)
    reference_kl = {}
    for method in ("clip", "length_normalized"):
        raw, shaped = reference.raw_and_shaped_kl(
            method, new0, inputs["ref_per_token_logps"], inputs["old_per_token_logps"], mask, estimator="k3",
            clip_threshold=CLIP, kl_target=0.1, bias_correction=bias_correction, unsloth_clamps=True,
        )  # fmt: skip
        reference_kl[method] = (torch.where(kept, raw, 0.0), torch.where(kept, shaped, 0.0), shaped)
    raw_kept, clip_kept, clip_all = reference_kl["clip"]
    _, length_normalized_kept, length_normalized_all = reference_kl["length_normalized"]
    tokens = mask.sum(-1).clamp(min=1)  # rejected tokens stay in the normaliser, as in Unsloth's loss
    results["rejection"] = {
        "valid": int(mask.sum()), "kept": int(kept.sum()), "margin": (gap[mask.bool()] - BOUND).abs().min().item(),
        "stats": rejected_stats.tolist(),
        "raw": raw_kept.sum().item(), "adapted": clip_kept.sum().item(), "adapted_without_rejection": clip_all.sum().item(),
        "length_normalized_kl_part": (with_kl.double() - without_kl.double()).item(),
        "length_normalized_reference": (BETA * (length_normalized_kept.sum(-1) / tokens).mean()).item(),
        "length_normalized_without_rejection": (BETA * (length_normalized_all.sum(-1) / tokens).mean()).item(),
    }  # fmt: skip


# The rewritten UnslothEfficientGRPO.forward (eager here: UNSLOTH_COMPILE_DISABLE): its mean_kl accumulator carries
# the loss's float64 sums out unchanged, as the one chunk's loss returned them.
class _Context:  # the part of autograd's ctx the forward uses
    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


forward_out = built["UnslothEfficientGRPO.forward"](
    _Context(), new0.clone(), inputs["old_per_token_logps"], inputs["ref_per_token_logps"], None, None, inputs["completion_ids"],
    mask, advantages, 1.0, None, 1, dict(common, adaptive_kl=fused_inputs("clip", BETA)),
)  # fmt: skip
results["forward_stats"] = {"dtype": str(forward_out[2].dtype), "values": forward_out[2].tolist()}
with open(OUT, "w") as f:
    json.dump(results, f)
