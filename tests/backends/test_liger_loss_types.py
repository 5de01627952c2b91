"""The Liger module's loss types are Liger's own list (``_liger_interface.LOSS_TYPES``), read against the installed
Liger-Kernel's source, and a loss type only TRL has is refused by name when the module is built."""

import ast
import inspect
import textwrap

import pytest
from liger_kernel.chunked_loss import grpo_loss

from unsloth_adaptive_kl import versions
from unsloth_adaptive_kl.backends import _liger_interface
from unsloth_adaptive_kl.backends.liger import AdaptiveFusedLinearGRPOLoss


def liger_aggregated_loss_types() -> set[str]:
    """The loss types the installed Liger's ``LigerFusedLinearGRPOFunction.ppo_loss_fn`` aggregates: every string it
    compares ``loss_type`` with (``==`` or ``in (...)``) in its branch that normalises the loss, read from the source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(grpo_loss.LigerFusedLinearGRPOFunction.ppo_loss_fn)))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "loss_type":
            for op, right in zip(node.ops, node.comparators):
                if isinstance(op, ast.Eq) and isinstance(right, ast.Constant):
                    found.add(right.value)
                elif isinstance(op, ast.In) and isinstance(right, (ast.Tuple, ast.List)):
                    found.update(e.value for e in right.elts if isinstance(e, ast.Constant))
    return found


def test_the_loss_types_are_those_the_installed_liger_aggregates():
    assert set(_liger_interface.LOSS_TYPES) == liger_aggregated_loss_types()
    assert len(set(_liger_interface.LOSS_TYPES)) == len(_liger_interface.LOSS_TYPES)


def test_a_loss_type_only_trl_has_is_refused_by_name_at_construction(monkeypatch):
    """A loss type TRL adds (here a made-up one) used to pass the constructor, the list being TRL's, and fail inside
    Liger at the first forward."""
    monkeypatch.setattr(_liger_interface, "ALL_LOSS_TYPES", (*versions.ALL_LOSS_TYPES, "newpo"))
    with pytest.raises(ValueError, match=r"loss_type='newpo' is not valid for the Liger module \(TRL has it; Liger-Kernel .* does not\)"):
        AdaptiveFusedLinearGRPOLoss(beta=0.1, loss_type="newpo")
    with pytest.raises(ValueError, match=r"loss_type='bogus' is not valid for the Liger module; allowed: \['grpo'"):
        AdaptiveFusedLinearGRPOLoss(beta=0.1, loss_type="bogus")


def test_every_liger_loss_type_builds_a_module():
    for loss_type in _liger_interface.LOSS_TYPES:
        assert AdaptiveFusedLinearGRPOLoss(beta=0.1, loss_type=loss_type, max_completion_length=4).loss_type == loss_type
