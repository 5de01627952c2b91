"""Graphs compiled per call of the compiled Liger module in a realistic training loop (issue 22).

In training every call of the loss brings a new completion length (the longest completion of the
micro-batch), new valid-token counts, a new ``num_items_in_batch`` (an int or a tensor, depending
on the caller) and, with a β controller, a new β. A compiled loss that specialises on any of them
recompiles at every step (and stops compiling at ``torch._dynamo.config.recompile_limit``).
:func:`graphs_per_call` runs a module through such a loop and counts the graphs dynamo compiles
in each call (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``), with the recompilation
reasons dynamo logs; :func:`grid` does it for every loss type × method × LM-head path, each
configuration from a clean dynamo state, in worker processes (compilation is CPU work).

Used by ``bench/bench_liger.py --recompile-loop`` (the table), tests/backends/test_liger.py (CPU)
and tests/gpu/test_liger_gpu.py (GPU).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import types
import warnings

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
HEADS = ("log-prob kernel", "fused")
NUM_ITEMS = ("int", "tensor", "none", "mixed")  # mixed: an int and a tensor in turn
ACCUMULATION = 3  # num_items_in_batch counts the tokens of this many micro-batches (gradient accumulation)


def loop_batches(calls: int, *, batch: int, lengths: tuple[int, int], hidden: int, vocab: int, dtype, device, num_items: str = "mixed", seed: int = 0):
    """What a training loop gives the loss in ``calls`` successive calls: a new padded length T (uniform in
    ``lengths``, distinct while the range lasts; the first two calls at its ends), completion lengths in ``[1, T]`` with one at T,
    new hidden states, token ids, advantages, old and reference log-probs, ``num_items_in_batch``
    (``ACCUMULATION`` × this micro-batch's valid tokens, as ``num_items`` says) and β."""
    if num_items not in NUM_ITEMS:
        raise ValueError(f"num_items={num_items!r} is not valid; allowed: {list(NUM_ITEMS)}")
    g = torch.Generator().manual_seed(seed)
    low, high = lengths
    inner = (low + 1 + torch.randperm(max(1, high - low - 1), generator=g)).tolist()  # distinct while they last
    for call in range(calls):
        length = (high, low)[call] if call < 2 else inner[(call - 2) % len(inner)]
        valid = torch.randint(1, length + 1, (batch,), generator=g)
        valid[int(torch.randint(0, batch, (1,), generator=g))] = length
        mask = (torch.arange(length)[None, :] < valid[:, None]).long()
        count = ACCUMULATION * int(mask.sum())
        as_tensor = num_items == "tensor" or (num_items == "mixed" and call % 2 == 1)
        yield dict(
            hidden=(torch.randn(batch, length, hidden, generator=g) * 0.5).to(device, dtype).requires_grad_(True),
            ids=torch.randint(0, vocab, (batch, length), generator=g).to(device),
            mask=mask.to(device),
            advantages=torch.randn(batch, generator=g).to(device),
            ref=(-torch.rand(batch, length, generator=g) * 2).to(device),
            old=(-torch.rand(batch, length, generator=g) * 2).to(device),
            num_items=None if num_items == "none" else torch.tensor(count, device=device) if as_tensor else count,
            beta=0.04 * (0.5 + float(torch.rand((), generator=g))),
        )


@contextlib.contextmanager
def recompile_reasons():
    """A list filled with the recompilation reasons dynamo logs inside (its ``recompiles`` log artifact)."""
    reasons: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            reasons.append(record.getMessage())

    logger, handler = logging.getLogger("torch._dynamo.guards.__recompiles"), Collect()
    torch._logging.set_logs(recompiles=True)
    logger.addHandler(handler)
    try:
        yield reasons
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()


def graphs_per_call(module, weight, batches) -> tuple[list[int], list[str], list[float]]:
    """Run ``module`` (Liger's forward) and backward on each of ``batches``; return the graphs compiled in each
    call, the recompilation reasons, and each call's wall time (s). The recompile limit raises here instead of
    silently running the rest uncompiled, which would count as 0 graphs."""
    from torch._dynamo.utils import counters

    graphs, seconds = [], []
    cuda = weight.is_cuda
    with recompile_reasons() as reasons, torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fused head's fallback warnings (vespo) are not what is counted
        for x in batches:
            module.beta = x["beta"]
            before, start = counters["stats"]["unique_graphs"], time.perf_counter()
            loss, _ = module(x["hidden"], weight, x["ids"], x["mask"], x["advantages"], ref_per_token_logps=x["ref"],
                             old_per_token_logps=x["old"], num_items_in_batch=x["num_items"])  # fmt: skip
            loss.backward()
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
            graphs.append(counters["stats"]["unique_graphs"] - before)
            weight.grad = None
    return graphs, reasons, seconds


def make_module(loss_type: str, method: str, head: str, *, estimator: str = "k3", max_completion_length: int = 1024):
    """A compiled module for the loop, with the KL state a trainer would pass (a standalone module refuses a
    β controller); ``head``: one of ``HEADS``."""
    from unsloth_adaptive_kl.adaptation import AdaptiveKL
    from unsloth_adaptive_kl.backends.liger import AdaptiveFusedLinearGRPOLoss
    from unsloth_adaptive_kl.config import DEFAULTS

    if head not in HEADS:
        raise ValueError(f"head={head!r} is not valid; allowed: {list(HEADS)}")
    state = AdaptiveKL(types.SimpleNamespace(**{**DEFAULTS, "kl_adaptation_method": method, "kl_estimator": estimator, "beta": 0.04}))
    return AdaptiveFusedLinearGRPOLoss(
        compiled=True, loss_type=loss_type, max_completion_length=max_completion_length, use_bias_correction_kl=True,
        adaptive_kl=state, fused_head=head == "fused",
    )  # fmt: skip


def run_case(case: dict) -> dict:
    """One configuration from a clean dynamo state: ``case`` has loss_type, method, head, calls, batch, lengths,
    hidden, vocab, dtype (name), device, num_items, backend (None: inductor) and estimator."""
    dtype = getattr(torch, case["dtype"])
    device = torch.device(case["device"])
    torch._dynamo.reset()
    module = make_module(case["loss_type"], case["method"], case["head"], estimator=case.get("estimator", "k3"), max_completion_length=case["lengths"][1])
    module_compile = functools.partial(torch.compile, backend=case["backend"]) if case.get("backend") else torch.compile
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(case["vocab"], case["hidden"], generator=g) / case["hidden"] ** 0.5).to(device, dtype).requires_grad_(True)
    batches = loop_batches(
        case["calls"], batch=case["batch"], lengths=tuple(case["lengths"]), hidden=case["hidden"], vocab=case["vocab"],
        dtype=dtype, device=device, num_items=case.get("num_items", "mixed"),
    )  # fmt: skip
    with _compile_as(module_compile):
        graphs, reasons, seconds = graphs_per_call(module, weight, batches)
    return {**case, "graphs": graphs, "reasons": reasons, "seconds": seconds, "head_path": module.head_path}


@contextlib.contextmanager
def _compile_as(compile_function):
    """``torch.compile`` replaced by ``compile_function`` inside (a cheaper backend on CPU)."""
    original = torch.compile
    torch.compile = compile_function
    try:
        yield
    finally:
        torch.compile = original


def grid(base: dict, *, loss_types=LOSS_TYPES, methods=None, heads=HEADS, workers: int = 1, on_result=None) -> list[dict]:
    """:func:`run_case` for every loss type × method (None: every registered one, ``_common.methods()``) × head;
    ``workers`` > 1: in that many spawned processes.
    ``on_result(result)`` is called as each one comes in (in order), so a run cut short still reports."""
    if methods is None:
        import _common

        methods = _common.methods()
    cases = [dict(base, loss_type=lt, method=m, head=h) for lt in loss_types for m in methods for h in heads]
    results = []

    def collect(iterator):
        for result in iterator:
            results.append(result)
            if on_result is not None:
                on_result(result)
        return results

    if workers <= 1:
        return collect(map(run_case, cases))
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return collect(pool.map(run_case, cases))


def after_warmup(result: dict, warmup_calls: int = 2) -> int:
    """Graphs compiled after the first ``warmup_calls`` calls (the target: 0)."""
    return sum(result["graphs"][warmup_calls:])


def table(results: list[dict]) -> str:
    """One row per loss type and head, one cell per method: ``graphs in calls 1-2 + graphs after``."""
    methods = list(dict.fromkeys(r["method"] for r in results))
    lines = [
        "| loss type | head | " + " | ".join(methods) + " |",
        "|---|---|" + "---|" * len(methods),
    ]
    for key in dict.fromkeys((r["loss_type"], r["head"]) for r in results):
        cells = []
        for m in methods:
            r = next((r for r in results if (r["loss_type"], r["head"], r["method"]) == (*key, m)), None)
            if r is None:
                cells.append("")
                continue
            ran = "" if r["head_path"] == r["head"] else f" (ran {r['head_path']})"
            cells.append(f"{sum(r['graphs'][:2])}+{after_warmup(r)}{ran}")
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
