"""``python -m unsloth_adaptive_kl doctor``: what it reports and when it exits non-zero.

Missing anchors, out-of-range versions, missing libraries and GPUs are simulated with
monkeypatch; one subprocess runs the real command as a user first would, ``python -m unsloth_adaptive_kl doctor``
(which checks Unsloth where it is installed: the tests that read its Unsloth section are skipped where it is not),
and two run the package with a TRL it refuses. (Each process imports torch, transformers and TRL, and Unsloth for the
plain command: ~9-19 s of CPU. What used to take a process of its own, ``--backend trl`` and ``--backend unsloth``, is
checked here in this process through ``doctor.main`` and the import-time decision of ``unsloth_adaptive_kl``, with
the plain command's process as the end-to-end run of both.)"""

import dataclasses
import importlib.util
import io
import os
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest
import torch
import unsloth_adaptive_kl
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from unsloth_adaptive_kl import doctor, versions
from unsloth_adaptive_kl.__main__ import main as cli_main
from unsloth_adaptive_kl._source_patch import Rewrite
from unsloth_adaptive_kl.backends import trl as trl_backend

ROOT = Path(__file__).resolve().parents[1]
ALLOW = "UNSLOTH_ADAPTIVE_KL_ALLOW_UNTESTED"


def installed_trl_anchor_set():
    return trl_backend.PLAN.select(trl_backend.owners())


def trl_plan_with(rewrites):
    """TRL's plan with only the installed TRL's anchor set, its rewrites replaced (``(anchor, replacement)`` pairs or Rewrites)."""
    as_rewrites = [r if isinstance(r, Rewrite) else Rewrite("GRPOTrainer._compute_loss", "trl", r[0], r[1], "test") for r in rewrites]
    anchor_set = dataclasses.replace(installed_trl_anchor_set(), rewrites=tuple(as_rewrites))
    return dataclasses.replace(trl_backend.PLAN, anchor_sets=(anchor_set,))


def report(*backends):
    out = io.StringIO()
    status = doctor.run(list(backends) or None, out=out)
    return status, out.getvalue()


def fake_versions(monkeypatch, **fake):
    """Make doctor see other installed versions (``liger_kernel`` for liger-kernel)."""
    fake = {name.replace("liger_kernel", "liger-kernel"): v for name, v in fake.items()}
    real = doctor.version_of
    monkeypatch.setattr(doctor, "version_of", lambda dist: fake.get(dist, real(dist)))


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    monkeypatch.delenv(ALLOW, raising=False)


def test_reports_versions_and_finds_every_trl_anchor():
    status, text = report("trl", "liger")
    assert status == 0, text
    assert f"torch: {torch.__version__}" in text
    assert f"trl: {doctor.version_of('trl')} (supported {versions.SUPPORTED['trl'].label})" in text
    family = trl_backend.PLAN.select(trl_backend.owners()).family
    assert f"[  ok] trl GRPOTrainer._compute_loss: 3 anchor(s) found (anchor set {family!r})" in text
    assert "_generate_and_score_completions" in text and "_load_callback_state" in text
    assert "[  ok] liger-kernel" in text
    assert text.rstrip().endswith("every checked backend can work")


def test_a_missing_trl_anchor_fails_naming_the_anchor(monkeypatch):
    broken = [*installed_trl_anchor_set().rewrites[:2], ("        if self._a_future_trl_line:\n", "")]
    monkeypatch.setattr(trl_backend, "PLAN", trl_plan_with(broken))
    status, text = report("trl")
    assert status == 1
    line = next(line for line in text.splitlines() if "_compute_loss" in line and "FAIL" in line)
    assert "if self._a_future_trl_line:" in line and f"trl {doctor.version_of('trl')}" in line


def test_a_missing_anchor_fails_even_with_the_override(monkeypatch):
    monkeypatch.setenv(ALLOW, "1")
    monkeypatch.setattr(trl_backend, "PLAN", trl_plan_with([("        nothing like this\n", "")]))
    assert report("trl")[0] == 1


def test_an_out_of_range_trl_fails_naming_the_range_unless_overridden(monkeypatch):
    fake_versions(monkeypatch, trl="1.17.0")
    status, text = report("trl")
    assert status == 1
    assert f"[FAIL] trl: 1.17.0 is outside the tested range {versions.SUPPORTED['trl'].label}" in text and ALLOW in text
    monkeypatch.setenv(ALLOW, "1")
    status, text = report("trl")
    assert status == 0, text
    assert f"[warn] trl: 1.17.0 is outside the tested range {versions.SUPPORTED['trl'].label}; allowed by" in text


def test_an_out_of_range_transformers_only_warns(monkeypatch):
    fake_versions(monkeypatch, transformers="4.55.4")  # no guard refuses it: doctor must not claim it cannot work
    status, text = report("trl")
    assert status == 0
    assert "[warn] transformers: 4.55.4 is outside the tested range" in text


def test_an_out_of_range_liger_fails(monkeypatch):
    fake_versions(monkeypatch, liger_kernel="0.9.1")
    status, text = report("liger")
    assert status == 1 and "liger-kernel: 0.9.1 is outside the tested range 0.8.x" in text


def test_asking_for_a_missing_backend_fails_but_an_unrequested_one_does_not(monkeypatch):
    fake_versions(monkeypatch, unsloth="not installed", unsloth_zoo="not installed")
    status, text = report("unsloth")
    assert status == 1 and "unsloth or unsloth_zoo is not installed" in text
    status, text = report()
    assert status == 0, text
    assert "[  --] unsloth: not checked: unsloth is not installed" in text


def test_an_out_of_range_unsloth_fails_naming_its_range(monkeypatch):
    fake_versions(monkeypatch, unsloth="2026.11.1", unsloth_zoo="2026.10.9")
    monkeypatch.setattr(doctor, "_generated_unsloth_module", lambda: (None, False))  # do not import unsloth here
    status, text = report("unsloth")
    assert status == 1
    assert f"[FAIL] unsloth: 2026.11.1 is outside the tested range {versions.SUPPORTED['unsloth'].label}" in text
    assert "[  ok] unsloth_zoo: 2026.10.9" in text


@pytest.mark.parametrize(
    "capability, arch_list, status, words",
    [
        ((12, 0), ["sm_80", "sm_90", "sm_100", "sm_120", "compute_120"], doctor.OK, ["compute capability 12.0 (Blackwell)", "has sm_120 kernels"]),
        ((10, 0), ["sm_80", "sm_90", "sm_100a"], doctor.OK, ["(Blackwell)", "has sm_100 kernels"]),
        ((12, 0), ["sm_80", "sm_90"], doctor.FAIL, ["(Blackwell)", "no kernels for sm_120", "CUDA 12.8"]),
        ((9, 0), ["sm_80", "sm_90"], doctor.OK, ["compute capability 9.0 (not Blackwell)"]),
        ((8, 6), ["sm_90", "sm_860"], doctor.FAIL, ["no kernels for sm_86"]),  # sm_860 is not sm_86
        ((8, 6), ["sm_80", "sm_90"], doctor.OK, ["has sm_80 kernels, which run on 8.6"]),  # was FAIL (issue 14)
        ((12, 1), ["sm_100", "sm_120"], doctor.OK, ["(Blackwell)", "has sm_120 kernels, which run on 12.1"]),
    ],
)
def test_gpu_capability_blackwell_and_torch_support(fake_gpu, capability, arch_list, status, words):
    fake_gpu(capability, arch_list)
    (finding,) = doctor.gpus()
    assert finding.status == status and finding.topic == "GPU 0"
    assert all(w in finding.detail for w in words), finding.detail


def test_an_unsupported_gpu_makes_the_doctor_fail(monkeypatch):
    monkeypatch.setattr(doctor, "gpus", lambda: [doctor.Finding("GPU 0", doctor.FAIL, "no sm_120 kernels")])
    assert report("trl")[0] == 1


def test_supported_ranges_agree_with_pyproject():
    """pyproject.toml declares exactly versions.py's ranges: every dependency, and the unsloth extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {r.name: r for r in map(Requirement, project["dependencies"] + project["optional-dependencies"]["unsloth"])}
    assert set(declared) == set(versions.SUPPORTED), set(declared) ^ set(versions.SUPPORTED)
    for name, supported in versions.SUPPORTED.items():
        assert declared[name].specifier == SpecifierSet(supported.specifier), name
    assert {Requirement(r).name for r in project["optional-dependencies"]["unsloth"]} == set(versions.EXTRA_UNSLOTH)
    assert project["requires-python"] == versions.PYTHON


@pytest.mark.parametrize("distribution, backend", [("trl", "trl"), ("liger-kernel", "liger")])
def test_the_install_hint_of_a_missing_library_is_versions_py_range(monkeypatch, distribution, backend):
    fake_versions(monkeypatch, **{distribution: "not installed"})
    (finding,) = doctor.BACKEND_CHECKS[backend]()
    assert finding.status == doctor.FAIL and f"pip install '{versions.requirement(distribution)}'" in finding.detail, finding.detail


def test_the_hint_for_an_untested_version_is_versions_py_range(monkeypatch):
    fake_versions(monkeypatch, trl="1.17.0")
    finding = doctor.version_finding("trl")
    assert finding.status == doctor.FAIL and "pip install 'trl>=0.24.0,<1.17'" in finding.detail, finding.detail


def test_cli_without_a_command_prints_usage_and_exits_2(capsys):
    assert cli_main([]) == 2
    assert "doctor" in capsys.readouterr().err


def _doctor_env(tmp_path):
    return {**os.environ, "TRITON_INTERPRET": "1", "UNSLOTH_COMPILE_DISABLE": "1", "UNSLOTH_COMPILE_LOCATION": str(tmp_path / "cache")}


@pytest.fixture(scope="module")
def doctor_plain(tmp_path_factory):
    """``python -m unsloth_adaptive_kl doctor``, run once for the tests below that read it."""
    env = _doctor_env(tmp_path_factory.mktemp("doctor"))
    return subprocess.run([sys.executable, "-m", "unsloth_adaptive_kl", "doctor"], capture_output=True, text=True, timeout=300, env=env)


def test_python_dash_m_doctor_runs_and_exits_zero(doctor_plain):
    proc = doctor_plain
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Backend trl" in proc.stdout and "Result: every checked backend can work" in proc.stdout


UNSLOTH_NOT_ACTIVE = "unsloth used on this machine: no: `import unsloth` does not patch TRL's GRPO trainer here"


@pytest.mark.skipif(importlib.util.find_spec("unsloth") is None, reason="unsloth is not installed")
def test_doctor_checks_every_unsloth_anchor_where_unsloth_is_installed(doctor_plain):
    proc = doctor_plain
    # Whether Unsloth's loss would be used here: only where `import unsloth` patches TRL (a GPU). On a machine without
    # one, every anchor is found, and the plain command warns (asking for the Unsloth backend fails: checked in
    # test_asking_for_unsloth_where_its_import_does_not_patch_trl_fails, in this process).
    if torch.cuda.is_available():
        assert "[  ok] unsloth used on this machine" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    else:
        assert f"[warn] {UNSLOTH_NOT_ACTIVE}" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "runs on TRL's eager loss" in proc.stdout
    from collections import Counter

    from unsloth_adaptive_kl._source_patch import version_of
    from unsloth_adaptive_kl.backends.unsloth import PLAN

    # every target of the anchor set that covers the installed unsloth_zoo, with its number of anchors
    anchor_set = next(a for a in PLAN.anchor_sets if a.family == "unsloth " + ".".join(version_of("unsloth_zoo").split(".")[:2]))
    for target, count in Counter(r.target for r in anchor_set.rewrites).items():
        assert f"{target}: {count} anchor(s) found" in proc.stdout, proc.stdout


def _unsloth_installed_but_not_patching_trl(monkeypatch):
    """Unsloth in the supported range, whose import does not rebind trl.GRPOTrainer (a machine without a GPU): the
    generated module is not built (no `import unsloth` in this process), which the doctor reports as a FAIL of its own."""
    assert SpecifierSet(versions.SUPPORTED["unsloth"].specifier).contains("2026.10.9")
    fake_versions(monkeypatch, unsloth="2026.10.9", unsloth_zoo="2026.10.9")
    monkeypatch.setattr(doctor, "_generated_unsloth_module", lambda: (types.SimpleNamespace(), False))


def test_asking_for_unsloth_where_its_import_does_not_patch_trl_fails(monkeypatch, capsys):
    # `doctor --backend unsloth` on a machine without a GPU: FAIL, exit status 1; not asked for, the same finding warns.
    _unsloth_installed_but_not_patching_trl(monkeypatch)
    assert cli_main(["doctor", "--backend", "unsloth"]) == 1
    text = capsys.readouterr().out
    assert f"[FAIL] {UNSLOTH_NOT_ACTIVE}" in text and "runs on TRL's eager loss" in text, text
    cli_main(["doctor"])
    text = capsys.readouterr().out
    assert f"[warn] {UNSLOTH_NOT_ACTIVE}" in text and f"[FAIL] {UNSLOTH_NOT_ACTIVE}" not in text, text


def test_doctor_for_trl_alone_does_not_check_unsloth(monkeypatch, capsys):
    _unsloth_installed_but_not_patching_trl(monkeypatch)
    checked = []
    monkeypatch.setattr(doctor, "_generated_unsloth_module", lambda: checked.append("unsloth") or (types.SimpleNamespace(), False))
    assert cli_main(["doctor", "--backend", "trl"]) == 0
    assert "[  --] unsloth: not checked: not requested" in capsys.readouterr().out
    assert not checked
    cli_main(["doctor"])  # the same machine, not asked: checked
    assert checked == ["unsloth"]


IMPORT_DECISIONS = [  # (the command after `python`, whether unsloth is installed, whether the import imports unsloth first)
    (["-m", "unsloth_adaptive_kl", "doctor"], True, True),
    (["-m", "unsloth_adaptive_kl", "doctor"], False, False),
    (["-m", "unsloth_adaptive_kl", "doctor", "--backend", "trl"], True, False),
    (["-m", "unsloth_adaptive_kl", "doctor", "--backend", "trl", "--backend", "liger"], True, False),
    (["-m", "unsloth_adaptive_kl", "doctor", "--backend", "unsloth"], True, True),
    (["-m", "unsloth_adaptive_kl", "doctor", "--backend=unsloth"], True, True),
    (["-m", "unsloth_adaptive_kl", "doctor", "--backend", "trl", "--backend", "unsloth"], True, True),
    (["-m", "unsloth_adaptive_kl", "doctor", "--help"], True, False),
    (["-m", "unsloth_adaptive_kl", "grpo", "--config", "recipe.yaml"], True, False),
    (["-m", "unsloth_adaptive_kl", "--help"], True, False),
    (["/venv/bin/unsloth-adaptive-kl", "doctor"], True, True),
    (["/venv/bin/unsloth-adaptive-kl", "doctor", "--backend", "trl"], True, False),
    (["train.py", "doctor"], True, False),  # a user's script given an argument "doctor"
    (["-c", "import unsloth_adaptive_kl"], True, False),
]


@pytest.mark.parametrize(
    "command, installed, imports_unsloth",
    IMPORT_DECISIONS,
    ids=[" ".join(c) + ("" if i else " [no unsloth]") for c, i, _ in IMPORT_DECISIONS],
)
def test_the_package_imports_unsloth_first_exactly_when_the_doctor_will_check_it(monkeypatch, command, installed, imports_unsloth):
    # issue 39, item 8: the doctor imports unsloth to check it, so `import unsloth_adaptive_kl` imports it first, before
    # the patch imports trl and transformers (else Unsloth warns "should be imported before"); a doctor not checking
    # Unsloth must not import it. The plain command's process (test_plain_doctor_...) shows the first case end to end.
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (object() if installed else None) if name == "unsloth" else find_spec(name, *a))
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, *command])
    # sys.argv as Python sets it: `-m`: the module's file, then the arguments; `-c`: "-c", then the arguments
    if command[0] == "-m":
        argv = [str(ROOT / "unsloth_adaptive_kl" / "__main__.py"), *command[2:]]
    else:
        argv = [command[0], *command[2:]] if command[0] == "-c" else list(command)
    monkeypatch.setattr(sys, "argv", argv)
    assert unsloth_adaptive_kl._doctor_checks_unsloth() is imports_unsloth


def test_doctor_reports_an_import_time_patch_error_instead_of_dying(tmp_path):
    # A sitecustomize that makes the installed TRL look like an unsupported release.
    (tmp_path / "sitecustomize.py").write_text(
        "import importlib.metadata as m\n"
        "_version = m.version\n"
        "m.version = lambda name: '9.0.0' if name == 'trl' else _version(name)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("UNSLOTH_ADAPTIVE_KL_ALLOW_UNTESTED", None)
    plain = subprocess.run([sys.executable, "-c", "import unsloth_adaptive_kl"], capture_output=True, text=True, env=env, timeout=300)
    assert plain.returncode != 0 and "trl 9.0.0" in plain.stderr  # a normal import still fails loudly
    doctor = subprocess.run([sys.executable, "-m", "unsloth_adaptive_kl", "doctor", "--backend", "trl"], capture_output=True, text=True, env=env, timeout=300)
    assert doctor.returncode == 1
    assert "Import" in doctor.stdout and "trl 9.0.0" in doctor.stdout and "[FAIL]" in doctor.stdout


@pytest.mark.parametrize("active, requested, status", [(True, True, doctor.OK), (True, False, doctor.OK), (False, True, doctor.FAIL), (False, False, doctor.WARN)])
def test_doctor_says_whether_unsloths_loss_would_be_used_here(active, requested, status):
    finding = doctor.unsloth_used_finding(active, requested)
    assert finding.status == status and finding.topic == "unsloth used on this machine"
    assert ("Unsloth's fused loss" in finding.detail) if active else ("runs on TRL's eager loss" in finding.detail)


def test_trl_fails_without_a_triton_driver_or_the_interpreter_and_names_the_fix(monkeypatch):
    # Before the fix, doctor passed here ("every checked backend can work") and the recipe then died
    # with Triton's "0 active drivers" at its first step.
    if torch.cuda.is_available():
        pytest.skip("a GPU gives Triton its driver; this checks a machine without one")
    from triton.runtime import driver

    with pytest.raises(RuntimeError, match="0 active drivers"):  # what TRL's kernel would hit here
        driver.active.get_current_target()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    status, text = report("trl")
    assert status == 1, text
    line = next(line for line in text.splitlines() if "trl Triton kernel on this machine" in line)
    assert "[FAIL]" in line and "0 active drivers" in line and "export TRITON_INTERPRET=1" in line
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    status, text = report("trl")
    assert status == 0 and "[  ok] trl Triton kernel on this machine: TRITON_INTERPRET=1" in text, text


@pytest.mark.skipif(importlib.util.find_spec("unsloth") is None, reason="unsloth is not installed")
def test_plain_doctor_imports_unsloth_before_trl_so_unsloth_does_not_warn_about_import_order(doctor_plain):
    # issue 39, item 8: before, the package's own patch imported trl and transformers, then the doctor imported
    # unsloth, which warned "Unsloth should be imported before [trl, transformers, peft]".
    proc = doctor_plain
    assert "Backend unsloth" in proc.stdout and "unsloth_zoo grpo_compute_loss" in proc.stdout, proc.stdout[-3000:]
    assert "should be imported before" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert "Unsloth Zoo will now patch" in proc.stdout  # (the banner `import unsloth` prints: it was imported)
    # A doctor not asked for Unsloth does not import it: test_the_package_imports_unsloth_first_exactly_when_the_doctor_
    # will_check_it (the import) and test_doctor_for_trl_alone_does_not_check_unsloth (the checks), in this process.


def test_on_a_version_no_anchor_set_covers_doctor_shows_each_sets_matching_and_failing_anchors(monkeypatch):
    # issue 39, item 10: before, only "no anchor set covers this version" (which anchors fail: only with the override).
    installed = installed_trl_anchor_set()
    broken = (*installed.rewrites[:2], Rewrite("GRPOTrainer._compute_loss", "trl", "        if self._a_future_trl_line:\n", "", "test"))
    plan = dataclasses.replace(
        trl_backend.PLAN,
        anchor_sets=(
            dataclasses.replace(installed, family="trl 0.1", versions={"trl": ">=0.1,<0.2"}),
            dataclasses.replace(installed, family="trl 0.2", versions={"trl": ">=0.2,<0.3"}, rewrites=broken),
        ),
    )
    monkeypatch.setattr(trl_backend, "PLAN", plan)
    status, text = report("trl")
    assert status == 1
    assert "[FAIL] trl anchors: " in text and "no anchor set of the trl backend covers this version (it has: trl 0.1, trl 0.2)" in text
    lines = {line.split(": ", 1)[0].strip(): line for line in text.splitlines() if "anchor set '" in line}
    first = lines["[  --] anchor set 'trl 0.1'"]
    assert "3 of 3 anchor(s) match exactly once" in first and "not matching" not in first, first
    second = lines["[  --] anchor set 'trl 0.2'"]
    assert "2 of 3 anchor(s) match exactly once: 'if self.beta != 0.0:" in second, second
    assert "not matching: 'if self._a_future_trl_line:' (0 times)" in second, second
