"""Liger backend: the drop-in module against Liger's own (every loss type and option, eager and
compiled), the KL part against float64 references, batch-level statistics, β without
recompiling, and ``GRPOTrainer(loss_class=...)`` against TRL's own loss and end to end."""

import decimal
import functools
import itertools
import math
import sys
from pathlib import Path

import pytest
import reference
import torch
from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

import unsloth_adaptive_kl
from unsloth_adaptive_kl import versions
import toy
from unsloth_adaptive_kl.backends import trl as trl_backend
from unsloth_adaptive_kl.backends.liger import AdaptiveFusedLinearGRPOLoss
from trl import GRPOConfig, GRPOTrainer

ROOT = Path(__file__).resolve().parents[2]
LOSS_TYPES = list(versions.ALL_LOSS_TYPES)
TOKEN_LEVEL_ONLY = ("cispo", "sapo", "vespo")
B, T, H, V = 3, 5, 8, 20


# -- a tiny batch of hidden states ---------------------------------------------------------------------
def make_batch(seed=0, with_bias=True):
    """Mixed-sign advantages, a padded and a nearly empty row, policy away from old and reference."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 3:] = 0
    mask[2, 1:] = 0
    return dict(
        _input=torch.randn(B, T, H, generator=g),
        lin_weight=torch.randn(V, H, generator=g) * 0.5,
        bias=torch.randn(V, generator=g) * 0.1 if with_bias else None,
        selected_token_ids=torch.randint(0, V, (B, T), generator=g),
        attention_mask=mask,
        advantages=torch.tensor([-1.0, 0.5, 1.2]),
        ref_per_token_logps=-torch.rand(B, T, generator=g) * 3 - 1,
        old_per_token_logps=-torch.rand(B, T, generator=g) * 3 - 1,
    )


def run_module(module, batch):
    """Loss, metrics and grads wrt input, weight and bias of one forward+backward."""
    leaves = {k: (v.clone().requires_grad_(True) if k in ("_input", "lin_weight", "bias") and v is not None else v) for k, v in batch.items()}
    loss, metrics = module(**leaves)
    loss.backward()
    grads = [leaves[k].grad for k in ("_input", "lin_weight", "bias") if leaves[k] is not None]
    return loss.detach(), metrics, grads


def assert_same(ours, theirs, atol=2e-6, rtol=1e-5):
    (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = ours, theirs
    torch.testing.assert_close(loss_a, loss_b, atol=atol, rtol=rtol)
    assert len(metrics_a) == len(metrics_b)
    for a, b in zip(metrics_a, metrics_b):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
    assert len(grads_a) == len(grads_b)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def liger_kwargs(loss_type, level="token", delta=None, bias_correction=False, **extra):
    kwargs = dict(beta=0.1, loss_type=loss_type, importance_sampling_level=level, delta=delta, use_bias_correction_kl=bias_correction, max_completion_length=T)
    if loss_type == "cispo":
        kwargs["epsilon_high"] = 5.0  # cispo's epsilon_high is an absolute cap
    kwargs.update(extra)
    return kwargs


GRID = [
    case
    for case in itertools.product(LOSS_TYPES, ["token", "sequence"], [None, 1.5], [False, True], [False, True])
    if not (case[1] == "sequence" and case[0] in TOKEN_LEVEL_ONLY)
]


@pytest.fixture
def light_compile(monkeypatch):
    """torch.compile through dynamo's graph capture, run eagerly: no C++ codegen (seconds, not minutes, on CPU).

    Liger compiles through ``torch.compile`` too, so both sides are traced the same way. The one
    inductor test below covers the real backend.
    """
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("loss_type, level, delta, with_bias, bias_correction", GRID)
def test_method_none_with_k3_matches_liger_eager(loss_type, level, delta, with_bias, bias_correction):
    kwargs = liger_kwargs(loss_type, level, delta, bias_correction, compiled=False)
    batch = make_batch(with_bias=with_bias)
    assert_same(run_module(AdaptiveFusedLinearGRPOLoss(**kwargs), batch), run_module(LigerFusedLinearGRPOLoss(**kwargs), batch))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_method_none_with_k3_matches_liger_compiled(light_compile, loss_type):
    for level, delta, bias_correction in itertools.product(["token", "sequence"], [None, 1.5], [False, True]):
        if level == "sequence" and loss_type in TOKEN_LEVEL_ONLY:
            continue
        torch._dynamo.reset()  # Liger builds a new compiled function per call: keep under the recompile limit
        kwargs = liger_kwargs(loss_type, level, delta, bias_correction, compiled=True)
        ours, liger = AdaptiveFusedLinearGRPOLoss(**kwargs), LigerFusedLinearGRPOLoss(**kwargs)
        # The bias enters the log-probs, computed before either compiled loss: one module (one compiled graph) per
        # side serves the batches without and with a bias, as a training loop calls one module with many batches.
        for with_bias in (False, True):
            batch = make_batch(with_bias=with_bias)
            assert_same(run_module(ours, batch), run_module(liger, batch))


def test_compiled_with_inductor_matches_liger_compiled():
    torch._dynamo.reset()
    kwargs = liger_kwargs("dapo", "token", 1.5, True, compiled=True)
    batch = make_batch()
    assert_same(run_module(AdaptiveFusedLinearGRPOLoss(**kwargs), batch), run_module(LigerFusedLinearGRPOLoss(**kwargs), batch))


def test_beta_zero_returns_liger_structure_without_kl_metric():
    batch = make_batch()
    ours = run_module(AdaptiveFusedLinearGRPOLoss(**liger_kwargs("dapo", beta=0.0, compiled=False)), batch)
    theirs = run_module(LigerFusedLinearGRPOLoss(**liger_kwargs("dapo", beta=0.0, compiled=False)), batch)
    assert len(ours[1]) == 1
    assert_same(ours, theirs)


@pytest.mark.parametrize("loss_type", TOKEN_LEVEL_ONLY)
def test_sequence_level_is_refused_where_liger_refuses_it(loss_type):
    batch = make_batch()
    for cls in (AdaptiveFusedLinearGRPOLoss, LigerFusedLinearGRPOLoss):
        with pytest.raises(ValueError, match="Sequence-level importance sampling is not supported"):
            cls(**liger_kwargs(loss_type, "sequence", compiled=False))(**batch)


def test_ref_input_and_num_items_and_vllm_ratio_match_liger():
    batch = make_batch()
    g = torch.Generator().manual_seed(5)
    ref_input = batch["_input"] + 0.1 * torch.randn(B, T, H, generator=g)
    extra = dict(ref_input=ref_input, ref_weight=batch["lin_weight"] * 1.1, ref_bias=batch["bias"], num_items_in_batch=torch.tensor(17.0), vllm_is_ratio=torch.rand(B, generator=g) + 0.5)
    batch = {**batch, "ref_per_token_logps": None, **extra}
    kwargs = liger_kwargs("dapo", compiled=False)
    assert_same(run_module(AdaptiveFusedLinearGRPOLoss(**kwargs), batch), run_module(LigerFusedLinearGRPOLoss(**kwargs), batch))


def sharp_batch(seed=0):
    """Liger's own test grid at its large shape (issue 10): logits so sharp that log-probs fall below
    -88, and old / reference log-probs are the policy's own plus noise, padding included."""
    batch = make_batch(seed)
    g = torch.Generator().manual_seed(seed + 1)
    batch["lin_weight"] = torch.randn(V, H, generator=g) * 40
    logits = (batch["_input"].double() @ batch["lin_weight"].double().T + batch["bias"].double())
    logps = logits.log_softmax(-1).gather(-1, batch["selected_token_ids"].unsqueeze(-1)).squeeze(-1).float()
    assert logps[batch["attention_mask"] == 0].min() < -89  # exp(0 - old) overflows float32 at padding
    batch["old_per_token_logps"] = logps + 0.01 * torch.randn(B, T, generator=g)
    batch["ref_per_token_logps"] = logps + 0.01 * torch.randn(B, T, generator=g)
    batch["advantages"] = torch.tensor([1.0, -0.5, 1.2])  # a padded row with A < 0: -min(inf * A, .) = inf
    return batch


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("bias_correction", [False, True])
def test_padding_with_very_negative_old_logps_is_finite_and_matches_liger(loss_type, bias_correction):
    """The forward computes no log-prob at padding; a ratio exp(0 - old) there must not overflow
    into the loss (inf * mask 0 = NaN): it was NaN in Liger's own grid, where stock Liger is finite."""
    kwargs = liger_kwargs(loss_type, bias_correction=bias_correction, compiled=False)
    batch = sharp_batch()
    ours, theirs = run_module(AdaptiveFusedLinearGRPOLoss(**kwargs), batch), run_module(LigerFusedLinearGRPOLoss(**kwargs), batch)
    assert torch.isfinite(theirs[0]) and all(torch.isfinite(g).all() for g in theirs[2])
    assert_same(ours, theirs, atol=1e-5, rtol=1e-4)


def test_both_reference_inputs_warn_as_liger_and_use_the_log_probs():
    batch = make_batch()
    extra = dict(ref_input=batch["_input"] + 1.0, ref_weight=batch["lin_weight"], ref_bias=batch["bias"])
    kwargs = liger_kwargs("dapo", compiled=False)
    for cls in (AdaptiveFusedLinearGRPOLoss, LigerFusedLinearGRPOLoss):
        with pytest.warns(UserWarning, match="Both ref_per_token_logps and ref_input are provided. Using ref_per_token_logps."):
            loss, _ = cls(**kwargs)(**batch, **extra)
        torch.testing.assert_close(loss, cls(**kwargs)(**batch)[0])


# -- β across calls --------------------------------------------------------------------------------------
def test_beta_changes_every_call_without_recompiling(light_compile):
    from torch._dynamo.utils import counters

    compiled = AdaptiveFusedLinearGRPOLoss(**liger_kwargs("dapo", compiled=True))
    eager = AdaptiveFusedLinearGRPOLoss(**liger_kwargs("dapo", compiled=False))
    batch = make_batch()
    counters.clear()
    losses = []
    for beta in (0.1, 0.2, 0.35, 0.05):
        compiled.beta = beta
        eager.beta = torch.tensor(beta)  # a 0-dim tensor works too
        ours = run_module(compiled, batch)
        assert_same(ours, run_module(eager, batch))
        losses.append(ours[0].item())
        if beta == 0.1:
            graphs_after_first_call = counters["stats"]["unique_graphs"]
    assert graphs_after_first_call > 0
    assert counters["stats"]["unique_graphs"] == graphs_after_first_call  # no recompilation for a new β
    assert len(set(losses)) == 4  # and β did reach the loss


# -- the KL part against float64 references -----------------------------------------------------------
def reference_kl_part(batch, logps, *, beta, estimator, method="none", loss_type="dapo", q=0.2, clip=0.4, target=0.2, threshold=None):
    """β × the aggregated KL term, in float64, from the module's own log-probs."""
    logp, ref, mask = logps.double(), batch["ref_per_token_logps"].double(), batch["attention_mask"].bool()
    r = ref - logp
    k3 = torch.exp(r) - r - 1
    if estimator == "bottom_q":
        if threshold is None:
            count = max(1, math.floor(decimal.Decimal(str(q)) * int(mask.sum())))  # the seed's floor(q * N), at least 1
            threshold = ref[mask].kthvalue(count).values
        kl = torch.where(ref <= threshold, k3 / q, torch.zeros_like(k3))
    else:
        # not a registry list: the float64 values of the estimators the cases below use
        kl = {"k3": k3, "k3+": k3, "k1": -r, "k1+": -r, "k2": 0.5 * r**2, "squared": 0.5 * r**2}[estimator]
    kl = torch.where(mask, reference.shaped64(kl, method, clip, target), torch.zeros_like(kl))
    if "length_normalized" in method:
        return beta * (kl.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    assert loss_type == "dapo"
    return beta * kl.sum() / mask.sum()


def module_logps(module, batch):
    from unsloth_adaptive_kl.backends.liger import selected_token_logps

    return selected_token_logps(batch["_input"], batch["lin_weight"], batch["bias"], batch["selected_token_ids"], batch["attention_mask"], module.temperature)


def kl_part(module, batch):
    with torch.no_grad():
        with_kl = module(**batch)[0]
        beta, module.beta = module.beta, 0.0
        without_kl = module(**batch)[0]
        module.beta = beta
    return with_kl.double() - without_kl.double()


@pytest.mark.parametrize(
    "method, estimator",
    [("none", "k3"), ("none", "bottom_q"), ("none", "squared"), ("none", "k1+"), ("none", "k3+"), ("clip", "k3"), ("soft_clip", "k3"), ("soft_clip+sigmoid", "k2"), ("sigmoid", "k2"), ("length_normalized", "k3"), ("clip+sigmoid+length_normalized", "bottom_q")],
)
def test_kl_part_matches_float64_reference(method, estimator):
    batch = make_batch(seed=1)
    module = AdaptiveFusedLinearGRPOLoss(**liger_kwargs("dapo", beta=0.3, compiled=False), kl_adaptation_method=method, kl_estimator=estimator, kl_clip_threshold=0.4, kl_target=0.2)
    expected = reference_kl_part(batch, module_logps(module, batch), beta=0.3, estimator=estimator, method=method)
    assert kl_part(module, batch).item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    if method != "none":  # the shaping reached the loss
        unshaped = reference_kl_part(batch, module_logps(module, batch), beta=0.3, estimator=estimator)
        assert abs(unshaped.item() - expected.item()) > 1e-4


def test_straight_through_estimators_take_the_gradient_of_k2():
    batch = make_batch(seed=2)

    def run(estimator):
        return run_module(AdaptiveFusedLinearGRPOLoss(**liger_kwargs("dapo", beta=0.5, compiled=False), kl_estimator=estimator), batch)

    (loss_k3p, _, grads_k3p), (loss_k2, _, grads_k2), (loss_k3, _, grads_k3) = run("k3+"), run("k2"), run("k3")
    torch.testing.assert_close(loss_k3p, loss_k3)  # value of k3
    for a, b in zip(grads_k3p, grads_k2):
        torch.testing.assert_close(a, b)  # gradient of k2
    assert not torch.allclose(grads_k3p[0], grads_k3[0])


def test_bottom_q_threshold_is_batch_level_whatever_the_chunk_size():
    batch = make_batch(seed=3)
    losses = [run_module(AdaptiveFusedLinearGRPOLoss(**liger_kwargs("dapo", compiled=False, chunk_size=c), kl_estimator="bottom_q", kl_bottom_q=0.3), batch) for c in (1, 2, 3)]
    for other in losses[1:]:
        assert_same(losses[0], other, atol=0, rtol=0)
    # The module's KL part is the float64 one with the threshold of the whole batch's valid
    # tokens, and not the one a row-chunked loss gets with a threshold per chunk (the seed's way).
    module = AdaptiveFusedLinearGRPOLoss(**liger_kwargs("dapo", compiled=False, chunk_size=1), kl_estimator="bottom_q", kl_bottom_q=0.3)
    logps = module_logps(module, batch).detach()
    whole = reference_kl_part(batch, logps, beta=0.1, estimator="bottom_q", q=0.3)
    per_row = 0.0
    for i in range(B):
        row = {k: v[i : i + 1] for k, v in batch.items() if k in ("ref_per_token_logps", "attention_mask")}
        row_tokens = int(row["attention_mask"].sum())
        per_row += reference_kl_part(row, logps[i : i + 1], beta=0.1, estimator="bottom_q", q=0.3).item() * row_tokens
    per_row /= int(batch["attention_mask"].sum())
    assert abs(whole.item() - per_row) > 1e-4  # the test can tell the two apart
    assert kl_part(module, batch).item() == pytest.approx(whole.item(), rel=1e-5)


def test_loss_from_logps_is_the_module_loss():
    batch = make_batch(seed=4)
    module = AdaptiveFusedLinearGRPOLoss(**liger_kwargs("grpo", compiled=False), kl_adaptation_method="clip+length_normalized", kl_estimator="k3+")
    logps = module_logps(module, batch)
    terms = module.loss_from_logps(logps, batch["attention_mask"], batch["advantages"], ref_per_token_logps=batch["ref_per_token_logps"], old_per_token_logps=batch["old_per_token_logps"])
    torch.testing.assert_close(terms.loss.detach(), run_module(module, batch)[0])
    assert terms.raw_kl.shape == terms.adapted_kl.shape == (B, T)


# -- GRPOTrainer(loss_class=...) ----------------------------------------------------------------------
MAX_COMPLETION = 6


def grpo_config(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=4, num_generations=4,
        max_completion_length=MAX_COMPLETION, max_steps=3, logging_steps=1, learning_rate=5e-3, beta=0.04, save_strategy="no", seed=0,
    )  # fmt: skip
    base.update(overrides)
    return GRPOConfig(**base)


def make_trainer(checkpoint, tmp_path, loss_class=AdaptiveFusedLinearGRPOLoss, **overrides):
    return GRPOTrainer(
        model=checkpoint,
        reward_funcs=[toy.format_reward, toy.correctness_reward],
        args=grpo_config(tmp_path, **overrides),
        train_dataset=toy.prompt_dataset(64),
        loss_class=loss_class,
    )


def loss_inputs(trainer, seed=0, batch=4, prompt=3, completion=MAX_COMPLETION):
    """As tests/backends/test_trl.py: variable lengths (one all-masked row), policy far from ref and old."""
    g = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    completion_mask = torch.ones(batch, completion, dtype=torch.long)
    for i, length in enumerate([completion, 3, 1, 0][:batch]):
        completion_mask[i, length:] = 0
    return {
        "prompt_ids": torch.randint(5, vocab, (batch, prompt), generator=g),
        "prompt_mask": torch.ones(batch, prompt, dtype=torch.long),
        "completion_ids": torch.randint(5, vocab, (batch, completion), generator=g),
        "completion_mask": completion_mask,
        "advantages": torch.randn(batch, generator=g),
        "old_per_token_logps": -torch.rand(batch, completion, generator=g) * 3 - 2,
        "ref_per_token_logps": -torch.rand(batch, completion, generator=g) * 6,
        "num_items_in_batch": completion_mask.sum().float() * 3,  # the generation batch spans several micro-batches
    }


@pytest.fixture(scope="module")
def loss_class_trainer(tiny_checkpoint, tmp_path_factory):
    t = make_trainer(tiny_checkpoint, tmp_path_factory.mktemp("liger"))
    t.model.train()
    return t


def configure(trainer, loss_type, method, loss_class=AdaptiveFusedLinearGRPOLoss, **fields):
    """Point the trainer at another loss type / method and rebuild its runtime and loss module."""
    from unsloth_adaptive_kl.backends import loss_class as liger

    for name, value in dict(loss_type=loss_type, kl_adaptation_method=method, **fields).items():
        setattr(trainer.args, name, value)
    trainer.loss_type = loss_type
    trainer.epsilon_high = trainer.args.epsilon_high if trainer.args.epsilon_high is not None else trainer.args.epsilon
    trainer._adaptive_kl = trl_backend.TRLAdaptiveKL(trainer)
    trainer.beta = trainer._adaptive_kl.beta
    trainer._adaptive_loss_module = liger.make_loss_module(trainer, loss_class)


def loss_and_grads(trainer, inputs):
    trainer.model.zero_grad(set_to_none=True)
    loss = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in trainer.model.parameters() if p.grad is not None]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("method", [*reference.ACCUMULATION_METHODS, "clip+sigmoid+length_normalized"])
def test_loss_class_matches_trl_loss_and_grads(loss_class_trainer, monkeypatch, loss_type, method):
    trainer = loss_class_trainer
    configure(trainer, loss_type, method, beta=0.3, beta_min=0.01, kl_clip_threshold=0.4, kl_target=0.2, use_bias_correction_kl=True, epsilon_high=5.0 if loss_type == "cispo" else None)
    trainer.current_gradient_accumulation_steps = 2
    monkeypatch.setattr(trainer.args, "steps_per_generation", 2)
    inputs = loss_inputs(trainer, seed=1)
    calls = []
    with monkeypatch.context() as spy:
        spy.setattr(trainer, "_get_per_token_logps_and_entropies", lambda *a, **k: calls.append(1))
        loss_module, grads_module = loss_and_grads(trainer, inputs)
    assert not calls  # TRL's per-token path was not used
    assert trainer._adaptive_loss_module.head_path == ("log-prob kernel" if loss_type == "vespo" else "fused")  # the default: fused where exact
    module, trainer._adaptive_loss_module = trainer._adaptive_loss_module, None
    try:
        loss_trl, grads_trl = loss_and_grads(trainer, inputs)
    finally:
        trainer._adaptive_loss_module = module
    torch.testing.assert_close(loss_module, loss_trl, atol=1e-6, rtol=1e-5)
    assert len(grads_module) == len(grads_trl) > 0
    for a, b in zip(grads_module, grads_trl):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("value, setting", [("auto", "auto"), (False, False), ("false", False), (True, True)])
def test_the_liger_fused_head_field_sets_the_module_path(loss_class_trainer, value, setting):
    trainer = loss_class_trainer
    configure(trainer, "dapo", "none", liger_fused_head=value, epsilon_high=None)
    trainer.current_gradient_accumulation_steps = 1
    assert trainer._adaptive_loss_module.fused_head == setting
    loss_and_grads(trainer, loss_inputs(trainer))
    assert trainer._adaptive_loss_module.head_path == ("log-prob kernel" if setting is False else "fused")


@pytest.mark.parametrize("loss_type", [t for t in TOKEN_LEVEL_ONLY if t in LOSS_TYPES])
def test_a_loss_class_trainer_liger_cannot_run_is_refused_when_it_is_made(loss_class_trainer, monkeypatch, loss_type):
    """Liger refuses sequence-level importance sampling for these loss types at each call: before, the trainer was made
    and its first training step raised. Now making its loss module does (as for top_entropy_quantile, kl_monitor)."""
    monkeypatch.setattr(loss_class_trainer, "importance_sampling_level", "sequence")
    monkeypatch.setattr(loss_class_trainer.args, "importance_sampling_level", "sequence")
    for loss_class in (AdaptiveFusedLinearGRPOLoss, LigerFusedLinearGRPOLoss):
        with pytest.raises(ValueError, match=f"Sequence-level importance sampling is not supported for loss_type='{loss_type}'"):
            configure(loss_class_trainer, loss_type, "none", loss_class=loss_class, epsilon_high=None)


@pytest.mark.parametrize("loss_class", [None, LigerFusedLinearGRPOLoss, AdaptiveFusedLinearGRPOLoss])
def test_liger_fused_head_set_where_no_module_reads_it_is_warned(tiny_checkpoint, tmp_path, caplog, loss_class):
    """liger_fused_head is read only by our loss_class module: set under TRL's own loss or Liger's own class, it has
    no effect, and the trainer says so once when it is made (before, nothing was said)."""
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        make_trainer(tiny_checkpoint, tmp_path, loss_class=loss_class, liger_fused_head=False)
    said = [r.getMessage() for r in caplog.records if "liger_fused_head" in r.getMessage()]
    if loss_class is AdaptiveFusedLinearGRPOLoss:
        assert said == []
    else:
        whose = "its backend's own (no loss_class)" if loss_class is None else "Liger's own class, which has none"
        assert said == ["unsloth_adaptive_kl: liger_fused_head=False has no effect: it sets the fused LM head of "
                        f"GRPOTrainer(loss_class=AdaptiveFusedLinearGRPOLoss), and this trainer's loss is {whose}"]


def test_liger_own_class_as_loss_class_matches_trl(loss_class_trainer):
    trainer = loss_class_trainer
    configure(trainer, "luspo", "none", loss_class=LigerFusedLinearGRPOLoss, beta=0.3, kl_estimator="k3", use_bias_correction_kl=True, epsilon_high=None)
    trainer._adaptive_loss_module.compiled = False
    trainer.current_gradient_accumulation_steps = 1
    inputs = loss_inputs(trainer, seed=2)
    loss_liger, grads_liger = loss_and_grads(trainer, inputs)
    module, trainer._adaptive_loss_module = trainer._adaptive_loss_module, None
    try:
        loss_trl, grads_trl = loss_and_grads(trainer, inputs)
    finally:
        trainer._adaptive_loss_module = module
    torch.testing.assert_close(loss_liger, loss_trl, atol=1e-6, rtol=1e-5)
    for a, b in zip(grads_liger, grads_trl):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_invalid_loss_class_raises_a_clear_type_error(loss_class_trainer):
    from unsloth_adaptive_kl.backends import loss_class as liger

    class NoLigerForward(torch.nn.Module):
        def __init__(self, **kwargs):
            super().__init__()

        def forward(self, logits, labels):
            return logits

    for bad in (AdaptiveFusedLinearGRPOLoss(), "AdaptiveFusedLinearGRPOLoss", dict, NoLigerForward):
        with pytest.raises(TypeError, match="loss_class=.*(not an nn.Module class|does not accept)"):
            liger.make_loss_module(loss_class_trainer, bad)


def test_liger_own_class_with_an_adaptive_method_is_refused(loss_class_trainer):
    with pytest.raises(ValueError, match="fixed k3 KL"):
        configure(loss_class_trainer, "dapo", "clip", loss_class=LigerFusedLinearGRPOLoss, beta=0.04)


def logged_metrics(trainer, compute_loss, inputs) -> dict:
    """The metrics one ``compute_loss`` call appends (the trainer's metrics cleared first)."""
    trainer._metrics["train"].clear()
    compute_loss(trainer, trainer.model, inputs)
    return {name: list(values) for name, values in trainer._metrics["train"].items()}


@pytest.mark.parametrize("method", ["none", "clip+sigmoid+length_normalized"])
@pytest.mark.parametrize("case", ["no valid token", "a NaN KL on a valid token"])
def test_loss_class_logs_trls_kl_as_stock_trl_for_a_micro_batch_without_a_valid_token(loss_class_trainer, method, case):
    """TRL's ``kl`` is sum / max(tokens, 1) over all processes: 0 for a micro-batch whose completions
    are all masked (the path appended NaN there), and still NaN when a valid token's KL is NaN. The
    reference is stock TRL's own ``_compute_loss`` on the same input. The adaptive_kl/* KL metrics
    observed no token: they get no entry (never a NaN), and current_beta is still logged."""
    trainer = loss_class_trainer
    configure(trainer, "grpo", method, beta=0.3, kl_clip_threshold=0.4, kl_target=0.2, epsilon_high=None)
    trainer.current_gradient_accumulation_steps = 1
    inputs = loss_inputs(trainer, seed=3)
    if case == "no valid token":
        inputs["completion_mask"] = torch.zeros_like(inputs["completion_mask"])
        inputs["num_items_in_batch"] = torch.tensor(12.0)  # the generation batch's other micro-batches have tokens
    else:
        inputs["ref_per_token_logps"][0, 0] = math.nan
    stock = logged_metrics(trainer, trl_backend.original(GRPOTrainer, "_compute_loss"), inputs)
    ours = logged_metrics(trainer, GRPOTrainer._compute_loss, inputs)
    assert len(stock["kl"]) == len(ours["kl"]) == 1
    if case == "no valid token":
        assert ours["kl"] == stock["kl"]
        assert ours.get("adaptive_kl/raw_kl", []) == ours.get("adaptive_kl/adapted_kl", []) == []
    else:
        assert math.isnan(stock["kl"][0]) and math.isnan(ours["kl"][0])  # a broken KL is not hidden as 0
    assert ours["adaptive_kl/current_beta"] == [0.3]
    assert not any(math.isnan(v) for name, values in ours.items() if name.startswith("adaptive_kl/") for v in values)


METHODS = reference.METHODS


@pytest.mark.parametrize("method", METHODS)
def test_loss_class_trains_end_to_end_logging_metrics_and_beta_trajectory(tiny_checkpoint, tmp_path, method):
    # two completions of one prompt per step: the claims hold for any group, and a step's cost on CPU goes with its
    # tokens (TRL's log-prob kernel runs interpreted)
    overrides = dict(kl_adaptation_method=method, **reference.training_settings(), kl_clip_threshold=0.05, learning_rate=2e-2, per_device_train_batch_size=2, num_generations=2)
    trainer = make_trainer(tiny_checkpoint, tmp_path, **overrides)
    assert isinstance(trainer._adaptive_loss_module, AdaptiveFusedLinearGRPOLoss)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [h for h in trainer.state.log_history if unsloth_adaptive_kl.CURRENT_BETA in h]
    assert len(logs) == 3
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    betas = [h[unsloth_adaptive_kl.CURRENT_BETA] for h in logs]
    for h in logs:
        assert math.isfinite(h[unsloth_adaptive_kl.RAW_KL]) and math.isfinite(h[unsloth_adaptive_kl.ADAPTED_KL])
        assert h[unsloth_adaptive_kl.RAW_KL] == pytest.approx(h["kl"], rel=1e-6)
    # dynamic: the reward is always above its threshold, so beta decays at every optimizer step
    assert betas == pytest.approx(reference.expected_betas(method, logs, completions=2), rel=1e-9)
    if method in ("clip", "soft_clip"):
        assert all(h[unsloth_adaptive_kl.ADAPTED_KL] <= 0.05 + 1e-9 for h in logs)
    if method == "none":
        assert all(h[unsloth_adaptive_kl.ADAPTED_KL] == h[unsloth_adaptive_kl.RAW_KL] for h in logs)


def test_a_method_registered_outside_the_package_runs_in_the_module_and_through_loss_class(tiny_checkpoint, tmp_path, half_kl):
    batch = make_batch(seed=1)
    halved = AdaptiveFusedLinearGRPOLoss(**liger_kwargs("dapo", beta=0.3, compiled=False), kl_adaptation_method="half_kl")
    unshaped = reference_kl_part(batch, module_logps(halved, batch), beta=0.3, estimator="k3")
    assert kl_part(halved, batch).item() == pytest.approx(0.5 * unshaped.item(), rel=1e-5, abs=1e-8) and unshaped.item() > 1e-3
    trainer = make_trainer(tiny_checkpoint, tmp_path, kl_adaptation_method="half_kl", max_steps=2, learning_rate=2e-2)
    trainer.train()
    logs = [h for h in trainer.state.log_history if unsloth_adaptive_kl.CURRENT_BETA in h]
    assert len(logs) == 2 and logs[-1][unsloth_adaptive_kl.RAW_KL] > 0
    for h in logs:
        assert h[unsloth_adaptive_kl.ADAPTED_KL] == pytest.approx(0.5 * h[unsloth_adaptive_kl.RAW_KL], rel=1e-6)


def test_example_subclass_overriding_only_the_kl_trains(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import custom_kl_variant
    finally:
        sys.path.pop(0)
    trainer = custom_kl_variant.train(str(tmp_path), steps=2, method="none")
    assert type(trainer._adaptive_loss_module) is custom_kl_variant.SymmetricKLLoss
    logs = [h for h in trainer.state.log_history if unsloth_adaptive_kl.RAW_KL in h]
    assert len(logs) == 2
    # the override is what the metrics measure: cosh(r) - 1 on the logged batch is not k3
    batch = make_batch(seed=6)
    variant = custom_kl_variant.SymmetricKLLoss(**liger_kwargs("dapo", beta=0.3, compiled=False))
    logps = module_logps(variant, batch).double()
    r = batch["ref_per_token_logps"].double() - logps
    mask = batch["attention_mask"].bool()
    expected = 0.3 * torch.where(mask, torch.cosh(r) - 1, torch.zeros_like(r)).sum() / mask.sum()
    assert kl_part(variant, batch).item() == pytest.approx(expected.item(), rel=1e-5)


def test_bench_smoke_runs_on_cpu(monkeypatch, capsys):
    """Every path of ``bench_liger.py --smoke`` runs (forward and backward, TRITON_INTERPRET=1) and the table is printed.
    In this process, each path timed once (no warm-up): the smoke's 1 + 2 calls per path ran the same code three times;
    and on half the smoke's tokens (2 x 16 instead of 4 x 16): the interpreted kernels' time goes with the tokens, and
    the smoke's second tile (16x128) still splits both the tokens (2 tiles) and the 300-wide vocabulary (3 tiles)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import bench_liger

    parse_args = bench_liger.parse_args

    def one_call_per_path(argv=None):
        args = parse_args(argv)
        assert args.smoke and (args.warmup, args.iters) == (1, 2)  # the smoke's own settings, replaced below
        assert (args.tokens, args.seq_len, args.vocab, args.tiles[1]) == (64, 16, 300, (16, 128))
        args.warmup, args.iters, args.tokens = 0, 1, 32
        return args

    monkeypatch.setattr(bench_liger, "parse_args", one_call_per_path)
    assert bench_liger.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "| path |" in out and "AdaptiveFusedLinearGRPOLoss (dynamic+length_normalized, log-prob kernel)" in out


@pytest.mark.parametrize("method", ["dynamic", "ziegler", "dynamic+clip", "ziegler+length_normalized", "sigmoid+dynamic"])
def test_a_standalone_module_refuses_a_beta_controller_it_could_not_run(method):
    """The message's "allowed" names what is allowed (none and the shaping methods), and names the controllers as what is
    not (it once listed the controllers as the allowed methods)."""
    from unsloth_adaptive_kl.controllers import controller_names
    from unsloth_adaptive_kl.shaping import shaping_names

    with pytest.raises(ValueError, match=r"kl_adaptation_method='.*' is not valid for a standalone AdaptiveFusedLinearGRPOLoss.*allowed") as caught:
        AdaptiveFusedLinearGRPOLoss(beta=0.1, compiled=False, kl_adaptation_method=method)
    allowed = str(caught.value).split("allowed: ", 1)[1]
    named, refused = allowed.split("none of the β controllers (", 1)
    assert named.startswith("'none' or shaping methods joined with '+' (") and all(repr(n) in named for n in shaping_names())
    assert not any(repr(n) in named for n in controller_names())
    assert refused.startswith(", ".join(repr(n) for n in controller_names()) + ")")


@pytest.mark.parametrize("method", ["none", "clip", "sigmoid+length_normalized"])
def test_a_standalone_module_accepts_methods_without_a_controller(method):
    assert AdaptiveFusedLinearGRPOLoss(beta=0.1, compiled=False, kl_adaptation_method=method).adaptive_kl.controller.name == "fixed"


def test_a_module_given_a_state_uses_its_controller_and_refuses_a_second_set_of_kl_settings():
    import types

    from unsloth_adaptive_kl.config import DEFAULTS

    state = unsloth_adaptive_kl.AdaptiveKL(types.SimpleNamespace(**{**DEFAULTS, "kl_adaptation_method": "dynamic+clip", "beta": 0.1}))
    module = AdaptiveFusedLinearGRPOLoss(beta=0.1, compiled=False, adaptive_kl=state)
    assert module.adaptive_kl is state and state.controller.name == "dynamic"
    with pytest.raises(ValueError, match=r"\['kl_target'\] given together with adaptive_kl="):
        AdaptiveFusedLinearGRPOLoss(beta=0.1, compiled=False, adaptive_kl=state, kl_target=0.3)
    # A field passed at its default value would be overridden by the state's just as silently.
    with pytest.raises(ValueError, match=r"\['kl_adaptation_method'\] given together with adaptive_kl="):
        AdaptiveFusedLinearGRPOLoss(compiled=False, adaptive_kl=state, kl_adaptation_method=DEFAULTS["kl_adaptation_method"])


def test_a_module_beta_is_its_state_controller_beta():
    module = AdaptiveFusedLinearGRPOLoss(**liger_kwargs("dapo", beta=0.3, compiled=False))
    assert module.beta == module.adaptive_kl.controller.beta == 0.3
    module.beta = 0.7
    assert module.adaptive_kl.controller.beta == 0.7
    shared = AdaptiveFusedLinearGRPOLoss(compiled=False, adaptive_kl=module.adaptive_kl)  # as loss_class= builds it
    module.beta = 0.2
    assert shared.beta == 0.2
    with pytest.raises(ValueError, match=r"\['beta'\] given together with adaptive_kl="):
        AdaptiveFusedLinearGRPOLoss(beta=0.9, compiled=False, adaptive_kl=module.adaptive_kl)
    # β passed at Liger's default (0.04) while the state's is 0.2: refused too, not silently the state's.
    with pytest.raises(ValueError, match=r"\['beta'\] given together with adaptive_kl="):
        AdaptiveFusedLinearGRPOLoss(beta=0.04, compiled=False, adaptive_kl=module.adaptive_kl)
    assert AdaptiveFusedLinearGRPOLoss(beta=0.2, compiled=False, adaptive_kl=module.adaptive_kl).beta == 0.2


# -- user code in a standalone module (issue 39): no trainer reads the metric sums -------------------------------
def power(kl):
    """kl ** 1.5: finite on the check at creation (KL >= 0), NaN on k1's negative values."""
    return kl**1.5


def shaky(logp, ref):
    """An estimator NaN for log-probs below -3.5: finite on the check at creation (log-probs in [-3, 0])."""
    return (logp - ref) * torch.sqrt(logp + 3.5)


def k1_of(module, batch):
    from unsloth_adaptive_kl.backends.liger import selected_token_logps

    with torch.no_grad():
        logps = selected_token_logps(batch["_input"], batch["lin_weight"], batch["bias"], batch["selected_token_ids"], batch["attention_mask"], module.temperature)
    valid = batch["attention_mask"].bool()
    return logps[valid], (logps - batch["ref_per_token_logps"])[valid]


@pytest.mark.parametrize("compiled", [False, True])
def test_a_standalone_module_refuses_a_user_shaping_nan_on_a_finite_kl_by_name(compiled, light_compile, user_shaping):
    """Before: the NaN reached the returned loss and kl_mean, unnamed. The count is made outside the compiled loss."""
    user_shaping("power", power)
    module = AdaptiveFusedLinearGRPOLoss(**liger_kwargs("dapo", compiled=compiled), kl_adaptation_method="power", kl_estimator="k1")
    batch = make_batch()
    _, k1 = k1_of(module, batch)
    assert (k1 < 0).any() and (k1 > 0).any()  # the batch has tokens where kl ** 1.5 is NaN
    with pytest.raises(ValueError, match=r"shaping method 'power' returned NaN or inf on valid tokens whose KL was finite \(%d of them\)" % int((k1 < 0).sum())):
        module(**batch)
    user_shaping("halve", lambda kl: kl * 0.5)
    finite = AdaptiveFusedLinearGRPOLoss(**liger_kwargs("dapo", compiled=compiled), kl_adaptation_method="halve", kl_estimator="k1")
    assert torch.isfinite(finite(**batch)[0])  # a finite method passes
    batch["ref_per_token_logps"][0, 0] = math.nan  # the model's NaN: not the method's fault (the loss is NaN, as stock)
    user_shaping("power_of_abs", lambda kl: kl.abs() ** 1.5)
    assert torch.isnan(AdaptiveFusedLinearGRPOLoss(**liger_kwargs("dapo", compiled=compiled), kl_adaptation_method="power_of_abs", kl_estimator="k1")(**batch)[0])


@pytest.mark.parametrize("compiled", [False, True])
def test_a_standalone_module_refuses_a_user_estimator_nan_on_finite_log_probs_by_name(compiled, light_compile):
    unsloth_adaptive_kl.register_estimator("shaky")(shaky)
    try:
        module = AdaptiveFusedLinearGRPOLoss(**liger_kwargs("dapo", compiled=compiled), kl_estimator="shaky")
        batch = make_batch()
        logps, _ = k1_of(module, batch)
        assert (logps < -3.5).any()
        with pytest.raises(ValueError, match=r"KL estimator 'shaky' returned NaN or inf on valid tokens whose log-probs were finite \(%d of them\)" % int((logps < -3.5).sum())):
            module(**batch)
    finally:
        unsloth_adaptive_kl.unregister_estimator("shaky")


def test_on_a_gpu_the_standalone_check_reads_the_count_at_a_later_call_once_its_copy_finished(monkeypatch, user_shaping):
    """The GPU path, with the device parts replaced (no GPU here): the count of a call is copied without waiting and
    read at the first later call whose copy has finished; the error says so. The copy itself: tests/gpu."""
    from unsloth_adaptive_kl.backends import liger

    class Event:
        finished = False

        def record(self, stream=None):
            pass

        def query(self):
            return Event.finished

    monkeypatch.setattr(liger, "_reads_later", lambda count: True)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    user_shaping("power", power)
    module = AdaptiveFusedLinearGRPOLoss(**liger_kwargs("dapo", compiled=False), kl_adaptation_method="power", kl_estimator="k1")
    batch = make_batch()
    module(**batch)  # the NaN call: no host read
    module(**batch)  # its copy is not finished: nothing read, nothing lost
    assert len(module._pending_faults) == 2
    Event.finished = True
    with pytest.raises(ValueError, match=r"shaping method 'power' returned NaN or inf .* \(counted in an earlier call of this module on the GPU"):
        module(**batch)
    assert len(module._pending_faults) == 1  # the second call's count, read at the next call


def test_the_standalone_user_shaping_check_adds_no_graph_when_beta_changes_every_call(light_compile, user_shaping):
    from torch._dynamo.utils import counters

    user_shaping("halve", lambda kl: kl * 0.5)
    module = AdaptiveFusedLinearGRPOLoss(**liger_kwargs("dapo", compiled=True), kl_adaptation_method="halve")
    batch = make_batch()
    counters.clear()
    for call, beta in enumerate((0.1, 0.2, 0.35, 0.05)):
        module.beta = beta
        run_module(module, batch)
        if call == 0:
            graphs_after_first_call = counters["stats"]["unique_graphs"]
    assert graphs_after_first_call > 0 and counters["stats"]["unique_graphs"] == graphs_after_first_call
