"""Unsloth backend: the training part of a GRPO step, stock Unsloth vs each method, interleaved.

One process, one GPU, Unsloth's generated ``UnslothGRPOTrainer`` (its fused, compiled GRPO loss).
The same method as ``bench_trl.py`` (``bench/_common.py``, docs/benchmarks.md): for each of
``--modes`` (``lora``: ``FastLanguageModel.get_peft_model`` r=16 on every projection, Unsloth's
normal mode, the reference is the model with the adapter off; ``full``: ``full_finetuning=True``,
the reference is a separate frozen model, as Unsloth's trainer makes it), one model and one AdamW
are shared by every row, every row trains on the same fixed batch (no generation), and a timed
step is: the reference forward (``_common.reference_logps``, skipped when β = 0), then
``trainer.compute_loss`` + ``backward``, ``optimizer.step()``, and the ``on_step_end`` callbacks.

Rows: ``stock`` (Unsloth's own functions: the package switched off), each ``kl_adaptation_method``,
and ``beta -> 0`` (``dynamic`` with ``beta_min=0``, 0 from its second step on).

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

import argparse
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

METHODS = ["none", "clip", "sigmoid", "length_normalized", "dynamic", "target", "dynamic+length_normalized"]
STOCK = "stock Unsloth (unpatched)"
ZERO = "beta -> 0 (dynamic, beta_min=0)"
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batch", type=int, default=8, help="completions per step (one group, one micro-batch)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--min-completion", type=int, default=512)
    p.add_argument("--max-completion", type=int, default=1024)
    p.add_argument("--modes", default="lora,full")
    p.add_argument("--rows", default="all", help=f"comma-separated subset of: stock,{','.join(METHODS)},zero")
    p.add_argument("--rounds", type=int, default=40, help="at most this many rounds per mode (the budget usually stops them first)")
    p.add_argument("--steps", type=int, default=1, help="timed steps per row per round")
    p.add_argument("--warmup", type=int, default=0, help="untimed steps per row per round, after its first round")
    p.add_argument("--first-warmup", type=int, default=2, help="untimed steps in each row's first block (compilation; beta -> 0 reaching 0)")
    p.add_argument("--budget", type=float, default=190.0, help="seconds for the whole run, import and model building included; each mode gets an equal share of what is left")
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--out", help="Markdown file rewritten after every round (and OUT.json with every timing, after every block)")
    p.add_argument("--smoke", action="store_true", help="tiny model (on the CPU without a GPU), 2 rounds")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.vocab, args.prompt, args.min_completion, args.max_completion = 64, 2, 300, 4, 6, 12
        args.batch, args.rounds = min(args.batch, 4), min(args.rounds, 3)
    if args.first_warmup < 2:
        p.error("--first-warmup must be at least 2 (the beta -> 0 row reaches 0 after its first step; its graph for 0 compiles in the second)")
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

    if key == "stock":
        name, fields = STOCK, {}
        switch.stock()
    elif key == "zero":
        # beta_min=0 reached by the schedule after 1 step, the first (untimed) warm-up step
        name, fields = ZERO, dict(kl_adaptation_method="dynamic", reward_threshold=1e9, beta_min=0.0, beta_schedule_steps=1)
        switch.patched()
    else:
        name, fields = key, dict(kl_adaptation_method=key)
        if "dynamic" in key:
            fields["reward_threshold"] = -1.0  # no reward is observed here; keep the controller moving
        switch.patched()
    # Unsloth caches the keyword names its config accepts (unsloth.models.rl_config_compat); patch()
    # drops that entry, a switch does not: drop it here, or a config made after a switch would be
    # filtered with the other state's names (the adaptive-KL fields passed to the stock __init__).
    getattr(sys.modules.get("unsloth.models.rl_config_compat"), "_ACCEPTED_CACHE", {}).clear()
    if not isinstance(GRPOTrainer, type) or GRPOTrainer.__module__ != module.__name__:
        raise SystemExit(f"trl.GRPOTrainer is {GRPOTrainer!r}, not Unsloth's generated trainer: import unsloth first")
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-unsloth-"), report_to="none", per_device_train_batch_size=args.batch,
        num_generations=args.batch, gradient_accumulation_steps=1, max_completion_length=args.max_completion,
        learning_rate=1e-6, beta=args.beta, seed=0, save_strategy="no", disable_tqdm=True, logging_steps=1,
        **(dict(use_cpu=True, bf16=False) if device.type == "cpu" else dict(bf16=True)), **fields,
    )  # fmt: skip
    dataset = Dataset.from_list([{"prompt": "w0 w1"}] * 8)
    with _common.shared_reference(module, ref_model) if ref_model is not None else contextlib.nullcontext():
        trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[lambda completions, **k: [0.0] * len(completions)], args=config, train_dataset=dataset)
    runtime = getattr(trainer, "_adaptive_kl", None)
    if key != "stock" and (runtime is None or trainer.args.kl_adaptation_method != fields["kl_adaptation_method"]):
        raise SystemExit(f"row {name}: the trainer was built without the adaptive KL (config {trainer.args.kl_adaptation_method!r}): not a patched row")
    if key == "stock" and runtime is not None:
        raise SystemExit("the stock row's trainer was built patched")
    if ref_model is not None and trainer.ref_model is None:
        raise SystemExit(f"row {name}: full fine-tuning without a reference model (beta {args.beta})")
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which does not run here

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

    activate = switch.stock if key == "stock" else switch.patched
    return _common.Row(name=name, step=step, activate=activate, info={"beta_start": float(trainer.beta)}), trainer


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
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-6, **({"fused": True} if device.type == "cuda" else {"foreach": True}))
    batch = _common.fixed_batch(
        batch=args.batch, prompt_len=args.prompt, min_completion=args.min_completion, max_completion=args.max_completion, vocab=args.vocab, device=device
    )  # fmt: skip
    common = dict(switch=switch, module=module, args=args, model=model, ref_model=ref_model, optimizer=optimizer, batch=batch, tokenizer=tokenizer, device=device)
    keys = wanted_rows(args)
    built = {key: make_row(key, **common) for key in keys}
    switch.patched()
    rows, trainers = [built[k][0] for k in keys], [built[k][1] for k in keys]
    title = f"{mode}: {'LoRA r=16 (FastLanguageModel.get_peft_model)' if mode == 'lora' else 'full fine-tuning (full_finetuning=True), separate reference model'}"
    note = f"trainable parameters: {sum(p.numel() for p in params):,}"

    def on_block(_, round_finished):
        for row, trainer in zip(rows, trainers):
            row.info["beta_now"] = float(trainer.beta)
        report.update(title, rows, STOCK, note, tables=round_finished)

    try:
        completed = _common.run_rounds(
            rows, rounds=args.rounds, steps=args.steps, warmup=args.warmup, first_warmup=args.first_warmup, device=device,
            deadline=deadline, on_block=on_block,
        )  # fmt: skip
    finally:
        switch.patched()
    if device.type == "cuda":
        note += f"; peak of the mode {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
    report.update(title, rows, STOCK, note + f"; rounds completed: {completed} of {args.rounds}")
    del trainers, built, model, ref_model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
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

    n_params = _common.parameter_count(args.hidden, args.layers, args.vocab)
    compiled = "eager (UNSLOTH_COMPILE_DISABLE=1)" if os.environ.get("UNSLOTH_COMPILE_DISABLE") == "1" else "compiled"
    header = (
        f"## Unsloth backend: training part of a GRPO step\n\nmachine: {_common.machine()}; unsloth {version_of('unsloth')}, "
        f"unsloth_zoo {version_of('unsloth_zoo')}, trl {version_of('trl')}; fused loss {compiled}\n"
        f"model: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab} ({n_params / 1e9:.2f} B parameters); "
        f"batch {args.batch} x (prompt {args.prompt} + completions {args.min_completion}-{args.max_completion} tokens); "
        f"beta {args.beta}; per row and round {args.steps} timed step(s) after {args.warmup} untimed ({args.first_warmup} in its first round), "
        f"interleaved, up to {args.rounds} rounds within --budget {args.budget:.0f} s; setup (import, model) {time.monotonic() - start:.0f} s\n"
        f"command: python bench/bench_unsloth.py {' '.join(argv if argv is not None else sys.argv[1:])}"
    )
    report = _common.Report(args.out, header)
    modes = args.modes.split(",")
    for i, mode in enumerate(modes):
        share = (args.budget - (time.monotonic() - start)) / (len(modes) - i)
        run_mode(mode, args, checkpoint, module, switch, report, deadline=time.monotonic() + share)
    print(report.text())
    print(f"wall time: {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
