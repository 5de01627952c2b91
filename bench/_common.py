"""What the GRPO step benchmarks share: the model, the fixed batch, the timer, the interleaved
schedule, the statistics and the tables (each written once, here).

Method (docs/benchmarks.md): every row trains the same model on the SAME fixed batch (built once,
not generated: generation is not part of what is compared). Rows run interleaved: in every round,
each row in a random order (seeded) runs ``warmup`` untimed steps then ``steps`` timed ones, so
the drift of the machine (clocks, temperature, other tenants) falls on every row alike. A step is
timed with CUDA events (``time.perf_counter`` on CPU). The ratio of a row to stock is
``median(row) / median(stock)`` over all its timed steps, with a 95 % percentile-bootstrap interval
(both samples resampled with replacement, ``BOOTSTRAP`` times, fixed seed). After every row-round
the tables so far are rewritten to ``--out`` (a run cut short keeps what it measured).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

BOOTSTRAP = 2000


# -- the model ----------------------------------------------------------------------------------------------
def build_checkpoint(path: str, *, hidden: int, layers: int, vocab: int, max_len: int, device: str = "cpu") -> str:
    """A randomly initialised bf16 Llama and a word-level tokenizer of exactly ``vocab`` tokens, saved to ``path``.

    Llama-3.2-1B's shape at hidden 2048 / 16 layers / vocab 128256 (GQA 32/8 heads, MLP 8192).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    words = {tok: i for i, tok in enumerate(specials + [f"w{i}" for i in range(vocab - len(specials))])}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>", padding_side="left"
    )
    heads = max(1, hidden // 64)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), max_position_embeddings=max_len,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds instead of a minute for 1 B parameters
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    return path


def parameter_count(hidden: int, layers: int, vocab: int) -> int:
    """Parameters of :func:`build_checkpoint`'s model (embedding and LM head untied)."""
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


# -- timing -----------------------------------------------------------------------------------------------
class Timer:
    """Seconds of GPU work between ``start()`` and ``stop()`` (CUDA events), or wall time on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self):
        if self.cuda:
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
def ratio_interval(row: list[float], stock: list[float], *, seed: int = 0, resamples: int = BOOTSTRAP) -> tuple[float, float, float]:
    """``median(row) / median(stock)`` and its 95 % percentile-bootstrap interval."""
    if not row or not stock:
        return (float("nan"),) * 3
    rng = random.Random(seed)
    point = statistics.median(row) / statistics.median(stock)
    ratios = sorted(
        statistics.median(rng.choices(row, k=len(row))) / statistics.median(rng.choices(stock, k=len(stock))) for _ in range(resamples)
    )
    return point, ratios[int(0.025 * resamples)], ratios[min(resamples - 1, int(0.975 * resamples))]


# -- the interleaved schedule ---------------------------------------------------------------------------------
@dataclass
class Row:
    """One configuration. ``step()`` runs one timed training step; ``graphs()`` counts compiled graphs."""

    name: str
    step: Callable[[], None]
    activate: Callable[[], None] = lambda: None  # before each of its blocks (e.g. patch or unpatch)
    times: list[float] = field(default_factory=list)
    peaks: list[float] = field(default_factory=list)  # bytes above the allocation at the block's start
    graphs_in_timed_steps: int = 0
    info: dict = field(default_factory=dict)


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def run_rounds(rows: list[Row], *, rounds: int, steps: int, warmup: int, device, deadline: float, on_round: Callable[[int], None], seed: int = 0) -> int:
    """Run up to ``rounds`` rounds (each row once per round, shuffled order) before ``deadline``
    (``time.monotonic()``); returns the rounds completed. ``on_round`` gets called after every row-block."""
    timer = Timer(device)
    rng = random.Random(seed)
    cuda = device.type == "cuda"
    done = 0
    for round_index in range(rounds):
        order = list(rows)
        rng.shuffle(order)
        for row in order:
            if time.monotonic() > deadline:
                return done
            row.activate()
            for _ in range(warmup):
                row.step()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                at_start = torch.cuda.memory_allocated()
            graphs_before = compiled_graphs()
            for _ in range(steps):
                timer.start()
                row.step()
                row.times.append(timer.stop())
            row.graphs_in_timed_steps += compiled_graphs() - graphs_before
            if cuda:
                row.peaks.append(torch.cuda.max_memory_allocated() - at_start)
            on_round(round_index)
        done += 1
    return done


# -- tables ---------------------------------------------------------------------------------------------------
def table(rows: list[Row], stock_name: str) -> str:
    stock = next((r for r in rows if r.name == stock_name), None)
    lines = [
        "| row | timed steps | median step (ms) | vs stock | 95 % interval | peak above start (GiB) | vs stock | graphs compiled in timed steps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r.times:
            lines.append(f"| {r.name} | 0 | not measured | | | | | |")
            continue
        point, low, high = ratio_interval(r.times, stock.times if stock else [])
        if r.peaks and stock and stock.peaks:  # CUDA only
            peak, stock_peak = max(r.peaks) / 2**30, max(stock.peaks) / 2**30
            memory = f"{peak:.3f} | {peak / stock_peak:.3f}x" if stock_peak else f"{peak:.3f} | n/a"
        else:
            memory = "n/a | n/a"
        lines.append(
            f"| {r.name} | {len(r.times)} | {statistics.median(r.times) * 1e3:.2f} | {point:.3f}x | [{low:.3f}, {high:.3f}] | "
            f"{memory} | {r.graphs_in_timed_steps} |"
        )
    return "\n".join(lines)


class Report:
    """Collects a bench's tables and rewrites ``path`` (Markdown) and ``path + '.json'`` on every update."""

    def __init__(self, path: str | None, header: str):
        self.path, self.header, self.sections = path, header, {}

    def update(self, title: str, rows: list[Row], stock_name: str, note: str = "") -> None:
        self.sections[title] = (table(rows, stock_name), note, [{"name": r.name, "times_s": r.times, "peaks_bytes": r.peaks, "graphs": r.graphs_in_timed_steps, **r.info} for r in rows])
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path + ".tmp", "w") as f:
                f.write(self.text() + "\n")
            os.replace(self.path + ".tmp", self.path)
            with open(self.path + ".json.tmp", "w") as f:
                json.dump({title: raw for title, (_, _, raw) in self.sections.items()}, f)
            os.replace(self.path + ".json.tmp", self.path + ".json")

    def text(self) -> str:
        parts = [self.header]
        for title, (text, note, _) in self.sections.items():
            parts += ["", f"### {title}", "", text] + ([note] if note else [])
        return "\n".join(parts)


def machine() -> str:
    import platform

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else (platform.processor() or platform.machine())
    return f"{name}; torch {torch.__version__}; Python {platform.python_version()}"
