"""What bounds the fused LM head (issue 22, item 2): its parts timed alone, next to the whole, in one process.

At bench_liger's shape (B·T 8192, H 4096, V 128256, bf16) the fused head of ``AdaptiveFusedLinearGRPOLoss``
(``kl_adaptation_method="none"``, ``fused_head=True``, chunk auto: one chunk) runs, per call:

* GEMM 1, the logits ``h Wᵀ`` (bf16 out, fp32 accumulate);
* the row pass (``row_logsumexp``: reads the logits once);
* the module's elementwise loss and its gradient on (B, T) log-probs;
* the gradient pass (``logits_to_grad_``: reads and writes the logits);
* GEMM 2, ``grad_h = G W``, and GEMM 3, ``grad_W = Gᵀ h`` (fp32 reduction, one rounding).

Each part runs alone on the same buffers, interleaved with the whole (forward + backward of the module,
as bench_liger measures it) for ``--rounds`` rounds; CUDA events time each. The table gives the median,
the share of the whole, and the rate (TFLOP/s for a GEMM, GB/s for a pass: bytes it must read and
write). "Measured GEMM floor" is the sum of the three GEMMs as cuBLAS runs them here; the peak floor
is bench_liger's (3 × 2·N·H·V at the GPU's dense bf16 peak). Two variants of GEMM 3 are timed as well
(reduced-precision reduction allowed; the transposed layout ``(hᵀ G)ᵀ``), and a torch.profiler table
of one whole call lists its kernels by CUDA time.

    python bench/bench_fused_head_parts.py             # GPU, bench_liger's default shape
    python bench/bench_fused_head_parts.py --smoke     # CPU, tiny, perf_counter (checks that it runs)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_liger  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="untimed rounds first (clocks, compilation)")
    p.add_argument("--hbm-gbs", type=float, help="the GPU's memory bandwidth in GB/s for the pass rows (default: from the name)")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    args.dtype, args.loss_type, args.estimator, args.beta = "bf16", "dapo", "k3", 0.04  # what bench_liger's helpers read
    if args.smoke:
        args.tokens, args.seq_len, args.hidden, args.vocab, args.rounds, args.warmup, args.dtype = 64, 16, 32, 300, 3, 1, "fp32"
    return args


HBM_GBS = [("H200", 4800.0), ("H100 SXM", 3350.0), ("H100 80GB HBM3", 3350.0), ("H100 PCIe", 2000.0), ("H100 NVL", 3900.0)]


class Timer:
    """CUDA events on a GPU, perf_counter on the CPU; ``ms()`` after a synchronise."""

    def __init__(self, cuda):
        self.cuda = cuda

    def __call__(self, fn):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            return lambda: start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        elapsed = (time.perf_counter() - t0) * 1e3
        return lambda: elapsed


def parts(args, x, device):
    """{key: (label, fn, work, unit)}: each part on its own buffers, the whole as bench_liger's module row."""
    from unsloth_adaptive_kl.backends import _fused_head
    from unsloth_adaptive_kl.backends.liger import AdaptiveFusedLinearGRPOLoss

    n, h_, v = args.tokens, args.hidden, args.vocab
    hidden = x["hidden"].detach().reshape(n, h_)
    weight = x["weight"].detach()
    ids = x["ids"].reshape(n)
    logits = torch.empty(n, v, device=device, dtype=hidden.dtype)
    torch.mm(hidden, weight.t(), out=logits)
    lse, _ = _fused_head.row_logsumexp(logits, ids, 1.0)
    grad_logp = torch.randn(n, device=device) * 1e-3
    grad_hidden = torch.empty_like(hidden)
    scratch = logits.clone()  # the gradient pass writes in place: it runs on a copy refreshed by nothing (same cost)
    common = dict(beta=args.beta, loss_type=args.loss_type, max_completion_length=args.seq_len, use_bias_correction_kl=True)
    module = AdaptiveFusedLinearGRPOLoss(compiled=not args.smoke, adaptive_kl=bench_liger.adaptive_state("none", args), fused_head=True, **common)
    whole = bench_liger.module_path(module)

    def run_whole():
        x["hidden"].grad = x["weight"].grad = None
        whole(x, args).backward()

    def reduced_mm3():
        torch.mm(logits.t(), hidden)

    def queued_whole():  # the whole behind a GEMM of the same size, as behind a model's forward in a training step
        torch.mm(hidden, weight.t(), out=scratch)
        run_whole()

    gemm, elem = 2 * n * h_ * v, logits.element_size() * n * v
    return module, {
        "whole": ("whole: fused head, forward + backward (module `none`, chunk auto)", run_whole, None, None),
        "queued": ("queued: a GEMM 1 of the same size, then the whole", queued_whole, None, None),
        "gemm1": ("GEMM 1: logits = h Wᵀ", lambda: torch.mm(hidden, weight.t(), out=logits), gemm, "TFLOP/s"),
        "row": ("row pass: logsumexp and the selected logit (reads N·V)", lambda: _fused_head.row_logsumexp(logits, ids, 1.0), elem, "GB/s"),
        "grad": ("gradient pass: G = g·(onehot − softmax) in place (reads and writes N·V)",
                 lambda: _fused_head.logits_to_grad_(scratch, ids, lse, grad_logp, 1.0), 2 * elem, "GB/s"),
        "gemm2": ("GEMM 2: grad_h = G W", lambda: torch.mm(logits, weight, out=grad_hidden), gemm, "TFLOP/s"),
        "gemm3": ("GEMM 3: grad_W = Gᵀ h (fp32 reduction, as the module)", lambda: _fused_head._full_precision_mm(logits.t(), hidden), gemm, "TFLOP/s"),
        "gemm3_reduced": ("GEMM 3 variant: reduced-precision reduction allowed", reduced_mm3, gemm, "TFLOP/s"),
        "gemm3_layout": ("GEMM 3 variant: layout (hᵀ G)ᵀ", lambda: _fused_head._full_precision_mm(hidden.t(), logits), gemm, "TFLOP/s"),
    }


def _short(name: str, width: int) -> str:
    """A kernel name cut to ``width`` characters for a table cell."""
    return name if len(name) <= width else name[: width - 3] + "..."


def kernel_table(fn, top=14) -> str:
    """torch.profiler's CUDA kernels of one call of ``fn``, by total CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        name = _short(e.name, 90)
        total, count = rows.get(name, (0.0, 0))
        rows[name] = (total + e.device_time_total / 1e3, count + 1)
    everything = sum(t for t, _ in rows.values())
    lines = [f"CUDA kernels of one whole call (torch.profiler): {everything:.2f} ms of kernel time", "",
             "| kernel | calls | ms | share |", "|---|---|---|---|"]
    for name, (total, count) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| `{name}` | {count} | {total:.2f} | {total / everything:.1%} |")
    return "\n".join(lines)


def gap_table(fn, top=6) -> str:
    """Where the GPU waits during one call of ``fn`` (torch.profiler, CPU and CUDA): before its first kernel, between
    kernels, after its last one until the call returns; the largest gaps between kernels, with their neighbours."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("whole call"):
            fn()
        torch.cuda.synchronize()
    events = prof.events()
    call = next(e for e in events if e.name == "whole call" and e.device_type.name == "CPU")
    kernels = sorted((e for e in events if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    if not kernels:
        return "no CUDA kernel in the profile"
    busy_end, gaps, busy = kernels[0].time_range.start, [], 0.0
    previous = None
    for k in kernels:
        start, end = k.time_range.start, k.time_range.end
        if start > busy_end and previous is not None:
            gaps.append((start - busy_end, previous.name, k.name))
        busy += max(0.0, end - max(start, busy_end))
        busy_end, previous = max(busy_end, end), k
    before = kernels[0].time_range.start - call.time_range.start
    after = call.time_range.end - busy_end
    between = sum(g for g, _, _ in gaps)
    lines = [f"GPU idle in one whole call (torch.profiler, CPU + CUDA; µs → ms): call {(call.time_range.end - call.time_range.start) / 1e3:.2f} ms "
             f"on the CPU, kernels busy {busy / 1e3:.2f} ms; before the first kernel {before / 1e3:.2f} ms, between kernels "
             f"{between / 1e3:.2f} ms ({len(gaps)} gaps), after the last kernel until the call returns {after / 1e3:.2f} ms", "",
             "| gap (ms) | after kernel | before kernel |", "|---|---|---|"]
    for g, a, b in sorted(gaps, reverse=True)[:top]:
        lines.append(f"| {g / 1e3:.3f} | `{_short(a, 60)}` | `{_short(b, 60)}` |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    x = bench_liger.make_inputs(args, device)
    module, table = parts(args, x, device)
    timer = Timer(cuda)
    samples = {key: [] for key in table}
    for r in range(args.warmup + args.rounds):
        pending = [(key, timer(fn)) for key, (_, fn, _, _) in table.items()]
        if cuda:
            torch.cuda.synchronize()
        if r >= args.warmup:
            for key, elapsed in pending:
                samples[key].append(elapsed())
    machine = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"machine: {machine}; torch {torch.__version__}; N={args.tokens}, H={args.hidden}, V={args.vocab}, {args.dtype}; "
          f"{args.rounds} interleaved rounds after {args.warmup}; the whole ran the {module.head_path} head")
    print(f"command: python bench/bench_fused_head_parts.py {' '.join(argv if argv is not None else sys.argv[1:])}\n")
    med = {key: statistics.median(s) for key, s in samples.items()}
    q = {key: statistics.quantiles(s, n=4) if len(s) > 1 else (s[0], s[0], s[0]) for key, s in samples.items()}
    whole = med["whole"]
    print("| part | median (ms) | quartiles (ms) | / whole | rate |\n|---|---|---|---|---|")
    for key, (label, _, work, unit) in table.items():
        rate = "" if work is None else f"{work / (med[key] * 1e-3) / (1e12 if unit == 'TFLOP/s' else 1e9):.0f} {unit}"
        print(f"| {label} | {med[key]:.2f} | {q[key][0]:.2f}-{q[key][2]:.2f} | {med[key] / whole:.3f} | {rate} |")
    gemms = med["gemm1"] + med["gemm2"] + med["gemm3"]
    passes = med["row"] + med["grad"]
    rest = whole - gemms - passes
    queued = med["queued"] - med["gemm1"]
    print(f"\nthe whole queued behind GPU work (queued row − GEMM 1): {queued:.2f} ms, {queued / whole:.3f} of the whole alone")
    print(f"\nmeasured GEMM floor (GEMMs 1-3 as cuBLAS runs them here): {gemms:.2f} ms; the two passes: {passes:.2f} ms; "
          f"the rest of the whole (elementwise loss and its gradient, launches, gathers): {rest:.2f} ms")
    print(f"whole / measured GEMM floor: {whole / gemms:.3f}; (GEMMs + passes) / measured GEMM floor: {(gemms + passes) / gemms:.3f}")
    if cuda:
        tflops = bench_liger.peak_tflops(machine, None)
        if tflops:
            floor = bench_liger.gemm_floor_ms(args.tokens, args.hidden, args.vocab, tflops)
            print(f"peak GEMM floor ({tflops:.0f} TFLOP/s): {floor:.2f} ms; whole / peak floor: {whole / floor:.3f}; "
                  f"measured GEMMs / peak floor: {gemms / floor:.3f}; (GEMMs + passes) / peak floor: {(gemms + passes) / floor:.3f}")
        gbs = args.hbm_gbs or next((g for key, g in HBM_GBS if key in machine), None)
        if gbs:
            elem = x["hidden"].element_size() * args.tokens * args.vocab
            print(f"the passes' bytes (3 × N·V × {x['hidden'].element_size()} B = {3 * elem / 1e9:.2f} GB) at {gbs:.0f} GB/s: "
                  f"{3 * elem / gbs / 1e6:.2f} ms at least")
        print()
        print(kernel_table(table["whole"][1]))
        print()
        print(gap_table(table["whole"][1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
