"""Unsloth scenarios, each run in a fresh process by test_unsloth.py: ``import unsloth`` rebinds
TRL's classes process-wide, so it must not happen inside the main test process.

    python unsloth_worker.py ORDER SCENARIO[,SCENARIO...] OUT_DIR

The process imports (in ORDER), lets Unsloth generate its trainer and builds the tiny checkpoint once (~20 s of CPU),
then forks one child per SCENARIO: each child starts from that state, as a fresh process would after the same imports,
runs its scenario alone and writes OUT_DIR/SCENARIO.json (or OUT_DIR/SCENARIO.error, its traceback). The scenarios of
one call are all ``compiled*`` or none is (Unsloth's compile switch is read at import). Before forking ``compiled*``
scenarios the process compiles transformers' mask on the paths a training step takes (warm_up_compiled: not under test,
and ~40 % of those scenarios' CPU when each run compiled it again); each scenario then runs each of its measured runs in
a child forked from that state (``forked``), counting the graphs compiled from the run's own start.

ORDER is ``unsloth-first``, ``ours-first`` or ``config-before-unsloth`` (this package, a GRPOConfig, then unsloth).
The scenarios in STOCK_FIRST run in the stock-first order (unsloth first, and a config with an adaptive-KL field built
before this package is imported: stock Unsloth's behaviour): with ORDER ``unsloth-first`` the process forks them once
Unsloth has generated its trainer, before it imports this package, so the two orders share one ``import unsloth``
(~20 s of CPU). The script writes a JSON object of measured facts;
the assertions live in test_unsloth.py.
"""

import contextlib
import io
import json
import math
import os
import pickle
import sys
import tempfile

import traceback

ORDER, SCENARIOS, OUT = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
#: Scenarios of the stock-first order (see above): forked from an ``unsloth-first`` process before it imports this package.
STOCK_FIRST = ("unpatch",)
if ORDER != "unsloth-first" and set(SCENARIOS) & set(STOCK_FIRST):
    sys.exit(f"{SCENARIOS}: {STOCK_FIRST} run stock-first, forked from an unsloth-first process")
if len({name.startswith("compiled") for name in SCENARIOS}) != 1:
    sys.exit(f"{SCENARIOS}: compiled* scenarios and eager ones need separate processes (the compile switch is read at import)")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", tempfile.mkdtemp(prefix="unsloth-cache-"))
# A private TorchInductor cache: a cache shared with other processes (or left by earlier runs) was
# seen to feed the compiled scenario a graph that failed with inductor::_alloc_from_pool aliasing.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-cache-"))
# With CI set, torch turns its custom-op aliasing check into an error, and on CPU it then trips over
# inductor's own inductor::_alloc_from_pool in a graph Unsloth compiles (transformers'
# create_causal_mask); outside CI it is a warning. Keep torch's default, not its CI strictness.
os.environ.setdefault("TORCHINDUCTOR_ERROR_ON_CUSTOM_OP_ALIASING", "0")
if not SCENARIOS[0].startswith("compiled"):
    os.environ["UNSLOTH_COMPILE_DISABLE"] = "1"  # eager: exact comparisons and fast tests
else:
    # Inductor compiles in this process, not in a pool of threads and worker processes: the compiled scenarios fork
    # after compiling (warm_up_compiled, forked), and a forked child inherits torch's thread pool without its threads
    # (it then waited forever on a kernel's compile). Torch's default (read when torch is imported) and Unsloth's
    # compile options (its switch, read at import: it sets it for pinned GPUs), whose compile_threads outranks torch's.
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    os.environ["UNSLOTH_FORCE_SINGLE_COMPILE_WORKER"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for reference.py



def probe_config():
    """What GRPOConfig(kl_adaptation_method="ziegler") does now: the value it kept (None when the
    field was dropped), the lines it printed about the field, or the error it raised."""
    import trl

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            c = trl.GRPOConfig(output_dir=tempfile.mkdtemp(prefix="out-"), use_cpu=True, bf16=False, report_to="none", beta=0.04, kl_adaptation_method="ziegler")
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    printed = [line for line in out.getvalue().splitlines() if "kl_adaptation_method" in line]
    return {"value": getattr(c, "kl_adaptation_method", None), "printed": printed}


import_log = io.StringIO()
# the stock-first branch (below): whether this process is it, and its exit status as seen by the parent
STOCK_BRANCH, BRANCH_FAILED = False, []
with contextlib.redirect_stdout(import_log):
    if ORDER == "unsloth-first":
        import unsloth  # noqa: F401
        from unsloth.models.rl import _patch_trl_rl_trainers

        _patch_trl_rl_trainers("grpo_trainer")
        never_patched = None
        if set(SCENARIOS) & set(STOCK_FIRST):
            # The stock-first branch: a child that builds a config with stock Unsloth, then imports this package (below)
            # and runs the STOCK_FIRST scenarios; this process waits for it, then goes on with the others.
            branch = [name for name in SCENARIOS if name in STOCK_FIRST]
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                STOCK_BRANCH, SCENARIOS = True, branch
                never_patched = probe_config()
            else:
                _, status = os.waitpid(pid, 0)
                if os.waitstatus_to_exitcode(status) != 0:
                    BRANCH_FAILED.append(f"stock-first branch (exit {os.waitstatus_to_exitcode(status)})")
                SCENARIOS = [name for name in SCENARIOS if name not in STOCK_FIRST]
        import unsloth_adaptive_kl
    else:
        import unsloth_adaptive_kl

        if ORDER == "config-before-unsloth":  # the config exists before Unsloth generates its trainer
            import trl

            EARLY_CONFIG = trl.GRPOConfig(
                output_dir=tempfile.mkdtemp(prefix="out-"), use_cpu=True, bf16=False, report_to="none",
                beta=0.04, kl_adaptation_method="clip", kl_clip_threshold=0.05,
            )  # fmt: skip
        import unsloth  # noqa: F401
        from unsloth.models.rl import _patch_trl_rl_trainers

        _patch_trl_rl_trainers("grpo_trainer")

import torch  # noqa: E402
import trl  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import reference  # noqa: E402
from unsloth_adaptive_kl import metrics, versions  # noqa: E402
import toy  # noqa: E402

generated = sys.modules["UnslothGRPOTrainer"]
CHECKPOINT = toy.build_checkpoint(tempfile.mkdtemp(prefix="tiny-"), hidden_size=32)
TOKENIZER = toy.build_tokenizer()
results = {"trainer_class": trl.GRPOTrainer.__module__ + "." + trl.GRPOTrainer.__name__}


def model():
    m = AutoModelForCausalLM.from_pretrained(CHECKPOINT)
    m.for_training = lambda *a, **k: None  # what FastLanguageModel adds; a plain model lacks them
    m.for_inference = lambda *a, **k: None
    return m


def config(**overrides):
    base = dict(
        output_dir=tempfile.mkdtemp(prefix="out-"), use_cpu=True, bf16=False, report_to="none",
        per_device_train_batch_size=4, num_generations=4, max_completion_length=reference.MAX_COMPLETION,
        max_steps=3, logging_steps=1, learning_rate=2e-2, beta=0.04, warmup_steps=0, save_strategy="no", seed=0,
        gradient_accumulation_steps=1,  # Unsloth's config defaults to 2; one micro-batch per step keeps logs = step means
    )
    base.update(overrides)
    return trl.GRPOConfig(**base)


def trainer(**overrides):
    return trl.GRPOTrainer(
        model=model(), reward_funcs=[toy.format_reward, toy.correctness_reward], args=config(**overrides),
        train_dataset=toy.prompt_dataset(64), processing_class=TOKENIZER,
    )


def loss_and_grads(t, inputs):
    t.model.zero_grad(set_to_none=True)
    loss = t.compute_loss(t.model, inputs)
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in t.model.parameters() if p.grad is not None]


def set_method(t, method, loss_type, **fields):
    from unsloth_adaptive_kl.backends.unsloth import UnslothAdaptiveKL

    for name, value in dict(kl_adaptation_method=method, loss_type=loss_type, **fields).items():
        setattr(t.args, name, value)
    t.loss_type = loss_type
    t._adaptive_kl = UnslothAdaptiveKL(t)
    t.beta = t._adaptive_kl.beta


def hand_made_inputs(t, seed):
    # Narrow log-ratios keep Unsloth's [-20, 20] and [-10, 10] clamps inactive, so the plain float64 formulas apply.
    return reference.loss_inputs(
        t.model.config.vocab_size, seed=seed, ref_spread=2.0, ref_offset=3.0, pad_token_id=TOKENIZER.pad_token_id
    )


def spy_on_fused_loss():
    """Capture what the fused loss sees: the arguments of UnslothEfficientGRPO (outside its torch.func
    transform, where tensors are plain)."""
    cls = generated.UnslothEfficientGRPO
    inner = cls.forward
    seen = {}

    def spy(ctx, new, old, ref, sampling, lm_head, input_ids, mask, advantages, beta, scaler=None, n_chunks=1, extra_kwargs=None, upstream_scale=None):
        seen.update(new=new.detach().clone(), ref=ref.clone(), old=old.clone(), mask=mask.clone(), input_ids=input_ids.clone())
        seen.update({k: extra_kwargs.get(k) for k in ("num_items_in_batch", "current_gradient_accumulation_steps", "steps_per_generation", "max_completion_length", "num_processes")})
        return inner(ctx, new, old, ref, sampling, lm_head, input_ids, mask, advantages, beta, scaler, n_chunks, extra_kwargs, upstream_scale)

    cls.forward = staticmethod(spy)
    return seen


def scenario_config():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        c = config(kl_adaptation_method="dynamic+clip", kl_clip_threshold=0.5, reward_threshold=0.3, kl_horizon=123.0)
    results["config_values"] = [c.kl_adaptation_method, c.kl_clip_threshold, c.reward_threshold, c.kl_horizon]
    results["to_dict"] = {k: c.to_dict().get(k) for k in ("kl_adaptation_method", "kl_clip_threshold", "kl_horizon")}
    results["printed"] = out.getvalue() + import_log.getvalue()
    try:
        config(kl_adaptation_method="bogus")
        results["bad_method_error"] = None
    except ValueError as e:
        results["bad_method_error"] = str(e)
    from transformers import HfArgumentParser

    (parsed,) = HfArgumentParser(trl.GRPOConfig).parse_args_into_dataclasses(
        ["--output_dir", tempfile.mkdtemp(), "--use_cpu", "--bf16", "False", "--beta", "0.1", "--kl_adaptation_method", "ziegler"]
    )
    results["cli_method"] = parsed.kl_adaptation_method


LOSS_TYPES = list(versions.ALL_LOSS_TYPES)


def scenario_identity():
    """Method none + k3: patched vs stock Unsloth (unpatched in place) on the same batch, per loss type."""
    t = trainer()
    t.model.train()
    identical = {}
    for loss_type in LOSS_TYPES:
        set_method(t, "none", loss_type, kl_estimator="k3")
        inputs = hand_made_inputs(t, seed=1)
        torch.manual_seed(0)
        patched = loss_and_grads(t, inputs)
        unsloth_adaptive_kl.unpatch()
        try:
            torch.manual_seed(0)
            stock = loss_and_grads(t, inputs)
        finally:
            unsloth_adaptive_kl.patch()
        identical[loss_type] = {
            "stock_grads_have_nan": any(bool(g.isnan().any()) for g in stock[1]),
            "loss_equal": bool(torch.equal(patched[0], stock[0])),
            "grads_equal": len(patched[1]) == len(stock[1]) > 0
            and all(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(patched[1], stock[1])),
            "loss": patched[0].item(),
        }
    results["identity"] = identical
    results["patched_again"] = generated.grpo_compute_loss is not unsloth_adaptive_kl.backends.trl.original(generated, "grpo_compute_loss")


def all_masked_inputs(t, seed):
    """Every completion truncated (no padding, full length) and masked, as TRL's mask_truncated_completions
    leaves them: Unsloth rebuilds the mask from the token ids, then reapplies TRL's zeroed rows. The
    generation batch's other micro-batches have tokens, so num_items_in_batch is not 0."""
    inputs = hand_made_inputs(t, seed)
    g = torch.Generator().manual_seed(seed)
    inputs["completion_ids"] = torch.randint(5, t.model.config.vocab_size, inputs["completion_ids"].shape, generator=g)
    inputs["completion_mask"] = torch.zeros_like(inputs["completion_mask"])
    inputs["num_items_in_batch"] = torch.tensor(12.0)
    return inputs


def scenario_all_masked():
    """A micro-batch with no valid token: the metrics, loss and gradients of stock Unsloth (unpatched in
    place) and of ours with method none + k3, per loss type; and ours with an adaptive method."""

    def measure(t, inputs):
        t._metrics["train"].clear()
        torch.manual_seed(0)
        loss, grads = loss_and_grads(t, inputs)
        logged = {k: list(v) for k, v in t._metrics["train"].items()}
        return loss, grads, logged

    t = trainer(mask_truncated_completions=True)
    t.model.train()
    seen = spy_on_fused_loss()
    out = {}
    for loss_type in LOSS_TYPES:
        set_method(t, "none", loss_type, kl_estimator="k3")
        inputs = all_masked_inputs(t, seed=3)
        loss, grads, logged = measure(t, inputs)
        ours_tokens = int(seen["mask"].sum())  # what the fused loss saw: no valid token
        unsloth_adaptive_kl.unpatch()
        try:
            stock_loss, stock_grads, stock_logged = measure(t, inputs)
            fused_tokens = [ours_tokens, int(seen["mask"].sum())]  # ours, stock
        finally:
            unsloth_adaptive_kl.patch()
        adaptive = {}
        for method in ("clip+sigmoid+length_normalized", "ziegler"):
            set_method(t, method, loss_type, kl_estimator="k3", kl_clip_threshold=0.4, kl_target=0.2, kl_horizon=1000.0)
            a_loss, a_grads, a_logged = measure(t, inputs)
            adaptive[method] = {
                "loss": a_loss.item(), "logged": a_logged, "grads_finite": all(bool(g.isfinite().all()) for g in a_grads),
            }
        out[loss_type] = {
            "stock_logged": stock_logged, "logged": logged, "stock_loss": stock_loss.item(), "loss": loss.item(),
            "loss_equal": bool(torch.equal(loss, stock_loss)), "fused_tokens": fused_tokens,
            "stock_grads": len(stock_grads), "stock_grads_zero": all(not bool(g.any()) for g in stock_grads),
            "grads_equal": len(grads) == len(stock_grads)
            and all(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(grads, stock_grads)),
            "adaptive": adaptive,
        }
    results["all_masked"] = out


# half_kl: a shaping method registered here, outside the package, as a user would (with its float64 reference).
@unsloth_adaptive_kl.register_shaping("half_kl")
def half_kl(kl):
    return 0.5 * kl


reference.SHAPING64["half_kl"] = lambda kl, c, t: 0.5 * kl
CASES = [("half_kl", "k3"), ("clip", "k3"), ("soft_clip", "k3"), ("sigmoid", "k3"), ("length_normalized", "k3"), ("clip+sigmoid+length_normalized", "k3"), ("none", "k1"), ("clip", "k2"), ("none", "abs")]


def scenario_kl_part():
    """The KL part of the loss (loss at beta minus loss at beta=0) and the metrics, against float64."""
    t = trainer()
    t.model.train()
    seen = spy_on_fused_loss()
    out = []
    beta, clip_threshold, kl_target = 0.3, 0.4, 0.2
    for loss_type in LOSS_TYPES:
        for method, estimator in CASES:
            set_method(t, method, loss_type, kl_estimator=estimator, beta=beta, kl_clip_threshold=clip_threshold, kl_target=kl_target)
            inputs = hand_made_inputs(t, seed=2)
            t._metrics["train"].clear()
            with torch.no_grad():
                with_kl = t.compute_loss(t.model, inputs).double().item()
                logged = {k: list(v) for k, v in t._metrics["train"].items() if k.startswith("adaptive_kl/")}
                t.beta = 0.0
                without_kl = t.compute_loss(t.model, inputs).double().item()
            # The reference sees exactly what the fused loss saw (Unsloth trims padding columns first).
            seen_inputs = {
                "ref_per_token_logps": seen["ref"], "old_per_token_logps": seen["old"], "completion_mask": seen["mask"],
                "num_items_in_batch": seen["num_items_in_batch"],
            }
            normaliser = dict(
                unsloth_clamps=True, max_completion=seen["max_completion_length"], ga=seen["current_gradient_accumulation_steps"],
                spg=seen["steps_per_generation"] or 1, nproc=seen["num_processes"],
            )
            expected, raw, shaped = reference.kl_part(
                method, seen["new"], seen_inputs, loss_type, beta=beta, estimator=estimator, clip_threshold=clip_threshold,
                kl_target=kl_target, **normaliser,
            )
            unshaped, _, _ = reference.kl_part(
                "none", seen["new"], seen_inputs, loss_type, beta=beta, estimator=estimator, clip_threshold=clip_threshold,
                kl_target=kl_target, **normaliser,
            )
            raw_mean, adapted_mean = reference.metric_reference(method, raw, shaped, seen["mask"])
            valid_raw = raw.double()[seen["mask"].bool()]
            out.append(
                dict(
                    loss_type=loss_type, method=method, estimator=estimator, got=with_kl - without_kl, expected=expected.item(),
                    unshaped=unshaped.item(), logged_raw=logged["adaptive_kl/raw_kl"], logged_adapted=logged["adaptive_kl/adapted_kl"],
                    logged_beta=logged["adaptive_kl/current_beta"], raw_ref=raw_mean, adapted_ref=adapted_mean,
                    logged_tail=[logged.get(name) for name in metrics.WINDOW_TAIL_METRICS], valid_raw=valid_raw.tolist(),
                )
            )
    results["kl_part"] = out
    results["kl_part_accumulation"] = kl_part_under_accumulation(t, seen, beta, clip_threshold, kl_target)


def kl_part_under_accumulation(t, seen, beta, clip_threshold, kl_target, accumulation=3):
    """Every method's KL part with 3 gradient-accumulation steps (and 3 steps per generation), against float64
    with the divisor the fused loss was given (the scenario's last use of the trainer)."""
    t.current_gradient_accumulation_steps, t.args.steps_per_generation = accumulation, accumulation
    out = []
    for loss_type in LOSS_TYPES:
        for method in reference.ACCUMULATION_METHODS:
            set_method(t, method, loss_type, kl_estimator="k3", beta=beta, kl_clip_threshold=clip_threshold, kl_target=kl_target)
            inputs = hand_made_inputs(t, seed=4)
            inputs["num_items_in_batch"] = inputs["num_items_in_batch"] * accumulation  # the generation batch's tokens
            with torch.no_grad():
                with_kl = t.compute_loss(t.model, inputs).double().item()
                t.beta = 0.0
                without_kl = t.compute_loss(t.model, inputs).double().item()
            seen_inputs = {
                "ref_per_token_logps": seen["ref"], "old_per_token_logps": seen["old"], "completion_mask": seen["mask"],
                "num_items_in_batch": seen["num_items_in_batch"],
            }
            expected, _, _ = reference.kl_part(
                method, seen["new"], seen_inputs, loss_type, beta=beta, estimator="k3", clip_threshold=clip_threshold,
                kl_target=kl_target, unsloth_clamps=True, max_completion=seen["max_completion_length"],
                ga=seen["current_gradient_accumulation_steps"], spg=seen["steps_per_generation"] or 1, nproc=seen["num_processes"],
            )
            out.append(dict(
                loss_type=loss_type, method=method, got=with_kl - without_kl, expected=expected.item(),
                accumulation=seen["current_gradient_accumulation_steps"],
            ))  # fmt: skip
    return out


def scenario_diagnostics():
    """kl_exclude_token_ids in the fused loss (eager, as every scenario but compiled*): the KL part and the metrics against float64 with
    the excluded positions masked, the β = 0 loss with and without the exclusion; and kl_monitor (below)."""
    t = trainer()
    t.model.train()
    seen = spy_on_fused_loss()
    beta, out = 0.3, []
    for loss_type in ("dapo", "grpo"):
        for method in ("none", "clip", "sigmoid+length_normalized"):
            inputs = hand_made_inputs(t, seed=5)
            ids = sorted(set(inputs["completion_ids"][0, :2].tolist()))
            case = dict(loss_type=loss_type, method=method, ids=ids)
            for exclude in (None, ids):
                set_method(t, method, loss_type, beta=beta, kl_clip_threshold=0.2, kl_target=0.1, kl_exclude_token_ids=exclude)
                t._metrics["train"].clear()
                with torch.no_grad():
                    with_kl = t.compute_loss(t.model, inputs).double().item()
                    logged = {k: list(v) for k, v in t._metrics["train"].items() if k.startswith("adaptive_kl/")}
                    t.beta = 0.0
                    policy = t.compute_loss(t.model, inputs).double().item()
                key = "all" if exclude is None else "excluded"
                case[key] = dict(kl_part=with_kl - policy, policy=policy, logged=logged)
            excluded = torch.zeros_like(seen["mask"], dtype=torch.bool)
            for i in ids:
                excluded |= seen["input_ids"] == i
            excluded &= seen["mask"].bool()
            seen_inputs = {"ref_per_token_logps": seen["ref"], "old_per_token_logps": seen["old"], "completion_mask": seen["mask"], "num_items_in_batch": seen["num_items_in_batch"]}
            normaliser = dict(unsloth_clamps=True, max_completion=seen["max_completion_length"], ga=seen["current_gradient_accumulation_steps"], spg=seen["steps_per_generation"] or 1, nproc=seen["num_processes"])
            expected, raw, _ = reference.kl_part(method, seen["new"], seen_inputs, loss_type, beta=beta, estimator="k3", clip_threshold=0.2, kl_target=0.1, excluded=excluded, **normaliser)
            kl_mask = seen["mask"].bool() & ~excluded
            case.update(expected=expected.item(), excluded_count=int(excluded.sum()), raw_ref=(raw.sum() / kl_mask.sum()).item(), valid_raw=raw[kl_mask].tolist())
            out.append(case)
    results["diagnostics"] = out
    results["monitor"] = monitor_against_stock()
    results["monitor_train"] = monitor_training()


def monitor_against_stock():
    """kl_monitor at beta = 0 on the generated trainer: its reference model; per loss type (method none, and a shaping
    method with the length-normalised term, its β set to 0 as a controller would) the loss and gradients against stock Unsloth's at beta = 0 (unpatched in
    place, no reference log-probs: what its beta = 0 generation gives), also with a NaN reference log-prob; the KL
    logged against float64 and against stock Unsloth's own kl at beta = 0.04 on the same batch."""
    t = trainer(beta=0.0, kl_monitor=True)
    t.model.train()
    out = {"args_beta": t.args.beta, "beta": t.beta, "has_ref_model": t.ref_model is not None, "cases": []}
    seen = spy_on_fused_loss()
    for loss_type in LOSS_TYPES:
        for method, nan_ref in (("none", False), ("clip+sigmoid+length_normalized", False), ("none", True)):
            # A shaping method cannot be configured with beta = 0; a controller can reach it (set here).
            set_method(t, method, loss_type, beta=0.0 if method == "none" else 0.04, kl_monitor=True, kl_clip_threshold=0.2, kl_target=0.1)
            t.beta = 0.0
            inputs = hand_made_inputs(t, seed=6)
            if nan_ref:
                inputs["ref_per_token_logps"][0, 1] = float("nan")
            t._metrics["train"].clear()
            torch.manual_seed(0)
            loss, grads = loss_and_grads(t, inputs)
            logged = {k: list(v) for k, v in t._metrics["train"].items()}
            fused_new, fused_ref, fused_old, fused_mask = seen["new"], seen["ref"], seen["old"], seen["mask"]
            unsloth_adaptive_kl.unpatch()
            try:
                t._metrics["train"].clear()
                torch.manual_seed(0)
                stock_loss, stock_grads = loss_and_grads(t, {k: v for k, v in inputs.items() if k != "ref_per_token_logps"})
                stock_logged = {k: list(v) for k, v in t._metrics["train"].items()}
                t.beta = 0.04  # stock Unsloth's own kl on the same batch, with its reference
                t._metrics["train"].clear()
                with torch.no_grad():
                    t.compute_loss(t.model, inputs)
                stock_kl = list(t._metrics["train"]["kl"])
            finally:
                unsloth_adaptive_kl.patch()
            mask = fused_mask.bool()
            raw, _ = reference.raw_and_shaped_kl("none", fused_new, fused_ref, fused_old, mask, estimator="k3", clip_threshold=0.2, kl_target=0.1, unsloth_clamps=True)
            out["cases"].append(dict(
                loss_type=loss_type, method=method, nan_ref=nan_ref, loss=loss.item(), stock_loss=stock_loss.item(),
                loss_equal=bool(torch.equal(loss, stock_loss)),
                # NaN where stock's are NaN (luspo's all-masked row), and bit-equal everywhere else
                grads_equal=len(grads) == len(stock_grads) > 0
                and all(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(grads, stock_grads)),
                grads_finite=[all(bool(g.isfinite().all()) for g in gs) for gs in (grads, stock_grads)], logged=logged, stock_logged=stock_logged,
                stock_kl=stock_kl, raw_ref=(raw.sum() / mask.sum()).item(), valid_raw=raw[mask].tolist(),
            ))  # fmt: skip
    return out


def monitor_training():
    """Short runs: one step with kl_monitor at beta = 0 against one stock Unsloth step at beta = 0 (the trainer
    created unpatched), same seed; then beta = 0 throughout, and the dynamic controller reaching 0 after 2 steps,
    with every step's reference forward counted."""
    def weights(t):
        return [p.detach().clone() for p in t.model.parameters()]

    out = {}
    unsloth_adaptive_kl.unpatch()
    try:
        stock = trainer(beta=0.0, max_steps=1)
        stock.train()
    finally:
        unsloth_adaptive_kl.patch()
    monitored = trainer(beta=0.0, kl_monitor=True, kl_monitor_every=1, max_steps=1)
    ref_calls = []
    monitored.ref_model.register_forward_hook(lambda *a: ref_calls.append(monitored.state.global_step))
    monitored.train()
    (stock_log,) = [h for h in stock.state.log_history if "loss" in h]
    (monitored_log,) = [h for h in monitored.state.log_history if "loss" in h]
    out["one_step"] = {
        "stock_runtime": getattr(stock, "_adaptive_kl", None) is None, "ref_calls": ref_calls,
        "weights_equal": all(torch.equal(a, b) for a, b in zip(weights(stock), weights(monitored))),
        "stock_log": stock_log, "monitored_log": monitored_log,
    }
    for name, overrides in {
        "zero": dict(beta=0.0, kl_monitor_every=1),
        "dynamic_to_zero": dict(
            beta=0.04, kl_adaptation_method="dynamic", reward_threshold=100.0, beta_min=0.0, beta_schedule_steps=2, kl_monitor_every=1,
        ),
        "sampled": dict(beta=0.0, kl_monitor_every=2),  # the reference forward on generation batches 0 and 2 only
    }.items():
        t = trainer(kl_monitor=True, max_steps=4, **overrides)
        calls = []
        t.ref_model.register_forward_hook(lambda *a, t=t, calls=calls: calls.append(t.state.global_step))
        t.train()
        logs = [{k: v for k, v in h.items() if k.startswith("adaptive_kl/") or k == "kl"} for h in t.state.log_history if "adaptive_kl/current_beta" in h]
        out[name] = {"logs": logs, "ref_calls": sorted(set(calls))}
    return out


METHODS = reference.METHODS


def scenario_train():
    import logging

    runs = {}
    for method in [*METHODS, "half_kl"]:
        out = io.StringIO()
        lines = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())
        logging.getLogger("unsloth_adaptive_kl").addHandler(handler)
        with contextlib.redirect_stdout(out):
            t = trainer(kl_adaptation_method=method, **reference.training_settings(), kl_clip_threshold=0.05)
            t.train()
        logging.getLogger("unsloth_adaptive_kl").removeHandler(handler)
        logs = [h for h in t.state.log_history if "adaptive_kl/current_beta" in h]
        runs[method] = {
            "logs": [{k: v for k, v in h.items() if k.startswith("adaptive_kl/") or k in ("kl", "reward")} for h in logs],
            "ignored_printed": "IGNORED" in out.getvalue(),
            "runtime": type(t._adaptive_kl).__name__,
            "backend_lines": [line for line in lines if "backend:" in line],
            "course_lines": [line for line in lines if " of this run" in line],
            "batch": [t.args.per_device_train_batch_size, t.args.gradient_accumulation_steps, t.args.steps_per_generation],
        }
    results["train"] = runs


def scenario_subclass():
    """Subclasses of the generated trainer that override compute_loss (issue 39, item 4): one that calls
    super().compute_loss, against the plain trainer; one that returns its own loss, which must be refused
    before any optimizer step."""
    import torch

    class SuperLoss(trl.GRPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.calls = getattr(self, "calls", 0) + 1
            return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    class OwnLoss(trl.GRPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return model(input_ids=inputs["completion_ids"]).logits.float().pow(2).mean()

    fields = dict(kl_adaptation_method="ziegler+clip", kl_clip_threshold=0.05, kl_target=0.02, kl_horizon=40.0)
    logged = ("loss", "kl", "adaptive_kl/raw_kl", "adaptive_kl/adapted_kl", "adaptive_kl/current_beta")

    def run(cls):
        t = cls(
            model=model(), reward_funcs=[toy.format_reward, toy.correctness_reward], args=config(**fields),
            train_dataset=toy.prompt_dataset(64), processing_class=TOKENIZER,
        )  # fmt: skip
        before = [p.detach().clone() for p in t.model.parameters()]
        error = None
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                t.train()
        except unsloth_adaptive_kl.PatchError as e:
            error = str(e)
        return {
            "logs": [{k: h[k] for k in logged if k in h} for h in t.state.log_history if "loss" in h],
            "error": error, "global_step": t.state.global_step, "calls": getattr(t, "calls", None),
            "weights_unchanged": all(torch.equal(a, b) for a, b in zip(before, t.model.parameters())),
        }  # fmt: skip

    results["subclass"] = {"plain": run(trl.GRPOTrainer), "super": run(SuperLoss), "own": run(OwnLoss)}


def scenario_renamed():
    """Mutated copies of the generated module, each with one variable of one patched function renamed (what an
    Unsloth release that renames it would ship; every anchor still matches): building the plan on each copy
    (issue 39, item 10). Returns {"function:name": the PatchError's message, or None if it built}."""
    import ast
    import importlib.util
    import re

    from unsloth_adaptive_kl._source_patch import PatchError
    from unsloth_adaptive_kl.backends import unsloth as backend

    with open(generated.__file__) as f:
        text = f.read()
    functions = {n.name: n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef)}
    renames = [("grpo_compute_loss", name) for name in ("new", "ref", "mask", "rs_keep", "current_gradient_accumulation_steps")]
    renames += [("grpo_accumulated_loss", name) for name in ("ref_logps", "completion_mask")]
    folder = tempfile.mkdtemp(prefix="renamed-")
    out = {}
    for i, (function, name) in enumerate(renames):
        node = functions[function]
        lines = text.splitlines(keepends=True)
        body = "".join(lines[node.lineno - 1 : node.end_lineno])
        lines[node.lineno - 1 : node.end_lineno] = [re.sub(rf"\b{name}\b", f"{name}_renamed", body)]
        module_name = f"UnslothGRPOTrainer_renamed_{i}"
        path = os.path.join(folder, module_name + ".py")
        with open(path, "w") as f:
            f.write("".join(lines))
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
        try:
            backend.PLAN.build(backend.owners(module), namespace=dict(module.__dict__))
            out[f"{function}:{name}"] = None
        except PatchError as error:
            out[f"{function}:{name}"] = str(error)
    unchanged = backend.PLAN.build(backend.owners(generated), namespace=dict(generated.__dict__))  # the real module builds
    results["renamed"] = {"errors": out, "unchanged_targets": sorted(unchanged)}


def scenario_early_config():
    """The trainer created from a config made before Unsloth generated its trainer (ORDER config-before-unsloth)."""
    import logging

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("unsloth_adaptive_kl").addHandler(handler)
    t = trl.GRPOTrainer(
        model=model(), reward_funcs=[toy.format_reward], args=EARLY_CONFIG, train_dataset=toy.prompt_dataset(8),
        processing_class=TOKENIZER,
    )
    runtime = getattr(t, "_adaptive_kl", None)
    results["early_config"] = {
        "config_class": type(EARLY_CONFIG).__module__ + "." + type(EARLY_CONFIG).__name__,
        "runtime": type(runtime).__name__, "method": t.args.kl_adaptation_method, "stock": getattr(runtime, "is_stock", None),
        "backend_lines": [line for line in lines if "backend:" in line],
        "loss_patched": generated.grpo_compute_loss is not unsloth_adaptive_kl.backends.trl.original(generated, "grpo_compute_loss"),
    }


def scenario_resume():
    """Checkpoint at step 2, resume: the beta series and controller state continue the uninterrupted run's."""
    out = {}
    for method in reference.controller_names():
        fields = dict(kl_adaptation_method=method, **reference.RESUME_SETTINGS, max_steps=5)
        full = trainer(**fields)
        full.train()
        first_dir = tempfile.mkdtemp(prefix="resume-")
        first = trainer(output_dir=first_dir, save_strategy="steps", save_steps=2, **fields)
        first.train()
        resumed = trainer(output_dir=first_dir, **fields)
        resumed.train(resume_from_checkpoint=os.path.join(first_dir, "checkpoint-2"))

        def betas(t, after=0):
            return [h["adaptive_kl/current_beta"] for h in t.state.log_history if "adaptive_kl/current_beta" in h and h["step"] > after]

        out[method] = {
            "full": betas(full), "resumed_after_2": betas(resumed, after=2),
            "full_state": full._adaptive_kl.state_dict(), "resumed_state": resumed._adaptive_kl.state_dict(),
        }
    results["resume"] = out


def scenario_compiled():
    """Compiled fused loss: graphs compiled per step with a fixed beta, a beta that changes every
    step, and a beta that reaches 0, without and with kl_monitor. Each run in a child forked from this scenario's
    state (after warm_up_compiled), counting every graph compiled from its own start."""
    from torch._dynamo.utils import counters
    from transformers import TrainerCallback

    class GraphCounter(TrainerCallback):
        def __init__(self):
            self.per_step = []

        def on_step_end(self, args, state, control, **kwargs):
            self.per_step.append(counters["stats"]["unique_graphs"])

    runs = {
        "fixed": dict(kl_adaptation_method="none"),
        "dynamic": dict(kl_adaptation_method="dynamic", reward_threshold=-1.0),
        "dynamic_to_zero": dict(kl_adaptation_method="dynamic", reward_threshold=-1.0, beta_min=0.0, beta_schedule_steps=3),
        "monitor_to_zero": dict(
            kl_adaptation_method="dynamic", reward_threshold=-1.0, beta_min=0.0, beta_schedule_steps=3, kl_monitor=True, kl_monitor_every=1,
        ),
    }

    def run(overrides):
        counters.clear()
        t = trainer(max_steps=5, **overrides)
        counter = GraphCounter()
        t.add_callback(counter)
        t.train()
        logs = [h for h in t.state.log_history if "adaptive_kl/current_beta" in h]
        return {
            "graphs": counter.per_step,
            "betas": [h["adaptive_kl/current_beta"] for h in logs],
            "raw_kl": [h.get("adaptive_kl/raw_kl") for h in logs],  # absent once β is 0 (nothing observed)
        }

    for name, overrides in runs.items():
        results[f"compiled_{name}"] = forked(lambda overrides=overrides: run(overrides))


def scenario_compiled_loop():
    """The compiled fused loss in a loop whose shapes change every call, as in training: a new completion length
    (max_completion_length at most), new valid-token counts and num_items_in_batch, and (patched) a new β.
    Graphs compiled per call, for stock Unsloth (unpatched in place, fixed β) and each method (dapo): each loop in a
    child forked from this scenario's state (after warm_up_compiled), so every loop starts from the same dynamo state
    and its position among the loops cannot change what it compiles. stock_again, forked after the patched loops,
    checks what still passes from loop to loop: the TorchInductor cache on disk (this scenario's, see forked) that
    the loops before it wrote."""
    import logging

    from torch._dynamo.utils import counters

    reasons = []
    handler = logging.Handler()
    handler.emit = lambda record: reasons.append(record.getMessage())
    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(handler)
    t = trainer(loss_type="dapo")
    t.model.train()
    lengths = [reference.MAX_COMPLETION, 2, 4, 5, 3]

    def loop(vary_beta):
        reasons.clear()
        per_call = []
        for call, length in enumerate(lengths):
            inputs = reference.loss_inputs(
                t.model.config.vocab_size, seed=call, completion=length, ref_spread=2.0, ref_offset=3.0, pad_token_id=TOKENIZER.pad_token_id
            )  # fmt: skip
            inputs["num_items_in_batch"] = inputs["num_items_in_batch"] * 3  # gradient accumulation: more than this batch
            if vary_beta:
                t.beta = 0.04 * (1 + 0.1 * call)
            before = counters["stats"]["unique_graphs"]
            loss_and_grads(t, inputs)
            per_call.append(counters["stats"]["unique_graphs"] - before)
        return {"graphs": per_call, "recompile_reasons": list(reasons)}

    def stock():
        set_method(t, "none", "dapo")
        unsloth_adaptive_kl.unpatch()  # in the forked child only: it ends there
        return loop(vary_beta=False)

    def patched(method):
        set_method(t, method, "dapo", reward_threshold=-1.0)
        return loop(vary_beta=True)

    runs = {"stock": forked(stock)}
    for method in ("none", "clip+sigmoid+length_normalized", "dynamic"):
        runs[method] = forked(lambda method=method: patched(method))
    runs["stock_again"] = forked(stock)  # stock after the patched loops: what the loop position alone gives
    results["compiled_loop"] = runs


def scenario_user_code():
    """Issue 39's probes on Unsloth's fused loss: shaping methods registered here as a user would (the in-place
    cap, a detached, a float64 and a NaN result, a NaN only on real KLs), an estimator NaN only on real log-probs,
    and a NaN reference log-prob (the model's)."""

    def error_of(build):
        try:
            build()
        except Exception as e:  # noqa: BLE001 (the message is the measurement)
            return f"{type(e).__name__}: {e}"
        return None

    out = {}
    user = {
        "cap_in_place": lambda kl: kl.clamp_(max=1e-3),
        "detached": lambda kl: kl.detach(),
        "float64": lambda kl: kl.double(),
        "nan": lambda kl: kl * torch.nan,
        "cap_in_place_on_real_batches": lambda kl: kl.clamp_(max=1e-3) if kl.shape[0] != 2 else kl.clamp(max=1e-3),
        "power": lambda kl: kl**1.5,
        "halve": lambda kl: kl * 0.5,
    }
    for name, fn in user.items():
        unsloth_adaptive_kl.register_shaping(name)(fn)
    # Estimators: one NaN for log-probs below -3.5 (finite on the check at creation, whose log-probs are in [-3, 0]; the
    # tiny model's sampled tokens are near log(1/64)), and k3 as a user writes it (for the NaN reference below).
    unsloth_adaptive_kl.register_estimator("shaky")(lambda logp, ref: (logp - ref) * torch.sqrt(logp + 3.5))
    unsloth_adaptive_kl.register_estimator("user_k3")(lambda logp, ref: torch.exp((ref - logp).clamp(-20, 20)) - (ref - logp).clamp(-20, 20) - 1)
    for name in ("cap_in_place", "detached", "float64", "nan"):
        out[f"created_{name}"] = error_of(lambda: trainer(kl_adaptation_method=f"ziegler+{name}", kl_target=0.02, kl_horizon=40.0))
    # Faults the check at creation cannot see, refused during training: before their optimizer step.
    for key, name, estimator in (("cap_in_place_on_real_batches", "cap_in_place_on_real_batches", "k3"), ("power", "power", "k1"), ("shaky", "none", "shaky")):
        t = trainer(kl_adaptation_method=name, kl_estimator=estimator, max_steps=4)
        out[f"trained_{key}"] = {
            "error": error_of(t.train), "global_step": t.state.global_step,
            "weights_finite": all(bool(p.isfinite().all()) for p in t.model.parameters()),
        }  # fmt: skip
    # A NaN reference log-prob on one completion of the first of two micro-batches of one logging window.
    t = trainer()
    t.model.train()
    for method, estimator in (("sigmoid", "k3"), ("halve", "user_k3")):  # a user method and estimator: neither is blamed
        set_method(t, method, "dapo", kl_estimator=estimator, kl_target=0.02)
        t._metrics["train"].clear()
        nan_inputs = hand_made_inputs(t, seed=4)
        nan_inputs["ref_per_token_logps"][0] = float("nan")
        with torch.no_grad():
            errors = [error_of(lambda: t.compute_loss(t.model, nan_inputs)), error_of(lambda: t.compute_loss(t.model, hand_made_inputs(t, seed=5)))]
        out[f"nan_reference_{method}"] = {"errors": errors, "logged": {k: list(v) for k, v in t._metrics["train"].items()}}
    results["user_code"] = out


def unsloths_columns(out):
    """Which columns of Unsloth's left-packed log-probs its own loss reads as completion tokens, by unsloth_zoo's
    own functions (``left_pack_padding``, ``create_completion_attention_mask``)."""
    from unsloth_zoo.rl_replacements import create_completion_attention_mask, left_pack_padding

    pads = (out["prompt_mask"] == 0).sum(1)
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    window = left_pack_padding(ids, TOKENIZER.pad_token_id)[:, -(out["completion_ids"].shape[1] + int(pads.max())) :]
    return create_completion_attention_mask(window, pads, int(pads.max()), TOKENIZER.pad_token_id)


def reads_unsloths_columns(seen, packed, mask, out):
    """Whether the log-probs the penalty saw (on TRL's layout, under its mask) are, row by row and in order, those
    Unsloth's loss reads from its left-packed ``packed``."""
    columns = unsloths_columns(out)
    return all(seen[r][mask[r].bool()].tolist() == packed[r][columns[r]].tolist() for r in range(seen.shape[0]))


def scenario_reward_placement():
    """kl_placement='reward' on the generated trainer: one scored generation batch (what the penalty saw, the
    rewards, the advantages, the metric), the loss against the same trainer's at beta 0, and a short run."""
    from unsloth_adaptive_kl.kl_term import KLTerm

    def length_reward(completions, **kwargs):
        return [len(c) / 10.0 for c in completions]

    t = trl.GRPOTrainer(
        model=model(), reward_funcs=[toy.format_reward, length_reward], train_dataset=toy.prompt_dataset(64), processing_class=TOKENIZER,
        args=config(per_device_train_batch_size=8, kl_placement="reward", beta=0.5, kl_adaptation_method="clip", kl_estimator="k1",
                    kl_clip_threshold=0.05),
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the policy starts as the reference (KL 0): move it away
        for p in t.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    t.model.train()
    seen = {}
    calculate, per_token = t._calculate_rewards, KLTerm.per_token

    def rewards_spy(*args, **kwargs):
        seen["rewards_per_func"] = calculate(*args, **kwargs)
        return seen["rewards_per_func"]

    def per_token_spy(term, logp, ref, mask, coef=None, statistic=None, estimator=None):
        seen.setdefault("scored", []).append((logp.clone(), ref.clone(), mask.clone(), coef))
        return per_token(term, logp, ref, mask, coef, statistic, estimator)

    t._calculate_rewards = rewards_spy

    def score(rows, seed):
        """One generation batch of each row 4 times, scored: what the penalty saw, TRL's output, and the policy's
        log-probs by Unsloth's own function (its old/ref log-probs) on the same batch."""
        seen.clear()
        KLTerm.per_token = per_token_spy
        torch.manual_seed(seed)
        out = t._generate_and_score_completions([row for row in rows for _ in range(4)])
        KLTerm.per_token = per_token
        ((logp, ref, mask, coef),) = seen["scored"]
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        with torch.no_grad():
            own = t._get_per_token_logps_and_entropies(t.model, ids, attention, out["completion_ids"].shape[1], batch_size=8)[0]
        return logp, ref, mask, coef, out, own, ids, attention

    logp, ref, mask, coef, out, own, ids, attention = score([toy.prompt_dataset(64)[i] for i in (0, 1)], 0)
    length = out["completion_ids"].shape[1]
    with torch.no_grad():  # and by a plain forward
        logits = t.model(input_ids=ids, attention_mask=attention).logits[:, -length - 1 : -1].double()
    plain = torch.log_softmax(logits, -1).gather(-1, out["completion_ids"].unsqueeze(-1)).squeeze(-1)
    scored = {
        "logp": logp.tolist(), "ref": ref.tolist(), "mask": mask.tolist(), "coef_is_none": coef is None,
        "ref_is_trls": reads_unsloths_columns(ref, out["ref_per_token_logps"], mask, out), "plain_logp": plain.tolist(),
        "logp_is_unsloths_own": reads_unsloths_columns(logp, own, mask, out), "completion_ids": out["completion_ids"].tolist(),
        "pad_token_id": TOKENIZER.pad_token_id,
        "rewards_per_func": seen["rewards_per_func"].tolist(), "advantages": out["advantages"].tolist(),
        "kl_penalty": list(t._metrics["train"]["adaptive_kl/kl_penalty"]), "num_generations": t.num_generations,
        "kl_dominated_groups": list(t._metrics["train"]["adaptive_kl/kl_dominated_groups"]),
        "kl_only_groups": list(t._metrics["train"]["adaptive_kl/kl_only_groups"]),
    }  # fmt: skip

    # Prompts of two lengths: Unsloth scores the old and reference log-probs on its left-packed layout (the
    # short prompt's pads moved to the row's end), wider than the completion mask. The penalty must read each
    # completion's own tokens: the columns Unsloth's own loss reads (unsloths_columns).
    logp, ref, mask, _, out, own, _, _ = score([{"prompt": "16+66=", "answer": "82"}, {"prompt": "1+4=", "answer": "5"}], 1)
    pads = (out["prompt_mask"] == 0).sum(1)
    zoo_mask = unsloths_columns(out)
    scored["left_padded"] = {
        "prompt_pads": pads.tolist(), "own_width": own.shape[1], "mask_width": mask.shape[1],
        "logp": logp.tolist(), "ref": ref.tolist(), "mask": mask.tolist(), "own": own.tolist(),
        "trl_ref": out["ref_per_token_logps"].tolist(), "zoo_mask": zoo_mask.tolist(), "trl_mask": out["completion_mask"].tolist(),
        "rewards_per_func": seen["rewards_per_func"].tolist(),
        "completion_ids": out["completion_ids"].tolist(), "pad_token_id": TOKENIZER.pad_token_id,
        "advantages": out["advantages"].tolist(),
    }  # fmt: skip

    # The loss: with the KL in the reward, the same as this trainer's at beta 0 (no KL term at all).
    set_method(t, "clip", "dapo", kl_estimator="k1", kl_clip_threshold=0.05, kl_placement="reward")
    inputs = hand_made_inputs(t, seed=1)
    torch.manual_seed(0)
    reward_loss, reward_grads = loss_and_grads(t, inputs)
    logged_raw = list(t._metrics["train"]["adaptive_kl/raw_kl"])
    t.beta = 0.0
    torch.manual_seed(0)
    zero_loss, zero_grads = loss_and_grads(t, inputs)
    set_method(t, "clip", "dapo", kl_estimator="k1", kl_clip_threshold=0.05, kl_placement="loss")
    torch.manual_seed(0)
    loss_loss, _ = loss_and_grads(t, inputs)
    loss = {
        "equal": bool(torch.equal(reward_loss, zero_loss)), "loss": reward_loss.item(), "zero": zero_loss.item(),
        "with_kl_in_loss": loss_loss.item(), "logged_raw": logged_raw,
        "grads_equal": len(reward_grads) == len(zero_grads) > 0 and all(torch.equal(a, b) for a, b in zip(reward_grads, zero_grads)),
        "grads_max_diff": max(float((a - b).abs().max()) for a, b in zip(reward_grads, zero_grads)),
    }  # fmt: skip

    # A short run with the target controller.
    run = trainer(kl_placement="reward", kl_adaptation_method="ziegler", kl_target=1e-4, kl_horizon=40.0)
    run.train()
    logs = [{k: v for k, v in h.items() if k.startswith("adaptive_kl/")} for h in run.state.log_history if "adaptive_kl/current_beta" in h]
    results["reward_placement"] = {"scored": scored, "loss": loss, "logs": logs, "runtime": type(run._adaptive_kl).__name__}

    # The rewritten scoring function's super() calls (its VLM branches): compiled outside the class, they need the class.
    import ast
    import inspect

    from unsloth_adaptive_kl.backends import reward_placement

    (rewritten,) = reward_placement.UNSLOTH_PLAN.build({"_UnslothGRPOTrainer": generated._UnslothGRPOTrainer}).values()
    tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(rewritten.__code__)))
    calls = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "super"]
    results["reward_placement"]["rewritten_super"] = {"calls": calls, "freevars": list(rewritten.__code__.co_freevars)}


def scenario_monitor_reward():
    """kl_monitor with kl_placement='reward' at beta = 0 (issue 53), kl_monitor_every=2, EOS excluded: 4 steps against 4
    steps of stock Unsloth at beta = 0 (unpatched), same seed and the same perturbed policy. Per step: what the generation
    returned (advantages, whether it scored the reference), what the fused loss saw (its policy and reference log-probs,
    mask and token ids, for a float64 KL), what the scoring-time KL of the reward placement saw (the alarm's input) and
    what the alarm was fed; the steps whose reference forward ran; the logs and the final weights of both runs."""
    from unsloth_adaptive_kl.kl_term import KLTerm

    eos = TOKENIZER.eos_token_id

    def perturbed(t):
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():  # the policy starts as the reference (KL 0): move it away
            for p in t.model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        return t

    def spy_generation(t, batches):
        generate = t._generate_and_score_completions

        def spy(*args, **kwargs):
            out = generate(*args, **kwargs)
            batches.append({"advantages": out["advantages"].clone(), "completion_ids": out["completion_ids"].clone(),
                            "completion_mask": out["completion_mask"].clone(), "scored_reference": out.get("ref_per_token_logps") is not None})  # fmt: skip
            return out

        t._generate_and_score_completions = spy

    def weights(t):
        return [p.detach().clone() for p in t.model.parameters()]

    unsloth_adaptive_kl.unpatch()
    try:
        stock = perturbed(trainer(beta=0.0, max_steps=4))
        stock_batches = []
        spy_generation(stock, stock_batches)
        stock.train()
    finally:
        unsloth_adaptive_kl.patch()

    fused, scored, fed, ref_calls, batches = [], [], [], [], []
    cls = generated.UnslothEfficientGRPO
    inner = cls.forward

    def fused_spy(ctx, new, old, ref, *args, **kwargs):
        mask, input_ids = args[3], args[2]
        fused.append({"new": new.detach().double().tolist(), "old": None if old is None else old.double().tolist(), "ref": None if ref is None else ref.double().tolist(),
                      "mask": mask.tolist(), "input_ids": input_ids.reshape(mask.shape).tolist()})  # fmt: skip
        return inner(ctx, new, old, ref, *args, **kwargs)

    cls.forward = staticmethod(fused_spy)
    per_token = KLTerm.per_token

    def per_token_spy(term, logp, ref, mask, coef=None, statistic=None, estimator=None):
        scored.append({"logp": logp.double().tolist(), "ref": ref.double().tolist(), "mask": mask.tolist()})
        return per_token(term, logp, ref, mask, coef, statistic, estimator)

    KLTerm.per_token = per_token_spy
    try:
        t = perturbed(trainer(beta=0.0, max_steps=4, kl_placement="reward", kl_monitor=True, kl_monitor_every=2, kl_exclude_token_ids=[eos]))
        spy_generation(t, batches)
        t.ref_model.register_forward_hook(lambda *a: ref_calls.append(t.state.global_step))
        end_step = t._adaptive_kl.alarm.end_step
        t._adaptive_kl.alarm.end_step = lambda step, kl: (fed.append([step, kl]), end_step(step, kl))[1]
        t.train()
    finally:
        KLTerm.per_token, cls.forward = per_token, inner
    keys = ("loss", "reward", "kl", "adaptive_kl/raw_kl", "adaptive_kl/current_beta", "adaptive_kl/kl_penalty")
    logs = [[{k: h[k] for k in keys if k in h} for h in run.state.log_history if "loss" in h] for run in (t, stock)]
    results["monitor_reward"] = {
        "eos": eos, "logs": logs[0], "stock_logs": logs[1], "fused": fused, "scored": scored, "fed": fed, "ref_calls": sorted(set(ref_calls)),
        "scored_reference": [b["scored_reference"] for b in batches],
        "watched_batches": [{k: b[k].tolist() for k in ("completion_ids", "completion_mask")} for b in batches if b["scored_reference"]],
        "advantages_equal": [torch.equal(a["advantages"], b["advantages"]) for a, b in zip(batches, stock_batches)],
        "completions_equal": [torch.equal(a["completion_ids"], b["completion_ids"]) for a, b in zip(batches, stock_batches)],
        "advantages_nonzero": any(bool(b["advantages"].abs().sum() > 0) for b in batches),
        "weights_equal": all(torch.equal(a, b) for a, b in zip(weights(t), weights(stock))),
        "stock_runtime": getattr(stock, "_adaptive_kl", None) is None,
    }  # fmt: skip


def scenario_unpatch():
    """Configs built by stock Unsloth, then after each of import, unpatch(), patch(), unpatch()."""
    results["never_patched"] = never_patched
    results["sequence"] = {"imported": probe_config()}
    for step in ("unpatched", "patched_again", "unpatched_again"):
        (unsloth_adaptive_kl.unpatch if step.startswith("unpatched") else unsloth_adaptive_kl.patch)()
        results["sequence"][step] = probe_config()


SCENARIO_FUNCTIONS = {"early_config": scenario_early_config, "config": scenario_config, "unpatch": scenario_unpatch, "identity": scenario_identity, "all_masked": scenario_all_masked, "resume": scenario_resume, "kl_part": scenario_kl_part, "train": scenario_train, "subclass": scenario_subclass, "renamed": scenario_renamed, "compiled": scenario_compiled, "compiled_loop": scenario_compiled_loop, "reward_placement": scenario_reward_placement, "user_code": scenario_user_code, "diagnostics": scenario_diagnostics, "monitor_reward": scenario_monitor_reward}


def forked(fn):
    """``fn()`` in a child forked from this process, which ends there; what it returns, sent back through a pipe (its
    traceback raised here if it failed). The compiled scenarios run each measured run in one, so every run starts from
    the same state (no ``torch._dynamo.reset()`` between runs, which also dropped what warm_up_compiled compiled). The
    children run one at a time and share this scenario's TorchInductor cache directory (scenario_in_child), as the runs of
    one scenario process did before."""
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            payload = pickle.dumps((True, fn()))
        except BaseException:
            payload = pickle.dumps((False, traceback.format_exc()))
        with os.fdopen(write, "wb") as f:
            f.write(payload)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        payload = f.read()
    _, status = os.waitpid(pid, 0)
    if not payload:
        raise RuntimeError(f"forked run died (exit {os.waitstatus_to_exitcode(status)}) without a result")
    ok, value = pickle.loads(payload)
    if not ok:
        raise RuntimeError(f"forked run failed:\n{value}")
    return value


def warm_up_compiled():
    """Compile once, before the compiled* scenarios fork, what their runs share and do not test: transformers'
    create_causal_mask, which Unsloth wraps in torch.compile(dynamic=True) (~1 s of CPU per variant, ~8 variants per
    training run: generation, the log-prob forwards, the training forward). Three steps of a trainer as the runs build
    it and the compiled_loop's calls, with the fused loss run eagerly (torch.compiler.set_stance("force_eager") inside
    UnslothEfficientGRPO.forward), so the fused loss, and anything it calls, is compiled by the runs themselves and
    counted there. A mask variant this misses is compiled, and counted, in each run that needs it, as before (Unsloth
    sets dynamo's recompile_limit to 1024: the warm-up's variants leave it room)."""
    from unsloth_zoo.temporary_patches.common import torch_compile_options

    threads = (torch._inductor.config.compile_threads, torch_compile_options.get("compile_threads"))
    if threads != (1, 1):
        raise RuntimeError(f"compile_threads (torch's, Unsloth's) = {threads}: a forked child would wait on this process's compile threads")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cache-")  # a private one (see above)
    cls = generated.UnslothEfficientGRPO
    inner = cls.forward

    def eager(*args, **kwargs):
        with torch.compiler.set_stance("force_eager"):
            return inner(*args, **kwargs)

    cls.forward = staticmethod(eager)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            trainer(max_steps=3).train()
            t = trainer(loss_type="dapo")
            t.model.train()
            for call, length in enumerate([reference.MAX_COMPLETION, 2]):
                loss_and_grads(t, reference.loss_inputs(
                    t.model.config.vocab_size, seed=call, completion=length, ref_spread=2.0, ref_offset=3.0, pad_token_id=TOKENIZER.pad_token_id
                ))  # fmt: skip
    finally:
        cls.forward = inner


def scenario_in_child(name):
    """``name`` alone, in a child forked from this process (``forked``), as a fresh process would run it after the same
    imports: its results as JSON text. Its own TorchInductor cache, as a fresh process had (see TORCHINDUCTOR_CACHE_DIR
    above)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cache-")
    SCENARIO_FUNCTIONS[name]()
    return json.dumps(results, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))


failed = list(BRANCH_FAILED)
if SCENARIOS and SCENARIOS[0].startswith("compiled"):
    warm_up_compiled()
for name in SCENARIOS:  # each written as OUT/NAME.json, or its traceback as OUT/NAME.error
    try:
        text = forked(lambda name=name: scenario_in_child(name))
    except RuntimeError as error:
        with open(os.path.join(OUT, name + ".error"), "w") as f:
            f.write(str(error))
        failed.append(name)
    else:
        with open(os.path.join(OUT, name + ".json"), "w") as f:
            f.write(text)
if STOCK_BRANCH:  # a forked branch ends without running its parent's exit handlers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else 0)
sys.exit(f"failed: {', '.join(failed)}" if failed else 0)
