"""tests/_triton_interpreter.py, the test processes' faster Triton interpreter: TRL's fused log-prob kernel gives
bit-identical results with and without it, a second run walks ``triton.language`` nowhere, and a launch still leaves
``triton.language`` as it found it."""

import importlib.util
import os

import pytest
import torch

import _triton_interpreter

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
    reason="Triton's interpreter is what this checks (TRITON_INTERPRET=1, no GPU)",
)


def _kernel_outputs():
    """TRL's ChunkedLogProbFunction (its forward and backward kernels, and the jit helper they call) on fixed inputs,
    chunks of 128 (three vocabulary tiles a row): every output and both gradients."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=gen, requires_grad=True)
    weight = torch.randn(300, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 300, (37,), generator=gen)
    outputs = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    logp, entropy, sq, mean, top1 = ChunkedLogProbFunction.apply(hidden, weight, None, targets, 0.7, 128, None, 1.0, outputs)
    (logp.sum() + 0.3 * entropy.sum()).backward()
    return [logp.detach(), entropy.detach(), sq, mean, top1, hidden.grad, weight.grad]


def test_the_kernels_give_the_same_bits_with_the_recorded_patches_and_leave_the_language_unpatched():
    from triton.runtime import interpreter
    import triton.language as tl

    _triton_interpreter.install()
    recording = interpreter._patch_lang
    if not getattr(recording, "_uakl_recording", False):
        pytest.skip(f"not installed on this Triton release ({__import__('triton').__version__})")
    before = {name: getattr(tl, name) for name in dir(tl)}
    table = interpreter._get_np_dtype
    # Triton's own walk at every call, and its own dtype function
    interpreter._patch_lang, interpreter._get_np_dtype = recording._uakl_original, table._uakl_original
    try:
        stock = _kernel_outputs()
    finally:
        interpreter._patch_lang, interpreter._get_np_dtype = recording, table
    ours = _kernel_outputs()  # the first launch, and the first call of each jit helper in it, record (if none did)
    walks = recording._uakl_walks[0]
    ours_again = _kernel_outputs()  # replayed: no walk of triton.language, in a launch or in a helper's call (tl.max)
    assert recording._uakl_walks[0] == walks
    for expected, got in ((stock, ours), (stock, ours_again)):
        for e, g in zip(expected, got):
            assert e.dtype == g.dtype and torch.equal(e, g)
    assert {name: getattr(tl, name) for name in dir(tl)} == before  # each launch restored what it patched
    assert not _triton_interpreter.install()  # once per process


def test_it_is_installed_in_the_test_processes_on_the_suites_triton():
    from triton.runtime import interpreter
    import triton

    if not triton.__version__.startswith(_triton_interpreter.SUPPORTED):
        pytest.skip(f"Triton {triton.__version__}: the interpreter is left as it is")
    assert getattr(interpreter._patch_lang, "_uakl_recording", False)
