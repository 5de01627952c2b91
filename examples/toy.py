"""A self-contained GRPO task for offline runs: synthetic arithmetic, a tokenizer trained on it,
and a small Llama built from a config. No downloads.

Used by the examples (the quickstart, the CLI recipe, the custom KL variant, the multi-GPU check), the Blackwell demo
and the tests. It is no part of the package (issue 54: a demo task does not ship in the wheel); scripts beside it
import it as ``toy``, the demo and the tests put examples/ on sys.path, and the recipe names ``examples.toy``.
"""

from __future__ import annotations

import random
import re

ANSWER_RE = re.compile(r"^\s*(-?\d+)\s*$")
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]


def arithmetic_problems(n: int, *, seed: int = 0, max_operand: int = 9) -> list[dict]:
    """``n`` prompts like ``"3+4="`` with their integer answers."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


# A Llama tokenizer's inputs. transformers 4.x gives a bare PreTrainedTokenizerFast token_type_ids
# too, which TRL 0.2x passes on to generate() and a Llama refuses.
MODEL_INPUT_NAMES = ["input_ids", "attention_mask"]


def build_tokenizer(*, seed: int = 0, vocab_size: int = 64):
    """A BPE tokenizer trained with ``tokenizers`` on a synthetic arithmetic corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [f"{r['prompt']}{r['answer']}" for r in arithmetic_problems(2000, seed=seed, max_operand=99)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.BPEDecoder()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        padding_side="left",
        model_input_names=MODEL_INPUT_NAMES,
    )


def build_model(tokenizer, *, hidden_size: int = 64, layers: int = 2, heads: int = 4, seed: int = 0,
                max_positions: int = 128):
    """A small Llama causal LM sized to ``tokenizer``, randomly initialised from ``seed``; it takes
    sequences (prompt and completion) of up to ``max_positions`` tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def prompt_dataset(n: int, *, seed: int = 0):
    from datasets import Dataset

    return Dataset.from_list(arithmetic_problems(n, seed=seed))


def format_reward(completions, **kwargs) -> list[float]:
    """0.5 when the completion is just an integer (the model stopped right after its answer)."""
    return [0.5 if ANSWER_RE.match(c) else 0.0 for c in completions]


def correctness_reward(completions, answer, **kwargs) -> list[float]:
    """0.5 when that integer equals the answer."""
    rewards = []
    for completion, expected in zip(completions, answer):
        m = ANSWER_RE.match(completion)
        rewards.append(0.5 if m and m.group(1) == expected else 0.0)
    return rewards


def warm_start(model, tokenizer, *, steps: int = 200, batch_size: int = 32, lr: float = 3e-3, seed: int = 0) -> float:
    """A short supervised phase on the task so GRPO starts from a competent policy; returns the last loss."""
    import torch

    rows = arithmetic_problems(steps * batch_size, seed=seed + 1)
    texts = [f"{r['prompt']}{r['answer']}{tokenizer.eos_token}" for r in rows]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    device = next(model.parameters()).device
    loss = torch.tensor(0.0)
    for i in range(steps):
        batch = tokenizer(texts[i * batch_size : (i + 1) * batch_size], return_tensors="pt", padding=True)
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def build_checkpoint(path: str, *, seed: int = 0, hidden_size: int = 64, layers: int = 2, warm_start_steps: int = 0) -> str:
    """Save a tokenizer and model built here to ``path`` (TRL loads the reference model from a path)."""
    tokenizer = build_tokenizer(seed=seed)
    model = build_model(tokenizer, hidden_size=hidden_size, layers=layers, seed=seed)
    if warm_start_steps:
        warm_start(model, tokenizer, steps=warm_start_steps, seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# -- a task with free-length working: room for completion lengths to drift ------------------------
# The arithmetic task above leaves no room: any token after the answer breaks the format. Here a
# completion is a scratchpad of any length, then ">" and the answer, like the <reasoning> block of
# Unsloth's GRPO notebook. The reward only reads what follows the last ">": the scratchpad's length
# is free, so whether it grows is up to the training dynamics, not the reward.

SCRATCHPAD_RE = re.compile(r"^[^>]*>(-?\d+)$")
SCRATCHPAD_ALPHABET = "0123456789+=,>"


def sum_problems(n: int, *, seed: int = 0, min_terms: int = 2, max_terms: int = 3, max_operand: int = 9) -> list[dict]:
    """``n`` prompts like ``"3+4+8="`` with their answers and operands."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        terms = [rng.randint(0, max_operand) for _ in range(rng.randint(min_terms, max_terms))]
        rows.append({"prompt": "+".join(map(str, terms)) + "=", "answer": str(sum(terms)), "terms": terms})
    return rows


def worked_solution(terms: list[int], style: int) -> str:
    """A correct completion for ``terms`` in one of three styles, shortest to longest:
    0 ``">15"``, 1 ``"7,15>15"`` (running sums), 2 ``"3+4=7,7+8=15>15"`` (every addition written out)."""
    total, steps = terms[0], []
    for term in terms[1:]:
        steps.append(f"{total}+{term}={total + term}" if style == 2 else str(total + term))
        total += term
    return (",".join(steps) if style else "") + f">{total}"


def column_solution(terms: list[int], style: int) -> str:
    """A correct completion for ``terms`` written as column addition, least significant column first,
    in one of three styles: 0 ``">12211"``; 1 the column sums (carry included), ``"1,11,12,12,1>12211"``;
    2 every column written out with the carry it receives, ``"1+0+0=1,2+9+0=11,8+3+1=12,4+7+1=12,1>12211"``
    (for 4821+7390). Same alphabet and answer format as :func:`worked_solution`, so the scratchpad
    tokenizer and rewards apply. With 4-5 terms of up to 8 digits, style 2 is at most 132 tokens long
    (end-of-sequence included; 110-132 in 4,000 draws)."""
    width = max(len(str(t)) for t in terms)
    columns = zip(*(str(t).rjust(width, "0")[::-1] for t in terms))
    carry, steps = 0, []
    for column in columns:
        digits = [int(d) for d in column]
        total = sum(digits) + carry
        steps.append("+".join(map(str, digits + [carry])) + f"={total}" if style == 2 else str(total))
        carry = total // 10
    if carry:
        steps.append(str(carry))
    return (",".join(steps) if style else "") + f">{sum(terms)}"


COLUMN_ROLES = ("copy", "carry", "sum", "answer", "mark")


def column_token_roles(terms: list[int], style: int) -> list[str]:
    """What each token of ``column_solution(terms, style)`` and its end-of-sequence token asks of a model, one
    role a token: "copy" (a digit of a term, written in its column: read from the prompt), "carry" (the carry a
    column receives, or the last one: the previous column's total // 10), "sum" (a column's total), "answer" (a
    digit after ">"), "mark" ("+", "=", ",", ">", end of sequence). For the loss by role of a warm start."""
    width = max(len(str(t)) for t in terms)
    columns = zip(*(str(t).rjust(width, "0")[::-1] for t in terms))
    carry, steps = 0, []
    for column in columns:
        total = sum(int(d) for d in column) + carry
        copied = ["copy", "mark"] * len(column)  # each digit then its "+"
        steps.append((copied + ["carry", "mark"] if style == 2 else []) + ["sum"] * len(str(total)))
        carry = total // 10
    if carry:
        steps.append(["carry"])
    roles = [role for i, step in enumerate(steps) for role in (["mark"] if i else []) + step] if style else []
    return roles + ["mark"] + ["answer"] * len(str(sum(terms))) + ["mark"]


def build_scratchpad_tokenizer():
    """A character-level tokenizer for the scratchpad task: one token per character, so a
    completion's length in tokens is its length in characters (plus the end-of-sequence token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + list(SCRATCHPAD_ALPHABET))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>", padding_side="left",
        model_input_names=MODEL_INPUT_NAMES,
    )


def scratchpad_dataset(n: int, *, seed: int = 0):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in sum_problems(n, seed=seed)])


def scratchpad_format_reward(completions, **kwargs) -> list[float]:
    """0.5 when the completion is a scratchpad (any length, no ">") then ">" and an integer."""
    return [0.5 if SCRATCHPAD_RE.match(c.strip()) else 0.0 for c in completions]


def scratchpad_correctness_reward(completions, answer, **kwargs) -> list[float]:
    """0.5 when the integer after ">" equals the answer."""
    rewards = []
    for completion, expected in zip(completions, answer):
        m = SCRATCHPAD_RE.match(completion.strip())
        rewards.append(0.5 if m and m.group(1) == expected else 0.0)
    return rewards


def supervised_warm_start(model, tokenizer, texts: list[str], *, batch_size: int = 32, lr: float = 3e-3,
                          losses: list | None = None, progress=None, progress_every: int = 100) -> float:
    """One pass of next-token training over ``texts`` in batches; returns the last loss, and appends
    every batch's loss to ``losses`` when given. ``progress(step, loss)``, when given, is called every
    ``progress_every`` steps and after the last (a record that survives a cut run; it reads the loss, one
    synchronisation each time, and changes nothing in the training).

    Position ids follow the attention mask, as in generation with left padding."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    device = next(model.parameters()).device
    loss = torch.tensor(0.0)
    batch_losses = []
    for start in range(0, len(texts) - batch_size + 1, batch_size):
        batch = tokenizer(texts[start : start + batch_size], return_tensors="pt", padding=True).to(device)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        position_ids = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        loss = model(**batch, position_ids=position_ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if losses is not None:
            batch_losses.append(loss.detach())
        step = start // batch_size + 1
        if progress is not None and (step % progress_every == 0 or start + 2 * batch_size > len(texts)):
            progress(step, float(loss.detach()))
    if batch_losses:  # one device-to-host copy at the end, not a synchronisation every batch
        losses.extend(torch.stack(batch_losses).float().cpu().tolist())
    return float(loss.detach())


def build_scratchpad_checkpoint(
    path: str, *, seed: int = 0, hidden_size: int = 128, layers: int = 4, warm_start_steps: int = 400, device: str = "cpu",
    lr: float = 3e-3,
) -> dict:
    """Build, warm-start and save the starting model of the scratchpad task; return what was done.

    The warm-start data mixes the three solution styles evenly, so the starting policy writes
    completions of many lengths and GRPO can move the length either way."""
    import torch

    tokenizer = build_scratchpad_tokenizer()
    model = build_model(tokenizer, hidden_size=hidden_size, layers=layers, seed=seed).to(device)
    rng = random.Random(seed + 1)
    batch_size = 64
    rows = sum_problems(warm_start_steps * batch_size, seed=seed + 1)
    texts = [r["prompt"] + worked_solution(r["terms"], rng.randrange(3)) + tokenizer.eos_token for r in rows]
    loss = supervised_warm_start(model, tokenizer, texts, batch_size=batch_size, lr=lr) if warm_start_steps else float("nan")
    model.to("cpu").save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    return {"path": path, "warm_start_steps": warm_start_steps, "warm_start_loss": loss}
