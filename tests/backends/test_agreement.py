"""Cross-backend agreement: identical per-token log-probs through TRL's eager loss, Unsloth's fused
loss and the Liger module give the same KL part of the loss, the same gradient of it w.r.t. the
log-probs, and the same ``adaptive_kl/*`` metrics, for every method × estimator.

* TRL: the patched ``GRPOTrainer._compute_loss``, with ``_get_per_token_logps_and_entropies``
  returning the shared log-probs, so TRL's own code aggregates.
* Unsloth: the rewritten ``grpo_compute_loss`` of the generated module, called directly with the
  kwargs a real call has, in a subprocess (agreement_worker.py): ``import unsloth`` rebinds
  TRL's classes process-wide.
* Liger: ``AdaptiveFusedLinearGRPOLoss.loss_from_logps``.

The KL part is the loss at β minus the loss at β = 0; its gradient likewise.
"""

import importlib.util
import itertools
import os
import subprocess
import sys
import types

import pytest
import torch

import reference
from unsloth_adaptive_kl import AdaptiveKL, metrics
import toy
from unsloth_adaptive_kl.config import DEFAULTS
from unsloth_adaptive_kl.backends import trl as trl_backend
from unsloth_adaptive_kl.backends.liger import AdaptiveFusedLinearGRPOLoss
from trl import GRPOConfig, GRPOTrainer

from unsloth_adaptive_kl.estimators import builtin_estimator_names

WORKER = os.path.join(os.path.dirname(__file__), "agreement_worker.py")
METHODS = reference.METHODS
ESTIMATORS = list(builtin_estimator_names())
LOSS_TYPES = ["dapo", "grpo"]
CASES = list(itertools.product(LOSS_TYPES, METHODS, ESTIMATORS))
T = reference.MAX_COMPLETION
# Small enough that clip (0.4) and sigmoid (target 0.2) act on some tokens and not on others,
# and bottom_q (q = 0.3) selects 3 of the 10 valid tokens.
# beta_min > 0: every controller has a floor it could reach (β does not move within these single loss calls).
FIELDS = dict(beta=0.3, beta_min=0.01, kl_clip_threshold=0.4, kl_target=0.2, kl_bottom_q=0.3, use_bias_correction_kl=True)
TOLERANCE = dict(rtol=1e-5, atol=1e-6)  # float32


def shared_batch(seed=0):
    """One batch for all three backends: variable lengths (6, 3, 1, 0 tokens), mixed-sign advantages.

    The log-ratios are moderate, |ref - logp| < 2.5 and |logp - old| <= 0.3, so Unsloth's
    clamps (log-ratio to [-20, 20], the bias-corrected KL to [-10, 10]) never act: the backends
    compute the same formula, and any difference is a disagreement, not a clamp.

    ``ref`` is drawn independently of ``logp`` (as a reference model's log-probs are). With seed 3
    the token at bottom_q's threshold has ``logp + (ref - logp) != ref`` in float32: a backend that
    rebuilds the reference from the log-ratio would drop it (the first test checks that).
    """
    g = torch.Generator().manual_seed(seed)
    batch, vocab = 4, 64
    mask = torch.ones(batch, T, dtype=torch.long)
    for i, length in enumerate([T, 3, 1, 0]):
        mask[i, length:] = 0
    logps = -torch.rand(batch, T, generator=g) * 1.5 - 0.05
    return {
        "logps": logps,
        "ref": -torch.rand(batch, T, generator=g) * 2.5 - 0.05,
        "old": logps + (torch.rand(batch, T, generator=g) * 0.6 - 0.3),
        "mask": mask,
        "advantages": torch.tensor([0.9, -1.3, 0.4, -0.2]),
        "completion_ids": torch.randint(5, vocab, (batch, T), generator=g).masked_fill(mask == 0, 0),
        "entropies": torch.rand(batch, T, generator=g) * 2,
        "num_items_in_batch": mask.sum().float(),
    }


BATCH = shared_batch(seed=3)


# -- TRL --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trainer(tiny_checkpoint, tmp_path_factory):
    args = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("agreement")), use_cpu=True, bf16=False, report_to="none",
        per_device_train_batch_size=4, num_generations=4, max_completion_length=T, max_steps=1, save_strategy="no",
        **FIELDS,
    )  # fmt: skip
    t = GRPOTrainer(model=tiny_checkpoint, reward_funcs=[toy.format_reward], args=args, train_dataset=toy.prompt_dataset(8))
    t.model.train()
    t.current_gradient_accumulation_steps = 1
    assert t.args.steps_per_generation == 1 and t.accelerator.num_processes == 1
    return t


def trl_results(trainer, monkeypatch, loss_type, method, estimator):
    for name, value in dict(kl_adaptation_method=method, kl_estimator=estimator, loss_type=loss_type).items():
        setattr(trainer.args, name, value)
    trainer.loss_type = loss_type
    trainer._adaptive_kl = trl_backend.TRLAdaptiveKL(trainer)
    beta = trainer.beta = trainer._adaptive_kl.beta
    inputs = {
        "prompt_ids": torch.full((4, 2), 5), "prompt_mask": torch.ones(4, 2, dtype=torch.long),
        "completion_ids": BATCH["completion_ids"], "completion_mask": BATCH["mask"], "advantages": BATCH["advantages"],
        "old_per_token_logps": BATCH["old"], "ref_per_token_logps": BATCH["ref"], "num_items_in_batch": BATCH["num_items_in_batch"],
    }  # fmt: skip

    def loss_and_grad():
        logps = BATCH["logps"].clone().requires_grad_(True)
        monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies", lambda *a, **k: (logps, BATCH["entropies"], None))
        loss = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
        (grad,) = torch.autograd.grad(loss, logps)
        return loss.detach().double(), grad

    trainer._metrics["train"].clear()
    with_kl, grad_with = loss_and_grad()
    logged = {name: trainer._metrics["train"][name][-1] for name in (metrics.RAW_KL, metrics.ADAPTED_KL, metrics.CURRENT_BETA)}
    trainer.beta = 0.0
    without_kl, grad_without = loss_and_grad()
    return dict(
        kl_part=(with_kl - without_kl).item(), grad=grad_with - grad_without, raw_kl=logged[metrics.RAW_KL],
        adapted_kl=logged[metrics.ADAPTED_KL], current_beta=logged[metrics.CURRENT_BETA], beta=beta,
    )  # fmt: skip


# -- Liger ------------------------------------------------------------------------------------------
def liger_results(loss_type, method, estimator):
    # The trainer's state, as GRPOTrainer(loss_class=...) passes it (a standalone module refuses a controller).
    state = AdaptiveKL(types.SimpleNamespace(**{**DEFAULTS, **FIELDS, "kl_adaptation_method": method, "kl_estimator": estimator}))
    module = AdaptiveFusedLinearGRPOLoss(
        beta=FIELDS["beta"], compiled=False, loss_type=loss_type, max_completion_length=T, use_bias_correction_kl=True, adaptive_kl=state,
    )  # fmt: skip

    def terms_and_grad():
        logps = BATCH["logps"].clone().requires_grad_(True)
        terms = module.loss_from_logps(
            logps, BATCH["mask"], BATCH["advantages"], ref_per_token_logps=BATCH["ref"], old_per_token_logps=BATCH["old"],
            num_items_in_batch=BATCH["num_items_in_batch"],
        )  # fmt: skip
        (grad,) = torch.autograd.grad(terms.loss, logps)
        return terms, grad

    with_kl, grad_with = terms_and_grad()
    beta, module.beta = module.beta, 0.0
    without_kl, grad_without = terms_and_grad()
    # As GRPOTrainer(loss_class=...) logs them (backends/liger.py, _log_adaptive).
    logged = module.adaptive_kl.record(with_kl.raw_kl, with_kl.adapted_kl, BATCH["mask"], training=True, beta=beta)
    return dict(
        kl_part=(with_kl.loss.detach().double() - without_kl.loss.detach().double()).item(), grad=grad_with - grad_without,
        raw_kl=logged[metrics.RAW_KL], adapted_kl=logged[metrics.ADAPTED_KL], current_beta=logged[metrics.CURRENT_BETA], beta=beta,
    )  # fmt: skip


# -- Unsloth (one subprocess for every case) ----------------------------------------------------------
@pytest.fixture(scope="module")
def unsloth_results(tmp_path_factory):
    if importlib.util.find_spec("unsloth") is None:
        pytest.skip("unsloth is not installed")
    folder = tmp_path_factory.mktemp("agreement-unsloth")
    spec, out = folder / "in.pt", folder / "out.pt"
    torch.save({"batch": BATCH, "fields": FIELDS, "cases": CASES, "max_completion_length": T}, spec)
    proc = subprocess.run([sys.executable, WORKER, str(spec), str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out)


# -- the comparisons -----------------------------------------------------------------------------------
def assert_agree(name, got, expected):
    """``got`` against ``expected`` (the TRL path) on every compared quantity."""
    assert got["beta"] == expected["beta"] == got["current_beta"] == expected["current_beta"] == FIELDS["beta"], name
    assert got["kl_part"] == pytest.approx(expected["kl_part"], rel=TOLERANCE["rtol"], abs=TOLERANCE["atol"]), name
    torch.testing.assert_close(got["grad"], expected["grad"], **TOLERANCE, msg=lambda m: f"{name}: gradient of the KL part\n{m}")
    for metric in ("raw_kl", "adapted_kl"):
        assert got[metric] == pytest.approx(expected[metric], rel=TOLERANCE["rtol"], abs=TOLERANCE["atol"]), (name, metric)


def test_the_batch_has_a_bottom_q_threshold_token_that_float32_cannot_rebuild_from_the_log_ratio():
    """Keeps the batch honest: Unsloth's fused loss has only the clamped log-ratio ``ref - logp`` at
    hand, and ``logp + (ref - logp)`` lands one ulp above ``ref`` on the threshold token here."""
    from unsloth_adaptive_kl.estimators import bottom_q_threshold

    valid = BATCH["mask"].bool()
    threshold = bottom_q_threshold(BATCH["ref"], valid, q=FIELDS["kl_bottom_q"])
    rebuilt = BATCH["logps"] + (BATCH["ref"] - BATCH["logps"])
    assert ((BATCH["ref"] <= threshold) & valid).sum() == 3
    assert ((rebuilt <= threshold) & valid).sum() == 2


@pytest.fixture(scope="module")
def trl_cache():
    return {}


@pytest.mark.parametrize("loss_type, method, estimator", CASES)
def test_trl_and_liger_agree_on_kl_part_gradient_and_metrics(trainer, monkeypatch, trl_cache, loss_type, method, estimator):
    trl = trl_cache[loss_type, method, estimator] = trl_results(trainer, monkeypatch, loss_type, method, estimator)
    assert trl["kl_part"] != 0.0  # the KL term reached the loss
    if not (method == "clip" and estimator == "bottom_q"):  # there every selected token's k3 / q is above the cap
        assert trl["grad"].abs().sum() > 0  # and its gradient
    assert_agree(f"liger {loss_type} {method} {estimator}", liger_results(loss_type, method, estimator), trl)


@pytest.mark.parametrize("loss_type, method, estimator", CASES)
def test_trl_and_unsloth_agree_on_kl_part_gradient_and_metrics(trainer, monkeypatch, trl_cache, unsloth_results, loss_type, method, estimator):
    key = (loss_type, method, estimator)
    trl = trl_cache.get(key) or trl_results(trainer, monkeypatch, *key)
    assert_agree(f"unsloth {loss_type} {method} {estimator}", unsloth_results[key], trl)
