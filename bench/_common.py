"""What the GRPO step benchmarks share: the model, the fixed batch, the timed step's reference
forward, the timer, the interleaved schedule, the statistics and the tables (each written once, here).

Method (docs/benchmarks.md): every row trains the same model on the SAME fixed batch (built once,
not generated: generation is not part of what is compared). Rows run interleaved: every round runs
each row's block once, in a random order (seeded); a block is ``warmup`` untimed steps (``first_warmup``
in a row's first block: compilation, autotuning, optimizer state) then ``steps`` timed ones. A step
is timed with CUDA events (``time.perf_counter`` on CPU), with the GPU idle and Python's garbage
collector off while it runs. Two ratios to stock are reported:

* paired (the headline): for every round, median(row's block) / median(stock's block) of that
  round; the median over rounds, with a 95 % percentile-bootstrap interval over rounds. The two
  blocks of a pair ran seconds apart, so slow drift (clocks, temperature) cancels in each pair, and
  rounds are the units the random order makes independent;
* unpaired: median(all the row's steps) / median(all stock's steps), with a 95 % bootstrap
  interval resampling both samples' steps.

Rounds stop before one that would not finish by the deadline, so every row gets the same number.
After every block the raw timings are rewritten to ``--out.json``, and after every round the tables
to ``--out`` (a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

BOOTSTRAP = 2000
MIN_ROUNDS_FOR_PAIRED = 10  # below this, a bootstrap over rounds says little: the table marks it
ZERO = "beta -> 0 (dynamic, beta_min=0)"
# Issue 36's rows. The tail metrics are always on: every patched row pays for them (``none`` vs stock is the
# package's whole cost). kl_monitor's cost, the reference forward at β = 0, is MONITOR against STOCK_BETA0.
STOCK_BETA0 = "stock, beta=0"
MONITOR = "kl_monitor (beta=0)"
#: The sampled monitor at its default kl_monitor_every (issue 53): one timed call is a cycle of kl_monitor_every steps, the
#: first with the reference forward, and its time is reported per step (Row.steps_per_call): the mean cost of a step.
MONITOR_SAMPLED = "kl_monitor sampled (beta=0, default kl_monitor_every)"
EXCLUDE = "none, kl_exclude_token_ids (4 ids)"
UNPATCHED_KEYS = ("stock", "stock_beta0")


def methods() -> list[str]:
    """Every registered method alone (none, the shaping methods, the controllers) and one composition.

    Imported when called: bench_unsloth must import Unsloth before this package."""
    from unsloth_adaptive_kl.method import method_names

    return [*method_names(), "dynamic+length_normalized"]


def row_keys() -> list[str]:
    return ["stock", *methods(), "zero", "stock_beta0", "monitor", "monitor_sampled", "exclude"]


# -- the command line and the rows ----------------------------------------------------------------------------
def parse_args(argv, *, description: str, batch: int, first_warmup: int, first_warmup_why: str, budget_includes: str,
               smoke_help: str, smoke_hidden: int, smoke_rounds: int) -> tuple[argparse.ArgumentParser, argparse.Namespace]:  # fmt: skip
    """The options both step benchmarks take (the arguments are where they differ); the parser is
    returned too, for the checks each script adds."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batch", type=int, default=batch, help="completions per step (one group, one micro-batch)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--min-completion", type=int, default=512)
    p.add_argument("--max-completion", type=int, default=1024)
    p.add_argument("--modes", default="lora,full")
    p.add_argument("--rows", default="all", help="comma-separated subset of: stock, the methods (every one alone, and dynamic+length_normalized), zero")
    p.add_argument("--rounds", type=int, default=40, help="at most this many rounds per mode (the budget usually stops them first)")
    p.add_argument("--steps", type=int, default=1, help="timed steps per row per round")
    p.add_argument("--warmup", type=int, default=0, help="untimed steps per row per round, after its first round")
    p.add_argument("--first-warmup", type=int, default=first_warmup, help=f"untimed steps in each row's first block{first_warmup_why}")
    p.add_argument("--budget", type=float, default=190.0, help=f"seconds for the whole run, {budget_includes} included; each mode gets an equal share of what is left")
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--out", help="Markdown file rewritten after every round (and OUT.json with every timing, after every block)")
    p.add_argument("--smoke", action="store_true", help=smoke_help)
    args = p.parse_args(argv)
    if args.smoke:
        # 2 completions of 2 and 4 tokens (a padded row): on the CPU, TRL's log-prob kernel is the Triton interpreter, one
        # program per valid token and call (bench_trl's sampled monitor row: 21 s of CPU at batch 4 x 6-12, 5.9 s here)
        args.hidden, args.layers, args.vocab, args.prompt, args.min_completion, args.max_completion = smoke_hidden, 2, 300, 4, 2, 4
        args.batch, args.rounds = min(args.batch, 2), min(args.rounds, smoke_rounds)
    return p, args


def check_modes(p: argparse.ArgumentParser, args) -> None:
    for mode in args.modes.split(","):
        if mode not in ("lora", "full"):
            p.error(f"--modes: {mode!r} is not one of lora, full")


def wanted_rows(args) -> list[str]:
    """The row keys of ``--rows`` (``stock``, a method, ``zero``), in the tables' order."""
    keys = row_keys()
    if args.rows == "all":
        return keys
    chosen = args.rows.split(",")
    unknown = [n for n in chosen if n not in keys]
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; allowed: {keys}")
    return [n for n in keys if n in chosen]


def row_name_and_fields(key: str, stock_name: str) -> tuple[str, dict]:
    """A row's name in the tables and the adaptive-KL fields of its config."""
    if key == "stock":
        return stock_name, {}
    if key == "stock_beta0":
        return STOCK_BETA0, dict(beta=0.0)
    if key == "monitor":  # the full monitor: the reference forward at every step
        return MONITOR, dict(kl_adaptation_method="none", beta=0.0, kl_monitor=True, kl_monitor_every=1)
    if key == "monitor_sampled":
        return MONITOR_SAMPLED, dict(kl_adaptation_method="none", beta=0.0, kl_monitor=True)
    if key == "exclude":  # ids the fixed batch draws from (4..vocab); the cost is one comparison per id
        return EXCLUDE, dict(kl_adaptation_method="none", kl_exclude_token_ids=[4, 5, 6, 7])
    if key == "zero":
        # beta_min=0 reached by the schedule after 1 step: the first (untimed) warm-up step; every timed step has β = 0
        return ZERO, dict(kl_adaptation_method="dynamic", reward_threshold=1e9, beta_min=0.0, beta_schedule_steps=1)
    fields = dict(kl_adaptation_method=key)
    if "dynamic" in key:
        fields["reward_threshold"] = -1.0  # no reward is observed here; keep the controller moving
    if key.split("+")[0] == "target":
        fields["target_warmup_steps"] = 0  # the bench's KL is below kl_target: without the warm-up β falls every step
    return key, fields


def steps_per_call(trainer) -> int:
    """How many training steps one call of :func:`training_step`'s function runs: under ``kl_monitor`` a cycle of
    ``kl_monitor_every`` steps (the first runs the reference forward), so every timed call holds the same share of
    monitored steps and its time per step is the monitor's mean cost; 1 otherwise."""
    runtime = getattr(trainer, "_adaptive_kl", None)
    return runtime.monitor_every if runtime is not None and runtime.monitor else 1


def training_step(trainer, model, optimizer, batch) -> Callable[[], None]:
    """One timed call of ``trainer`` on the fixed batch (:func:`steps_per_call` steps): the reference forward (skipped
    at β = 0, as the trainers skip it; under kl_monitor run on the steps it watches, one generation batch a step here),
    the loss, backward, the optimizer, and the step-end callbacks (β updates)."""
    runtime = getattr(trainer, "_adaptive_kl", None)  # None for a stock trainer
    cycle = steps_per_call(trainer)

    def step():
        for _ in range(cycle):
            one_step()

    def one_step():
        if runtime is not None:
            runtime.observe_reward(0.0)  # what generation reports (no generation here): the dynamic controller's input
        inputs = dict(batch)
        watched = runtime is not None and runtime.monitors_batch(trainer.state.global_step)  # kl_monitor: also at β = 0
        if trainer.beta != 0.0 or watched:
            inputs["ref_per_token_logps"] = reference_logps(trainer, model, inputs)
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        trainer.state.global_step += 1
        trainer.callback_handler.on_step_end(trainer.args, trainer.state, trainer.control)
        trainer._metrics["train"].clear()  # the metrics a log() would flush; nothing logs here

    return step


def make_optimizer(model, device) -> tuple[list, torch.optim.Optimizer]:
    params = [p for p in model.parameters() if p.requires_grad]
    return params, torch.optim.AdamW(params, lr=1e-6, **({"fused": True} if device.type == "cuda" else {"foreach": True}))


def beta_reporter(report, title: str, rows: list, trainers: list, stock_name: str, note: str) -> Callable[[int, bool], None]:
    """``run_rounds``' ``on_block``: record each trainer's β, rewrite the raw timings (and the tables after a round)."""

    def on_block(_, round_finished):
        for row, trainer in zip(rows, trainers):
            # The controller's β: trainer.beta reads it only while the patch is on, and a block may end with
            # the stock functions switched in (then trainer.beta is the trainer's own, unmoved value).
            runtime = getattr(trainer, "_adaptive_kl", None)
            row.info["beta_now"] = float(trainer.beta if runtime is None else runtime.beta)
        report.update(title, rows, stock_name, note, tables=round_finished)

    return on_block


def run_modes(args, start: float, run_mode: Callable[[str, float], None]) -> None:
    """Each mode of ``--modes`` in turn, each with an equal share of what is left of the budget; the
    mode's models and trainers are freed (its function returned) before the next one starts."""
    modes = args.modes.split(",")
    for i, mode in enumerate(modes):
        share = (args.budget - (time.monotonic() - start)) / (len(modes) - i)
        run_mode(mode, time.monotonic() + share)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def step_header(script: str, title: str, args, argv, *, versions: str = "", precision: str = "", setup: str = "") -> str:
    """The header of a step benchmark's report: the machine, the model, the batch, the schedule, the command."""
    n_params = parameter_count(args.hidden, args.layers, args.vocab)
    return (
        f"## {title}\n\nmachine: {machine()}{versions}\n"
        f"model: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab} ({n_params / 1e9:.2f} B parameters){precision}; "
        f"batch {args.batch} x (prompt {args.prompt} + completions {args.min_completion}-{args.max_completion} tokens); "
        f"beta {args.beta}; per row and round {args.steps} timed step(s) after {args.warmup} untimed ({args.first_warmup} in its first round), "
        f"interleaved, up to {args.rounds} rounds within --budget {args.budget:.0f} s{setup}\n"
        f"command: python bench/{script} {' '.join(argv if argv is not None else sys.argv[1:])}"
    )


def run_report(args, start: float, header: str, run_mode: Callable[..., list]) -> int:
    """Run every mode (``run_mode(mode, report, deadline)``), print the report and the wall time."""
    report = Report(args.out, header)
    run_modes(args, start, lambda mode, deadline: run_mode(mode, report, deadline))
    print(report.text())
    print(f"wall time: {time.monotonic() - start:.0f} s")
    return 0


def time_mode(report, title: str, rows, trainers, stock: str, note: str, args, device, deadline: float) -> None:
    """Time the mode's rows in rounds (the table rewritten after every block), then write its last table,
    with its memory at the end (on a GPU) and the rounds it completed."""
    completed = run_rounds(
        rows, rounds=args.rounds, steps=args.steps, warmup=args.warmup, first_warmup=args.first_warmup, device=device,
        deadline=deadline, on_block=beta_reporter(report, title, rows, trainers, stock, note),
    )  # fmt: skip
    if device.type == "cuda":
        note += f"; allocated at the end {torch.cuda.memory_allocated() / 2**30:.1f} GiB, peak of the mode {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
    note += monitor_note(rows)
    report.update(title, rows, stock, note + f"; rounds completed: {completed} of {args.rounds}")


def monitor_note(rows) -> str:
    """kl_monitor's own cost: its row against stock at β = 0 (paired, as the table's ratios), when both ran."""
    by_name = {r.name: r for r in rows}
    stock = by_name.get(STOCK_BETA0)
    notes = []
    for name, what in ((MONITOR, "the reference forward and the logged KL"), (MONITOR_SAMPLED, "per step, over cycles of kl_monitor_every steps")):
        monitor = by_name.get(name)
        if monitor is None or stock is None or not monitor.times or not stock.times:
            continue
        point, low, high = paired_interval(round_ratios(monitor.times, monitor.rounds, stock.times, stock.rounds))
        every = f", kl_monitor_every={monitor.steps_per_call}" if name == MONITOR_SAMPLED else ""
        notes.append(f"; {name} vs {STOCK_BETA0} ({what}{every}): paired {point:.3f}x [{low:.3f}, {high:.3f}]")
    return "".join(notes)


# -- the model ----------------------------------------------------------------------------------------------
def build_tokenizer(vocab: int):
    """A word-level tokenizer of exactly ``vocab`` tokens (``w0``, ``w1``, ... after 4 specials)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    words = {tok: i for i, tok in enumerate(specials + [f"w{i}" for i in range(vocab - len(specials))])}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>", padding_side="left"
    )


def build_model(*, hidden: int, layers: int, vocab: int, max_len: int, device: str = "cpu", dtype=torch.bfloat16, seed: int = 0):
    """A randomly initialised Llama (seeded: the same weights on every call with the same arguments).

    Llama-3.2-1B's shape at hidden 2048 / 16 layers / vocab 128256 (GQA 32/8 heads, MLP 8192), untied.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(1, hidden // 64)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), max_position_embeddings=max_len,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    with torch.device(device):  # random init on the GPU: seconds instead of a minute for 1 B parameters
        return LlamaForCausalLM(config).to(dtype)


def build_checkpoint(path: str, *, hidden: int, layers: int, vocab: int, max_len: int, device: str = "cpu") -> str:
    """:func:`build_model` (bf16) and :func:`build_tokenizer`, saved to ``path`` (for loaders that need a path)."""
    model = build_model(hidden=hidden, layers=layers, vocab=vocab, max_len=max_len, device=device)
    model.save_pretrained(path)
    build_tokenizer(vocab).save_pretrained(path)
    del model
    return path


def parameter_count(hidden: int, layers: int, vocab: int) -> int:
    """Parameters of :func:`build_model`'s model (embedding and LM head untied)."""
    heads = max(1, hidden // 64)
    kv = max(1, heads // 4) * 64
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * 4 * hidden + 2 * hidden
    return layers * per_layer + 2 * vocab * hidden + hidden


# -- the fixed batch -----------------------------------------------------------------------------------------
def fixed_batch(*, batch: int, prompt_len: int, min_completion: int, max_completion: int, vocab: int, device, seed: int = 0) -> dict:
    """One GRPO micro-batch as ``GRPOTrainer._prepare_inputs`` returns it, without generating.

    Random token ids (ids 4.. of the vocabulary), prompts of ``prompt_len``, completions padded to
    ``max_completion`` with lengths spread evenly over ``[min_completion, max_completion]``
    (the completion mask), advantages of one group (zero mean), no old log-probs (one iteration
    per generation: TRL uses the detached current ones). ``ref_per_token_logps`` is added per row,
    inside the timed step, by the row's reference forward.
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(min_completion, max_completion, batch).round().long()
    completion_mask = (torch.arange(max_completion)[None, :] < lengths[:, None]).long()
    advantages = torch.randn(batch, generator=g)
    advantages = (advantages - advantages.mean()) / advantages.std().clamp(min=1e-6)
    inputs = {
        "prompt_ids": torch.randint(4, vocab, (batch, prompt_len), generator=g),
        "prompt_mask": torch.ones(batch, prompt_len, dtype=torch.long),
        "completion_ids": torch.randint(4, vocab, (batch, max_completion), generator=g),
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": completion_mask.sum(),
    }
    return {k: v.to(device) for k, v in inputs.items()}


def activation_gib(tokens: int, hidden: int, layers: int) -> float:
    """Rough bf16 activation memory of one forward + backward without gradient checkpointing.

    Per token and layer a Llama block keeps about 56·hidden bytes for backward (norm inputs in
    float32, q/k/v/attention output, and the 4·hidden-wide gate, up, SiLU and product of the MLP).
    The measured peak of the earlier run (docs/benchmarks.md: 9.39 GiB above start for 4 x 1088
    tokens, full fine-tuning, 3 GiB of it gradients) gives 1.5 MiB per token, close to 56·2048·16.
    """
    return tokens * layers * 56 * hidden / 2**30


# -- the training step's reference forward ------------------------------------------------------------------
def reference_logps(trainer, model, inputs):
    """The reference forward of ``_generate_and_score_completions`` (TRL 1.15, and Unsloth's copy of it)
    in its β != 0 branch: the separate reference model, or under PEFT the policy with the adapter off
    (or TRL's frozen copy of it, named ``ref``); no grad, gradient checkpointing off."""
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.grpo_trainer import use_adapter

    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    keep = inputs["completion_ids"].size(1)
    with torch.no_grad(), disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs):
        if trainer.ref_model is not None:
            return trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, mask, keep, batch_size=ids.size(0))[0]
        with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
            return trainer._get_per_token_logps_and_entropies(model, ids, mask, keep, batch_size=ids.size(0))[0]


@contextlib.contextmanager
def shared_reference(module, ref_model):
    """Make every trainer built inside use ``ref_model`` as its separate reference model instead of
    loading its own copy: ``module`` is the trainer's module (TRL's grpo_trainer, or Unsloth's
    generated one), whose ``create_model_from_path`` makes the reference when β != 0."""
    original = module.create_model_from_path
    module.create_model_from_path = lambda *a, **k: ref_model
    try:
        yield
    finally:
        module.create_model_from_path = original


# -- switching the patch without making new functions --------------------------------------------------------
class PatchSwitch:
    """Switch the package between unpatched and patched with the SAME objects every time.

    ``unpatch()`` then ``patch()`` compiles the rewritten functions anew: new code objects, which
    ``torch.compile`` (Unsloth's fused loss) compiles again, seconds per switch. Built while
    patched, this records the ledger of :mod:`unsloth_adaptive_kl._source_patch` (every attribute
    the package set, with what was there before) and the patched values; ``stock()`` restores the
    originals exactly as ``unpatch()`` does (same objects, same order), ``patched()`` puts the
    recorded patched objects back. The ledger itself is left as it is (the package still counts
    as patched), so the package's own ``patch()``/``unpatch()`` keep working afterwards.
    """

    def __init__(self):
        from unsloth_adaptive_kl import _source_patch

        if not _source_patch.is_patched():
            raise RuntimeError("PatchSwitch needs the package patched (call unsloth_adaptive_kl.patch() first)")
        self._ledger = list(_source_patch._ORIGINALS)
        self._patched = {(id(owner), name): (owner, name, owner.__dict__[name]) for owner, name, _, _ in self._ledger}
        self.state = "patched"

    def stock(self) -> None:
        if self.state == "stock":
            return
        for owner, name, value, had_own in reversed(self._ledger):
            if had_own:
                setattr(owner, name, value)
            elif name in owner.__dict__:
                delattr(owner, name)
        self.state = "stock"

    def patched(self) -> None:
        if self.state == "patched":
            return
        for owner, name, value in self._patched.values():
            setattr(owner, name, value)
        self.state = "patched"


# -- timing -----------------------------------------------------------------------------------------------
class Timer:
    """Seconds of GPU work between ``start()`` and ``stop()`` (CUDA events), or wall time on CPU.

    ``start()`` waits for the GPU to be idle first, so a step never starts behind earlier work."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self):
        if self.cuda:
            torch.cuda.synchronize()
            self._begin = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._begin.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            return self._begin.elapsed_time(self._end) / 1e3
        return time.perf_counter() - self._t0


# -- statistics ----------------------------------------------------------------------------------------------
def _bootstrap_medians(sample: list[float], rng: np.random.Generator, resamples: int) -> np.ndarray:
    values = np.asarray(sample, dtype=np.float64)
    return np.median(values[rng.integers(0, len(values), size=(resamples, len(values)))], axis=1)


def _interval(point: float, draws: np.ndarray) -> tuple[float, float, float]:
    low, high = np.quantile(draws, [0.025, 0.975])
    return float(point), float(low), float(high)


def ratio_interval(row: list[float], stock: list[float], *, seed: int = 0, resamples: int = BOOTSTRAP) -> tuple[float, float, float]:
    """Unpaired: ``median(row) / median(stock)`` and its 95 % percentile-bootstrap interval (both
    samples resampled with replacement, independently)."""
    if not row or not stock:
        return (float("nan"),) * 3
    rng = np.random.default_rng(seed)
    draws = _bootstrap_medians(row, rng, resamples) / _bootstrap_medians(stock, rng, resamples)
    return _interval(statistics.median(row) / statistics.median(stock), draws)


def round_ratios(row_times: list[float], row_rounds: list[int], stock_times: list[float], stock_rounds: list[int]) -> list[float]:
    """For every round where both ran: median of the row's steps / median of stock's steps in that round."""

    def by_round(times, rounds):
        blocks: dict[int, list[float]] = {}
        for t, r in zip(times, rounds):
            blocks.setdefault(r, []).append(t)
        return blocks

    row, stock = by_round(row_times, row_rounds), by_round(stock_times, stock_rounds)
    return [statistics.median(row[r]) / statistics.median(stock[r]) for r in sorted(row) if r in stock]


def paired_interval(ratios: list[float], *, seed: int = 0, resamples: int = BOOTSTRAP) -> tuple[float, float, float]:
    """Paired: the median of the per-round ratios and its 95 % percentile-bootstrap interval over rounds."""
    if not ratios:
        return (float("nan"),) * 3
    return _interval(statistics.median(ratios), _bootstrap_medians(ratios, np.random.default_rng(seed), resamples))


# -- the interleaved schedule ---------------------------------------------------------------------------------
@dataclass
class Row:
    """One configuration. ``step()`` runs one training step; ``activate()`` runs before each of its blocks."""

    name: str
    step: Callable[[], None]
    activate: Callable[[], None] = lambda: None  # e.g. patch or unpatch
    times: list[float] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)  # the round of each timed step
    peaks: list[float] = field(default_factory=list)  # bytes above the allocation at the block's start
    graphs_in_timed_steps: int = 0
    graphs_in_warmup: int = 0
    info: dict = field(default_factory=dict)
    steps_per_call: int = 1  # training steps in one step() call (the sampled monitor's cycle); times are per step


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def run_rounds(
    rows: list[Row], *, rounds: int, steps: int, warmup: int, first_warmup: int, device, deadline: float,
    on_block: Callable[[int, bool], None], seed: int = 0, clock: Callable[[], float] = time.monotonic,
) -> int:  # fmt: skip
    """Run up to ``rounds`` rounds (each row's block once per round, shuffled order); returns the
    rounds completed. A round starts only if the longest round so far, not counting the first
    blocks' warm-up (compilation), fits before ``deadline`` (on ``clock``, ``time.monotonic`` by default).
    ``on_block(round_index, round_finished)`` is called after every block.

    Garbage collection: everything built before the first round is frozen (``gc.freeze``), a
    collection runs before each block, and the collector is off during the block's steps (a full
    collection over the trainers' objects in a timed step was a plausible cause of the earlier
    run's +30-50 % outlier steps)."""
    timer = Timer(device)
    rng = random.Random(seed)
    cuda = device.type == "cuda"
    gc.collect()
    gc.freeze()
    longest_round, done, started = 0.0, 0, set()
    for round_index in range(rounds):
        if clock() + longest_round > deadline:
            break
        round_start, first_warmup_time = clock(), 0.0
        order = list(rows)
        rng.shuffle(order)
        for position, row in enumerate(order):
            row.activate()
            gc.collect()
            gc.disable()
            try:
                graphs_before, warmup_start = compiled_graphs(), clock()
                for _ in range(warmup if id(row) in started else first_warmup):
                    row.step()
                if id(row) not in started:
                    first_warmup_time += clock() - warmup_start
                started.add(id(row))
                row.graphs_in_warmup += compiled_graphs() - graphs_before
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    at_start = torch.cuda.memory_allocated()
                graphs_before = compiled_graphs()
                for _ in range(steps):
                    timer.start()
                    row.step()
                    row.times.append(timer.stop() / row.steps_per_call)
                    row.rounds.append(round_index)
                row.graphs_in_timed_steps += compiled_graphs() - graphs_before
                if cuda:
                    row.peaks.append(torch.cuda.max_memory_allocated() - at_start)
            finally:
                gc.enable()
            on_block(round_index, position == len(order) - 1)
        done += 1
        longest_round = max(longest_round, clock() - round_start - first_warmup_time)
    gc.unfreeze()
    return done


# -- tables ---------------------------------------------------------------------------------------------------
def table(rows: list[Row], stock_name: str) -> str:
    stock = next((r for r in rows if r.name == stock_name), None)
    lines = [
        "| row | timed steps | median step (ms) | paired vs stock | paired 95 % | unpaired vs stock | unpaired 95 % | "
        "peak above start (GiB) | vs stock | graphs compiled in timed steps (in warm-up) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r.times:
            lines.append(f"| {r.name} | 0 | not measured | | | | | | | |")
            continue
        point, low, high = ratio_interval(r.times, stock.times if stock else [])
        ratios = round_ratios(r.times, r.rounds, stock.times, stock.rounds) if stock else []
        p_point, p_low, p_high = paired_interval(ratios)
        few = " (few rounds)" if len(ratios) < MIN_ROUNDS_FOR_PAIRED else ""
        if r.peaks and stock and stock.peaks:  # CUDA only
            peak, stock_peak = max(r.peaks) / 2**30, max(stock.peaks) / 2**30
            memory = f"{peak:.3f} | {peak / stock_peak:.3f}x" if stock_peak else f"{peak:.3f} | n/a"
        else:
            memory = "n/a | n/a"
        lines.append(
            f"| {r.name} | {len(r.times)} | {statistics.median(r.times) * 1e3:.2f} | {p_point:.3f}x | [{p_low:.3f}, {p_high:.3f}]{few} | "
            f"{point:.3f}x | [{low:.3f}, {high:.3f}] | {memory} | {r.graphs_in_timed_steps} ({r.graphs_in_warmup}) |"
        )
    return "\n".join(lines)


class Report:
    """Collects a bench's tables; rewrites ``path + '.json'`` (every timing) on every update and
    ``path`` (Markdown, with the bootstrap intervals) when asked to."""

    def __init__(self, path: str | None, header: str):
        self.path, self.header, self.sections = path, header, {}

    def update(self, title: str, rows: list[Row], stock_name: str, note: str = "", *, tables: bool = True) -> None:
        raw = [
            {"name": r.name, "times_s": r.times, "rounds": r.rounds, "peaks_bytes": r.peaks, "graphs": r.graphs_in_timed_steps,
             "graphs_in_warmup": r.graphs_in_warmup, "steps_per_call": r.steps_per_call, **r.info}
            for r in rows
        ]  # fmt: skip
        text = table(rows, stock_name) if tables or title not in self.sections else self.sections[title][0]
        self.sections[title] = (text, note, raw)
        if not self.path:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._write(self.path + ".json", json.dumps({t: r for t, (_, _, r) in self.sections.items()}))
        if tables:
            self._write(self.path, self.text() + "\n")

    @staticmethod
    def _write(path: str, content: str) -> None:
        with open(path + ".tmp", "w") as f:
            f.write(content)
        os.replace(path + ".tmp", path)

    def text(self) -> str:
        parts = [self.header]
        for title, (text, note, _) in self.sections.items():
            parts += ["", f"### {title}", "", text] + ([note] if note else [])
        return "\n".join(parts)


def machine() -> str:
    import platform

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else (platform.processor() or platform.machine())
    return f"{name}; torch {torch.__version__}; Python {platform.python_version()}"
