"""TRL backend: the training part of a GRPO step, stock TRL vs each method, interleaved.

One process, one GPU. For each of ``--modes`` (``lora``: LoRA r=16 on every projection, the
reference is the base model with the adapter off; ``full``: full fine-tuning, the reference is a
separate frozen copy), one model and one optimizer (AdamW) are shared by every row, and every row
trains on the same fixed batch (``_common.fixed_batch``: no generation). A row is one
``GRPOTrainer`` (its config differs); a timed step is what the training part of a TRL step does:

1. the reference forward (``_common.reference_logps``: TRL's ``_get_per_token_logps_and_entropies``
   on the reference model, or under LoRA on the model with the adapter off, as
   ``_generate_and_score_completions`` does), skipped when ``trainer.beta == 0`` as TRL skips it;
2. ``trainer.compute_loss`` (forward) and ``backward``;
3. ``optimizer.step()`` and ``zero_grad``; then the trainer's ``on_step_end`` callbacks (the β
   controllers of ``dynamic``/``target`` update β there, as in training).

Rows: ``stock`` (TRL with ``unsloth_adaptive_kl.unpatch()``), each ``kl_adaptation_method``
(patched), and ``beta -> 0`` (``dynamic`` with ``beta_min=0`` reaching 0 after its first, untimed
step: the reference forward and the KL are skipped in every timed step). Timing, interleaving,
statistics and tables: ``bench/_common.py`` and docs/benchmarks.md.

The defaults make a step GPU-bound: 16 completions of 512-1024 tokens (17,408 tokens with the
prompts) per step, one timed step per row per round, as many rounds as ``--budget`` allows
(~20 per mode in ~190 s on an H100), gradient checkpointing off (a shorter step: a stricter ratio).

    python bench/bench_trl.py --out /tmp/bench-trl.md                 # ~1 B Llama, both modes
    python bench/bench_trl.py --smoke --out /tmp/bench-trl-smoke.md   # CPU, tiny model, ~1 min
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import _common  # noqa: E402

METHODS = ["none", "clip", "sigmoid", "length_normalized", "dynamic", "target", "dynamic+length_normalized"]
STOCK = "stock TRL (unpatched)"
ZERO = "beta -> 0 (dynamic, beta_min=0)"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batch", type=int, default=16, help="completions per step (one group, one micro-batch)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--min-completion", type=int, default=512)
    p.add_argument("--max-completion", type=int, default=1024)
    p.add_argument("--modes", default="lora,full")
    p.add_argument("--rows", default="all", help=f"comma-separated subset of: stock,{','.join(METHODS)},zero")
    p.add_argument("--rounds", type=int, default=40, help="at most this many rounds per mode (the budget usually stops them first)")
    p.add_argument("--steps", type=int, default=1, help="timed steps per row per round")
    p.add_argument("--warmup", type=int, default=0, help="untimed steps per row per round, after its first round")
    p.add_argument("--first-warmup", type=int, default=1, help="untimed steps in each row's first block")
    p.add_argument("--budget", type=float, default=190.0, help="seconds for the whole run, model building included; each mode gets an equal share of what is left")
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--out", help="Markdown file rewritten after every round (and OUT.json with every timing, after every block)")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (TRITON_INTERPRET=1), 2 rounds")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.vocab, args.prompt, args.min_completion, args.max_completion = 32, 2, 300, 4, 6, 12
        args.batch, args.rounds = min(args.batch, 4), min(args.rounds, 2)
    if args.first_warmup < 1:
        p.error("--first-warmup must be at least 1 (the beta -> 0 row reaches 0 in its first step, which is not timed)")
    for mode in args.modes.split(","):
        if mode not in ("lora", "full"):
            p.error(f"--modes: {mode!r} is not one of lora, full")
    return args


def wanted_rows(args) -> list[str]:
    names = ["stock", *METHODS, "zero"]
    if args.rows == "all":
        return names
    chosen = args.rows.split(",")
    unknown = [n for n in chosen if n not in names]
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; allowed: {names}")
    return [n for n in names if n in chosen]


def make_row(name, fields, *, patched, args, model, ref_model, optimizer, batch, tokenizer):
    import unsloth_adaptive_kl
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer import grpo_trainer

    (unsloth_adaptive_kl.patch if patched else unsloth_adaptive_kl.unpatch)()
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), report_to="none", per_device_train_batch_size=args.batch,
        num_generations=args.batch, gradient_accumulation_steps=1, max_completion_length=args.max_completion,
        learning_rate=1e-6, beta=args.beta, bf16=not args.smoke, use_cpu=args.smoke, seed=0, save_strategy="no",
        disable_tqdm=True, logging_steps=1, **fields,
    )  # fmt: skip
    dataset = Dataset.from_list([{"prompt": "w0 w1"}] * 8)
    if "ref" in getattr(model, "peft_config", {}):
        model.delete_adapter("ref")  # TRL adds its own copy of the adapter as the reference, once per trainer
    with _common.shared_reference(grpo_trainer, ref_model) if ref_model is not None else contextlib.nullcontext():
        trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[lambda completions, **k: [0.0] * len(completions)], args=config, train_dataset=dataset)
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which does not run here
    model.train()

    runtime = getattr(trainer, "_adaptive_kl", None)  # None for stock TRL

    def step():
        if runtime is not None:
            runtime.observe_reward(0.0)  # what generation reports (no generation here): the dynamic controller's input
        inputs = dict(batch)
        if trainer.beta != 0.0:
            inputs["ref_per_token_logps"] = _common.reference_logps(trainer, model, inputs)
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        trainer.state.global_step += 1
        trainer.callback_handler.on_step_end(trainer.args, trainer.state, trainer.control)
        trainer._metrics["train"].clear()  # the metrics a log() would flush; nothing logs here

    def activate():
        (unsloth_adaptive_kl.patch if patched else unsloth_adaptive_kl.unpatch)()

    return _common.Row(name=name, step=step, activate=activate, info={"beta_start": float(trainer.beta)}), trainer


def build_rows(args, common) -> tuple[list, list]:
    rows, trainers = [], []
    for key in wanted_rows(args):
        if key == "stock":
            row, trainer = make_row(STOCK, {}, patched=False, **common)
        elif key == "zero":
            # beta_min=0 reached by the schedule after 1 step: the first (untimed) warm-up step; every timed step has β = 0
            zero = dict(kl_adaptation_method="dynamic", reward_threshold=1e9, beta_min=0.0, beta_schedule_steps=1)
            row, trainer = make_row(ZERO, zero, patched=True, **common)
        else:
            fields = dict(kl_adaptation_method=key)
            if "dynamic" in key:
                fields["reward_threshold"] = -1.0  # no reward is observed here; keep the controller moving
            row, trainer = make_row(key, fields, patched=True, **common)
        rows.append(row)
        trainers.append(trainer)
    return rows, trainers


def memory_estimate(mode, args) -> str:
    """Resident bytes per parameter (bf16 weights, a bf16 reference copy, bf16 gradients, AdamW's
    two bf16 states) and the activations of one micro-batch, for the header of a mode's table."""
    n = _common.parameter_count(args.hidden, args.layers, args.vocab)
    tokens = args.batch * (args.prompt + args.max_completion)
    activations = _common.activation_gib(tokens, args.hidden, args.layers)
    if mode == "full":
        resident, during = 2 * 2 * n / 2**30 + 4 * n / 2**30, 2 * n / 2**30  # weights + reference, AdamW; gradients
    else:
        resident, during = 2 * n / 2**30, 0.0  # LoRA's own parameters and states are a few MiB
    return f"estimated: {resident:.1f} GiB resident + {during + activations:.1f} GiB per step ({activations:.1f} GiB activations of {tokens:,} tokens)"


def run_mode(mode, args, report, deadline):
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    tokenizer = _common.build_tokenizer(args.vocab)
    shape = dict(hidden=args.hidden, layers=args.layers, vocab=args.vocab, max_len=args.prompt + args.max_completion + 8, device=device.type, dtype=dtype)
    model, ref_model = _common.build_model(**shape), None  # seeded: the same weights in both modes
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        target = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=target, task_type="CAUSAL_LM"))
    else:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-6, **({"fused": True} if device.type == "cuda" else {"foreach": True}))
    batch = _common.fixed_batch(
        batch=args.batch, prompt_len=args.prompt, min_completion=args.min_completion, max_completion=args.max_completion, vocab=args.vocab, device=device
    )  # fmt: skip
    common = dict(args=args, model=model, ref_model=ref_model, optimizer=optimizer, batch=batch, tokenizer=tokenizer)
    rows, trainers = build_rows(args, common)
    title = f"{mode}: {'LoRA r=16' if mode == 'lora' else 'full fine-tuning, separate reference model'}"
    note = f"trainable parameters: {sum(p.numel() for p in params):,}; memory {memory_estimate(mode, args)}"

    def on_block(_, round_finished):
        for row, trainer in zip(rows, trainers):
            row.info["beta_now"] = float(trainer.beta)
        report.update(title, rows, STOCK, note, tables=round_finished)

    completed = _common.run_rounds(
        rows, rounds=args.rounds, steps=args.steps, warmup=args.warmup, first_warmup=args.first_warmup, device=device,
        deadline=deadline, on_block=on_block,
    )  # fmt: skip
    if device.type == "cuda":
        note += f"; allocated at the end {torch.cuda.memory_allocated() / 2**30:.1f} GiB, peak of the mode {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
    report.update(title, rows, STOCK, note + f"; rounds completed: {completed} of {args.rounds}")
    del trainers, model, ref_model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench_trl.py needs a CUDA GPU (or --smoke for a CPU pass)")
    start = time.monotonic()
    import unsloth_adaptive_kl  # noqa: F401

    n_params = _common.parameter_count(args.hidden, args.layers, args.vocab)
    header = (
        f"## TRL backend: training part of a GRPO step\n\nmachine: {_common.machine()}\n"
        f"model: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab} ({n_params / 1e9:.2f} B parameters), "
        f"{'float32' if args.smoke else 'bf16'}; batch {args.batch} x (prompt {args.prompt} + completions {args.min_completion}-{args.max_completion} tokens); "
        f"beta {args.beta}; per row and round {args.steps} timed step(s) after {args.warmup} untimed ({args.first_warmup} in its first round), "
        f"interleaved, up to {args.rounds} rounds within --budget {args.budget:.0f} s\n"
        f"command: python bench/bench_trl.py {' '.join(argv if argv is not None else sys.argv[1:])}"
    )
    report = _common.Report(args.out, header)
    modes = args.modes.split(",")
    for i, mode in enumerate(modes):
        # each mode gets an equal share of what is left of the budget
        share = (args.budget - (time.monotonic() - start)) / (len(modes) - i)
        run_mode(mode, args, report, deadline=time.monotonic() + share)
    print(report.text())
    print(f"wall time: {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
