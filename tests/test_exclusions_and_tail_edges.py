"""Issue 52, finding 10: ``kl_exclude_token_ids`` ids outside the model's vocabulary, or a list of every token, were
accepted without a word; ``token_kl_top1pct_share`` was absent while every token's KL was 0 (the first step)."""

import math
from types import SimpleNamespace

import pytest
import torch

from unsloth_adaptive_kl import metrics, tail
from unsloth_adaptive_kl.adaptation import AdaptiveKL
from unsloth_adaptive_kl.config import DEFAULTS, build


def _term(ids):
    return build(SimpleNamespace(**{**DEFAULTS, "beta": 0.1, "kl_exclude_token_ids": ids})).term


def test_an_id_outside_the_vocabulary_is_refused_naming_the_field_the_ids_and_the_range():
    with pytest.raises(ValueError, match=r"kl_exclude_token_ids=\[2, 64, 151645\] is not valid: \[64, 151645\] are outside the model's vocabulary of 64 tokens.*ids from 0 to 63"):
        _term([151645, 2, 64]).check_vocabulary(64)
    _term([2, 63]).check_vocabulary(64)
    _term([151645]).check_vocabulary(None)  # the vocabulary is not known: not checked


def test_excluding_every_token_is_refused():
    with pytest.raises(ValueError, match="kl_exclude_token_ids lists all 8 tokens of the model's vocabulary"):
        _term(list(range(8))).check_vocabulary(8)
    _term(list(range(7))).check_vocabulary(8)


def test_a_trainer_with_an_id_outside_its_models_vocabulary_is_refused_when_it_is_created(tiny_checkpoint, tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    import toy

    config = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=4, num_generations=4,
        max_completion_length=4, max_steps=1, beta=0.04, save_strategy="no", kl_exclude_token_ids=[1, 100000],
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"kl_exclude_token_ids=\[1, 100000\] is not valid: \[100000\] are outside"):
        GRPOTrainer(model=tiny_checkpoint, reward_funcs=[toy.format_reward], args=config, train_dataset=toy.prompt_dataset(8))


@pytest.mark.parametrize("n", [5, 150, 1000])
def test_the_top_share_of_an_all_zero_kl_is_k_over_n(n):
    """Every token's KL is 0 (policy = reference): the share of the top k of n equal values, k / n, as for any
    constant KL (here checked against a constant 0.3)."""
    zero = tail.statistics(tail.TailTotals.from_reduced(tail.spread(tail.local_tail(torch.zeros(n), torch.ones(n)), 0, 1)))
    constant = tail.statistics(tail.TailTotals.from_reduced(tail.spread(tail.local_tail(torch.full((n,), 0.3), torch.ones(n)), 0, 1)))
    k = max(1, math.ceil(n / 100))
    assert zero.top_share == k / n and zero.top_share_bounds == (k / n, k / n)
    assert constant.top_share == pytest.approx(k / n, rel=1e-9)


def test_the_top_share_is_logged_when_the_policy_is_the_reference():
    state = AdaptiveKL(SimpleNamespace(**{**DEFAULTS, "beta": 0.1}))
    logp = -torch.rand(4, 5)
    mask = torch.ones(4, 5, dtype=torch.long)
    values = state.record(*state.per_token(logp, logp.clone(), mask), mask, training=True, beta=0.1)
    assert values[metrics.TOKEN_KL_MAX] == 0.0 and values[metrics.TOKEN_KL_TOP1PCT_SHARE] == 1 / 20


def test_a_signed_kl_summing_to_zero_still_has_no_share():
    values = torch.tensor([0.5, -0.5, 0.25, -0.25])
    stats = tail.statistics(tail.TailTotals.from_reduced(tail.spread(tail.local_tail(values, torch.ones(4)), 0, 1)))
    assert math.isnan(stats.top_share)


def test_the_eos_example_of_the_docs_excludes_no_unknown_token_on_a_tokenizer_without_the_chat_tokens():
    """Issue 52, finding 9: docs/metrics-tail.md's example used convert_tokens_to_ids("<|im_end|>"), which on a
    tokenizer without that token returns <unk>'s id: <unk> was excluded without a word. Run as written (GRPOConfig
    stands in as a function returning its keywords) on the toy tokenizer, which has neither chat token."""
    import re
    from pathlib import Path

    import toy

    page = (Path(__file__).resolve().parents[1] / "docs" / "metrics-tail.md").read_text()
    code = re.search(r"\*\*The EOS use case\.\*\*.*?```python\n(.*?)```", page, re.S).group(1)
    tokenizer = toy.build_tokenizer()
    assert "<|im_end|>" not in tokenizer.get_vocab() and tokenizer.unk_token_id is not None
    namespace = {"tokenizer": tokenizer, "GRPOConfig": lambda *args, **kwargs: kwargs}
    exec(compile(code, "docs/metrics-tail.md (the EOS use case)", "exec"), namespace)  # noqa: S102 -- the docs' own example
    assert namespace["config"]["kl_exclude_token_ids"] == [tokenizer.eos_token_id]
