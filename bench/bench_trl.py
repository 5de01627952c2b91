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
(patched; every patched row computes the tail metrics), ``beta -> 0`` (``dynamic`` with ``beta_min=0``
reaching 0 after its first, untimed step: the reference forward and the KL are skipped in every timed
step), ``stock, beta=0``, ``kl_monitor (beta=0)`` (the full monitor, ``kl_monitor_every=1``) and ``kl_monitor sampled``
(its default ``kl_monitor_every``: one timed call is a cycle of that many steps, the first with the reference
forward, timed per step) (the monitors' cost: the report's note pairs each with ``stock, beta=0``), and ``none``
with ``kl_exclude_token_ids``. Timing, interleaving,
statistics and tables: ``bench/_common.py`` and docs/benchmarks.md.

The defaults make a step GPU-bound: 16 completions of 512-1024 tokens (17,408 tokens with the
prompts) per step, one timed step per row per round, as many rounds as ``--budget`` allows
(~20 per mode in ~190 s on an H100), gradient checkpointing off (a shorter step: a stricter ratio).

    python bench/bench_trl.py --out /tmp/bench-trl.md                 # ~1 B Llama, both modes
    python bench/bench_trl.py --smoke --out /tmp/bench-trl-smoke.md   # CPU, tiny model, ~1 min
"""

from __future__ import annotations

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

STOCK = "stock TRL (unpatched)"


def parse_args(argv=None):
    p, args = _common.parse_args(
        argv, description=__doc__, batch=16, first_warmup=1, first_warmup_why="", budget_includes="model building",
        smoke_help="tiny model on CPU (TRITON_INTERPRET=1), 2 rounds", smoke_hidden=32, smoke_rounds=2,
    )  # fmt: skip
    if args.first_warmup < 1:
        p.error("--first-warmup must be at least 1 (the beta -> 0 row reaches 0 in its first step, which is not timed)")
    _common.check_modes(p, args)
    return args


def make_row(key, *, args, model, ref_model, optimizer, batch, tokenizer, loss_class=None, fused_head=None, name=None):
    """The row ``key`` (one of ``_common.row_keys()``); with ``loss_class``, trained through ``GRPOTrainer(loss_class=...)``,
    its config's ``liger_fused_head`` set to ``fused_head`` unless None, named ``name``."""
    import unsloth_adaptive_kl
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer import grpo_trainer

    default_name, fields = _common.row_name_and_fields(key, STOCK)
    if fused_head is not None:
        fields["liger_fused_head"] = fused_head
    name = name or default_name
    patched = key not in _common.UNPATCHED_KEYS
    beta = fields.pop("beta", args.beta)
    extra = {} if loss_class is None else {"loss_class": loss_class}
    (unsloth_adaptive_kl.patch if patched else unsloth_adaptive_kl.unpatch)()
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), report_to="none", per_device_train_batch_size=args.batch,
        num_generations=args.batch, gradient_accumulation_steps=1, max_completion_length=args.max_completion,
        learning_rate=1e-6, beta=beta, bf16=not args.smoke, use_cpu=args.smoke, seed=0, save_strategy="no",
        disable_tqdm=True, logging_steps=1, **fields,
    )  # fmt: skip
    dataset = Dataset.from_list([{"prompt": "w0 w1"}] * 8)
    if "ref" in getattr(model, "peft_config", {}):
        model.delete_adapter("ref")  # TRL adds its own copy of the adapter as the reference, once per trainer
    with _common.shared_reference(grpo_trainer, ref_model) if ref_model is not None else contextlib.nullcontext():
        trainer = GRPOTrainer(
            model=model, processing_class=tokenizer, reward_funcs=[lambda completions, **k: [0.0] * len(completions)], args=config,
            train_dataset=dataset, **extra,
        )  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which does not run here
    model.train()
    step = _common.training_step(trainer, model, optimizer, batch)

    def activate():
        (unsloth_adaptive_kl.patch if patched else unsloth_adaptive_kl.unpatch)()

    info = {"beta_start": float(trainer.beta)}
    module = getattr(trainer, "_adaptive_loss_module", None)
    if module is not None:  # the raw timings record the LM-head path the module's last call ran
        train_step = step

        def step():
            train_step()
            info["head_path"] = module.head_path

    return _common.Row(name=name, step=step, activate=activate, info=info, steps_per_call=_common.steps_per_call(trainer)), trainer


def build_rows(args, common) -> tuple[list, list]:
    built = [make_row(key, **common) for key in _common.wanted_rows(args)]
    return [row for row, _ in built], [trainer for _, trainer in built]


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


def run_mode(mode, args, report, deadline, build=build_rows):
    """One mode's rows (``build(args, common)``: rows and their trainers), interleaved until ``deadline``."""
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
    params, optimizer = _common.make_optimizer(model, device)
    batch = _common.fixed_batch(
        batch=args.batch, prompt_len=args.prompt, min_completion=args.min_completion, max_completion=args.max_completion, vocab=args.vocab, device=device
    )  # fmt: skip
    common = dict(args=args, model=model, ref_model=ref_model, optimizer=optimizer, batch=batch, tokenizer=tokenizer)
    rows, trainers = build(args, common)
    title = f"{mode}: {'LoRA r=16' if mode == 'lora' else 'full fine-tuning, separate reference model'}"
    note = f"trainable parameters: {sum(p.numel() for p in params):,}; memory {memory_estimate(mode, args)}"
    _common.time_mode(report, title, rows, trainers, STOCK, note, args, device, deadline)
    return rows


def main(argv=None, *, args=None, script="bench_trl.py", title="TRL backend: training part of a GRPO step", build=build_rows) -> int:
    """The benchmark; ``args`` (parsed already), ``script``, ``title`` and ``build`` (the rows) let another
    script run its own rows through the same method (bench_loss_class.py)."""
    args = args or parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA GPU (or --smoke for a CPU pass)")
    start = time.monotonic()
    import unsloth_adaptive_kl  # noqa: F401

    precision = f", {'float32' if args.smoke else 'bf16'}"
    header = _common.step_header(script, title, args, argv, precision=precision)
    return _common.run_report(args, start, header, lambda mode, report, deadline: run_mode(mode, args, report, deadline, build=build))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
