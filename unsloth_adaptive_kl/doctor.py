"""``python -m unsloth_adaptive_kl doctor``: what is installed, and whether each backend can work.

It prints Python, torch and CUDA; each GPU with its compute capability, whether it is a
Blackwell part (compute capability 10.x, 11.x or 12.x) and whether this torch build's kernels run
on it (:mod:`unsloth_adaptive_kl.gpu_support`); the versions of TRL, transformers, Unsloth,
unsloth_zoo and Liger against the ranges of
:mod:`unsloth_adaptive_kl.versions`; and, per backend, whether every patch target exists and
every source anchor matches. The rewrites are dry-run: compiled into a throwaway function, never
installed. The reward placement's anchors (``kl_placement="reward"``) are dry-run too: where they do not
match, a WARN says that a trainer asking for that placement will be refused (the loss placement works).

Exit status: 0 when every checked backend can work, 1 otherwise. ``--backend NAME`` (repeatable)
checks only those backends and fails if one of them is unavailable; without it, TRL is checked
and so is every optional backend whose library is installed (a missing optional library is
reported, not an error).
"""

from __future__ import annotations

import argparse
import inspect
import os
import platform
import sys
from dataclasses import dataclass

from ._source_patch import ALLOW_UNTESTED_ENV, PatchError, anchor_text, compile_target, libraries_of, resolve, version_of
from .gpu_support import BLACKWELL, kernel_support
from .versions import PYTHON, SUPPORTED, requirement

BACKENDS = ("trl", "unsloth", "liger")
OK, WARN, FAIL, INFO = "ok", "warn", "FAIL", "--"


@dataclass
class Finding:
    topic: str
    status: str  # OK, WARN, FAIL or INFO
    detail: str


# -- environment ------------------------------------------------------------------------------------
def environment() -> list[Finding]:
    import torch
    from packaging.specifiers import SpecifierSet

    python = platform.python_version()
    findings = [
        Finding("Python", OK if SpecifierSet(PYTHON).contains(python) else FAIL, f"{python} (supported {PYTHON})"),
        version_finding("torch", torch.__version__),
    ]
    if torch.version.cuda is None:
        findings.append(Finding("CUDA", INFO, "this torch build has no CUDA (CPU only)"))
    else:
        available = "available" if torch.cuda.is_available() else "not available (no GPU or driver seen)"
        findings.append(Finding("CUDA", INFO, f"torch built with CUDA {torch.version.cuda}; {available}"))
    return findings


def gpus() -> list[Finding]:
    """One finding per GPU: name, compute capability, Blackwell or not, and whether this torch build's
    kernels run on it (:func:`~unsloth_adaptive_kl.gpu_support.kernel_support`): ok with machine code
    for it, warn with only PTX the driver must JIT-compile, FAIL with neither."""
    import torch

    if not torch.cuda.is_available():
        return [Finding("GPU", INFO, "none")]
    arch_list = torch.cuda.get_arch_list()
    findings = []
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        blackwell = "Blackwell" if major in BLACKWELL else "not Blackwell"
        detail = f"{torch.cuda.get_device_name(index)}, compute capability {major}.{minor} ({blackwell})"
        support = kernel_support((major, minor), arch_list)
        if support.native:
            findings.append(Finding(f"GPU {index}", OK, f"{detail}; {support.reason}"))
            continue
        fix = (f"Install a torch build whose torch.cuda.get_arch_list() has sm_{major}{minor} or an earlier "
               f"sm_{major}x entry" + (" (CUDA 12.8 or newer for Blackwell)." if major in BLACKWELL else "."))
        findings.append(Finding(f"GPU {index}", WARN if support.runs else FAIL, f"{detail}; {support.reason}. {fix}"))
    return findings


def version_finding(distribution: str, version: str | None = None) -> Finding:
    """``distribution``'s installed version against its range; out of range is FAIL for guarded
    libraries (the backend refuses it) unless the override is set, WARN otherwise."""
    supported = SUPPORTED[distribution]
    version = version_of(distribution) if version is None else version
    if version == "not installed":
        return Finding(distribution, INFO, f"not installed (supported {supported.label})")
    if supported.contains(version):
        return Finding(distribution, OK, f"{version} (supported {supported.label})")
    untested = f"{version} is outside the tested range {supported.label}"
    if not supported.guarded:
        return Finding(distribution, WARN, f"{untested}; not refused, but untested")
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return Finding(distribution, WARN, f"{untested}; allowed by {ALLOW_UNTESTED_ENV}=1 (anchors are still checked)")
    return Finding(
        distribution,
        FAIL,
        f"{untested}; pip install '{requirement(distribution)}', or set {ALLOW_UNTESTED_ENV}=1 to try anyway",
    )


# -- backends ---------------------------------------------------------------------------------------
def plan_findings(plan, owners: dict, *, namespace: dict | None = None) -> list[Finding]:
    """Dry-run a backend's plan: compile each target with its rewrites (installed nowhere), one
    finding per target, named after the library that holds the anchors. FAIL names the missing anchor."""
    try:
        anchor_set = plan.select(owners)
    except PatchError as error:  # no anchor set covers this version: show how each would fare
        return [Finding(f"{plan.backend} anchors", FAIL, str(error)), *anchor_set_findings(plan, owners, namespace=namespace)]
    findings = []
    for target, rewrites in anchor_set.targets().items():
        topic = f"{' / '.join(libraries_of(rewrites))} {target}"
        try:
            compile_target(owners, target, rewrites, namespace=namespace)
        except PatchError as error:
            findings.append(Finding(topic, FAIL, str(error)))
        else:
            findings.append(Finding(topic, OK, f"{len(rewrites)} anchor(s) found (anchor set {anchor_set.family!r})"))
    return findings


def anchor_set_findings(plan, owners: dict, *, namespace: dict | None = None) -> list[Finding]:
    """For a version no anchor set covers: for every anchor set and target, which anchors match the installed
    source exactly once and which do not; where all match, whether the rewrite compiles (the names its
    replacements read). What ``UNSLOTH_ADAPTIVE_KL_ALLOW_UNTESTED=1`` would try, as information (``--``)."""
    findings = []
    for anchor_set in plan.anchor_sets:
        for target, rewrites in anchor_set.targets().items():
            topic = f"anchor set {anchor_set.family!r}: {' / '.join(libraries_of(rewrites))} {target}"
            try:
                source = inspect.getsource(resolve(owners, target))
            except (OSError, TypeError, KeyError, AttributeError) as error:
                findings.append(Finding(topic, INFO, f"its source cannot be read ({type(error).__name__}: {error})"))
                continue
            counts = [source.count(r.anchor) for r in rewrites]
            matching = [repr(anchor_text(r.anchor)) for r, count in zip(rewrites, counts) if count == 1]
            failing = [f"{anchor_text(r.anchor)!r} ({count} times)" for r, count in zip(rewrites, counts) if count != 1]
            detail = f"{len(matching)} of {len(rewrites)} anchor(s) match exactly once"
            detail += f": {', '.join(matching)}" if matching else ""
            if failing:
                detail += f"; not matching: {', '.join(failing)}"
            else:
                try:
                    compile_target(owners, target, rewrites, namespace=None if namespace is None else dict(namespace))
                except PatchError as error:
                    detail += f"; yet the rewrite fails: {error}"
            findings.append(Finding(topic, INFO, detail))
    return findings


def reward_placement_findings(plan, owners: dict, *, namespace: dict | None = None) -> list[Finding]:
    """Dry-run the reward placement's plan (``kl_placement="reward"``, :mod:`.backends.reward_placement`) as
    :func:`plan_findings` does. Where it cannot be built, the loss placement still works, so the finding is a WARN
    (not a FAIL) saying that a trainer with ``kl_placement="reward"`` will be refused, and why."""
    findings = []
    for finding in plan_findings(plan, owners, namespace=namespace):
        if finding.status == FAIL:
            finding = Finding(
                finding.topic, WARN,
                f"kl_placement='reward' cannot work here: a trainer asking for it is refused ({finding.detail}); "
                "kl_placement='loss' is unaffected",
            )  # fmt: skip
        elif finding.status == OK:
            finding = Finding(finding.topic, OK, f"kl_placement='reward': {finding.detail}")
        findings.append(finding)
    return findings


def monitor_with_reward_findings(target: str, features: tuple, owners: dict) -> list[Finding]:
    """Dry-run ``target`` (the generation) with the edits of ``features`` (kl_monitor's and the reward placement's)
    composed onto one copy of its source, as a trainer with both gets it (``backends/_generation.py``). Where they cannot
    be combined each still works alone: a WARN saying that a trainer asking for both will be refused, and why."""
    from .backends import _generation

    topic = f"{target} (kl_monitor with kl_placement='reward')"
    _, reasons = _generation.build(target, features, owners)
    alone = [f.name for f in features if frozenset({f.name}) in reasons]
    if alone:
        return [Finding(topic, INFO, f"not checked: {' and '.join(alone)} cannot work here on its own (see above)")]
    reason = reasons.get(frozenset(f.name for f in features))
    if reason is None:
        return [Finding(topic, OK, f"the edits of {' and '.join(f.name for f in features)} compose onto one copy of its source")]
    return [Finding(topic, WARN, f"kl_monitor=True with kl_placement='reward' cannot work here: a trainer asking for both is refused ({reason})")]


def targets_exist(owner, names: tuple[str, ...], topic: str) -> Finding:
    missing = [name for name in names if not hasattr(owner, name)]
    if missing:
        return Finding(topic, FAIL, f"{owner.__qualname__} has no {missing}: this version is not supported")
    return Finding(topic, OK, ", ".join(names))


def trl_backend_findings() -> list[Finding]:
    findings = [version_finding("trl"), version_finding("transformers")]
    if findings[0].status == INFO:
        return [Finding("trl", FAIL, f"not installed; pip install '{requirement('trl')}'")]
    from .backends import _config_class, _trainer, reward_placement
    from .backends import trl as trl_backend

    owners = trl_backend.owners()  # TRL's own classes, also where Unsloth rebound the names
    findings.append(targets_exist(owners["GRPOConfig"], _config_class.CONFIG_ATTRIBUTES, "trl GRPOConfig"))
    findings.append(targets_exist(owners["GRPOTrainer"], _trainer.WRAPPED_TRAINER_METHODS, "trl GRPOTrainer"))
    if findings[-1].status == OK:
        findings.extend(plan_findings(trl_backend.PLAN, owners))
        findings.extend(reward_placement_findings(reward_placement.TRL_PLAN, owners))
        features = (trl_backend.MONITOR, reward_placement.feature(reward_placement.TRL_PLAN))
        findings.extend(monitor_with_reward_findings(trl_backend.GENERATE, features, owners))
    findings.append(triton_finding())
    findings.append(
        Finding("trl used when", INFO, "trl.GRPOTrainer is TRL's own class (Unsloth not active: see Backend unsloth) and no loss_class= is given")
    )
    return findings


def triton_finding() -> Finding:
    """Whether TRL's Triton log-prob kernel (``trl.kernels``, used by its GRPO loss whenever Triton is
    installed) can run here: it needs a Triton driver (a GPU Triton sees) or ``TRITON_INTERPRET=1``
    (the CPU interpreter, slow). Without either, training dies at its first step with Triton's
    ``RuntimeError: 0 active drivers``."""
    topic = "trl Triton kernel on this machine"
    try:
        from triton.runtime import driver
    except ImportError:
        return Finding(topic, OK, "triton is not installed: TRL computes its log-probs in torch")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return Finding(topic, OK, "TRITON_INTERPRET=1: TRL's Triton kernel runs in the CPU interpreter (slowly)")
    try:
        target = driver.active.get_current_target()
    except Exception as error:  # noqa: BLE001 - Triton says why it has no driver; report it
        return Finding(
            topic,
            FAIL,
            f"no Triton driver ({type(error).__name__}: {error}), so TRL's Triton log-prob kernel cannot run and "
            "training would stop at its first step. Fix: export TRITON_INTERPRET=1 before starting Python (CPU, slow), "
            "or train where Triton sees a GPU",
        )
    return Finding(topic, OK, f"Triton driver for {getattr(target, 'backend', target)}")


def _generated_unsloth_module():
    """Unsloth's generated GRPO module, and whether ``import unsloth`` itself generated it and rebound
    ``trl.GRPOTrainer`` to it (what a user's import does). Where it does not (no GPU), the module is
    generated through Unsloth's own (private) entry point, so the anchors can still be checked."""
    import unsloth  # noqa: F401  (generates the RL trainers on a GPU machine)
    import trl

    from .backends import unsloth as unsloth_backend

    module = sys.modules.get(unsloth_backend.GENERATED_MODULE)
    active = module is not None and getattr(trl, "GRPOTrainer", None) is getattr(module, "UnslothGRPOTrainer", None)
    return unsloth_backend.generate_trainer_module(), active


def unsloth_used_finding(active: bool, requested: bool) -> Finding:
    """Whether a GRPOTrainer created after ``import unsloth`` on this machine would use Unsloth's loss.
    Where it would not, that is FAIL when the Unsloth backend was asked for, WARN otherwise."""
    topic = "unsloth used on this machine"
    if active:
        return Finding(topic, OK, "`import unsloth` rebinds trl.GRPOTrainer to UnslothGRPOTrainer: a GRPOTrainer created after it uses Unsloth's fused loss")
    return Finding(
        topic,
        FAIL if requested else WARN,
        "no: `import unsloth` does not patch TRL's GRPO trainer here (it needs a GPU), so a GRPOTrainer created on this "
        "machine runs on TRL's eager loss, not Unsloth's fused one; the anchors below were checked on a trainer "
        "generated through Unsloth's private entry point",
    )


def unsloth_backend_findings(requested: bool = False) -> list[Finding]:
    findings = [version_finding("unsloth"), version_finding("unsloth_zoo")]
    if any(f.status == INFO for f in findings):
        return [Finding("unsloth", FAIL, "unsloth or unsloth_zoo is not installed; pip install 'unsloth-adaptive-kl[unsloth]'")]
    try:
        module, active = _generated_unsloth_module()
    except Exception as error:  # noqa: BLE001 - report whatever stopped Unsloth, then fail
        return findings + [Finding("unsloth import", FAIL, f"{type(error).__name__}: {error}")]
    if module is None:
        return findings + [Finding("unsloth GRPO trainer", FAIL, "Unsloth did not generate its GRPO trainer module")]
    findings.append(unsloth_used_finding(active, requested))
    from .backends import unsloth as unsloth_backend

    trainer_cls = getattr(module, "UnslothGRPOTrainer", None)
    efficient = getattr(module, "UnslothEfficientGRPO", None)
    if trainer_cls is None or efficient is None or not hasattr(module, "grpo_compute_loss"):
        return findings + [Finding("unsloth GRPO trainer", FAIL, "the generated module lacks UnslothGRPOTrainer, UnslothEfficientGRPO or grpo_compute_loss")]
    findings += plan_findings(unsloth_backend.PLAN, unsloth_backend.owners(module), namespace=dict(module.__dict__))
    from .backends import reward_placement

    generated = getattr(module, "_UnslothGRPOTrainer", trainer_cls.__mro__[1])  # the class whose copy of TRL's function it rewrites
    owners = {"_UnslothGRPOTrainer": generated}
    features = (unsloth_backend.MONITOR, reward_placement.feature(reward_placement.UNSLOTH_PLAN))
    return (
        findings
        + reward_placement_findings(reward_placement.UNSLOTH_PLAN, owners)
        + monitor_with_reward_findings(unsloth_backend.MONITOR_GENERATE, features, owners)
    )


def liger_backend_findings() -> list[Finding]:
    findings = [version_finding("liger-kernel")]
    if findings[0].status == INFO:
        return [Finding("liger-kernel", FAIL, f"not installed; pip install '{requirement('liger-kernel')}'")]
    from liger_kernel.chunked_loss import fused_linear_ppo, grpo_loss

    findings.append(targets_exist(grpo_loss.LigerFusedLinearGRPOFunction, ("ppo_loss_fn",), "liger LigerFusedLinearGRPOFunction"))
    findings.append(targets_exist(fused_linear_ppo.LigerFusedLinearPPOBase, ("_compute_dapo_normalizer",), "liger LigerFusedLinearPPOBase"))
    try:
        from trl.kernels import ChunkedLogProbFunction  # noqa: F401  (the log-prob kernel the Liger module uses)
    except ImportError as error:
        findings.append(Finding("trl.kernels.ChunkedLogProbFunction", FAIL, f"{error}: the Liger module needs TRL 1.15's kernel"))
    import torch

    if not torch.cuda.is_available():
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        findings.append(
            Finding(
                "liger on CPU",
                OK if interpreted else WARN,
                "TRITON_INTERPRET=1 is set" if interpreted else "no GPU: set TRITON_INTERPRET=1 before importing trl to run it (slowly)",
            )
        )
    findings.append(Finding("liger used when", INFO, "GRPOTrainer(loss_class=AdaptiveFusedLinearGRPOLoss or a Liger-shaped class) is given"))
    return findings


BACKEND_CHECKS = {"trl": trl_backend_findings, "unsloth": unsloth_backend_findings, "liger": liger_backend_findings}
OPTIONAL_DISTRIBUTION = {"unsloth": "unsloth", "liger": "liger-kernel"}


# -- the command ------------------------------------------------------------------------------------
def run(requested: list[str] | None = None, out=None) -> int:
    """Print the report; return the exit status (0: everything checked can work)."""
    out = out or sys.stdout
    sections = [("Environment", environment() + gpus())]
    failed = any(f.status == FAIL for f in sections[0][1])
    backends = requested or [b for b in BACKENDS if b == "trl" or version_of(OPTIONAL_DISTRIBUTION[b]) != "not installed"]
    for backend in BACKENDS:
        if backend not in backends:
            why = "not requested" if requested else f"{OPTIONAL_DISTRIBUTION[backend]} is not installed"
            sections.append((f"Backend {backend}", [Finding(backend, INFO, f"not checked: {why}")]))
            continue
        try:
            asked = {"requested": True} if requested and backend == "unsloth" else {}
            findings = BACKEND_CHECKS[backend](**asked)
        except Exception as error:  # noqa: BLE001 - a doctor reports, it does not crash
            findings = [Finding(backend, FAIL, f"checking it raised {type(error).__name__}: {error}")]
        sections.append((f"Backend {backend}", findings))
        failed = failed or any(f.status == FAIL for f in findings)
    from . import IMPORT_PATCH_ERROR, __version__

    if IMPORT_PATCH_ERROR is not None:  # `import unsloth_adaptive_kl` would raise this anywhere else
        sections.insert(0, ("Import", [Finding("import unsloth_adaptive_kl", FAIL, str(IMPORT_PATCH_ERROR))]))
        failed = True
    print(f"unsloth-adaptive-kl {__version__} doctor", file=out)
    for title, findings in sections:
        print(f"\n{title}", file=out)
        for f in findings:
            print(f"  [{f.status:>4}] {f.topic}: {f.detail}", file=out)
    verdict = "some checked backend cannot work (see FAIL above)" if failed else "every checked backend can work"
    print(f"\nResult: {verdict}", file=out)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unsloth-adaptive-kl doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--backend", action="append", choices=BACKENDS, help="check only this backend, and fail if it cannot work (repeatable)"
    )
    args = parser.parse_args(argv)
    return run(args.backend)
