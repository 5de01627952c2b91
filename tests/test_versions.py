"""Version guards: an untested TRL, Unsloth/unsloth_zoo or Liger is refused with an error naming
the library, its version and the supported range; ``UNSLOTH_ADAPTIVE_KL_ALLOW_UNTESTED=1``
lets it through; a missing source anchor raises even then."""

import types
from pathlib import Path

import pytest

import unsloth_adaptive_kl
from unsloth_adaptive_kl import _source_patch, versions
from unsloth_adaptive_kl.backends import trl as trl_backend
from unsloth_adaptive_kl.backends import unsloth as unsloth_backend

ALLOW = _source_patch.ALLOW_UNTESTED_ENV


@pytest.fixture
def installed(monkeypatch):
    """``installed(trl="1.16.0", ...)`` makes the guards see those versions."""
    monkeypatch.delenv(ALLOW, raising=False)

    def fake(**fake_versions):
        fake_versions = {k.replace("liger_kernel", "liger-kernel"): v for k, v in fake_versions.items()}
        real = _source_patch.version_of
        monkeypatch.setattr(_source_patch, "version_of", lambda dist: fake_versions.get(dist, real(dist)))

    return fake


@pytest.fixture
def unpatched(monkeypatch):
    """Run with TRL unpatched; patch it back afterwards (with the real versions) whatever happened."""
    unsloth_adaptive_kl.unpatch()
    try:
        yield
    finally:
        unsloth_adaptive_kl.unpatch()
        monkeypatch.undo()
        unsloth_adaptive_kl.patch()


@pytest.mark.parametrize(
    "distribution, inside, outside",
    [
        ("trl", ["0.24.0", "0.29.1", "1.15.0", "1.16.0", "1.16.3", "1.16.0rc1"], ["0.23.1", "1.17.0", "2.0.0", "not installed"]),
        ("liger-kernel", ["0.8.0", "0.8.5", "0.8.10.dev0"], ["0.7.9", "0.9.0"]),
        ("unsloth", ["2026.8.0", "2026.8.22", "2026.9.14", "2026.10.9"], ["2026.7.6", "2026.11.0"]),
        ("unsloth_zoo", ["2026.8.17", "2026.10.9"], ["2026.7.1", "2026.11.0"]),
        ("transformers", ["4.56.1", "4.56.2", "4.57.6", "5.0.0", "5.17.0", "5.24.0", "6.0.0"], ["4.56.0", "4.55.4"]),
        ("torch", ["2.6.0", "2.13.0+cpu"], ["2.5.1"]),
    ],
)
def test_supported_ranges(distribution, inside, outside):
    supported = versions.SUPPORTED[distribution]
    assert all(supported.contains(v) for v in inside), inside
    assert not any(supported.contains(v) for v in outside), outside


def test_untested_trl_is_refused_naming_version_and_range_then_overridable(installed, monkeypatch, unpatched):
    installed(trl="1.17.0")
    with pytest.raises(unsloth_adaptive_kl.PatchError) as error:
        unsloth_adaptive_kl.patch()
    assert "trl 1.17.0 is installed" in str(error.value) and f"supports trl {versions.SUPPORTED['trl'].label}" in str(error.value) and ALLOW in str(error.value)
    assert "pip install 'trl>=0.24.0,<1.17'" in str(error.value)  # the range of versions.py, as doctor's hint gives it
    assert not trl_backend.is_patched()
    monkeypatch.setenv(ALLOW, "1")
    unsloth_adaptive_kl.patch()
    assert trl_backend.is_patched()


def test_a_missing_trl_anchor_raises_even_with_the_override(installed, monkeypatch, unpatched):
    from test_doctor import trl_plan_with

    # the installed TRL's anchors plus one that no TRL has; then a TRL version outside every family
    monkeypatch.setattr(trl_backend, "PLAN", trl_plan_with([*trl_backend.PLAN.select(trl_backend.owners()).rewrites, ("        not in trl\n", "")]))
    installed(trl="1.17.0")
    monkeypatch.setenv(ALLOW, "1")
    from trl.trainer.grpo_trainer import GRPOTrainer

    pristine = GRPOTrainer._compute_loss
    with pytest.raises(unsloth_adaptive_kl.PatchError, match=r"anchor 'not in trl'.*found it 0 times"):
        unsloth_adaptive_kl.patch()
    assert not trl_backend.is_patched() and GRPOTrainer._compute_loss is pristine  # nothing half-patched


def _fake_generated_module():
    """A stand-in for Unsloth's generated module whose loss no longer has the anchors."""

    def grpo_compute_loss(ref, new, old, mask, beta, advantages, **kwargs):
        return new.sum()

    class UnslothEfficientGRPO:
        @staticmethod
        def forward(ctx, *args):
            return None

    class PristineConfig:
        pass

    class UnslothGRPOConfig(PristineConfig):
        pass

    class UnslothGRPOTrainer:
        def compute_loss(self, model, inputs):
            return 0

    def grpo_accumulated_loss(trainer, **kwargs):
        return 0

    return types.SimpleNamespace(
        __name__="UnslothGRPOTrainer", grpo_compute_loss=grpo_compute_loss, grpo_accumulated_loss=grpo_accumulated_loss,
        UnslothEfficientGRPO=UnslothEfficientGRPO, UnslothGRPOConfig=UnslothGRPOConfig, UnslothGRPOTrainer=UnslothGRPOTrainer,
    )  # fmt: skip


@pytest.mark.parametrize("bad", ["unsloth", "unsloth_zoo"])
def test_untested_unsloth_is_refused_before_anything_is_touched(installed, bad):
    installed(**{"unsloth": "2026.10.9", "unsloth_zoo": "2026.10.9", bad: "2026.11.2"})
    module = _fake_generated_module()
    before = dict(vars(module))
    with pytest.raises(unsloth_adaptive_kl.PatchError) as error:
        unsloth_backend.patch_generated_module(module)
    assert f"{bad} 2026.11.2 is installed" in str(error.value) and versions.SUPPORTED[bad].label in str(error.value)
    assert vars(module) == before


def test_untested_unsloth_with_the_override_still_raises_on_a_missing_anchor(installed, monkeypatch):
    installed(unsloth="2026.11.2", unsloth_zoo="2026.11.2")
    monkeypatch.setenv(ALLOW, "1")
    module = _fake_generated_module()
    before = dict(vars(module))
    with pytest.raises(unsloth_adaptive_kl.PatchError, match=r"unsloth_zoo .*anchor 'kl_i = torch.expm1\(kl_log_ratio\) - kl_log_ratio'.*grpo_compute_loss"):
        unsloth_backend.patch_generated_module(module)
    assert vars(module) == before and unsloth_backend._patched_module is not module


def test_untested_liger_is_refused_when_a_loss_module_is_created_then_overridable(installed, monkeypatch):
    from unsloth_adaptive_kl.backends.liger import AdaptiveFusedLinearGRPOLoss

    installed(liger_kernel="0.9.0")
    with pytest.raises(unsloth_adaptive_kl.PatchError) as error:
        AdaptiveFusedLinearGRPOLoss(compiled=False)
    assert "liger-kernel 0.9.0 is installed" in str(error.value) and "0.8.x" in str(error.value) and ALLOW in str(error.value)
    monkeypatch.setenv(ALLOW, "1")
    if not versions.Supported("trl", versions.LOSS_CLASS_TRL, "", guarded=True).contains(_source_patch.version_of("trl")):
        with pytest.raises(unsloth_adaptive_kl.PatchError, match=r"trl\.kernels"):  # not overridable: no kernel to call
            AdaptiveFusedLinearGRPOLoss(compiled=False)
        return
    assert AdaptiveFusedLinearGRPOLoss(compiled=False).beta == 0.04


def test_the_readme_supported_versions_table_is_the_one_of_versions_py():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert versions.supported_versions_table() in readme


def test_the_tested_column_names_every_release_a_stack_pins():
    """The "tested" cell comes from STACKS: every release a stack pins is in it (or in its range of
    minor lines); the hand-written text was missing transformers 4.56.2 (the trl-1.16-transformers-4 stack)."""
    cells = {row.split(" | ")[0].strip("| "): row.split(" | ")[-1] for row in versions.supported_versions_table().splitlines()[2:]}
    for distribution in versions.SUPPORTED:
        cell = cells[distribution]
        pins = [v for stack in versions.STACKS.values() if (v := stack.pin(distribution)) is not None]
        assert versions.pinned_releases(distribution) == sorted(set(pins), key=versions.Version)
        if cell.startswith("one release per minor line"):
            assert f"{min(pins, key=versions.Version)} to {max(pins, key=versions.Version)} ({len(set(pins))} lines)" in cell
        else:
            assert all(v in cell for v in pins), (distribution, cell)
    assert "4.56.2" in cells["transformers"]


def test_the_loss_types_offered_are_those_the_installed_trl_computes():
    """versions.trl_loss_types against the installed TRL's own _compute_loss (run on every stack)."""
    import inspect
    import re

    from trl.trainer.grpo_trainer import GRPOTrainer

    source = inspect.getsource(GRPOTrainer._compute_loss)  # the installed one: the patch keeps __wrapped__
    in_source = {t for t in versions.ALL_LOSS_TYPES if re.search(rf'"{t}"', source)}
    assert set(versions.trl_loss_types(_source_patch.version_of("trl"))) == in_source


def test_only_the_patched_libraries_are_capped():
    """The dependency policy (docs/compatibility.md): an upper bound only where this package patches the
    library's source (guarded); transformers, torch, peft, accelerate and datasets have lower bounds only,
    so installing this package never downgrades them."""
    from packaging.specifiers import SpecifierSet

    for supported in versions.SUPPORTED.values():
        operators = {spec.operator for spec in SpecifierSet(supported.specifier)}
        if supported.guarded:
            assert operators == {">=", "<"}, supported
        else:
            assert operators == {">="}, supported
