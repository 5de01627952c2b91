"""Whether a torch build's CUDA kernels run on a GPU: one pure rule, used by ``doctor`` and the demo.

Input: the device's compute capability ``(major, minor)`` (``torch.cuda.get_device_capability()``)
and the build's targets (``torch.cuda.get_arch_list()``: ``sm_XY`` for machine code, a *cubin*, and
``compute_XY`` for PTX, each with an optional ``a`` or ``f`` suffix; XY is the capability with its
last digit as the minor, so ``sm_100`` is 10.0 and ``sm_86`` is 8.6).

The rule, from CUDA's compatibility model:

- A cubin ``sm_XY`` runs on capability X.Z for every Z >= Y, never on another major. (CUDA C++
  Programming Guide, "Binary Compatibility": binary compatibility is guaranteed from one minor
  revision to the next, not to the previous one or across major revisions.) So ``sm_120`` runs on
  12.1 (DGX Spark) and ``sm_80`` on 8.6, but ``sm_90`` not on 10.0.
- ``a`` (architecture-specific: ``sm_90a``, ``sm_100a``, ``sm_120a``) code uses features of exactly
  that capability and runs only there. (PTX ISA, targets with suffix ``a``: "supported on the
  specified architecture only ... do not follow the onion layer model"; the Programming Guide's
  "Architecture-Specific Feature Set".)
- ``f`` (family-specific, CUDA 12.9+: ``sm_100f``, ``sm_120f``) code runs on the same major from
  that minor on: ``sm_100f`` on 10.0 and 10.3, not on 12.x. (NVIDIA's blog "NVIDIA Blackwell and
  NVIDIA CUDA 12.9 Introduce Family-Specific Architecture Features"; the Programming Guide's
  "Family-Specific Feature Set".)
- PTX ``compute_XY`` is compiled by the driver at load time (JIT) for any capability >= X.Y, of any
  major: PTX is forward compatible (same blog: "PTX code built for previous GPUs can be JIT
  compiled by today's drivers"). ``compute_XYa`` / ``compute_XYf`` keep their suffix's limits. The
  first start then compiles every kernel (slow), and PyTorch itself warns that such a build "is not
  compatible" (``torch.cuda._check_capability`` only accepts same-major code): the result says
  which of the two, cubin or PTX, makes the kernels run, and the caller decides what PTX-only means.
- Integrated (Tegra/Jetson) GPUs have their own machine code: a cubin runs on one of them only if
  built for exactly its capability, and an integrated GPU's cubin runs on nothing else (5.3, 6.2,
  7.2, 8.7 and 10.1, as in PyTorch's ``torch.cuda.DEVICE_REQUIREMENT`` table, which accounts "for
  incompatibility of iGPU and dGPU"). PTX is unaffected.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

INTEGRATED = frozenset({(5, 3), (6, 2), (7, 2), (8, 7), (10, 1)})
BLACKWELL = {10: "datacenter Blackwell (B200, B300, GB200)", 11: "Blackwell (Jetson Thor)",
             12: "Blackwell (RTX 50, RTX PRO 6000, DGX Spark)"}  # by major; Thor was 10.1 before CUDA 13
_TARGET = re.compile(r"(sm|compute)_(\d+)(a|f)?")


@dataclass(frozen=True)
class Target:
    """One entry of ``torch.cuda.get_arch_list()``, parsed."""

    name: str  # as torch spells it, e.g. "sm_100a"
    ptx: bool  # compute_XY (PTX, compiled by the driver) rather than sm_XY (a cubin)
    capability: tuple[int, int]
    suffix: str  # "", "a" (architecture-specific) or "f" (family-specific)


def parse_target(name: str) -> Target | None:
    """``"sm_100a"`` -> Target(ptx=False, capability=(10, 0), suffix="a"); None for anything else
    (a ROCm ``gfx90a``, a typo)."""
    match = _TARGET.fullmatch(name.strip())
    if match is None:
        return None
    kind, digits, suffix = match.groups()
    if len(digits) < 2:
        return None
    return Target(name.strip(), kind == "compute", (int(digits[:-1]), int(digits[-1])), suffix or "")


def runs_on(target: Target, capability: tuple[int, int]) -> bool:
    """Whether ``target``'s code runs on a device of ``capability`` (the rules of the module docstring)."""
    if target.suffix == "a":  # architecture-specific: this capability only
        return capability == target.capability
    if target.ptx and not target.suffix:  # plain PTX: any capability at or above it
        return capability >= target.capability
    if not target.ptx and (capability in INTEGRATED or target.capability in INTEGRATED):
        return capability == target.capability  # integrated GPUs: their own machine code only
    return capability[0] == target.capability[0] and capability[1] >= target.capability[1]  # same major, later minor


@dataclass(frozen=True)
class KernelSupport:
    """The verdict for one device: ``runs`` when a cubin or PTX of the build runs on it."""

    runs: bool
    cubin: str | None  # the sm_ entry whose machine code runs here (the closest), if any
    ptx: str | None  # the compute_ entry the driver would JIT-compile, when no cubin runs
    reason: str  # one clause: "this torch build has ..."

    @property
    def native(self) -> bool:
        return self.cubin is not None


def kernel_support(capability: tuple[int, int], arch_list: Sequence[str]) -> KernelSupport:
    """Judge ``torch.cuda.get_arch_list()`` against a device of ``capability``. Pure: the caller measures."""
    major, minor = capability
    sm = f"sm_{major}{minor}"
    targets = [t for t in map(parse_target, arch_list) if t is not None]
    cubins = [t for t in targets if not t.ptx and runs_on(t, capability)]
    if cubins:
        best = max(cubins, key=lambda t: (t.capability, t.suffix == ""))  # the closest, plain sm_XY first
        if best.capability == capability:
            kind = {"a": f"for exactly {major}.{minor}", "f": f"for the {major}.x family from {major}.{minor}"}
            detail = f" ({best.name}: {kind[best.suffix]})" if best.suffix else ""
            return KernelSupport(True, best.name, None, f"this torch build has {sm} kernels{detail}")
        why = "family-specific code runs on its family's later minors" if best.suffix == "f" else (
            "a cubin runs on later minors of its major")
        return KernelSupport(True, best.name, None,
                             f"this torch build has {best.name} kernels, which run on {major}.{minor} ({why})")
    listed = ", ".join(arch_list) or "none"
    ptx = [t for t in targets if t.ptx and runs_on(t, capability)]
    if ptx:
        best = max(ptx, key=lambda t: t.capability)
        return KernelSupport(
            True, None, best.name,
            f"this torch build has no kernels for {sm}, only PTX {best.name} (it has {listed}), which the driver "
            f"JIT-compiles for {major}.{minor} when a kernel is first loaded: a slow first start, and PyTorch warns "
            "that the build is not compatible",
        )
    return KernelSupport(False, None, None, f"this torch build has no kernels for {sm} (it has {listed})")
