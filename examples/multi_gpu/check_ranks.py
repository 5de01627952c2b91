"""Two-process GRPO with the TRL backend (or ``--backend unsloth``) under ``accelerate launch``: are the ranks consistent?

    python examples/multi_gpu/check_ranks.py --config examples/multi_gpu/ddp.yaml --out /tmp/mg-ddp
    python examples/multi_gpu/check_ranks.py --config examples/multi_gpu/fsdp2.yaml --out /tmp/mg-fsdp
    python examples/multi_gpu/check_ranks.py --config examples/multi_gpu/fsdp2.yaml --lora --out /tmp/mg-fsdp-lora
    python examples/multi_gpu/check_ranks.py --config examples/multi_gpu/deepspeed_zero2.yaml --out /tmp/mg-ds2
    python examples/multi_gpu/check_ranks.py --config examples/multi_gpu/deepspeed_zero3.yaml --out /tmp/mg-ds3
    python examples/multi_gpu/check_ranks.py --config examples/multi_gpu/ddp.yaml --backend unsloth --out /tmp/mg-unsloth
    python examples/multi_gpu/check_ranks.py --config examples/multi_gpu/ddp.yaml --cpu --out /tmp/mg-cpu   # 2 CPU processes, gloo
    python examples/multi_gpu/check_ranks.py --config examples/multi_gpu/fsdp2.yaml --cpu --precision bf16 --out /tmp/mg-cpu-fsdp

It builds a small Llama and tokenizer (``examples/toy.py``), then launches
``accelerate launch --config_file CONFIG --num_processes 2 check_ranks.py --worker ...`` under a
timeout (a hang fails the check instead of blocking). Every rank trains ``--steps`` GRPO steps
for each of ``--methods`` (default: the β controllers ``none``, ``dynamic``, ``target`` and the
shaping ``clip``), the whole model or (``--lora``) a LoRA adapter; rank 1 masks its first completion
and cuts the others to 3 tokens, so the ranks see different completion lengths and an all-masked row.
Each rank records:

* β at the start and after every optimizer step;
* for every micro-batch, the per-token raw and adapted KL of its valid tokens (with Unsloth, whose
  fused loss keeps them inside its compiled region: the rank's local sums of them), and the
  ``adaptive_kl/*`` values the package computed (after its cross-process reduce);
* the inputs and the loss of step 2's micro-batch, the KL rows that micro-batch recorded, and the weights
  (gathered from the wrapped model: DeepSpeed's engine under ZeRO-3) that loss saw.

Then this process (no launcher) checks:

1. β is identical on both ranks at every step;
2. every logged ``adaptive_kl/raw_kl`` and ``adapted_kl`` equals the token-weighted mean of the
   per-token values gathered from both ranks (recomputed here in float64), to 1e-6 relative;
3. the loss of step 2's global batch (both ranks' inputs concatenated), computed by one process
   from the same weights, β and gradient-accumulation divisor (Unsloth's config accumulates 2
   micro-batches by default), equals the mean of the two ranks' losses (the gradient
   DDP/FSDP/ZeRO apply), within bf16 tolerance (float32 tolerance with ``--precision fp32``). That
   process is a child started with exactly one visible GPU (``CUDA_VISIBLE_DEVICES`` = the first this
   process sees): a Trainer that sees 2 GPUs wraps the model in ``nn.DataParallel``, which GRPOTrainer
   refuses. If it fails, the report shows its exception. The compared micro-batch's KL must not be 0 on
   every rank: that loss check then could not see the KL term (a policy still at the reference), and fails.

With ``--cpu`` an FSDP config runs as FSDP2 over gloo (``fully_shard`` works on CPU; accelerate alone
would fall back to DDP there, see :func:`fsdp_on_cpu`); a DeepSpeed config still falls back to DDP and
is reported as a failure. It prints a table (β per rank per step) and writes ``OUT/report.md`` and
``OUT/report.json``; the exit status is 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:  # examples/, for the toy task (examples/toy.py), in every rank too
    sys.path.insert(0, os.path.dirname(HERE))
METHODS = {  # not a registry list: one case per kind, each with settings that make beta move
    "none": dict(kl_adaptation_method="none"),
    "dynamic": dict(kl_adaptation_method="dynamic", reward_threshold=-1.0),  # decays every step
    "target": dict(kl_adaptation_method="target", kl_target=1e-6),  # far below the KL: β rises from step 2 on
    "clip": dict(kl_adaptation_method="clip", kl_clip_threshold=0.002),
}
BETA = 0.04
BATCH, GENERATIONS, COMPLETION = 4, 4, 8  # per rank: 4 completions, one group of 4 per rank
CAPTURE_STEP = 2  # the loss compared with one process: step 2's, once the policy has moved from the reference


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="accelerate config file (examples/multi_gpu/*.yaml)")
    p.add_argument("--out", required=True)
    p.add_argument("--cpu", action="store_true", help="2 CPU processes over gloo, float32 unless --precision bf16 (no GPU needed)")
    p.add_argument("--precision", choices=("bf16", "fp32"), help="mixed precision of the run (default: bf16 on GPU, fp32 with --cpu)")
    p.add_argument("--lora", action="store_true", help="train a LoRA adapter (peft) instead of the full model")
    p.add_argument("--backend", choices=("trl", "unsloth"), default="trl",
                   help="unsloth: Unsloth's generated GRPO trainer and fused loss, a LoRA model from FastLanguageModel (GPU only)")  # fmt: skip
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--timeout", type=int, default=300, help="seconds for the launched run; longer counts as a hang")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--worker", nargs=1, metavar="CHECKPOINT", help=argparse.SUPPRESS)
    p.add_argument("--reference", nargs=1, metavar="CHECKPOINT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.bf16 = (args.precision or ("fp32" if args.cpu else "bf16")) == "bf16"
    unknown = [m for m in args.methods.split(",") if m not in METHODS]
    if unknown:
        p.error(f"--methods: unknown {unknown}; allowed: {list(METHODS)}")
    if args.backend == "unsloth" and args.cpu:
        p.error("--backend unsloth needs a GPU (Unsloth does not run on CPU)")
    args.lora = args.lora or args.backend == "unsloth"
    if args.steps < CAPTURE_STEP:
        p.error(f"--steps must be at least {CAPTURE_STEP} (step {CAPTURE_STEP}'s loss is compared with one process)")
    if not args.worker and not args.reference and not args.config:
        p.error("--config is required")
    return args


def grpo_config(method: str, args, output_dir: str):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir, report_to="none", use_cpu=args.cpu, bf16=args.bf16,
        per_device_train_batch_size=BATCH, num_generations=GENERATIONS, max_completion_length=COMPLETION,
        max_steps=args.steps, logging_steps=1, learning_rate=5e-3, beta=BETA, save_strategy="no", seed=0,
        disable_tqdm=True, warmup_steps=0, **METHODS[method],
    )  # fmt: skip
    # warmup_steps=0: TRL's default; Unsloth's config defaults to warmup_steps=0.1 (one step of 4 here, at a
    # learning rate of 0), which left the policy at the reference at step 2, so the loss check saw a KL of 0.


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_trainer(method: str, args, checkpoint: str, output_dir: str):
    """The GRPO trainer every rank (and the one-process reference) builds: the TRL backend, full
    fine-tuning or (``--lora``) a LoRA adapter on every projection of the toy Llama."""
    import_backend(args)
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    import unsloth_adaptive_kl  # noqa: F401  (patches TRL, or Unsloth's generated trainer)
    import toy

    peft_config, model, tokenizer = None, checkpoint, None
    if args.backend == "unsloth":
        import torch
        from unsloth import FastLanguageModel

        # Unsloth puts each rank's model on cuda:LOCAL_RANK under a launcher (unsloth/models/loader_utils.py)
        model, tokenizer = FastLanguageModel.from_pretrained(model_name=checkpoint, max_seq_length=128, load_in_4bit=False, dtype=torch.bfloat16)
        model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=16, target_modules=LORA_TARGETS, random_state=0)
    elif args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(checkpoint)
    return GRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[toy.format_reward, toy.correctness_reward],
        args=grpo_config(method, args, output_dir), train_dataset=same_length_prompts(tokenizer, 64), peft_config=peft_config,
    )  # fmt: skip


def fsdp_on_cpu() -> None:
    """Let ``--cpu`` run an FSDP config as FSDP. accelerate sets FSDP up only on an accelerator (on CPU its state
    says MULTI_CPU and the model gets DDP), while torch's ``fully_shard`` runs on CPU over gloo: when the launcher
    asked for FSDP (``ACCELERATE_USE_FSDP``), make the state FSDP with the plugin it was given, as accelerate does
    on GPU. Only the ``--cpu`` worker calls it."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def __init__(self, *a, **k):
        original(self, *a, **k)
        plugin = k.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            # every AcceleratorState() copies PartialState's type: set both, as accelerate's own init does
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            if self._mixed_precision != "no":
                plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = plugin

    AcceleratorState.__init__ = __init__


def same_length_prompts(tokenizer, n: int):
    """Prompts that all tokenize to the same length: concatenating two ranks' batches then needs no
    re-padding of the prompts, so every token keeps its position (Llama takes positions from the index)."""
    from collections import Counter

    from datasets import Dataset

    import toy

    rows = toy.arithmetic_problems(8 * n)
    lengths = [len(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]) for r in rows]
    common = Counter(lengths).most_common(1)[0][0]
    keep = [r for r, length in zip(rows, lengths) if length == common][:n]
    if len(keep) < n:
        raise RuntimeError(f"only {len(keep)} prompts of {common} tokens; need {n}")
    return Dataset.from_list(keep)


# -- one rank (under accelerate launch) ------------------------------------------------------------------
def import_backend(args) -> None:
    """Unsloth first, before transformers and trl (it patches them), in every process that builds a trainer.
    Each rank gets its own compile cache: two ranks writing Unsloth's generated trainer modules into one
    folder at once is the race of unsloth issue #3031 ("module 'UnslothPPOTrainer' has no attribute ...")."""
    if args.backend == "unsloth":
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            base = os.environ.get("UNSLOTH_COMPILE_LOCATION", "unsloth_compiled_cache")
            os.environ["UNSLOTH_COMPILE_LOCATION"] = f"{base}-rank{os.environ.get('RANK', '0')}"
        import unsloth  # noqa: F401


def worker(args):
    import faulthandler

    # a rank that aborts in C++ (a CPU CI run once saw "terminate called without an active exception" on rank 1 after
    # both trainings) prints every thread's Python stack to stderr, which the test's failure message shows
    faulthandler.enable(all_threads=True)
    import_backend(args)
    import torch
    from transformers import TrainerCallback

    from unsloth_adaptive_kl import metrics

    checkpoint = args.worker[0]
    rank = int(os.environ.get("RANK", "0"))
    if args.cpu and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        fsdp_on_cpu()
    results = {"world_size": int(os.environ.get("WORLD_SIZE", "1")), "rank": rank}

    for method in args.methods.split(","):
        trainer = make_trainer(method, args, checkpoint, tempfile.mkdtemp(prefix=f"mg-{method}-"))
        runtime = getattr(trainer, "_adaptive_kl", None)
        if runtime is None or not hasattr(runtime, "record"):
            raise RuntimeError("the trainer has no adaptive-KL runtime with record(): is unsloth_adaptive_kl's TRL patch applied?")
        record = {"betas": [float(trainer.beta)], "rows": [], "loss": None}

        class Betas(TrainerCallback):
            def on_step_begin(self, a, state, control, **kwargs):
                if state.global_step == CAPTURE_STEP - 1:  # the weights this step's loss sees, gathered (a collective)
                    # model_wrapped: under DeepSpeed the engine, which ZeRO-3 needs to gather its shards (the bare model has
                    # no zero_gather_16bit_weights_on_model_save); DDP's wrapper is unwrapped; FSDP2's is the model itself.
                    weights = trainer.accelerator.get_state_dict(trainer.model_wrapped)
                    if rank == 0:
                        torch.save(weights, os.path.join(args.out, f"{method}-weights.pt"))
                    record["armed"] = True

            def on_step_end(self, a, state, control, **kwargs):
                record["betas"].append(float(trainer.beta))

        trainer.add_callback(Betas())

        generate = trainer._generate_and_score_completions

        def uneven(*a, **k):
            out = generate(*a, **k)
            if rank == 1:  # an all-masked row and short rows on rank 1 only
                mask = out["completion_mask"].clone()
                mask[0] = 0
                mask[1:, 3:] = 0
                out["completion_mask"] = mask
            return out

        trainer._generate_and_score_completions = uneven

        original_record, original_record_sums = runtime.record, runtime.record_sums

        def record_values(raw, adapted, mask, *, training, beta):  # the TRL backend: every valid token's KL
            values = original_record(raw, adapted, mask, training=training, beta=beta)
            if raw is not None and training:
                valid = mask.bool()
                logged = {"logged_raw": values[metrics.RAW_KL], "logged_adapted": values[metrics.ADAPTED_KL]}
                record["rows"].append({"raw": raw[valid].double().tolist(), "adapted": adapted[valid].double().tolist(), **logged})
            return values

        def record_sums(local_sums, *, training, beta):  # Unsloth's fused loss: only this rank's sums leave it
            values = original_record_sums(local_sums, training=training, beta=beta)
            if local_sums is not None and training:
                logged = {"logged_raw": values[metrics.RAW_KL], "logged_adapted": values[metrics.ADAPTED_KL]}
                record["rows"].append({"sums": local_sums.double().tolist(), **logged})
            return values

        if args.backend == "unsloth":
            runtime.record_sums = record_sums
        else:
            runtime.record = record_values

        compute_loss = trainer.compute_loss

        def captured_loss(model, inputs, *a, **k):
            rows_before = len(record["rows"])
            loss = compute_loss(model, inputs, *a, **k)
            if record.pop("armed", False):
                record["loss"], record["loss_beta"] = float(loss.detach()), float(trainer.beta)
                # the KL rows this very micro-batch recorded (one; none if β was 0): the KL the loss check can see
                record["loss_rows"] = list(range(rows_before, len(record["rows"])))
                cpu = {key: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for key, v in inputs.items()}
                torch.save(cpu, os.path.join(args.out, f"{method}-rank{rank}-inputs.pt"))
            return loss

        trainer.compute_loss = captured_loss
        trainer.train()
        # what the launcher set up: DistributedType and the class of the wrapped model (FSDP2 makes it FSDP<Llama...>)
        results["distributed_type"] = str(trainer.accelerator.distributed_type)
        results["wrapped_model"] = type(trainer.model_wrapped).__name__
        # whole-tensor sizes: an FSDP2 DTensor's numel() is the whole tensor's; a ZeRO-3 parameter's is 0 (ds_numel has it)
        sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in trainer.model.parameters()]
        total = sum(n for n, _ in sizes)
        results["trainable_fraction"] = sum(n for n, trains in sizes if trains) / total if total else None
        results[method] = record
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:  # before the trainer's teardown (below)
            json.dump(results, f)
        trainer.accelerator.wait_for_everyone()
        del trainer
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # torn down here, not at the interpreter's exit, where a
        dist.barrier()  # gloo group's threads can abort a rank ("terminate called without an active exception")
        dist.destroy_process_group()
    # Nothing is left to do, and a rank aborted (SIGABRT) in CI once more after both trainings (2026-11-29; where
    # exactly, the cut log did not show): leave without the interpreter's teardown (C++ destructors), output flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- the checks (one process) ----------------------------------------------------------------------------
def merge_inputs(parts):
    """One global batch from the ranks' inputs: rows concatenated, completion-side tensors padded on the right."""
    import torch

    merged = {}
    for key in parts[0]:
        values = [p[key] for p in parts]
        first = values[0]
        if not isinstance(first, torch.Tensor):
            if any(v != first for v in values):
                raise ValueError(f"input {key!r} differs between ranks: {values}")
            merged[key] = first
        elif first.dim() == 0:
            if any(not torch.equal(v, first) for v in values):
                raise ValueError(f"input {key!r} differs between ranks: {values}")
            merged[key] = first
        elif first.dim() == 1:
            merged[key] = torch.cat(values)
        elif key.startswith("prompt"):
            if len({v.shape[1] for v in values}) != 1:
                raise ValueError(f"prompt lengths differ between ranks ({[v.shape for v in values]}): positions would shift")
            merged[key] = torch.cat(values)
        else:
            width = max(v.shape[1] for v in values)
            merged[key] = torch.cat([torch.nn.functional.pad(v, (0, width - v.shape[1])) for v in values])
    return merged


def single_process_loss(method, args, checkpoint, parts, beta):
    """The loss of the merged batch on one process, with the weights and β the ranks had at that step."""
    import torch
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(True)
    PartialState._reset_state()
    trainer = make_trainer(method, args, checkpoint, tempfile.mkdtemp(prefix=f"mg-single-{method}-"))
    device = trainer.accelerator.device
    weights = torch.load(os.path.join(args.out, f"{method}-weights.pt"), map_location="cpu", weights_only=True)
    trainer.model.load_state_dict(weights)
    trainer.beta = beta
    inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in merge_inputs(parts).items()}
    model = trainer.model
    model.train()
    # The accumulation divisor the ranks' training loop set (len of the step's micro-batches: the configured
    # gradient_accumulation_steps; Unsloth's GRPOConfig defaults to 2). dapo's normaliser scales with it over
    # steps_per_generation (= gradient_accumulation_steps here): 1 made this loss 2x the ranks' mean under Unsloth.
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    # bf16 as under the launcher: accelerate's autocast (the launched ranks get it from prepare()).
    with trainer.compute_loss_context_manager(), trainer.accelerator.autocast():
        loss = trainer.compute_loss(model, inputs)
    return float(loss.detach())


def rank_consistency(zero: dict, one: dict, steps: int) -> tuple[list[str], float]:
    """Checks 1 and 2 on two ranks' records of one method: the failures, and the largest relative
    error of a logged adaptive_kl value against the global token-weighted mean."""
    failures, metric_error = [], 0.0
    if zero["betas"] != one["betas"]:
        failures.append(f"beta differs between ranks: {zero['betas']} vs {one['betas']}")
    if len(zero["betas"]) != steps + 1:
        failures.append(f"{len(zero['betas'])} betas recorded, expected {steps + 1}")
    if len(zero["rows"]) != len(one["rows"]) or not zero["rows"]:
        failures.append(f"micro-batches recorded: {len(zero['rows'])} vs {len(one['rows'])}")
    for a, b in zip(zero["rows"], one["rows"]):
        expected = global_means(a, b)
        for row in (a, b):
            for got, want in zip((row["logged_raw"], row["logged_adapted"]), expected):
                error = 0.0 if (math.isnan(got) and math.isnan(want)) else abs(got - want) / max(abs(want), 1e-12)
                metric_error = max(metric_error, error)
                if not error <= 1e-6:  # the package sums each shard's values in float64 (issue 24: bf16 sums were 5.9e-4 off)
                    failures.append(f"adaptive_kl logged {got!r}, global token-weighted mean {want!r}")
        if valid_tokens(a) == valid_tokens(b):
            failures.append("the ranks did not see different numbers of valid tokens")
    return failures, metric_error


def compared_kl_sums(record: dict) -> tuple[float, float] | None:
    """The (raw, adapted) KL sums of a rank's compared micro-batch (step CAPTURE_STEP's captured loss), from the
    rows that micro-batch recorded; None where it recorded none (β was 0, or no loss was captured)."""
    from unsloth_adaptive_kl import metrics

    rows = [record["rows"][i] for i in record.get("loss_rows") or ()]
    if not rows:
        return None
    if "sums" in rows[0]:
        return tuple(math.fsum(r["sums"][i] for r in rows) for i in (metrics.RAW_SUM, metrics.ADAPTED_SUM))
    return math.fsum(v for r in rows for v in r["raw"]), math.fsum(v for r in rows for v in r["adapted"])


def kl_visibility(zero: dict, one: dict) -> list[str]:
    """The loss check compares losses that hold β times the adapted KL: where the compared micro-batch's KL is 0 on
    every rank (e.g. a policy still at the reference), it cannot tell whether the KL term is right. A failure then."""
    sums = [compared_kl_sums(zero), compared_kl_sums(one)]
    if any(s is None for s in sums):
        return [f"no KL recorded for step {CAPTURE_STEP}'s compared micro-batch (rank 0: {sums[0]}, rank 1: {sums[1]}): the loss check cannot see the KL term"]
    if all(raw == 0 and adapted == 0 for raw, adapted in sums):
        return [f"step {CAPTURE_STEP}'s KL is 0 on every rank (raw, adapted sums of the compared micro-batch: rank 0 {sums[0]}, "
                f"rank 1 {sums[1]}): the loss check cannot see the KL term"]  # fmt: skip
    return []


def valid_tokens(row: dict) -> int:
    from unsloth_adaptive_kl import metrics

    return len(row["raw"]) if "raw" in row else int(row["sums"][metrics.TOKENS])


def global_means(a: dict, b: dict) -> tuple[float, float]:
    """The token-weighted means of raw and adapted KL over both ranks' rows, in float64: from every valid
    token's value (TRL backend), or, where a rank's per-token values never leave Unsloth's compiled loss,
    from each rank's local sums (what one process would compute on both shards)."""
    from unsloth_adaptive_kl import metrics

    if "sums" in a:
        tokens = a["sums"][metrics.TOKENS] + b["sums"][metrics.TOKENS]
        totals = [a["sums"][i] + b["sums"][i] for i in (metrics.RAW_SUM, metrics.ADAPTED_SUM)]
        return tuple(t / tokens for t in totals) if tokens else (math.nan, math.nan)
    raw, adapted = a["raw"] + b["raw"], a["adapted"] + b["adapted"]
    return (math.fsum(raw) / len(raw), math.fsum(adapted) / len(adapted)) if raw else (math.nan, math.nan)


# -- the one-process reference (a child process that sees one device) -------------------------------------
REFERENCE_REQUEST, REFERENCE_RESULT = "reference-request.json", "reference-result.json"
ERROR_LINES = 15  # of a failed reference run's traceback, kept in the report


def one_device_env(cpu: bool, environ=None) -> dict:
    """The environment of the one-process reference run: exactly one visible GPU, the first this process
    sees (none with --cpu). A Trainer that sees 2 GPUs in one process wraps the model in
    ``nn.DataParallel``, which GRPOTrainer refuses."""
    environ = dict(os.environ if environ is None else environ)
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    environ["CUDA_VISIBLE_DEVICES"] = "" if cpu else ("0" if visible is None else visible.split(",")[0].strip())
    environ["TOKENIZERS_PARALLELISM"] = "false"
    return environ


def reference_command(args, checkpoint: str, methods) -> list[str]:
    command = [sys.executable, os.path.abspath(__file__), "--reference", checkpoint, "--out", args.out, "--steps", str(args.steps)]
    command += ["--methods", ",".join(methods), "--timeout", str(args.timeout)] + run_flags(args)
    return command


def run_flags(args) -> list[str]:
    """The flags that make a worker or the reference build the same trainer as this run."""
    flags = ["--precision", "bf16" if args.bf16 else "fp32", "--backend", args.backend]
    return flags + (["--cpu"] if args.cpu else []) + (["--lora"] if args.lora else [])


def reference_losses(args, checkpoint: str, betas: dict) -> dict:
    """Step 2's loss of the global batch for each method of ``betas`` (method: the β the ranks had), from a
    child process that sees one device. Returns ``{"device": what the child saw, method: {"loss": x} or
    {"error": why}}``; a child that failed before writing a method's result gives that method its stderr tail."""
    with open(os.path.join(args.out, REFERENCE_REQUEST), "w") as f:
        json.dump(betas, f)
    result_path = os.path.join(args.out, REFERENCE_RESULT)
    if os.path.exists(result_path):
        os.remove(result_path)
    env = one_device_env(args.cpu)
    try:
        proc = subprocess.run(reference_command(args, checkpoint, betas), env=env, capture_output=True, text=True, timeout=args.timeout)
        why = f"the one-process reference run exited with status {proc.returncode}:\n" + tail(proc.stderr or proc.stdout)
    except subprocess.TimeoutExpired as error:
        why = f"the one-process reference run did not finish in {args.timeout} s:\n" + tail(error.stderr)
    results = {}
    if os.path.exists(result_path):
        with open(result_path) as f:
            results = json.load(f)
    results.setdefault("device", {"CUDA_VISIBLE_DEVICES": env["CUDA_VISIBLE_DEVICES"]})
    for method in betas:
        results.setdefault(method, {"error": why})
    return results


def tail(text, lines: int = ERROR_LINES) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "(no output)").rstrip().splitlines()[-lines:])


def reference(args) -> None:
    """The child: for each requested method, the loss of the merged batch; one method's exception is recorded
    (its traceback's tail) and the others still run. Results are written after each method."""
    import traceback

    import_backend(args)
    import torch

    checkpoint = args.reference[0]
    with open(os.path.join(args.out, REFERENCE_REQUEST)) as f:
        betas = json.load(f)
    gpus = torch.cuda.device_count()
    results = {"device": {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"), "cuda_device_count": gpus}}
    for method, beta in betas.items():
        try:
            if gpus > 1:
                raise RuntimeError(f"the one-process reference sees {gpus} GPUs (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
            parts = [torch.load(os.path.join(args.out, f"{method}-rank{r}-inputs.pt"), weights_only=False) for r in (0, 1)]
            results[method] = {"loss": single_process_loss(method, args, checkpoint, parts, beta)}
        except Exception:  # noqa: BLE001  (reported as this method's failure, with its traceback)
            results[method] = {"error": tail(traceback.format_exc())}
        with open(os.path.join(args.out, REFERENCE_RESULT), "w") as f:
            json.dump(results, f)


def check(args, checkpoint, ranks) -> dict:
    report = {"methods": {}, "passed": True}
    # float32: tight; bf16 (GPU, or --precision bf16): the policy term is exact, exp(logp - logp.detach()) = 1; the
    # tolerance is for the KL term, whose log-probs come from bf16 GEMMs of other batch shapes.
    atol, rtol = (2e-4, 2e-3) if args.bf16 else (1e-6, 1e-5)
    methods = args.methods.split(",")
    captured = {m: ranks[0][m]["loss_beta"] for m in methods if ranks[0][m]["loss"] is not None and ranks[1][m]["loss"] is not None}
    one_process = reference_losses(args, checkpoint, captured) if captured else {}
    report["reference_device"] = one_process.get("device")
    for method in methods:
        zero, one = ranks[0][method], ranks[1][method]
        failures, metric_error = rank_consistency(zero, one, args.steps)
        single = distributed = math.nan
        if method not in captured:
            failures.append(f"no loss captured at step {CAPTURE_STEP}")
        else:
            failures += kl_visibility(zero, one)
            if zero["loss_beta"] != one["loss_beta"]:
                failures.append(f"beta at the compared step differs: {zero['loss_beta']} vs {one['loss_beta']}")
            distributed = (zero["loss"] + one["loss"]) / 2
            result = one_process[method]
            if "error" in result:
                failures.append(f"step-{CAPTURE_STEP} loss on one process failed: {result['error']}")
            else:
                single = result["loss"]
                if not abs(single - distributed) <= atol + rtol * abs(single):
                    failures.append(f"step-{CAPTURE_STEP} loss: mean of ranks {distributed!r}, one process on the global batch {single!r}")
        report["methods"][method] = {
            "betas_rank0": zero["betas"], "betas_rank1": one["betas"], "max_metric_rel_error": metric_error,
            "loss_ranks": [zero["loss"], one["loss"]], "loss_mean_of_ranks": distributed, "loss_one_process": single,
            "tokens_per_rank": [valid_tokens(zero["rows"][0]), valid_tokens(one["rows"][0])] if zero["rows"] and one["rows"] else None,
            "compared_rows": [zero.get("loss_rows"), one.get("loss_rows")], "compared_kl_sums": [compared_kl_sums(zero), compared_kl_sums(one)],
            "failures": failures,
        }  # fmt: skip
        report["passed"] &= not failures
    return report


def format_report(args, report) -> str:
    mode = f" (--cpu: 2 processes, gloo, {'bf16' if args.bf16 else 'float32'})" if args.cpu else ""
    lines = [
        f"config: {args.config}{mode}; backend {args.backend}{'; LoRA (peft)' if args.lora else '; full fine-tuning'}; {args.steps} steps; "
        f"accelerate distributed_type {report['distributed_type']}, wrapped model {report['wrapped_model']}, "
        f"trainable fraction of the parameters {report.get('trainable_fraction')}",
        f"one-process reference: {report.get('reference_device')}",
        "",
    ]
    lines += ["| method | step | β rank 0 | β rank 1 |", "|---|---|---|---|"]
    for method, r in report["methods"].items():
        for step, (b0, b1) in enumerate(zip(r["betas_rank0"], r["betas_rank1"])):
            lines.append(f"| {method} | {step} | {b0:.8g} | {b1:.8g} |")
    lines += ["", "| method | valid tokens rank 0 / 1 (step 1) | adaptive_kl max rel. error | step-2 adapted KL sum rank 0, rank 1 | step-2 loss rank 0, rank 1 | mean of ranks | one process | result |", "|---|---|---|---|---|---|---|---|"]
    for method, r in report["methods"].items():
        result = "ok" if not r["failures"] else f"FAIL ({len(r['failures'])}, below)"
        tokens = "n/a" if r["tokens_per_rank"] is None else f"{r['tokens_per_rank'][0]} / {r['tokens_per_rank'][1]}"
        kl = ", ".join("n/a" if sums is None else f"{sums[1]:.6g}" for sums in r["compared_kl_sums"])
        lines.append(
            f"| {method} | {tokens} | {r['max_metric_rel_error']:.1e} | {kl} | {r['loss_ranks'][0]}, {r['loss_ranks'][1]} | "
            f"{r['loss_mean_of_ranks']:.8f} | {r['loss_one_process']:.8f} | {result} |"
        )
    for method, r in report["methods"].items():
        for failure in r["failures"]:
            lines += ["", f"FAIL {method}:", "```", failure, "```"]
    if report.get("setup_failure"):
        lines += ["", "FAIL: " + report["setup_failure"]]
    for reason in report.get("relaunches", []):
        lines += ["", "relaunched once: " + reason]
    lines += ["", "all checks passed" if report["passed"] else "SOME CHECKS FAILED"]
    return "\n".join(lines)


def configured_type(config_path: str, cpu: bool) -> str:
    """The config file's ``distributed_type`` (MULTI_GPU runs as MULTI_CPU with --cpu)."""
    with open(config_path) as f:
        line = next((line for line in f if line.startswith("distributed_type:")), None)
    if line is None:
        raise SystemExit(f"{config_path}: no distributed_type")
    kind = line.split(":", 1)[1].strip()
    return "MULTI_CPU" if cpu and kind == "MULTI_GPU" else kind


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: lines of a failed run's output that say why it failed: C++ aborts, faulthandler's stacks, Python errors, and the
#: launcher's per-rank exit codes
ABORT = r"terminate called|what\(\)|exitcode|Signal \d+"  # a C++ abort, and how the launcher saw each rank end
SALIENT = re.compile(ABORT + r"|Fatal Python error|^\s*File \"|Error|Exception|Aborted")


def salient(text: str, limit: int = 40) -> str:
    """The lines of ``text`` that say why a run failed (at most ``limit``, the last ones), then its last 5 lines."""
    lines = text.splitlines()
    picked = [line for line in lines if SALIENT.search(line)][-limit:]
    return "\n".join(picked + ["-- last lines --"] + lines[-5:])


def run_shown_and_kept(command, env, timeout, log_path):
    """Runs ``command``, its output shown as it comes and kept in ``log_path``; returns (exit status or None on a
    timeout, the output)."""
    import threading

    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")

        def pump():
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        reader.join(timeout=10)
    with open(log_path) as f:
        return rc, f.read()


def results_written(args) -> bool:
    """Both ranks wrote their results of every method (a rank writes them after each training, before that trainer's
    teardown and the distributed stack's)."""
    for rank in (0, 1):
        try:
            with open(os.path.join(args.out, f"rank{rank}.json")) as f:
                results = json.load(f)
        except (OSError, ValueError):
            return False
        if not all(method in results for method in args.methods.split(",")):
            return False
    return True


def launch(args, checkpoint) -> list[str]:
    """The two ranks, through ``accelerate launch``. Returns the relaunches made (one at most: a rank that died by a
    signal after both ranks had written their results of every method, i.e. in the teardown of the last trainer or of
    the distributed stack, where CPU CI runs saw a rank abort twice; the reason is printed and reported). Any other
    failure, and a second one, raises with the lines of the ranks' output that say why."""
    accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or shutil.which("accelerate")
    if accelerate is None:
        raise SystemExit("accelerate's launcher is not on PATH")
    relaunches = []
    for attempt in (1, 2):
        command = [accelerate, "launch", "--config_file", args.config, "--num_processes", "2", "--main_process_port", str(free_port())]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        if args.cpu:
            # --cpu with 2 processes needs MPI; the torchrun launcher with use_cpu=True (in GRPOConfig) uses gloo.
            command += ["--mixed_precision", "bf16" if args.bf16 else "no"]
            env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TRITON_INTERPRET="1", ACCELERATE_USE_CPU="true")
        command += [os.path.abspath(__file__), "--worker", checkpoint, "--out", args.out, "--steps", str(args.steps), "--methods", args.methods]
        command += run_flags(args)
        for rank in (0, 1):  # a results file is this launch's, never a previous one's
            if os.path.exists(os.path.join(args.out, f"rank{rank}.json")):
                os.remove(os.path.join(args.out, f"rank{rank}.json"))
        print("launch:", " ".join(command), flush=True)
        rc, output = run_shown_and_kept(command, env, args.timeout, os.path.join(args.out, f"launch{attempt}.log"))
        if rc is None:
            raise SystemExit(f"HANG: the 2-process run did not finish in {args.timeout} s (killed)\n{salient(output)}")
        if rc == 0:
            return relaunches
        died_by_signal = re.search(r"exitcode\s*:\s*-\d+", output) is not None
        if attempt == 1 and died_by_signal and results_written(args):
            reason = "a rank died by a signal after both ranks had written their results of every method (teardown): " + "; ".join(
                line.strip() for line in output.splitlines() if re.search(ABORT, line)
            )
            print("relaunching once:", reason, flush=True)
            relaunches.append(reason)
            continue
        raise SystemExit(f"the 2-process run failed (exit status {rc})\n{salient(output)}")
    raise AssertionError("unreachable")


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.cpu:  # TRL's Triton kernels, interpreted (before trl or triton is imported)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.worker:
        worker(args)
        return 0
    if args.reference:
        reference(args)
        return 0
    import toy

    checkpoint = toy.build_checkpoint(os.path.join(args.out, "checkpoint"), hidden_size=args.hidden, layers=args.layers)
    relaunches = launch(args, checkpoint)
    ranks = []
    for rank in (0, 1):
        with open(os.path.join(args.out, f"rank{rank}.json")) as f:
            ranks.append(json.load(f))
    if [r["world_size"] for r in ranks] != [2, 2]:
        raise SystemExit(f"expected 2 processes, got world sizes {[r['world_size'] for r in ranks]}")
    report = check(args, checkpoint, ranks)
    report.update({key: ranks[0].get(key) for key in ("distributed_type", "wrapped_model", "trainable_fraction")})
    report["relaunches"] = relaunches
    expected = configured_type(args.config, args.cpu)
    if not str(report["distributed_type"]).endswith("." + expected):
        # e.g. accelerate runs an FSDP or DeepSpeed config as plain DDP (MULTI_CPU) when use_cpu is set
        report["passed"] = False
        report["setup_failure"] = f"the launcher set up {report['distributed_type']}, not the config's {expected}"
    text = format_report(args, report)
    print(text)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
