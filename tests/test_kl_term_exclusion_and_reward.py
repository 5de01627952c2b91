"""The core's pieces that only trainer tests reached (mutation testing found no fast test executing them,
docs/reliability.md): ``kl_exclude_token_ids`` (``KLTerm.excluded``, ``kl_mask``, ``without_excluded``), the
``kl_placement="reward"`` penalty (``KLTerm.reward_penalty``) and the scoring-time sums (``AdaptiveKL.
observe_scoring_sums``), each against a reference written from its definition (Python loops, float64)."""

from types import SimpleNamespace

import pytest
import torch

from unsloth_adaptive_kl import FIELDS, AdaptiveKL, metrics
from unsloth_adaptive_kl.config import build


def _config(**fields):
    config = {f.name: f.default for f in FIELDS}
    config.update(beta=0.1, kl_estimator="k3", **fields)
    return SimpleNamespace(**config)


def _tokens(seed=0, rows=3, length=7):
    return torch.randint(0, 6, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("exclude", [None, [4], [0, 2, 5]])
def test_excluded_tokens_are_those_whose_id_is_listed_and_leave_the_kl_mask_and_the_kl(exclude):
    term = build(_config(kl_exclude_token_ids=exclude)).term
    ids = _tokens()
    mask = (torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) > 0.2).long()
    kl = torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) + 0.1
    listed = set(exclude or ())
    reference = torch.tensor([[token in listed for token in row] for row in ids.tolist()])
    excluded = term.excluded(ids)
    if not listed:
        assert excluded is None and term.kl_mask(mask, ids) is mask and term.without_excluded(kl, ids) is kl
        return
    assert reference.any() and not reference.all()  # the case tells: some tokens are excluded, some not
    assert excluded.dtype == torch.bool and torch.equal(excluded, reference)
    kl_mask = term.kl_mask(mask, ids)
    assert kl_mask.dtype == mask.dtype
    assert kl_mask.tolist() == [[0 if hit else m for hit, m in zip(r, row)] for r, row in zip(reference.tolist(), mask.tolist())]
    assert term.without_excluded(kl, ids).tolist() == [
        [0.0 if hit else v for hit, v in zip(r, row)] for r, row in zip(reference.tolist(), kl.tolist())
    ]


@pytest.mark.parametrize("method", ["none", "clip", "length_normalized", "clip+length_normalized"])
def test_the_reward_penalty_is_beta_times_each_completions_summed_or_mean_valid_adapted_kl(method):
    term = build(_config(kl_adaptation_method=method)).term
    adapted = torch.rand(3, 5, generator=torch.Generator().manual_seed(3), requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    beta = 0.3
    per_token_mean = "length_normalized" in method
    expected = []
    for row, valid in zip(adapted.tolist(), mask.tolist()):
        kept = [v for v, m in zip(row, valid) if m]
        total = sum(kept) / len(kept) if per_token_mean and kept else (0.0 if per_token_mean else sum(kept))
        expected.append(beta * total)
    penalty = term.reward_penalty(adapted, mask, beta=beta)
    assert penalty.dtype == torch.float64 and penalty.shape == (3,) and not penalty.requires_grad
    assert penalty.tolist() == pytest.approx(expected, rel=1e-12)
    assert penalty[2].item() == 0.0  # a completion with no valid token


def test_scoring_sums_are_reduced_and_accumulated_for_the_steps_controller_update():
    reduced = []

    def two_processes(local):  # a second process with the same sums
        reduced.append(local.clone())
        return 2 * local

    runtime = AdaptiveKL(_config(kl_adaptation_method="ziegler", kl_target=0.2, kl_horizon=10.0), two_processes)
    a = torch.tensor([[0.1, 0.4], [0.2, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    first = metrics.local_kl_sums(a, a, mask)
    second = metrics.local_kl_sums(3 * a, 3 * a, mask)
    assert torch.equal(runtime.observe_scoring_sums(first), 2 * first)
    assert torch.equal(runtime.observe_scoring_sums(second), 2 * second)
    assert [r.tolist() for r in reduced] == [first.tolist(), second.tolist()]  # each batch reduced once, as given
    assert torch.equal(runtime._step_sums, 2 * first + 2 * second)  # what end_step's controller update reads


def test_a_shaping_fault_at_scoring_time_is_refused_naming_the_user_methods_and_the_token_count(user_shaping):
    # NaN between 0.3 and 0.45 only: the check at creation (KL 0 to 30 on a few values) passes it
    nan_on_large = user_shaping("nan_on_large", lambda kl: torch.where((kl > 0.3) & (kl < 0.45), torch.nan, kl))
    other = user_shaping("halve_it", lambda kl: 0.5 * kl, order=95)  # after it
    raw = torch.tensor([[0.1, 0.4, 0.35], [0.41, 0.2, 0.4]])  # 3 valid tokens in that range, and a masked one
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    for method, who in (
        (nan_on_large, "shaping method 'nan_on_large'"),
        (f"{nan_on_large}+{other}", "one of the shaping methods 'nan_on_large', 'halve_it' (applied in this order)"),
    ):
        runtime = AdaptiveKL(_config(kl_adaptation_method=method))
        adapted = runtime.term.shape(raw)
        sums = metrics.local_kl_sums(raw, adapted, mask, count_shaping_faults=True)
        with pytest.raises(ValueError) as error:
            runtime.observe_scoring_sums(sums)
        assert str(error.value) == (
            f"{who} returned NaN or inf on valid tokens whose KL was finite (3 of them) in "
            f"kl_adaptation_method={method!r}: the bug is in that function; allowed: a finite value for every finite KL"
        )
    # a fault slot without a user method (no check asked for) is not read
    runtime = AdaptiveKL(_config(kl_adaptation_method="clip", kl_clip_threshold=0.2))
    faulty = metrics.local_kl_sums(raw, raw, mask)
    faulty[metrics.SHAPING_FAULTS] = 2.0
    assert torch.equal(runtime.observe_scoring_sums(faulty), faulty)


# -- the pipeline's exclusion step (kl_pipeline), which every loss runs: eager, Unsloth's fused loss, the Liger module --
def _reference_kl_positions(mask, ids, exclude):
    """The definition, in Python loops: a position keeps its mask value unless its token id is listed."""
    return torch.tensor([[0 if int(i) in set(exclude or ()) else int(m) for m, i in zip(mr, ir)] for mr, ir in zip(mask, ids)])


@pytest.mark.parametrize("exclude", [None, [4], [0, 2, 5]])
def test_the_pipelines_exclusion_step_in_each_of_its_forms_matches_the_definition(exclude):
    from unsloth_adaptive_kl.kl_pipeline import adapted_in_graph, kl_keep, kl_positions

    term = build(_config(kl_exclude_token_ids=exclude, kl_adaptation_method="soft_clip")).term
    ids = _tokens(3)
    mask = (torch.rand(ids.shape, generator=torch.Generator().manual_seed(4)) > 0.2).long()
    expected = _reference_kl_positions(mask, ids, exclude)
    assert torch.equal(kl_positions(term, mask, ids), expected)
    keep = kl_keep(term, ids)
    assert (keep is None) == (exclude is None)
    assert torch.equal(mask if keep is None else mask * keep, expected)  # the Liger module's form: a factor
    raw = torch.rand(ids.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 3
    got_raw, got_adapted = adapted_in_graph(term, raw, ids.unsqueeze(-1))  # Unsloth's input_ids are (B, T, 1)
    listed = torch.tensor([[int(i) in set(exclude or ()) for i in row] for row in ids])
    assert torch.equal(got_raw, torch.where(listed, 0.0, raw))
    assert torch.equal(got_adapted, torch.where(listed, 0.0, term.shape(raw)))
    assert not torch.equal(term.shape(raw), raw)  # the shaping acted, so the order of the steps tells


def test_the_exclusion_step_refuses_missing_or_misshaped_token_ids_and_reads_none_without_exclusions():
    from unsloth_adaptive_kl.kl_pipeline import kl_keep, kl_positions

    mask = torch.ones(2, 3)
    plain = build(_config()).term
    assert kl_positions(plain, mask, None) is mask and kl_keep(plain, None) is None
    term = build(_config(kl_exclude_token_ids=[1])).term
    with pytest.raises(ValueError, match=r"kl_exclude_token_ids=\[1\] needs the completion tokens, shaped as the mask \(2, 3\); got None, here"):
        kl_positions(term, mask, None, needs=", here")
    with pytest.raises(ValueError, match=r"shaped as the mask \(2, 3\); got \(2, 4\)"):
        kl_positions(term, mask, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"kl_exclude_token_ids=\[1\] needs the completion tokens; got None: pass them"):
        kl_keep(term, None, needs=": pass them")


def test_the_exclusion_step_compiles_in_one_graph_and_once_for_a_changing_beta():
    """Inside a compiled loss the step is Python constants and elementwise ops: fullgraph holds, and a new β (a
    tensor, as the backends pass it) reuses the graph."""
    from unsloth_adaptive_kl.kl_pipeline import adapted_in_graph, kl_positions

    term = build(_config(kl_exclude_token_ids=[0, 2], kl_adaptation_method="soft_clip")).term
    counts = []

    def backend(gm, example_inputs):
        counts.append(1)
        return gm.forward

    @torch.compile(fullgraph=True, backend=backend, dynamic=False)
    def loss(raw, ids, mask, beta):
        raw, adapted = adapted_in_graph(term, raw, ids)
        return (beta * adapted * kl_positions(term, mask, ids.reshape(mask.shape))).sum()

    ids, mask, raw = _tokens(6), torch.ones(3, 7), torch.rand(3, 7)
    torch._dynamo.reset()
    for beta in (0.1, 0.2, 0.05):
        eager = (beta * torch.where(torch.isin(ids, torch.tensor([0, 2])), 0.0, term.shape(raw))).sum()
        assert torch.allclose(loss(raw, ids, mask, torch.tensor(beta)), eager)
    assert len(counts) == 1
