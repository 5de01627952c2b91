"""``patch()`` / ``unpatch()`` on TRL: every patched object comes back exactly (identity, not
equality), patching twice changes nothing, and the cycle can be repeated."""

import dataclasses

import pytest
from trl.trainer.grpo_config import GRPOConfig
from trl.trainer.grpo_trainer import GRPOTrainer

import unsloth_adaptive_kl
from unsloth_adaptive_kl import _source_patch
from unsloth_adaptive_kl.backends import trl as trl_backend
from unsloth_adaptive_kl.config import FIELD_NAMES

PATCHED = [
    (GRPOConfig, "__init__"),
    (GRPOConfig, "__dataclass_fields__"),
    (GRPOConfig, "__annotations__"),
    (GRPOConfig, "__post_init__"),
    (GRPOTrainer, "__init__"),
    (GRPOTrainer, "_compute_loss"),
    (GRPOTrainer, "_generate_and_score_completions"),
    (GRPOTrainer, "_load_callback_state"),
]
MISSING = object()


def own_attributes():
    """What each patched class holds in its own ``__dict__`` (MISSING where it holds nothing)."""
    return {(owner.__name__, name): vars(owner).get(name, MISSING) for owner, name in PATCHED}


@pytest.fixture
def pristine():
    """The attributes as TRL defines them, read while unpatched; the package is re-patched afterwards."""
    unsloth_adaptive_kl.unpatch()
    try:
        yield own_attributes()
    finally:
        unsloth_adaptive_kl.unpatch()
        unsloth_adaptive_kl.patch()


def test_patch_replaces_every_target_and_unpatch_restores_each_by_identity(pristine):
    assert not trl_backend.is_patched()
    assert not set(FIELD_NAMES) & {f.name for f in dataclasses.fields(GRPOConfig)}
    unsloth_adaptive_kl.patch()
    patched = own_attributes()
    for key, value in patched.items():
        assert value is not pristine[key], f"{key} was not patched"
    for owner, name in PATCHED:  # the ledger knows each original
        assert trl_backend.original(owner, name) is (
            pristine[owner.__name__, name] if pristine[owner.__name__, name] is not MISSING else getattr(super(owner, owner), name)
        )
    unsloth_adaptive_kl.unpatch()
    restored = own_attributes()
    for key, value in restored.items():
        assert value is pristine[key], f"{key} is not the original object after unpatch()"
    assert not set(FIELD_NAMES) & {f.name for f in dataclasses.fields(GRPOConfig)}
    assert "_load_callback_state" not in vars(GRPOTrainer)  # inherited from Trainer, not left as a copy


def test_patching_twice_is_a_no_op(pristine):
    unsloth_adaptive_kl.patch()
    first, ledger = own_attributes(), list(_source_patch._ORIGINALS)
    unsloth_adaptive_kl.patch()
    second = own_attributes()
    assert all(second[key] is first[key] for key in first)
    assert _source_patch._ORIGINALS == ledger
    assert [f.name for f in dataclasses.fields(GRPOConfig)].count("kl_adaptation_method") == 1


def test_repeated_patch_unpatch_cycles_restore_the_same_objects(pristine):
    for _ in range(3):
        unsloth_adaptive_kl.patch()
        config = GRPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, beta=0.1, kl_adaptation_method="clip")
        assert config.kl_adaptation_method == "clip"
        unsloth_adaptive_kl.unpatch()
        assert own_attributes() == pristine and all(own_attributes()[k] is v for k, v in pristine.items())
        with pytest.raises(TypeError, match="kl_adaptation_method"):
            GRPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, kl_adaptation_method="clip")


def test_a_config_class_imported_before_patching_gains_and_loses_the_fields(pristine):
    config_cls = GRPOConfig  # this module imported it before the fixture unpatched and re-patched
    unsloth_adaptive_kl.patch()
    assert config_cls(output_dir="/tmp/unused", use_cpu=True, bf16=False).kl_estimator == "k3"
    unsloth_adaptive_kl.unpatch()
    assert not hasattr(config_cls(output_dir="/tmp/unused", use_cpu=True, bf16=False), "kl_estimator")
