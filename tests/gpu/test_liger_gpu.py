"""Liger module on a GPU (issue 22): no recompiles after the first two calls of a realistic loop through
inductor (bf16, lengths 300-1030, num_items_in_batch an int and a tensor in turn, β changing), and the
fused LM head against the log-prob-kernel path in bf16 (the real Triton kernels), both against float32
materialised logits. Skipped without CUDA.

    export PYTHONPATH=$PWD/.gpu-site:$PWD; python -m pytest -q -s tests/gpu/test_liger_gpu.py
"""

import os
import sys
import types

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
import recompile_loop  # noqa: E402

from unsloth_adaptive_kl.adaptation import AdaptiveKL  # noqa: E402
from unsloth_adaptive_kl.backends.liger import AdaptiveFusedLinearGRPOLoss  # noqa: E402
from unsloth_adaptive_kl.config import DEFAULTS  # noqa: E402

LOOP = dict(calls=6, batch=8, lengths=(300, 1030), hidden=1024, vocab=32000, dtype="bfloat16", device="cuda", num_items="mixed", backend=None)


@pytest.fixture(autouse=True)
def clean_dynamo():
    """Every module compiles the same function: a clean state per test keeps it under the recompile limit."""
    torch._dynamo.reset()
    yield


def test_no_graph_after_the_first_two_calls_of_a_realistic_loop():
    """A subset (bench/bench_liger.py --recompile-loop runs every loss type × method × head)."""
    results = recompile_loop.grid(
        LOOP, loss_types=("grpo", "dapo"), methods=("none", "clip+sigmoid+length_normalized"),
        workers=int(os.environ.get("UAKL_LOOP_WORKERS", "8")),
    )  # fmt: skip
    print("\n" + recompile_loop.table(results))
    bad = [(r["loss_type"], r["method"], r["head"], r["graphs"], r["reasons"][-2:]) for r in results if recompile_loop.after_warmup(r)]
    assert not bad, bad
    assert all(r["graphs"][0] >= 1 and r["head_path"] == r["head"] for r in results)


def make_batch(seed=0, batch=4, length=512, hidden=1024, vocab=32000):
    g = torch.Generator().manual_seed(seed)
    valid = torch.randint(1, length + 1, (batch,), generator=g)
    valid[0] = length
    return dict(
        _input=(torch.randn(batch, length, hidden, generator=g) * 0.5).cuda().bfloat16(),
        lin_weight=(torch.randn(vocab, hidden, generator=g) / hidden**0.5).cuda().bfloat16(),
        selected_token_ids=torch.randint(0, vocab, (batch, length), generator=g).cuda(),
        attention_mask=(torch.arange(length)[None] < valid[:, None]).long().cuda(),
        advantages=torch.randn(batch, generator=g).cuda(),
        ref_per_token_logps=(-torch.rand(batch, length, generator=g) * 2 - 9).cuda(),
        old_per_token_logps=(-torch.rand(batch, length, generator=g) * 2 - 9).cuda(),
        num_items_in_batch=torch.tensor(3000.0).cuda(),
    )


def run(module, batch, materialise=False):
    hidden, weight = (batch[k].clone().requires_grad_(True) for k in ("_input", "lin_weight"))
    rest = {k: v for k, v in batch.items() if k not in ("_input", "lin_weight")}
    if materialise:  # float32 logits: the reference
        logps = torch.log_softmax(hidden.float() @ weight.float().t(), -1).gather(-1, rest["selected_token_ids"].unsqueeze(-1)).squeeze(-1)
        keys = ("ref_per_token_logps", "old_per_token_logps", "num_items_in_batch")
        loss = module.loss_from_logps(logps, rest["attention_mask"], rest["advantages"], **{k: rest[k] for k in keys}).loss
    else:
        loss = module(hidden, weight, **rest)[0]
    loss.backward()
    return loss.detach().float(), hidden.grad.float(), weight.grad.float()


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo"])
@pytest.mark.parametrize("method", ["none", "ziegler+clip+sigmoid+length_normalized"])
def test_fused_head_matches_the_log_prob_kernel_path_in_bf16(loss_type, method):
    fields = {**DEFAULTS, "kl_adaptation_method": method, "beta": 0.1}

    def module(fused):
        return AdaptiveFusedLinearGRPOLoss(
            beta=0.1, loss_type=loss_type, max_completion_length=512, use_bias_correction_kl=True, fused_head=fused,
            adaptive_kl=AdaptiveKL(types.SimpleNamespace(**fields)),
        )  # fmt: skip

    batch = make_batch()
    torch._dynamo.reset()
    fused, kernel, reference = run(module(True), batch), run(module(False), batch), run(module(False), batch, materialise=True)
    for name, a, b, r in zip(("loss", "grad hidden", "grad weight"), fused, kernel, reference):
        err_fused, err_kernel = ((a - r).norm() / r.norm()).item(), ((b - r).norm() / r.norm()).item()
        print(f"{loss_type} {method} {name}: relative error vs float32 logits: fused {err_fused:.2e}, kernel {err_kernel:.2e}")
        assert err_fused <= max(2 * err_kernel, 1e-2), (name, err_fused, err_kernel)  # bf16 tolerance: no worse than the kernel path


def test_a_standalone_module_names_a_user_shaping_nan_one_call_late_without_a_host_sync():
    """On a GPU the count of a user shaping step's NaN is copied to the host without waiting and read at a later call
    (tests/backends/test_liger.py fakes the device parts on CPU). k1 is negative on about half the tokens here
    (reference log-probs around the policy's), where kl ** 1.5 is NaN."""
    import unsloth_adaptive_kl

    unsloth_adaptive_kl.register_shaping("power_gpu")(lambda kl: kl**1.5)
    try:
        module = AdaptiveFusedLinearGRPOLoss(beta=0.1, loss_type="dapo", kl_adaptation_method="power_gpu", kl_estimator="k1")
        batch = make_batch(vocab=512)
        batch["ref_per_token_logps"] = batch["old_per_token_logps"] = torch.full_like(batch["ref_per_token_logps"], -6.2)
        loss = run(module, batch)[0]  # no error: the count is not read at this call
        assert torch.isnan(loss) and len(module._pending_faults) == 1
        torch.cuda.synchronize()  # the copy has finished: the next call reads it
        with pytest.raises(ValueError, match=r"shaping method 'power_gpu' returned NaN or inf .* \(counted in an earlier call of this module on the GPU"):
            run(module, batch)
    finally:
        unsloth_adaptive_kl.unregister_shaping("power_gpu")
