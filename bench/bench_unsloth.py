"""Unsloth backend: step time, peak memory and compiled graphs, stock Unsloth vs each method.

One process, one GPU. Every row trains the same LoRA model (built from a config: hidden 1024,
vocab 32768, completions of exactly --completion tokens) for --steps GRPO steps and reports
medians over the steps after --warmup:

* ``stock fixed beta``: unpatched Unsloth (``unsloth_adaptive_kl.unpatch()``), beta fixed; run
  first and last, to show the drift of the machine over the run;
* one row per ``kl_adaptation_method``;
* ``naive dynamic beta``: unpatched Unsloth, ``trainer.beta *= 0.9`` after every step (what a
  user would write without this package): every new float is a new graph;
* ``beta -> 0``: ``dynamic`` with ``beta_min=0`` reaching 0 after the warmup; its step time
  is measured once beta is 0, so the reference forward and the KL are skipped.

Columns: median step time (whole GRPO step: generation + reference forward + loss), median
train time (step time minus generation and scoring), peak GPU memory of the training run above
what was allocated when it started (the loaded model is excluded: earlier rows leave memory
behind in this one process), graphs compiled in total
and after the warmup (torch._dynamo counters). Ratios are against the mean of the two stock rows.

    python bench/bench_unsloth.py              # defaults as in docs/benchmarks.md
    python bench/bench_unsloth.py --smoke      # a quick functional pass (tiny sizes)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

METHODS = ["none", "clip", "sigmoid", "length_normalized", "dynamic", "target", "dynamic+length_normalized"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--completion", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="completions per step (one prompt group)")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--rows", default="all", help="comma-separated subset: stock,METHOD...,naive,zero")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.vocab, args.completion, args.steps, args.warmup = 64, 2, 512, 16, 3, 1
    return args


def build_checkpoint(args) -> str:
    """A Llama with a word-level tokenizer of exactly --vocab tokens, saved to disk."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + [f"w{i}" for i in range(args.vocab - len(specials))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>", padding_side="left")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(2.75 * args.hidden), num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64), num_key_value_heads=max(1, args.hidden // 256), max_position_embeddings=args.completion + 64,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False,
    )
    path = tempfile.mkdtemp(prefix="bench-unsloth-")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def reward(completions, **kwargs):
    """A reward with spread inside every group (GRPO needs it), cheap and deterministic."""
    return [float(hash(c) % 1000) / 1000.0 for c in completions]


def prompts(n: int, vocab: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (n, 8), generator=g)
    return Dataset.from_list([{"prompt": " ".join(f"w{i - 4}" for i in row.tolist())} for row in ids])


def run_row(name, args, path, *, patched: bool, fields: dict, naive: bool = False):
    import unsloth_adaptive_kl
    from torch._dynamo.utils import counters
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from unsloth import FastLanguageModel

    (unsloth_adaptive_kl.patch if patched else unsloth_adaptive_kl.unpatch)()
    model, tokenizer = FastLanguageModel.from_pretrained(model_name=path, max_seq_length=args.completion + 32, load_in_4bit=False, dtype=torch.bfloat16)
    model = FastLanguageModel.get_peft_model(
        model, r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], random_state=0
    )
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-out-"), report_to="none", per_device_train_batch_size=args.batch,
        num_generations=args.batch, gradient_accumulation_steps=1, max_completion_length=args.completion, max_steps=args.steps,
        logging_steps=1, learning_rate=1e-5, warmup_steps=0, save_strategy="no", beta=args.beta, bf16=True, seed=0,
        generation_kwargs={"min_new_tokens": args.completion}, disable_tqdm=True, **fields,
    )
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[reward], args=config, train_dataset=prompts(512, args.vocab))
    generation_times, graphs = [], []
    generate = trainer._generate_and_score_completions

    def timed_generate(*a, **k):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = generate(*a, **k)
        torch.cuda.synchronize()
        generation_times.append(time.perf_counter() - start)
        return out

    trainer._generate_and_score_completions = timed_generate

    class Probe(TrainerCallback):
        def on_step_end(self, a, state, control, **kwargs):
            graphs.append(counters["stats"]["unique_graphs"])
            if naive:  # what a user would write without this package
                trainer.beta *= 0.9

    trainer.add_callback(Probe())
    graphs_before = counters["stats"]["unique_graphs"]
    # Earlier rows leave memory behind in this process (compiled graphs, caches): count this row's
    # peak above what was allocated when it started.
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    allocated_at_start = torch.cuda.memory_allocated()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() - allocated_at_start
    step_times = [h["step_time"] for h in trainer.state.log_history if "step_time" in h]
    measured = slice(args.warmup, None)
    train_times = [s - g for s, g in zip(step_times, generation_times)]
    betas = [h.get("adaptive_kl/current_beta") for h in trainer.state.log_history if "step_time" in h]
    row = {
        "name": name,
        "step": statistics.median(step_times[measured]),
        "train": statistics.median(train_times[measured]),
        "peak_gib": peak / 2**30,
        "graphs_total": graphs[-1] - graphs_before,
        "graphs_after_warmup": graphs[-1] - graphs[args.warmup - 1],
        "betas": betas,
    }
    del trainer, model
    torch.cuda.empty_cache()
    print(f"ROW {row}", flush=True)  # progress, and a record if the run is cut short
    return row


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_unsloth.py needs a CUDA GPU (Unsloth's fused GRPO loss)")
    import unsloth  # noqa: F401  (first, as Unsloth asks)
    from torch import _dynamo

    import unsloth_adaptive_kl  # noqa: F401

    # Many trainers in one process: let every configuration keep its own compiled graphs.
    _dynamo.config.recompile_limit = 256
    _dynamo.config.accumulated_recompile_limit = 4096
    path = build_checkpoint(args)
    wanted = None if args.rows == "all" else set(args.rows.split(","))
    rows = []

    def want(key):
        return wanted is None or key in wanted

    if want("stock"):
        rows.append(run_row("stock fixed beta", args, path, patched=False, fields={}))
    for method in METHODS:
        if want(method):
            rows.append(run_row(method, args, path, patched=True, fields=dict(kl_adaptation_method=method, reward_threshold=-1.0)))
    if want("naive"):
        rows.append(run_row("naive dynamic beta (stock, trainer.beta *= 0.9)", args, path, patched=False, fields={}, naive=True))
    if want("zero"):
        zero = dict(kl_adaptation_method="dynamic", reward_threshold=1e9, beta_min=0.0, beta_schedule_steps=args.warmup)
        rows.append(run_row("beta -> 0 (dynamic, beta_min=0)", args, path, patched=True, fields=zero))
    if want("stock"):
        rows.append(run_row("stock fixed beta (again)", args, path, patched=False, fields={}))

    stock = [r for r in rows if r["name"].startswith("stock")]
    base_step = statistics.mean(r["step"] for r in stock) if stock else float("nan")
    base_train = statistics.mean(r["train"] for r in stock) if stock else float("nan")
    base_peak = statistics.mean(r["peak_gib"] for r in stock) if stock else float("nan")
    print(f"\nMachine: {torch.cuda.get_device_name()} | torch {torch.__version__} | Python {platform.python_version()}")
    print(f"Model: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, LoRA r=16, bf16; {args.batch} completions x {args.completion} tokens per step")
    print(f"Command: python {' '.join(sys.argv)}\n")
    print("| row | step (s) | vs stock | train (s) | vs stock | peak GiB | vs stock | graphs | graphs after warmup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['name']} | {r['step']:.3f} | {r['step'] / base_step:.3f}x | {r['train']:.3f} | {r['train'] / base_train:.3f}x | "
            f"{r['peak_gib']:.2f} | {r['peak_gib'] / base_peak:.3f}x | {r['graphs_total']} | {r['graphs_after_warmup']} |"
        )
    print("\nbeta per step:")
    for r in rows:
        print(f"  {r['name']}: {[None if b is None else round(b, 5) for b in r['betas']]}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
