"""Unsloth backend: the training part of a GRPO step, stock Unsloth vs each method, interleaved.

One process, one GPU, Unsloth's generated ``UnslothGRPOTrainer`` (its fused, compiled GRPO loss).
The same method as ``bench_trl.py`` (``bench/_common.py``, docs/benchmarks.md): for each of
``--modes`` (``lora``: ``FastLanguageModel.get_peft_model`` r=16 on every projection, Unsloth's
normal mode, the reference is the model with the adapter off; ``full``: ``full_finetuning=True``,
the reference is a separate frozen model, as Unsloth's trainer makes it), one model and one AdamW
are shared by every row, every row trains on the same fixed batch (no generation), and a timed
step is: the reference forward (``_common.reference_logps``, skipped when β = 0), then
``trainer.compute_loss`` + ``backward``, ``optimizer.step()``, and the ``on_step_end`` callbacks.

Rows: ``stock`` (Unsloth's own functions: the package switched off), each ``kl_adaptation_method``
(every patched row computes the tail metrics in the fused loss), ``beta -> 0`` (``dynamic`` with
``beta_min=0``, 0 from its second step on), ``stock, beta=0``, ``kl_monitor (beta=0)`` (the full monitor,
``kl_monitor_every=1``), ``kl_monitor sampled`` (its default ``kl_monitor_every``: a timed call is a cycle of that
many steps, the first with the reference forward, timed per step; its unmonitored steps take Unsloth's own β = 0
graph, compiled in its first, untimed cycle) (the monitors' cost: the report's note pairs each with ``stock,
beta=0``) and ``none`` with ``kl_exclude_token_ids``.

Switching between stock and patched: ``unpatch()`` then ``patch()`` would compile the rewritten
functions anew, and ``torch.compile`` would compile the fused loss again after every switch. So
every trainer is built once, and each block switches with ``_common.PatchSwitch``, which puts back
the very objects ``unpatch()`` restores or ``patch()`` set: after each row's first block (2 untimed
steps: compilation, and β reaching 0 in the ``beta -> 0`` row) no step should compile anything,
and the table counts the graphs compiled in timed steps (``torch._dynamo`` counters) to show it.

    python bench/bench_unsloth.py --out /tmp/bench-unsloth.md      # ~1 B Llama, LoRA and full FT
    python bench/bench_unsloth.py --smoke --out /tmp/u.md          # tiny model, CPU (see below)

``--smoke`` runs a tiny model through the same code (~30 s), on the CPU where there is no GPU:
Unsloth's trainer is then generated through its private entry point
(``unsloth_adaptive_kl.backends.unsloth.generate_trainer_module``), Unsloth's CPU fallback loads
the model, Triton is interpreted, and TorchInductor compiles the fused loss for the CPU: the graph
counts are real (``UNSLOTH_COMPILE_DISABLE=1`` runs it eagerly instead). The timings mean nothing.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # a private cache per run (as the tests' Unsloth worker does): a shared one was seen to feed a stale graph
    os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", tempfile.mkdtemp(prefix="unsloth-cache-"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-cache-"))
    os.environ.setdefault("TORCHINDUCTOR_ERROR_ON_CUSTOM_OP_ALIASING", "0")

import torch  # noqa: E402

import _common  # noqa: E402

STOCK = "stock Unsloth (unpatched)"
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv=None):
    p, args = _common.parse_args(
        argv, description=__doc__, batch=8, first_warmup=2, first_warmup_why=" (compilation; beta -> 0 reaching 0)",
        budget_includes="import and model building", smoke_help="tiny model (on the CPU without a GPU), 3 rounds",
        smoke_hidden=64, smoke_rounds=3,
    )  # fmt: skip
    if args.first_warmup < 2:
        p.error("--first-warmup must be at least 2 (the beta -> 0 row reaches 0 after its first step; its graph for 0 compiles in the second)")
    _common.check_modes(p, args)
    return args


def import_unsloth():
    """``import unsloth`` first (as Unsloth asks), then this package; the generated trainer module,
    patched, and a :class:`_common.PatchSwitch` over the whole patch."""
    import unsloth  # noqa: F401

    import unsloth_adaptive_kl
    from unsloth_adaptive_kl.backends import unsloth as backend

    module = backend.generate_trainer_module()
    if module is None:
        raise SystemExit(f"Unsloth generated no {backend.GENERATED_MODULE} module: nothing to benchmark")
    unsloth_adaptive_kl.patch()  # patches the generated module if it appeared after the import
    if backend._patched_module is not module:
        raise SystemExit(f"unsloth_adaptive_kl did not patch {backend.GENERATED_MODULE}: the rows would all be stock")
    return module, _common.PatchSwitch()


def make_row(key, *, switch, module, args, model, ref_model, optimizer, batch, tokenizer, device):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from unsloth_adaptive_kl.backends.unsloth_hooks import forget_accepted_config_arguments

    name, fields = _common.row_name_and_fields(key, STOCK)
    beta = fields.pop("beta", args.beta)
    stock = key in _common.UNPATCHED_KEYS
    activate = switch.stock if stock else switch.patched
    activate()
    # Unsloth memoises the keyword names its config accepts; patch() and unpatch() empty that memo, a
    # switch does not: empty it here, or a config made after a switch would be filtered with the other
    # state's names (the adaptive-KL fields passed to the stock __init__).
    forget_accepted_config_arguments()
    if not isinstance(GRPOTrainer, type) or GRPOTrainer.__module__ != module.__name__:
        raise SystemExit(f"trl.GRPOTrainer is {GRPOTrainer!r}, not Unsloth's generated trainer: import unsloth first")
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-unsloth-"), report_to="none", per_device_train_batch_size=args.batch,
        num_generations=args.batch, gradient_accumulation_steps=1, max_completion_length=args.max_completion,
        learning_rate=1e-6, beta=beta, seed=0, save_strategy="no", disable_tqdm=True, logging_steps=1,
        **(dict(use_cpu=True, bf16=False) if device.type == "cpu" else dict(bf16=True)), **fields,
    )  # fmt: skip
    dataset = Dataset.from_list([{"prompt": "w0 w1"}] * 8)
    with _common.shared_reference(module, ref_model) if ref_model is not None else contextlib.nullcontext():
        trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[lambda completions, **k: [0.0] * len(completions)], args=config, train_dataset=dataset)
    runtime = getattr(trainer, "_adaptive_kl", None)
    if not stock and (runtime is None or trainer.args.kl_adaptation_method != fields["kl_adaptation_method"]):
        raise SystemExit(f"row {name}: the trainer was built without the adaptive KL (config {trainer.args.kl_adaptation_method!r}): not a patched row")
    if stock and runtime is not None:
        raise SystemExit("the stock row's trainer was built patched")
    if ref_model is not None and trainer.ref_model is None and beta != 0.0:
        raise SystemExit(f"row {name}: full fine-tuning without a reference model (beta {args.beta})")
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which does not run here
    step = _common.training_step(trainer, model, optimizer, batch)
    row = _common.Row(name=name, step=step, activate=activate, info={"beta_start": float(trainer.beta)}, steps_per_call=_common.steps_per_call(trainer))
    return row, trainer


def run_mode(mode, args, checkpoint, module, switch, report, deadline):
    from transformers import AutoModelForCausalLM
    from unsloth import FastLanguageModel

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    max_len = args.prompt + args.max_completion + 8
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=checkpoint, max_seq_length=max_len, load_in_4bit=False, dtype=dtype, full_finetuning=mode == "full"
    )  # fmt: skip
    ref_model = None
    if mode == "lora":
        model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, target_modules=TARGET_MODULES, random_state=0)
    else:
        ref_model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval().requires_grad_(False)
    FastLanguageModel.for_training(model)
    params, optimizer = _common.make_optimizer(model, device)
    batch = _common.fixed_batch(
        batch=args.batch, prompt_len=args.prompt, min_completion=args.min_completion, max_completion=args.max_completion, vocab=args.vocab, device=device
    )  # fmt: skip
    common = dict(switch=switch, module=module, args=args, model=model, ref_model=ref_model, optimizer=optimizer, batch=batch, tokenizer=tokenizer, device=device)
    keys = _common.wanted_rows(args)
    built = {key: make_row(key, **common) for key in keys}
    switch.patched()
    rows, trainers = [built[k][0] for k in keys], [built[k][1] for k in keys]
    title = f"{mode}: {'LoRA r=16 (FastLanguageModel.get_peft_model)' if mode == 'lora' else 'full fine-tuning (full_finetuning=True), separate reference model'}"
    note = f"trainable parameters: {sum(p.numel() for p in params):,}"
    try:
        _common.time_mode(report, title, rows, trainers, STOCK, note, args, device, deadline)
    finally:
        switch.patched()
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench_unsloth.py needs a CUDA GPU (or --smoke for a CPU pass)")
    start = time.monotonic()
    module, switch = import_unsloth()
    from torch import _dynamo

    # Many trainers in one process: every configuration keeps its own compiled graphs (past the
    # default limit, Unsloth's fused loss falls back to eager silently, which would skew the times).
    _dynamo.config.recompile_limit = 256
    _dynamo.config.accumulated_recompile_limit = 4096
    checkpoint = _common.build_checkpoint(
        tempfile.mkdtemp(prefix="bench-unsloth-model-"), hidden=args.hidden, layers=args.layers, vocab=args.vocab,
        max_len=args.prompt + args.max_completion + 8, device="cuda" if torch.cuda.is_available() else "cpu",
    )  # fmt: skip
    from unsloth_adaptive_kl._source_patch import version_of

    compiled = "eager (UNSLOTH_COMPILE_DISABLE=1)" if os.environ.get("UNSLOTH_COMPILE_DISABLE") == "1" else "compiled"
    versions = f"; unsloth {version_of('unsloth')}, unsloth_zoo {version_of('unsloth_zoo')}, trl {version_of('trl')}; fused loss {compiled}"
    setup = f"; setup (import, model) {time.monotonic() - start:.0f} s"
    header = _common.step_header("bench_unsloth.py", "Unsloth backend: training part of a GRPO step", args, argv, versions=versions, setup=setup)
    return _common.run_report(args, start, header, lambda mode, report, deadline: run_mode(mode, args, checkpoint, module, switch, report, deadline))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
