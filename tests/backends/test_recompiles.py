"""No recompiles after warm-up in a realistic loop (issue 22): the compiled Liger module, through the
log-prob kernel and the fused head, with the completion length, the valid-token counts,
``num_items_in_batch`` (an int, a tensor, both in turn, or none) and β changing at every call
(``bench/recompile_loop.py``). Dynamo only (``backend="eager"``: its guards decide recompilation;
seconds per case on CPU), and one case through inductor. The GPU grid: tests/gpu/test_liger_gpu.py
and ``bench/bench_liger.py --recompile-loop``."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
import recompile_loop  # noqa: E402

LOOP = dict(calls=5, batch=3, lengths=(5, 24), hidden=8, vocab=40, dtype="float64", device="cpu", num_items="mixed", backend="eager")
# Every op of the KL term (clip, sigmoid, length normalisation) and a β controller, on both heads.
CASES = [("none", "fused"), ("clip+sigmoid+length_normalized", "fused"), ("dynamic+length_normalized", "log-prob kernel")]


@pytest.fixture(autouse=True)
def clean_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def check(result):
    """The loop compiled in its first call, nothing after its second; and it ran the head it names."""
    graphs = result["graphs"]
    assert graphs[0] >= 1, graphs
    assert recompile_loop.after_warmup(result) == 0, (result["loss_type"], result["method"], result["head"], graphs, result["reasons"])
    expected_head = "log-prob kernel" if result["loss_type"] == "vespo" else result["head"]  # vespo: not local (fallback)
    assert result["head_path"] == expected_head


def test_the_loop_changes_what_a_training_loop_changes():
    calls = list(recompile_loop.loop_batches(5, batch=3, lengths=(5, 24), hidden=8, vocab=40, dtype=torch.float64, device="cpu"))
    assert len({x["mask"].shape[1] for x in calls}) == 5  # a new padded length each call
    assert len({int(x["mask"].sum()) for x in calls}) == 5 and len({x["beta"] for x in calls}) == 5
    assert [type(x["num_items"]).__name__ for x in calls] == ["int", "Tensor", "int", "Tensor", "int"]
    assert all(int(x["num_items"]) == recompile_loop.ACCUMULATION * int(x["mask"].sum()) for x in calls)


@pytest.mark.parametrize("loss_type", recompile_loop.LOSS_TYPES)
def test_no_graph_after_the_first_two_calls_for_every_loss_type(loss_type):
    for method, head in CASES:
        torch._dynamo.reset()
        check(recompile_loop.run_case(dict(LOOP, loss_type=loss_type, method=method, head=head)))


@pytest.mark.parametrize("num_items", ["int", "tensor", "none"])
def test_no_graph_after_the_first_two_calls_whatever_num_items_is(num_items):
    for loss_type in ("dapo", "cispo"):  # the loss types whose normaliser reads it
        torch._dynamo.reset()
        check(recompile_loop.run_case(dict(LOOP, loss_type=loss_type, method="ziegler", head="fused", num_items=num_items)))


def test_no_graph_after_the_first_two_calls_with_a_batch_statistic():
    check(recompile_loop.run_case(dict(LOOP, loss_type="dapo", method="clip", head="fused", estimator="bottom_q")))


def test_no_graph_after_the_first_two_calls_through_inductor():
    check(recompile_loop.run_case(dict(LOOP, calls=4, dtype="float32", loss_type="dapo", method="none", head="fused", backend=None)))


def test_the_loop_sees_the_recompiles_of_a_python_count_and_a_static_length(monkeypatch):
    """The loss as it was before issue 22 (a Python int into Liger's normaliser, no dynamic mark): the loop
    counts a graph at every call, with dynamo's reasons; and the recompile limit raises rather than counting 0."""
    from unsloth_adaptive_kl.backends import liger

    monkeypatch.setattr(liger, "normaliser_tensor", lambda n, device: None if n is None else int(n) if isinstance(n, torch.Tensor) else n)
    monkeypatch.setattr(liger, "sequence_dynamic", lambda *tensors: tensors)
    result = recompile_loop.run_case(dict(LOOP, num_items="int", loss_type="dapo", method="none", head="log-prob kernel"))
    assert result["graphs"] == [1] * LOOP["calls"]
    assert any("num_items_in_batch" in reason for reason in result["reasons"]), result["reasons"]
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2), pytest.raises(Exception, match="recompile_limit"):
        recompile_loop.run_case(dict(LOOP, num_items="int", loss_type="dapo", method="none", head="log-prob kernel"))
