"""The config side every backend shares: the adaptive-KL fields grafted onto a GRPO config class (validated in its
``__post_init__``), the check of ``loss_type``, and the defaults for a config made before the import. Every attribute
set here goes through the ledger of :mod:`unsloth_adaptive_kl._source_patch`."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging

from .._source_patch import set_attribute, version_of
from ..config import FIELDS, validate
from ..versions import ALL_LOSS_TYPES, offered_loss_types

logger = logging.getLogger("unsloth_adaptive_kl")

#: What :func:`patch_config_class` replaces (doctor checks they exist).
CONFIG_ATTRIBUTES = ("__init__", "__post_init__", "__dataclass_fields__")


def patch_config_class(config_cls, after_post_init=None) -> None:
    """Graft the adaptive-KL fields onto a dataclass config class, in place; ``after_post_init()``
    runs after each config's validation (the moment to patch a trainer Unsloth generated late)."""
    if "kl_adaptation_method" in config_cls.__dataclass_fields__:
        return
    extended = dataclasses.make_dataclass(
        config_cls.__name__,
        [(f.name, f.type, dataclasses.field(default=f.default, metadata={"help": f.help})) for f in FIELDS],
        bases=(config_cls,),
    )
    annotations = dict(config_cls.__dict__.get("__annotations__", {}))
    annotations.update({f.name: f.type for f in FIELDS})
    original_post_init = config_cls.__post_init__

    @functools.wraps(original_post_init)
    def __post_init__(self):
        original_post_init(self)
        validate(self)
        if hasattr(self, "loss_type"):
            check_loss_type(self.loss_type)
        if after_post_init is not None:
            after_post_init()

    set_attribute(config_cls, "__init__", extended.__init__)
    set_attribute(config_cls, "__dataclass_fields__", extended.__dataclass_fields__)
    for f in FIELDS:  # a config made before the import reads these (to_dict() walks every field; args.kl_target)
        set_attribute(config_cls, f.name, f.default)
    set_attribute(config_cls, "__annotations__", annotations)
    set_attribute(config_cls, "__post_init__", __post_init__)


def check_loss_type(value) -> None:
    """Refuse a ``loss_type`` that no TRL release has (a typo: ``'dapoo'``, ``'DAPO'``, ``'grpo '``; TRL itself
    checks it only at the first loss), naming the field, the value, the values the installed TRL offers and
    the closest one. One that some TRL has but the installed one lacks is the backend's to refuse, saying so."""
    if isinstance(value, str) and value in ALL_LOSS_TYPES:
        return
    version = version_of("trl")
    offered = ALL_LOSS_TYPES if version == "not installed" else [name for name, why in offered_loss_types(version).items() if why is None]
    hint = ""
    if isinstance(value, str):
        close = difflib.get_close_matches(value.strip().lower(), ALL_LOSS_TYPES, n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
    others = [name for name in ALL_LOSS_TYPES if name not in offered]
    elsewhere = f"; other TRL releases also have {', '.join(others)}" if others else ""
    raise ValueError(
        f"loss_type={value!r} is not valid: no TRL release has this loss type{hint}; allowed with the installed trl "
        f"{version}: {', '.join(offered)}{elsewhere}"
    )


def fill_missing_fields(config) -> None:
    """A config made before ``import unsloth_adaptive_kl`` lacks the fields its (now patched) class
    has: give it their defaults (method ``none``). A config whose class was never patched is left
    alone, for :func:`validate` to refuse with its hint."""
    own = getattr(config, "__dict__", {})  # the class has each field as its default since the patch: look at the object
    missing = [f for f in FIELDS if f.name not in own]
    class_fields = getattr(type(config), "__dataclass_fields__", {})
    if not missing or not all(f.name in class_fields for f in missing):
        return
    for f in missing:
        setattr(config, f.name, f.default)
    set_after = [f.name for f in FIELDS if f not in missing]  # set on the object after it was created
    logger.info(
        "unsloth_adaptive_kl: this %s was created before `import unsloth_adaptive_kl`; %s. It trains with "
        "kl_adaptation_method=%r. To set the fields in the constructor, create the config after the import.",
        type(config).__name__,
        "its adaptive-KL fields take their defaults" if not set_after else
        f"the adaptive-KL fields not set on it since take their defaults (set: {', '.join(set_after)})",
        config.kl_adaptation_method,
    )

