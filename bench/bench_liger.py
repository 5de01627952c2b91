"""Forward + backward time and peak memory of GRPO losses computed from final hidden states.

Paths, all in one process on the same inputs:

* stock ``LigerFusedLinearGRPOLoss`` (Liger-Kernel 0.8.5, its defaults: compiled, chunk_size=1);
* TRL 1.15's fused LM head: ``trl.kernels.ChunkedLogProbFunction`` on the valid tokens, then the
  elementwise GRPO loss (what ``GRPOTrainer._compute_loss`` does);
* materialised logits: ``log_softmax(hidden @ W.T)``, then the same elementwise loss;
* ``AdaptiveFusedLinearGRPOLoss`` (this package) for each ``kl_adaptation_method`` on the log-prob
  kernel path (``fused_head=False``; ``--tiles``: one set of rows per kernel tile);
* with ``--fused-chunks``, the same with the fused head (its default where exact; the gradient computed
  in the forward, 3 GEMMs), one set of rows per chunk size (``auto``: the module's rule);
  ``--fused-blocks``: one more set per Triton block width.

Time is the median of ``--iters`` forward+backward calls after ``--warmup`` calls; peak memory is
``torch.cuda.max_memory_allocated`` during those calls (inputs and weights included). Prints a
Markdown table with ratios to the TRL fused-head path; the targets for our module are
≤ 1.15× its time and ≤ 1.05× its peak memory.

    python bench/bench_liger.py                      # GPU, B·T=8192, H=4096, V=128256, bf16, dapo, k3
    python bench/bench_liger.py --smoke              # CPU, tiny sizes, < 1 min (TRITON_INTERPRET=1)
    python bench/bench_liger.py --methods none,clip,dynamic,target --fused-chunks auto,2048   # old and new paths
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # TRL's Triton kernel, interpreted on CPU

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

TARGET_TIME, TARGET_MEMORY = 1.15, 1.05


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="B·T")
    parser.add_argument("--seq-len", type=int, default=1024, help="T (B = tokens / T)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--loss-type", default="dapo")
    parser.add_argument("--estimator", default="k3")
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--methods", default="all", help="comma-separated kl_adaptation_method values; all: every method alone, and dynamic+length_normalized")
    tiles_help = ("comma-separated TOKENSxVOCAB tile shapes for the adaptive module's log-prob kernel (TRL's TOKEN_CHUNK_SIZE x "
                  "this package's VOCAB_TILE); each adds rows 'AdaptiveFusedLinearGRPOLoss (METHOD, log-prob kernel, tile TxV)'. "
                  "The first is the default; e.g. 4096x32768,2048x65536,1024x131072 (same buffer, fewer kernel launches)")
    parser.add_argument("--tiles", default="4096x32768", help=tiles_help)
    fused_chunks_help = ("comma-separated token chunk sizes for the module with fused_head=True ('auto': its memory rule); "
                         "each adds rows 'AdaptiveFusedLinearGRPOLoss (METHOD, fused head, chunk C)'. Default: none")
    parser.add_argument("--fused-chunks", default="", help=fused_chunks_help)
    fused_blocks_help = ("comma-separated vocabulary widths per Triton program of the fused head's two passes over the logits "
                         "(default 1024); each adds rows 'AdaptiveFusedLinearGRPOLoss (METHOD, fused head, chunk auto, block K)'")
    parser.add_argument("--fused-blocks", default="", help=fused_blocks_help)
    parser.add_argument("--peak-tflops", type=float, help="bf16 dense peak of the GPU for the GEMM floor (default: from the device name)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, eager (compiled=False)")
    loop_help = ("instead of timing: the realistic loop of bench/recompile_loop.py (compiled module, B 8, H 1024, V 32000, "
                 "lengths 300-1030, num_items_in_batch an int and a tensor in turn, β changing) for every loss type × method × "
                 "head; prints the graphs compiled in calls 1-2 + after them (the target: +0)")
    parser.add_argument("--recompile-loop", action="store_true", help=loop_help)
    parser.add_argument("--loop-calls", type=int, default=8, help="calls per configuration in --recompile-loop")
    parser.add_argument("--loop-workers", type=int, default=8, help="processes compiling configurations in parallel in --recompile-loop")
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.seq_len, args.hidden, args.vocab, args.dtype, args.iters, args.warmup = 64, 16, 32, 300, "fp32", 2, 1
        if args.tiles == "4096x32768":
            args.tiles = "4096x32768,16x128"
        args.fused_chunks = args.fused_chunks or "auto"
    try:
        args.tiles = [tuple(int(n) for n in t.split("x")) for t in args.tiles.split(",")]
        assert all(len(t) == 2 and min(t) > 0 for t in args.tiles)
    except (ValueError, AssertionError):
        parser.error(f"--tiles: {args.tiles!r} is not a list of TOKENSxVOCAB with positive integers")
    chunks = [c.strip() for c in args.fused_chunks.split(",") if c.strip()]
    if not all(c == "auto" or (c.isdigit() and int(c) > 0) for c in chunks):
        parser.error(f"--fused-chunks: {args.fused_chunks!r} is not a list of 'auto' or positive integers")
    args.fused_chunks = [None if c == "auto" else int(c) for c in chunks]
    blocks = [b.strip() for b in args.fused_blocks.split(",") if b.strip()]
    if not all(b.isdigit() and int(b) >= 16 and int(b) & (int(b) - 1) == 0 for b in blocks):
        parser.error(f"--fused-blocks: {args.fused_blocks!r} is not a list of powers of two >= 16")
    args.fused_blocks = [int(b) for b in blocks]
    return args


# -- the LM-head GEMM floor -----------------------------------------------------------------------------------
#: bf16 dense peak (TFLOP/s, no sparsity) by device-name substring; first match wins.
BF16_PEAK_TFLOPS = [("H200", 989.0), ("H100 SXM", 989.0), ("H100 80GB HBM3", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("A100", 312.0)]


def peak_tflops(device_name: str, override: float | None) -> float | None:
    if override is not None:
        return override
    return next((tf for key, tf in BF16_PEAK_TFLOPS if key in device_name), None)


def gemm_floor_ms(tokens: int, hidden: int, vocab: int, tflops: float) -> float:
    """Time of the 3 LM-head GEMMs a forward+backward needs at least (logits, grad of hidden, grad of
    weight), 2·N·H·V FLOP each, at the GPU's bf16 dense peak."""
    return 3 * 2 * tokens * hidden * vocab / (tflops * 1e12) * 1e3


# -- inputs ------------------------------------------------------------------------------------------------
def make_inputs(args, device):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    batch, length = args.tokens // args.seq_len, args.seq_len
    g = torch.Generator(device="cpu").manual_seed(0)
    logps_like = lambda: (-torch.rand(batch, length, generator=g) * 2).to(device)  # noqa: E731
    return dict(
        hidden=(torch.randn(batch, length, args.hidden, generator=g) * 0.5).to(device, dtype).requires_grad_(True),
        weight=(torch.randn(args.vocab, args.hidden, generator=g) / args.hidden**0.5).to(device, dtype).requires_grad_(True),
        ids=torch.randint(0, args.vocab, (batch, length), generator=g).to(device),
        mask=torch.ones(batch, length, dtype=torch.long, device=device),
        advantages=torch.randn(batch, generator=g).to(device),
        ref=logps_like(),
        old=logps_like(),
    )


# -- the reference paths -------------------------------------------------------------------------------------
def trl_elementwise_loss(logps, x, beta, loss_type):
    """TRL 1.15 ``_compute_loss`` for token-level clipped PPO + k3 KL (bias-corrected), dapo/bnpo normaliser."""
    mask = x["mask"]
    coef_1 = torch.exp(logps - x["old"])
    coef_2 = torch.clamp(coef_1, 0.8, 1.2)
    advantages = x["advantages"].unsqueeze(1)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    r = x["ref"] - logps
    per_token_loss = per_token_loss + beta * (torch.exp(r) - r - 1) * coef_1
    if loss_type in ("grpo", "sapo"):
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


def trl_fused_head(x, args):
    from trl.kernels import ChunkedLogProbFunction

    batch, length, width = x["hidden"].shape
    keep = x["mask"].reshape(-1).bool()
    logps = ChunkedLogProbFunction.apply(
        x["hidden"].reshape(-1, width)[keep], x["weight"], None, x["ids"].reshape(-1)[keep], 1.0, 32768, None, 1.0, ()
    )[0]
    logps = logps.new_zeros(batch * length).masked_scatter(keep, logps).view(batch, length)
    return trl_elementwise_loss(logps, x, args.beta, args.loss_type)


def materialised_logits(x, args):
    logits = (x["hidden"] @ x["weight"].t()).float()
    logps = torch.log_softmax(logits, dim=-1).gather(-1, x["ids"].unsqueeze(-1)).squeeze(-1)
    return trl_elementwise_loss(logps, x, args.beta, args.loss_type)


def module_path(module):
    def run(x, args):
        return module(x["hidden"], x["weight"], x["ids"], x["mask"], x["advantages"], ref_per_token_logps=x["ref"], old_per_token_logps=x["old"])[0]

    return run


def paths(args):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    from unsloth_adaptive_kl.backends.liger import AdaptiveFusedLinearGRPOLoss

    compiled = not args.smoke
    if args.methods == "all":
        args.methods = ",".join(_common.methods())
    common = dict(beta=args.beta, loss_type=args.loss_type, use_bias_correction_kl=True, max_completion_length=args.seq_len)
    yield "stock `LigerFusedLinearGRPOLoss` (defaults)", module_path(LigerFusedLinearGRPOLoss(compiled=compiled, **common))
    yield "TRL fused LM head + elementwise loss", trl_fused_head
    yield "materialised logits", materialised_logits
    for index, tile in enumerate(args.tiles):
        for method in args.methods.split(","):
            module = AdaptiveFusedLinearGRPOLoss(compiled=compiled, adaptive_kl=adaptive_state(method, args), fused_head=False, **common)
            suffix = "" if index == 0 else f", tile {tile[0]}x{tile[1]}"
            yield f"AdaptiveFusedLinearGRPOLoss ({method}, log-prob kernel{suffix})", with_tile(tile, module_path(module))
    for chunk in args.fused_chunks:
        for method in args.methods.split(","):
            module = AdaptiveFusedLinearGRPOLoss(
                compiled=compiled, adaptive_kl=adaptive_state(method, args), fused_head=True, fused_chunk_tokens=chunk, **common
            )
            yield f"AdaptiveFusedLinearGRPOLoss ({method}, fused head, chunk {chunk or 'auto'})", fused_path(module)
    yield from blocked_paths(args, common, compiled)


def blocked_paths(args, common, compiled):
    """The fused head (chunks auto) with the Triton passes' vocabulary block of each ``--fused-blocks``."""
    from unsloth_adaptive_kl.backends.liger import AdaptiveFusedLinearGRPOLoss

    for block in args.fused_blocks:
        for method in args.methods.split(","):
            module = AdaptiveFusedLinearGRPOLoss(compiled=compiled, adaptive_kl=adaptive_state(method, args), fused_head=True, **common)
            run = fused_path(module)
            run.block = block
            yield f"AdaptiveFusedLinearGRPOLoss ({method}, fused head, chunk auto, block {block})", run


def fused_path(module):
    """``module_path``, keeping the module so that the table can say which head it ran."""
    run = module_path(module)
    run.module = module
    return run


def adaptive_state(method, args):
    """The module's KL state for ``method``, as ``GRPOTrainer(loss_class=...)`` passes it: a standalone module refuses
    a β controller (``dynamic``, ``target``), which only a trainer runs; within one loss call it changes nothing."""
    import types

    from unsloth_adaptive_kl.adaptation import AdaptiveKL
    from unsloth_adaptive_kl.config import DEFAULTS

    fields = {**DEFAULTS, "kl_adaptation_method": method, "kl_estimator": args.estimator, "beta": args.beta}
    return AdaptiveKL(types.SimpleNamespace(**fields))


def with_tile(tile, run):
    """``run``, marked to be measured (forward and backward) with the log-prob kernel tiled ``tile``."""
    run.tile = tile
    return run


@contextlib.contextmanager
def tiled(tile):
    """The log-prob kernel tiled ``tokens x vocab`` inside (TRL's ``TOKEN_CHUNK_SIZE``, read by its forward and
    backward, and this package's ``VOCAB_TILE``); None: unchanged. Results change only by float32 summation
    order (the online logsumexp folds the same 1024-wide blocks)."""
    if tile is None:
        yield
        return
    from trl.kernels import chunked_logprob

    from unsloth_adaptive_kl.backends import _liger_parts

    saved = chunked_logprob.TOKEN_CHUNK_SIZE, _liger_parts.VOCAB_TILE
    chunked_logprob.TOKEN_CHUNK_SIZE, _liger_parts.VOCAB_TILE = tile
    try:
        yield
    finally:
        chunked_logprob.TOKEN_CHUNK_SIZE, _liger_parts.VOCAB_TILE = saved


@contextlib.contextmanager
def fused_block(block):
    """The fused head's Triton passes with ``block`` vocabulary columns per program inside; None: unchanged."""
    if block is None:
        yield
        return
    from unsloth_adaptive_kl.backends import _fused_head

    saved, _fused_head.BLOCK = _fused_head.BLOCK, block
    try:
        yield
    finally:
        _fused_head.BLOCK = saved


# -- measuring ------------------------------------------------------------------------------------------------
def measure(fn, x, args, device):
    cuda = device.type == "cuda"

    def step():
        x["hidden"].grad = x["weight"].grad = None
        with tiled(getattr(fn, "tile", None)), fused_block(getattr(fn, "block", None)):
            fn(x, args).backward()

    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.iters):
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    x["hidden"].grad = x["weight"].grad = None
    return statistics.median(times) * 1e3, peak


def table(rows, baseline_name, floor_ms=None) -> str:
    base_time, base_peak = next((t, p) for name, t, p in rows if name == baseline_name)
    lines = [
        "| path | time (ms) | peak memory (GiB) | time / TRL fused head | memory / TRL fused head | time / GEMM floor |",
        "|---|---|---|---|---|---|",
    ]
    for name, ms, peak in rows:
        peak_text = "n/a" if peak is None else f"{peak:.2f}"
        memory_ratio = "n/a" if peak is None else f"{peak / base_peak:.3f}"
        floor_ratio = "n/a" if floor_ms is None else f"{ms / floor_ms:.2f}"
        lines.append(f"| {name} | {ms:.1f} | {peak_text} | {ms / base_time:.2f} | {memory_ratio} | {floor_ratio} |")
    return "\n".join(lines)


def run_recompile_loop(args, argv) -> int:
    import recompile_loop

    cuda = torch.cuda.is_available() and not args.smoke
    base = dict(calls=args.loop_calls, batch=8, lengths=(300, 1030), hidden=1024, vocab=32000, dtype="bfloat16", device="cuda", num_items="mixed", backend=None)
    grid = {}
    if not cuda:  # dynamo only, tiny: what the CPU can do in seconds per configuration
        base.update(batch=3, lengths=(5, 24), hidden=8, vocab=40, dtype="float64", device="cpu", backend="eager")
        grid = dict(loss_types=("dapo", "luspo"), methods=("none", "dynamic+length_normalized"))
    start = time.perf_counter()
    def report(r):
        print(f"{r['loss_type']} {r['method']} {r['head']}: graphs per call {r['graphs']}, first two calls {sum(r['seconds'][:2]):.1f} s", flush=True)

    results = recompile_loop.grid(base, workers=args.loop_workers if cuda else 1, on_result=report, **grid)
    print(f"machine: {torch.cuda.get_device_name() if cuda else platform.machine()}; torch {torch.__version__}")
    print(f"command: python bench/bench_liger.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"loop: {base}; {len(results)} configurations in {time.perf_counter() - start:.0f} s\n")
    print("graphs compiled in calls 1-2 + after call 2 (target: +0), per loss type, head and kl_adaptation_method:\n")
    print(recompile_loop.table(results))
    bad = [r for r in results if recompile_loop.after_warmup(r)]
    for r in bad:
        print(f"\n{r['loss_type']} {r['method']} {r['head']}: graphs per call {r['graphs']}; reasons:\n" + "\n".join(r["reasons"][-3:]))
    warm = [s for r in results for s in r["seconds"][2:]]
    first = [sum(r["seconds"][:2]) for r in results]
    print(f"\ncalls 1-2 (compiling): median {statistics.median(first):.1f} s, max {max(first):.1f} s per configuration; "
          f"later calls: median {statistics.median(warm) * 1e3:.1f} ms, max {max(warm) * 1e3:.1f} ms")  # fmt: skip
    print("recompiles after warm-up: " + ("none" if not bad else f"{len(bad)} configurations"))
    return 0 if not bad else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.recompile_loop:
        return run_recompile_loop(args, argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    x = make_inputs(args, device)
    rows = []
    for name, fn in paths(args):
        torch._dynamo.reset()  # every module compiles the same function: past recompile_limit (8) later rows ran uncompiled
        ms, peak = measure(fn, x, args, device)
        if getattr(fn, "module", None) is not None and fn.module.head_path != "fused":
            name += f" [ran the {fn.module.head_path} path]"
        rows.append((name, ms, peak))
        print(f"measured {name}: {ms:.1f} ms", file=sys.stderr)
    machine = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"machine: {machine}; torch {torch.__version__}; B·T={args.tokens} (T={args.seq_len}), H={args.hidden}, V={args.vocab}, {args.dtype}, {args.loss_type}, {args.estimator}")
    print(f"command: python bench/bench_liger.py {' '.join(argv if argv is not None else sys.argv[1:])}\n")
    baseline = "TRL fused LM head + elementwise loss"
    floor_ms = None
    if device.type == "cuda":
        tflops = peak_tflops(machine, args.peak_tflops)
        if tflops is None:
            print(f"GEMM floor: no bf16 peak known for {machine!r}; pass --peak-tflops", file=sys.stderr)
        else:
            floor_ms = gemm_floor_ms(args.tokens, args.hidden, args.vocab, tflops)
            print(f"GEMM floor: 3 x 2·N·H·V = {6 * args.tokens * args.hidden * args.vocab / 1e12:.2f} TFLOP at {tflops:.0f} TFLOP/s (bf16 dense) = {floor_ms:.1f} ms")
    print(table(rows, baseline, floor_ms))
    if device.type == "cuda":
        base_time, base_peak = next((t, p) for name, t, p in rows if name == baseline)
        ours = [(name, t / base_time, p / base_peak) for name, t, p in rows if name.startswith("AdaptiveFused")]
        failed = [name for name, tr, mr in ours if tr > TARGET_TIME or mr > TARGET_MEMORY]
        print(f"\ntargets (≤ {TARGET_TIME}× time, ≤ {TARGET_MEMORY}× memory of the TRL fused head): " + ("all met" if not failed else f"missed by {failed}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
