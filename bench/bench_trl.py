"""TRL backend: the training part of a GRPO step, stock TRL vs each method, interleaved.

One process, one GPU. For each of ``--modes`` (``lora``: LoRA r=16 on every projection, the
reference is the base model with the adapter off; ``full``: full fine-tuning, the reference is a
separate frozen copy), one model and one optimizer (AdamW) are shared by every row, and every row
trains on the same fixed batch (``_common.fixed_batch``: no generation). A row is one
``GRPOTrainer`` (its config differs); a timed step is what the training part of a TRL step does:

1. the reference forward (``_get_per_token_logps_and_entropies`` on the reference model, or
   under LoRA on TRL's frozen copy of the adapter, as
   ``_generate_and_score_completions`` does), skipped when ``trainer.beta == 0`` as TRL skips it;
2. ``trainer.compute_loss`` (forward) and ``backward``;
3. ``optimizer.step()`` and ``zero_grad``; then the trainer's ``on_step_end`` callbacks (the β
   controllers of ``dynamic``/``target`` update β there, as in training).

Rows: ``stock`` (TRL with ``unsloth_adaptive_kl.unpatch()``), each ``kl_adaptation_method``
(patched), and ``beta -> 0`` (``dynamic`` with ``beta_min=0`` reaching 0 after its first, untimed
step: the reference forward and the KL are skipped in every timed step). Timing, interleaving, statistics and tables: ``bench/_common.py`` and
docs/benchmarks.md.

    python bench/bench_trl.py --out /tmp/bench-trl.md                 # ~1 B Llama, both modes
    python bench/bench_trl.py --smoke --out /tmp/bench-trl-smoke.md   # CPU, tiny model, ~1 min
"""

from __future__ import annotations

import argparse
import contextlib
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
    p.add_argument("--batch", type=int, default=4, help="completions per micro-batch (one group)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--min-completion", type=int, default=512)
    p.add_argument("--max-completion", type=int, default=1024)
    p.add_argument("--modes", default="lora,full")
    p.add_argument("--rows", default="all", help=f"comma-separated subset of: stock,{','.join(METHODS)},zero")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="timed steps per row per round (rows get rounds x steps)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per row per round")
    p.add_argument("--budget", type=float, default=240.0, help="seconds for the whole run; rounds stop when it is spent")
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--out", help="Markdown file rewritten after every row-round (and OUT.json with every timing)")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (TRITON_INTERPRET=1), 2 rounds x 2 steps")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.vocab, args.prompt, args.min_completion, args.max_completion = 32, 2, 300, 4, 6, 12
        args.rounds, args.steps, args.warmup = min(args.rounds, 2), min(args.steps, 2), 1
    if args.warmup < 1:
        p.error("--warmup must be at least 1 (the beta -> 0 row reaches 0 in its first step, which is not timed)")
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


@contextlib.contextmanager
def shared_reference(ref_model):
    """Make every trainer built inside use ``ref_model`` instead of loading its own copy (full fine-tuning)."""
    from trl.trainer import grpo_trainer

    original = grpo_trainer.create_model_from_path
    grpo_trainer.create_model_from_path = lambda *a, **k: ref_model
    try:
        yield
    finally:
        grpo_trainer.create_model_from_path = original


def reference_logps(trainer, model, inputs):
    """The reference forward of TRL 1.15's ``_generate_and_score_completions`` (its β != 0 branch)."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    keep = inputs["completion_ids"].size(1)
    with torch.no_grad():
        if trainer.ref_model is not None:
            return trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, mask, keep, batch_size=ids.size(0))[0]
        from trl.trainer.grpo_trainer import use_adapter

        # LoRA: TRL's frozen copy of the adapter ("ref"), or the base model where PEFT cannot add one
        with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
            return trainer._get_per_token_logps_and_entropies(model, ids, mask, keep, batch_size=ids.size(0))[0]


def make_row(name, fields, *, patched, args, model, ref_model, optimizer, batch, checkpoint, tokenizer):
    import unsloth_adaptive_kl
    from trl import GRPOConfig, GRPOTrainer

    (unsloth_adaptive_kl.patch if patched else unsloth_adaptive_kl.unpatch)()
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), report_to="none", per_device_train_batch_size=args.batch,
        num_generations=args.batch, gradient_accumulation_steps=1, max_completion_length=args.max_completion,
        learning_rate=1e-6, beta=args.beta, bf16=not args.smoke, use_cpu=args.smoke, seed=0, save_strategy="no",
        disable_tqdm=True, logging_steps=1, **fields,
    )  # fmt: skip
    from datasets import Dataset

    dataset = Dataset.from_list([{"prompt": "w0 w1"}] * 8)
    if "ref" in getattr(model, "peft_config", {}):
        model.delete_adapter("ref")  # TRL adds its own copy of the adapter as the reference, once per trainer
    with shared_reference(ref_model) if ref_model is not None else contextlib.nullcontext():
        trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[lambda completions, **k: [0.0] * len(completions)], args=config, train_dataset=dataset)
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which does not run here
    model.train()

    runtime = getattr(trainer, "_adaptive_kl", None)  # None for stock TRL

    def step():
        if runtime is not None:
            runtime.observe_reward(0.0)  # what generation reports (no generation here): the dynamic controller's input
        inputs = dict(batch)
        if trainer.beta != 0.0:
            inputs["ref_per_token_logps"] = reference_logps(trainer, model, inputs)
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


def run_mode(mode, args, checkpoint, report, deadline):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device)
    ref_model = None
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        target = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=target, task_type="CAUSAL_LM"))
    else:
        ref_model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval().requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-6, foreach=True)
    batch = _common.fixed_batch(
        batch=args.batch, prompt_len=args.prompt, min_completion=args.min_completion, max_completion=args.max_completion, vocab=args.vocab, device=device
    )  # fmt: skip
    rows, trainers = [], []
    common = dict(args=args, model=model, ref_model=ref_model, optimizer=optimizer, batch=batch, checkpoint=checkpoint, tokenizer=tokenizer)
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
    title = f"{mode}: {'LoRA r=16' if mode == 'lora' else 'full fine-tuning, separate reference model'}"
    note = f"trainable parameters: {sum(p.numel() for p in params):,}"

    def on_round(_):
        for row, trainer in zip(rows, trainers):
            row.info["beta_now"] = float(trainer.beta)
        report.update(title, rows, STOCK, note)

    completed = _common.run_rounds(rows, rounds=args.rounds, steps=args.steps, warmup=args.warmup, device=device, deadline=deadline, on_round=on_round)
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

    checkpoint = _common.build_checkpoint(
        tempfile.mkdtemp(prefix="bench-trl-model-"), hidden=args.hidden, layers=args.layers, vocab=args.vocab,
        max_len=args.prompt + args.max_completion + 8, device="cpu" if args.smoke else "cuda",
    )  # fmt: skip
    n_params = _common.parameter_count(args.hidden, args.layers, args.vocab)
    header = (
        f"## TRL backend: training part of a GRPO step\n\nmachine: {_common.machine()}\n"
        f"model: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab} ({n_params / 1e9:.2f} B parameters), "
        f"{'float32' if args.smoke else 'bf16'}; batch {args.batch} x (prompt {args.prompt} + completions {args.min_completion}-{args.max_completion} tokens); "
        f"beta {args.beta}; {args.rounds} rounds x {args.steps} timed steps (+{args.warmup} untimed) per row, interleaved\n"
        f"command: python bench/bench_trl.py {' '.join(argv if argv is not None else sys.argv[1:])}"
    )
    report = _common.Report(args.out, header)
    modes = args.modes.split(",")
    for i, mode in enumerate(modes):
        # each mode gets an equal share of what is left of the budget
        share = (args.budget - (time.monotonic() - start)) / (len(modes) - i)
        run_mode(mode, args, checkpoint, report, deadline=time.monotonic() + share)
    print(report.text())
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
