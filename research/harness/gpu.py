"""The GPU check: can this torch build train on this GPU? ``check_gpu`` judges (pure), ``probe_gpu``
measures; the kernel rule itself is :func:`unsloth_adaptive_kl.gpu_support.kernel_support`, the one
``doctor`` uses. Also the backend choice."""

from __future__ import annotations

from dataclasses import dataclass

from unsloth_adaptive_kl.gpu_support import BLACKWELL, kernel_support

BLACKWELL_FIX = (
    "Install a PyTorch build for CUDA >= 12.8, e.g. `pip install torch --index-url "
    "https://download.pytorch.org/whl/cu128` (or a newer cu12x/cu13x index), or, as Unsloth's Blackwell guide "
    "recommends, `uv pip install unsloth --torch-backend=auto`. Then check: python -c \"import torch; "
    'print(torch.cuda.get_arch_list())"'
)


@dataclass(frozen=True)
class GpuCheck:
    ok: bool
    blackwell: bool
    report: str  # one line for the run's header
    fix: str | None = None


def check_gpu(name: str | None, capability: tuple[int, int] | None, arch_list: list[str], bf16_error: str | None) -> GpuCheck:
    """Judge whether this torch build can train on this GPU. Pure: the caller measures.

    ``capability`` is ``torch.cuda.get_device_capability()`` (None without a GPU), ``arch_list``
    ``torch.cuda.get_arch_list()``, ``bf16_error`` the error of a small bf16 matmul (None if it
    worked). Which kernels run is :func:`~unsloth_adaptive_kl.gpu_support.kernel_support`'s rule
    (sm_120 covers a 12.1 card, sm_100a only 10.0); the demo trains only where machine code runs:
    a build with only PTX for this GPU would have the driver JIT-compile every kernel first."""
    if capability is None:
        return GpuCheck(True, False, "no CUDA GPU: running on the CPU, not on Blackwell")
    major, minor = capability
    family = BLACKWELL.get(major)
    where = f"{name} (sm_{major}{minor}, {family or 'not Blackwell'})"
    support = kernel_support(capability, arch_list)
    if not support.native:
        needs = "; the demo needs machine code (an sm_ entry) for this GPU" if support.runs else ""
        return GpuCheck(False, family is not None, f"{where}: {support.reason}{needs}",
                        BLACKWELL_FIX if family else "Install a PyTorch build whose CUDA version supports this GPU.")
    if bf16_error is not None:
        return GpuCheck(False, family is not None, f"{where}: a bf16 matmul failed: {bf16_error}",
                        BLACKWELL_FIX if family else "Install a PyTorch build with CUDA bf16 support for this GPU.")
    verdict = "Blackwell check passed" if family else "runs, but this is not a Blackwell GPU"
    return GpuCheck(True, family is not None, f"{where}: {support.reason}, bf16 matmul OK; {verdict}")


def probe_gpu() -> GpuCheck:
    """Measure this machine and judge it with :func:`check_gpu`."""
    import torch

    if not torch.cuda.is_available():
        return check_gpu(None, None, [], None)
    bf16_error = None
    try:
        a = torch.randn(64, 64, device="cuda")
        exact = a @ a
        err = ((a.bfloat16() @ a.bfloat16()).float() - exact).abs().max().item()
        if not err < 1.0:  # bf16 keeps ~3 significant digits; entries of a @ a are ~8
            bf16_error = f"bf16 result off by {err}"
    except Exception as e:  # "no kernel image is available" on a build without this arch
        bf16_error = f"{type(e).__name__}: {e}".splitlines()[0]
    return check_gpu(torch.cuda.get_device_name(), torch.cuda.get_device_capability(), torch.cuda.get_arch_list(), bf16_error)


def choose_backend(requested: str, *, unsloth_installed: bool, cuda: bool) -> str:
    """``auto``: Unsloth when it is installed and CUDA is available, TRL otherwise."""
    if requested == "unsloth" and not unsloth_installed:
        raise SystemExit("--backend unsloth: unsloth is not installed (pip install -e '.[unsloth]').")
    if requested == "auto":
        return "unsloth" if unsloth_installed and cuda else "trl"
    return requested
