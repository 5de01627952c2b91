"""The GPU-support rule (unsloth_adaptive_kl.gpu_support) on a table of (capability, arch list) cases,
and its user ``doctor.gpus`` (the study harness's ``check_gpu``, the other user, is
research/tests/test_harness_demo.py's; it reads CASES from here).

Expected values come from CUDA's compatibility model (the module docstring cites the sources), not
from the code: a cubin sm_XY runs on X.Z for Z >= Y; ``a`` code only on exactly X.Y; ``f`` code on
its family's later minors; PTX compute_XY on any capability >= X.Y; integrated GPUs (8.7 ...) only
run cubins built for them."""

import pytest

from unsloth_adaptive_kl import doctor
from unsloth_adaptive_kl.gpu_support import kernel_support, parse_target

CU128 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]  # PyTorch's cu128 wheels
CU124 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]

# (capability, arch list, the cubin that runs, the PTX the driver would JIT-compile): runs = either.
CASES = [
    # Blackwell
    ((10, 0), CU128, "sm_100", None),
    ((10, 3), CU128, "sm_100", None),  # B300: sm_100 runs on the later minor
    ((12, 0), CU128, "sm_120", None),
    ((12, 1), CU128, "sm_120", None),  # DGX Spark: sm_120 runs on 12.1
    ((10, 0), ["sm_90", "sm_100a"], "sm_100a", None),  # arch-specific, exactly this capability
    ((10, 3), ["sm_90", "sm_100a"], None, None),  # ... and no other: FAIL
    ((10, 3), ["sm_90", "sm_100f"], "sm_100f", None),  # family-specific: 10.0 and later 10.x
    ((12, 0), ["sm_100f", "sm_100a"], None, None),  # another family: FAIL
    ((12, 0), ["sm_120a"], "sm_120a", None),
    ((12, 1), ["sm_120a", "compute_120"], None, "compute_120"),  # sm_120a is not 12.1; the PTX is
    ((12, 0), CU124, None, None),  # a CUDA 12.4 build on an RTX 5090: FAIL
    ((10, 0), ["sm_90", "compute_90"], None, "compute_90"),  # PTX crosses majors
    # Hopper, Ada, Ampere
    ((9, 0), ["sm_80", "sm_90a"], "sm_90a", None),
    ((9, 0), ["sm_80", "compute_100"], None, None),  # PTX never runs below its capability: FAIL
    ((9, 0), ["compute_80"], None, "compute_80"),  # PTX-only list
    ((8, 6), ["sm_80"], "sm_80", None),  # RTX 30xx / A10 on sm_80 kernels
    ((8, 9), ["sm_80", "sm_86"], "sm_86", None),  # the closest of two that run
    ((8, 6), ["sm_80a", "sm_90"], None, None),  # a made-up sm_80a would still be 8.0 only: FAIL
    ((10, 0), ["compute_90a"], None, None),  # arch-specific PTX keeps its limit: FAIL
    # integrated GPUs (Jetson Orin 8.7) and odd entries
    ((8, 7), ["sm_80", "sm_86"], None, None),
    ((8, 7), ["sm_87"], "sm_87", None),
    ((8, 9), ["sm_87"], None, None),
    ((8, 6), ["gfx90a", "sm_860"], None, None),  # a ROCm name and sm_860 (86.0): neither is 8.6
    ((12, 1), [], None, None),
]


@pytest.mark.parametrize("capability, arch_list, cubin, ptx", CASES)
def test_kernel_support_follows_cudas_compatibility_rules(capability, arch_list, cubin, ptx):
    support = kernel_support(capability, arch_list)
    assert (support.cubin, support.ptx, support.runs, support.native) == (cubin, ptx, bool(cubin or ptx), bool(cubin))
    sm = f"sm_{capability[0]}{capability[1]}"
    if cubin is None:
        assert f"no kernels for {sm}" in support.reason and (", ".join(arch_list) or "none") in support.reason
    if ptx is not None:
        assert f"only PTX {ptx}" in support.reason and "JIT" in support.reason


def test_targets_parse_into_capability_kind_and_suffix():
    assert parse_target("sm_100a") == parse_target(" sm_100a ")
    assert (parse_target("sm_121").capability, parse_target("sm_121").ptx) == ((12, 1), False)
    assert (parse_target("compute_90").capability, parse_target("compute_90").ptx) == ((9, 0), True)
    assert parse_target("sm_100f").suffix == "f" and parse_target("sm_90").suffix == ""
    assert parse_target("gfx90a") is None and parse_target("sm_9") is None and parse_target("sm_90x") is None


# -- doctor.gpus: ok with a cubin, warn with PTX only, FAIL with neither ---------------------------
@pytest.mark.parametrize("capability, arch_list, cubin, ptx", CASES)
def test_doctor_reports_each_case_by_the_rule(fake_gpu, capability, arch_list, cubin, ptx):
    fake_gpu(capability, arch_list)
    (finding,) = doctor.gpus()
    assert finding.status == (doctor.OK if cubin else doctor.WARN if ptx else doctor.FAIL), finding.detail
    assert kernel_support(capability, arch_list).reason in finding.detail
    if not cubin:
        assert f"sm_{capability[0]}{capability[1]}" in finding.detail.split("Install")[1]
