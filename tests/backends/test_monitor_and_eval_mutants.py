"""Two surviving mutants of issue 52's mutation run, each with the case that kills it: kl_monitor on TRL at β = 0
with a NaN reference log-prob (a loss that added ``0 · adapted_kl`` would be NaN; stock TRL's is finite), and the
``loss_class=`` loss in evaluation (divided by the gradient-accumulation steps it was 1/3 of TRL's own at
accumulation 3). References: TRL's own unpatched loss on the same inputs."""

import math

import pytest
import torch
from test_liger import configure, loss_inputs as liger_inputs, make_trainer as make_liger_trainer
from test_trl import loss_and_grads, loss_inputs, make_trainer

from unsloth_adaptive_kl import metrics
from unsloth_adaptive_kl.backends import trl as trl_backend
from trl import GRPOTrainer


def test_kl_monitor_at_beta_zero_keeps_stock_trls_finite_loss_when_a_reference_log_prob_is_nan(tiny_checkpoint, tmp_path):
    trainer = make_trainer(tiny_checkpoint, tmp_path, beta=0.0, kl_monitor=True)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = loss_inputs(trainer, seed=11)
    assert inputs["completion_mask"][0, 1] == 1
    inputs["ref_per_token_logps"][0, 1] = math.nan  # a valid token: the KL there is NaN
    torch.manual_seed(0)
    loss, grads = loss_and_grads(trainer, inputs)
    logged = {name: list(values) for name, values in trainer._metrics["train"].items()}
    original = trl_backend.original(GRPOTrainer, "_compute_loss")
    torch.manual_seed(0)
    stock_loss, stock_grads = loss_and_grads(trainer, {k: v for k, v in inputs.items() if k != "ref_per_token_logps"}, original)
    assert torch.isfinite(stock_loss) and torch.equal(loss, stock_loss)
    assert len(grads) == len(stock_grads) > 0 and all(torch.equal(a, b) for a, b in zip(grads, stock_grads))
    assert logged[metrics.NONFINITE_KL_BATCHES] == [1.0] and metrics.RAW_KL not in logged  # counted, not averaged in


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_the_loss_class_eval_loss_is_trls_eval_loss_whatever_the_accumulation(tiny_checkpoint, tmp_path, loss_type):
    trainer = make_liger_trainer(tiny_checkpoint, tmp_path)
    configure(trainer, loss_type, "none", beta=0.3, use_bias_correction_kl=True, epsilon_high=None)
    trainer.model.eval()
    trainer.current_gradient_accumulation_steps = 3
    inputs = liger_inputs(trainer, seed=2)
    with torch.no_grad():
        module_loss = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
        module, trainer._adaptive_loss_module = trainer._adaptive_loss_module, None
        try:
            trl_loss = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
        finally:
            trainer._adaptive_loss_module = module
    assert trl_loss.abs() > 1e-3  # the case tells: a loss divided by 3 would differ
    torch.testing.assert_close(module_loss, trl_loss, atol=1e-6, rtol=1e-5)
