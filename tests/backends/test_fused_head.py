"""The Liger module's fused LM head (``fused_head=True``): loss, metrics and the gradients of hidden
states, weight and bias against materialised float64 logits through the module's own elementwise loss
and against the log-prob kernel path, for every loss type and method where it is used; the fallback
where it is not exact; the kernels (Triton, interpreted here) against torch; the backward scaling."""

import itertools
import os
import types
import warnings

import pytest
import torch

from unsloth_adaptive_kl.estimators import builtin_estimator_names

import reference
from unsloth_adaptive_kl.adaptation import AdaptiveKL
from unsloth_adaptive_kl.backends import _fused_head as fused
from unsloth_adaptive_kl.backends.liger import AdaptiveFusedLinearGRPOLoss
from unsloth_adaptive_kl.config import DEFAULTS
from unsloth_adaptive_kl.estimators import register_estimator, unregister_estimator

LOCAL_LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo"]
METHODS = ["none", *reference.BUILTIN_SHAPING, "dynamic", "+".join(["ziegler", *reference.BUILTIN_SHAPING])]
B, T, H, V = 4, 6, 8, 40


def make_batch(dtype=torch.float64, seed=0, vocab=V, with_bias=True):
    """Uneven completion lengths (one nearly empty), padding, mixed-sign advantages."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 4:] = 0
    mask[2, 1:] = 0
    mask[3, 2:] = 0
    return dict(
        _input=torch.randn(B, T, H, generator=g).to(dtype),
        lin_weight=(torch.randn(vocab, H, generator=g) * 0.5).to(dtype),
        bias=(torch.randn(vocab, generator=g) * 0.1).to(dtype) if with_bias else None,
        selected_token_ids=torch.randint(0, vocab, (B, T), generator=g),
        attention_mask=mask,
        advantages=torch.tensor([-1.0, 0.5, 1.2, -0.3]).to(dtype),
        ref_per_token_logps=(-torch.rand(B, T, generator=g) * 3 - 1).to(dtype),
        old_per_token_logps=(-torch.rand(B, T, generator=g) * 3 - 1).to(dtype),
    )


def module(loss_type="dapo", method="none", estimator="k3", **kwargs):
    """A module whose KL state is built from ``method`` (with a controller, as GRPOTrainer(loss_class=...) passes it);
    the log-prob kernel path unless ``fused_head`` is given (the comparisons' reference)."""
    fields = {**DEFAULTS, "kl_adaptation_method": method, "kl_estimator": estimator, "beta": kwargs.get("beta", 0.1), "kl_bottom_q": 0.3}
    kwargs = {"beta": 0.1, "compiled": False, "loss_type": loss_type, "max_completion_length": T, "fused_head": False, **kwargs}
    if loss_type == "cispo":
        kwargs.setdefault("epsilon_high", 5.0)
    return AdaptiveFusedLinearGRPOLoss(adaptive_kl=AdaptiveKL(types.SimpleNamespace(**fields)), **kwargs)


LEAVES = ("_input", "lin_weight", "bias")


def run(mod, batch):
    """Loss, metrics and the grads of hidden states, weight and bias of one forward + backward."""
    leaves = {k: (v.clone().requires_grad_(True) if k in LEAVES and v is not None else v) for k, v in batch.items()}
    loss, metrics = mod(**leaves)
    loss.backward()
    return loss.detach(), metrics, [leaves[k].grad for k in LEAVES if leaves[k] is not None]


def materialised(mod, batch):
    """The reference: float64 logits materialised, log-softmax, the module's own elementwise loss, autograd."""
    leaves = {k: (v.clone().requires_grad_(True) if k in LEAVES and v is not None else v) for k, v in batch.items()}
    logits = leaves["_input"] @ leaves["lin_weight"].t()
    if leaves["bias"] is not None:
        logits = logits + leaves["bias"]
    logps = torch.log_softmax(logits / mod.temperature, -1).gather(-1, batch["selected_token_ids"].unsqueeze(-1)).squeeze(-1)
    keys = ("ref_per_token_logps", "old_per_token_logps", "vllm_is_ratio", "num_items_in_batch")
    terms = mod.loss_from_logps(logps, batch["attention_mask"], batch["advantages"], **{k: batch.get(k) for k in keys})
    terms.loss.backward()
    return terms.loss.detach(), terms.liger_output()[1], [leaves[k].grad for k in LEAVES if leaves[k] is not None]


def assert_same(ours, theirs, atol, rtol):
    (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = ours, theirs
    torch.testing.assert_close(loss_a.double(), loss_b.double(), atol=atol, rtol=rtol)
    assert len(metrics_a) == len(metrics_b) and len(grads_a) == len(grads_b)
    for a, b in zip([*metrics_a, *grads_a], [*metrics_b, *grads_b]):
        torch.testing.assert_close(a.double(), b.double(), atol=atol, rtol=rtol)


# -- exact where used ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_type,method", list(itertools.product(LOCAL_LOSS_TYPES, METHODS)))
def test_fused_head_matches_materialised_float64_logits(loss_type, method):
    batch = make_batch()
    mod = module(loss_type, method, fused_head=True, fused_chunk_tokens=5, use_bias_correction_kl=True, temperature=0.7)
    ours = run(mod, batch)
    assert mod.head_path == "fused"
    assert_same(ours, materialised(module(loss_type, method, use_bias_correction_kl=True, temperature=0.7), batch), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("estimator", builtin_estimator_names())
@pytest.mark.parametrize("chunk_tokens", [1, 3, 100])
def test_fused_head_matches_materialised_for_each_estimator_and_chunk_size(estimator, chunk_tokens):
    batch = make_batch(seed=1, with_bias=False)
    mod = module("grpo", "clip+length_normalized", estimator, fused_head=True, fused_chunk_tokens=chunk_tokens)
    assert_same(run(mod, batch), materialised(module("grpo", "clip+length_normalized", estimator), batch), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "luspo"])
def test_fused_head_with_delta_vllm_ratio_num_items_and_beta_zero(loss_type):
    batch = make_batch(seed=2)
    batch["vllm_is_ratio"] = torch.rand(B, T, dtype=torch.float64) + 0.5
    batch["num_items_in_batch"] = torch.tensor(37.0)
    for beta, method in ((0.1, "sigmoid"), (0.0, "none")):
        kwargs = dict(delta=1.3, beta=beta)
        inputs = batch if beta else {**batch, "ref_per_token_logps": None}
        mod = module(loss_type, method, fused_head=True, fused_chunk_tokens=4, **kwargs)
        ours = run(mod, inputs)
        assert mod.head_path == "fused" and len(ours[1]) == (2 if beta else 1)
        assert_same(ours, materialised(module(loss_type, method, **kwargs), inputs), 1e-12, 1e-10)


@pytest.fixture
def triton_kernels(monkeypatch):
    """The fused head's Triton kernels, interpreted on the CPU (TRITON_INTERPRET=1), instead of torch's ops there; the
    kernels' launches counted."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton runs on a GPU or in its interpreter (TRITON_INTERPRET=1)")
    monkeypatch.setattr(fused, "INTERPRET_KERNELS", True)
    kernels, launches = fused._kernels(), []
    for name in ("row_stats", "logits_grad"):
        kernel = getattr(kernels, name)

        class Counted:
            def __getitem__(self, grid, kernel=kernel, name=name):
                launches.append(name)
                return kernel[grid]

        monkeypatch.setattr(kernels, name, Counted())
    return launches


def test_on_the_cpu_the_passes_are_torchs_and_on_a_gpu_or_when_asked_the_kernels(monkeypatch):
    logits = torch.zeros(2, 3)
    assert not fused._use_triton(logits)  # the CPU: torch, even with TRITON_INTERPRET=1 (set for TRL's kernel)
    monkeypatch.setattr(fused, "INTERPRET_KERNELS", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fused._use_triton(logits) and not fused._use_triton(logits.double())
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not fused._use_triton(logits)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "luspo", "sapo"])
def test_fused_head_matches_the_log_prob_kernel_path_in_float32_through_the_triton_kernels(loss_type, triton_kernels):
    """float32 runs the Triton kernels (interpreted on CPU); a vocabulary of 2.5 kernel blocks."""
    batch = make_batch(torch.float32, seed=3, vocab=2 * fused.BLOCK + 500)
    kernel = run(module(loss_type, "clip+length_normalized", use_bias_correction_kl=True), batch)
    mod = module(loss_type, "clip+length_normalized", use_bias_correction_kl=True, fused_head=True, fused_chunk_tokens=7)
    assert_same(run(mod, batch), kernel, atol=2e-5, rtol=1e-4)
    assert mod.head_path == "fused" and {"row_stats", "logits_grad"} <= set(triton_kernels)


def test_fused_head_compiled_matches_eager(monkeypatch):
    """compiled=True: the elementwise loss traced by dynamo and AOTAutograd (with and without grad), run eagerly."""
    import functools

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    batch = make_batch(seed=7)
    for method in ("clip+length_normalized", "ziegler+sigmoid"):
        compiled = run(module("grpo", method, compiled=True, fused_head=True, fused_chunk_tokens=4, use_bias_correction_kl=True), batch)
        assert_same(compiled, materialised(module("grpo", method, use_bias_correction_kl=True), batch), atol=1e-12, rtol=1e-10)
    torch._dynamo.reset()


def test_fused_head_with_a_reference_model_input_matches_the_kernel_path():
    batch = make_batch(torch.float32, seed=4)
    g = torch.Generator().manual_seed(5)
    extra = dict(ref_input=torch.randn(B, T, H, generator=g), ref_weight=torch.randn(V, H, generator=g) * 0.5, ref_bias=None)
    batch = {**batch, "ref_per_token_logps": None, **extra}
    assert_same(run(module("bnpo", "clip", fused_head=True), batch), run(module("bnpo", "clip"), batch), atol=2e-5, rtol=1e-4)


def test_kernels_match_torch(triton_kernels):
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 2 * fused.BLOCK + 77, generator=g) * 4
    ids = torch.randint(0, logits.shape[1], (5,), generator=g)
    grad_logp = torch.randn(5, generator=g)
    z = logits.double() / 0.8
    lse, target = fused.row_logsumexp(logits, ids, 1 / 0.8)  # float32: Triton (interpreted)
    torch.testing.assert_close(lse.double(), torch.logsumexp(z, -1), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(target.double(), z.gather(1, ids[:, None]).squeeze(1), atol=1e-5, rtol=1e-6)
    expected = (torch.nn.functional.one_hot(ids, logits.shape[1]) - torch.softmax(z, -1)) * grad_logp.double()[:, None] / 0.8
    in_place = logits.clone()
    fused.logits_to_grad_(in_place, ids, lse, grad_logp, 1 / 0.8)
    torch.testing.assert_close(in_place.double(), expected, atol=1e-6, rtol=1e-5)
    assert triton_kernels == ["row_stats", "logits_grad"]


# -- the backward ---------------------------------------------------------------------------------------------
def test_backward_scales_by_the_incoming_gradient_and_accumulates_into_existing_grads():
    batch = make_batch()
    _, _, expected = materialised(module("dapo", "clip"), batch)
    mod = module("dapo", "clip", fused_head=True, fused_chunk_tokens=4)
    leaves = {k: (v.clone().requires_grad_(True) if k in LEAVES else v) for k, v in batch.items()}
    (mod(**leaves)[0] * 3.0).backward()
    (mod(**leaves)[0] * -0.5).backward()
    for key, reference in zip(LEAVES, expected):
        torch.testing.assert_close(leaves[key].grad, 2.5 * reference, atol=1e-12, rtol=1e-10)


def test_under_no_grad_the_fused_head_computes_the_loss_only(monkeypatch):
    batch = make_batch()
    expected = materialised(module("dapo", "clip"), batch)[0]
    calls = []
    monkeypatch.setattr(fused, "logits_to_grad_", lambda *args: calls.append(args))
    leaves = {k: (v.clone().requires_grad_(True) if k in LEAVES else v) for k, v in batch.items()}
    with torch.no_grad():
        loss = module("dapo", "clip", fused_head=True, fused_chunk_tokens=4)(**leaves)[0]
    torch.testing.assert_close(loss, expected, atol=1e-12, rtol=1e-10)
    assert not calls and not loss.requires_grad


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_an_all_padding_batch_gives_zero_gradients_as_the_kernel_path(loss_type):
    batch = {**make_batch(torch.float32), "attention_mask": torch.zeros(B, T, dtype=torch.long)}
    assert_same(run(module(loss_type, fused_head=True), batch), run(module(loss_type), batch), atol=0, rtol=0)


def test_a_second_backward_raises_rather_than_doubling_the_gradient():
    batch = make_batch()
    leaves = {k: (v.clone().requires_grad_(True) if k in LEAVES else v) for k, v in batch.items()}
    loss = module(fused_head=True)(**leaves)[0]
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        loss.backward()


# -- the fallback ---------------------------------------------------------------------------------------------
def _overridden_kl_module(**kwargs):
    class OwnKL(AdaptiveFusedLinearGRPOLoss):
        def per_token_kl(self, logp, ref_logp, *, mask, statistic):
            return (logp - ref_logp) ** 2 * mask

    return OwnKL(compiled=False, max_completion_length=T, beta=0.1, **kwargs)


@pytest.fixture
def user_estimator():
    register_estimator("test_fused_user_kl")(lambda logp, ref_logp: (logp - ref_logp).abs())
    yield "test_fused_user_kl"
    unregister_estimator("test_fused_user_kl")


FALLBACKS = {
    "sequence-level importance sampling": lambda: dict(mod=module("grpo", importance_sampling_level="sequence", fused_head=True)),
    "vespo": lambda: dict(mod=module("vespo", fused_head=True)),
    "use_ref_model=False": lambda: dict(mod=module("dapo", use_ref_model=False, fused_head=True)),
    "per_token_kl is overridden": lambda: dict(mod=_overridden_kl_module(fused_head=True)),
    "require grad": lambda: dict(mod=module("dapo", fused_head=True), grad_key="advantages"),
    "different dtypes": lambda: dict(mod=module("dapo", fused_head=True), cast=("lin_weight", torch.float64)),
}


@pytest.mark.parametrize("reason", list(FALLBACKS))
def test_fallback_where_not_exact_is_named_and_equals_the_kernel_path(reason):
    case = FALLBACKS[reason]()
    mod, batch = case["mod"], make_batch(torch.float32)
    if "grad_key" in case:
        batch[case["grad_key"]] = batch[case["grad_key"]].clone().requires_grad_(True)
    if "cast" in case:
        batch[case["cast"][0]] = batch[case["cast"][0]].to(case["cast"][1])
    with pytest.warns(UserWarning, match=reason):
        ours = run(mod, batch)
    assert mod.head_path == "log-prob kernel"
    mod.fused_head = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same(ours, run(mod, batch), atol=0, rtol=0)


def test_fallback_for_a_user_registered_estimator(user_estimator):
    mod = module("dapo", estimator=user_estimator, fused_head=True)
    with pytest.warns(UserWarning, match="registered outside this package"):
        run(mod, make_batch(torch.float32))
    assert mod.head_path == "log-prob kernel"


def test_fallback_for_a_user_registered_shaping_method(half_kl):
    mod = module("dapo", method=half_kl, fused_head=True)
    with pytest.warns(UserWarning, match="a shaping method registered outside this package"):
        run(mod, make_batch(torch.float32))
    assert mod.head_path == "log-prob kernel"


def test_the_path_is_named_and_a_fallback_warns_once():
    mod = module("dapo", fused_head=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(mod, make_batch(torch.float32))
    assert mod.head_path == "log-prob kernel"
    mod = module("vespo", fused_head=True)
    with pytest.warns(UserWarning):
        run(mod, make_batch(torch.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(mod, make_batch(torch.float32))


def test_by_default_the_fused_head_runs_wherever_it_is_exact_and_falls_back_silently():
    """fused_head="auto" (the default): the fused head where exact (its result is the fused_head=True one), the
    log-prob kernel path elsewhere without a warning (it was not asked for); head_path names the path."""
    batch = make_batch(torch.float32)
    default = AdaptiveFusedLinearGRPOLoss(compiled=False, beta=0.1, max_completion_length=T)
    assert default.fused_head == "auto"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto = module("dapo", fused_head="auto", method="clip")
        assert_same(run(auto, batch), run(module("dapo", fused_head=True, method="clip"), batch), atol=0, rtol=0)
        assert auto.head_path == "fused"
        run(default, batch)
        assert default.head_path == "fused"
        vespo = module("vespo", fused_head="auto")
        assert_same(run(vespo, batch), run(module("vespo", fused_head=False), batch), atol=0, rtol=0)
        assert vespo.head_path == "log-prob kernel"


@pytest.mark.parametrize("kwargs", [dict(fused_head="yes"), dict(fused_head="true"), dict(fused_head=1), dict(fused_chunk_tokens=0), dict(fused_chunk_tokens=2.5)])
def test_invalid_fused_arguments_raise(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        AdaptiveFusedLinearGRPOLoss(compiled=False, **kwargs)


def test_the_module_keyword_and_the_config_field_share_one_fused_head_check():
    """The keyword takes Python's True/False, the GRPOConfig field also the command line's "true"/"false"."""
    from unsloth_adaptive_kl.config import fused_head_setting

    with pytest.raises(ValueError) as keyword:
        fused.check_fused_arguments("true", None)
    with pytest.raises(ValueError) as field:
        fused_head_setting("yes")
    assert str(keyword.value).startswith("fused_head='true' is not valid; allowed: 'auto'") and "True" in str(keyword.value)
    assert str(field.value).startswith("liger_fused_head='yes' is not valid; allowed: 'auto'") and "true" in str(field.value)
    assert fused_head_setting("TRUE") is True and fused_head_setting("false") is False and fused_head_setting("auto") == "auto"
    for value in (True, False, "auto"):
        fused.check_fused_arguments(value, None)


# -- memory ---------------------------------------------------------------------------------------------------
def test_default_chunk_keeps_the_peak_within_the_accumulating_path():
    """Several chunks: the buffer (chunk × V) is at most TRL's kernel tile, plus the weight's size when the weight
    gets a gradient. One chunk (no fp32 accumulator) where its peak, 2·N·V + 2·V·H bytes, is at most the
    6·V·H bytes the accumulating path needs anyway (fp32 accumulator + its conversion), or the buffer rule allows it. At the benchmark size
    (N = 8192, V = 128256, H = 4096): one chunk of 8192 tokens (equal peaks), 8 of 1024 for a frozen head."""
    assert fused.default_chunk_tokens(8192, 128256, True, 4096) == 8192
    assert fused.default_chunk_tokens(8193, 128256, True, 4096) == 4224  # 2 chunks, multiples of 128
    assert fused.default_chunk_tokens(8192, 128256, False, 4096) == 1024
    for tokens, vocab, hidden, grad in itertools.product([1, 100, 8192, 50000], [300, 32000, 128256, 262144], [64, 4096], [True, False]):
        chunk = fused.default_chunk_tokens(tokens, vocab, grad, hidden)
        assert 1 <= chunk <= tokens
        if grad and chunk == tokens:  # within the 6·V·H floor, or a chunk the buffer rule allows (then 4·V·H less than before)
            assert 2 * tokens * vocab + 2 * vocab * hidden <= 6 * vocab * hidden or tokens * vocab <= fused.KERNEL_TILE + vocab * hidden
        else:
            assert chunk == 1 or chunk * vocab <= fused.KERNEL_TILE + (vocab * hidden if grad else 0)
