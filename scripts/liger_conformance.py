"""Helper of scripts/liger_conformance.sh: run Liger-Kernel's own GRPO test file
(``test/chunked_loss/test_grpo_loss.py`` of the liger-kernel sdist) against a chosen loss class.

As a pytest plugin (``-p liger_conformance``), set by the environment:

- ``LIGER_CONFORMANCE_TARGET``: ``stock`` (Liger's ``LigerFusedLinearGRPOLoss``, the control) or
  ``adaptive`` (``AdaptiveFusedLinearGRPOLoss`` put in its place in the test module, after import
  and before any test runs; nothing else in the file changes).
- ``LIGER_CONFORMANCE_SHARD``: ``i/n`` keeps every n-th applicable case starting at the i-th (0-based),
  so n processes run disjoint sets that together are the whole grid.

The tests that exercise something other than the module (Liger's functional API, its internal
chunked log-prob function, its Triton loss and the transformers-side reducer) are deselected for
both targets, with the reason below; every other case runs unchanged.

As a script, ``python liger_conformance.py summary DIR EXPECTED`` reads the JUnit files
``DIR/<target>-<shard>.xml`` and prints, per target, the counts and every failure, then each case
whose outcome differs between the targets. Exit status 1 when the drop-in fails a case the
control passes, or when a target has fewer results than ``EXPECTED`` cases (a shard that died).
"""

from __future__ import annotations

import collections
import glob
import os
import sys
import xml.etree.ElementTree as ET

import pytest

NOT_A_MODULE = {
    "test_selective_chunk_forward_matches_reference": "Liger's internal LigerFusedLinearPPOBase.chunk_forward",
    "test_functional_correctness": "Liger's functional liger_fused_linear_grpo against its autograd Function",
    "test_reduce_grpo_loss_matches_reference": "liger_kernel.transformers.grpo_loss._reduce_grpo_loss",
    "test_reduce_grpo_loss_requires_max_completion_length": "liger_kernel.transformers.grpo_loss._reduce_grpo_loss",
    "test_triton_grpo_loss_matches_reference": "Liger's Triton triton_grpo_loss",
    "test_selective_logprob_backward_skips_frozen_params": "Liger's internal _ChunkedSelectiveLogProbFunction",
}
NAME = "LigerFusedLinearGRPOLoss"  # the name the upstream test module imports and builds


def _target() -> str:
    target = os.environ.get("LIGER_CONFORMANCE_TARGET", "")
    if target not in ("stock", "adaptive"):
        raise pytest.UsageError(f"LIGER_CONFORMANCE_TARGET={target!r} is not valid; allowed: 'stock', 'adaptive'")
    return target


def _shard() -> tuple[int, int]:
    spec = os.environ.get("LIGER_CONFORMANCE_SHARD", "0/1")
    index, _, count = spec.partition("/")
    if not (index.isdigit() and count.isdigit() and 0 <= int(index) < int(count)):
        raise pytest.UsageError(f"LIGER_CONFORMANCE_SHARD={spec!r} is not valid; allowed: 'i/n' with 0 <= i < n")
    return int(index), int(count)


def pytest_report_header(config):
    index, count = _shard()
    return [f"liger conformance: target={_target()} shard={index}/{count}; deselected (not the module): {sorted(NOT_A_MODULE)}"]


@pytest.hookimpl(trylast=True)  # after -k / -m, so shards split what is left
def pytest_collection_modifyitems(session, config, items):
    target = _target()
    index, count = _shard()
    applicable = [item for item in items if item.originalname not in NOT_A_MODULE]
    kept = applicable[index::count]
    kept_ids = {id(item) for item in kept}
    dropped = [item for item in items if id(item) not in kept_ids]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept
    if target != "adaptive":
        return
    from unsloth_adaptive_kl.backends.liger import AdaptiveFusedLinearGRPOLoss

    modules = {item.module for item in items if item.module is not None}
    for module in modules:
        if not hasattr(module, NAME):
            raise pytest.UsageError(f"{module.__name__} has no {NAME} to substitute: the upstream test file changed")
        setattr(module, NAME, AdaptiveFusedLinearGRPOLoss)


def pytest_runtest_setup(item):
    if _target() == "adaptive":  # the substitution is in place for every case that runs
        from unsloth_adaptive_kl.backends.liger import AdaptiveFusedLinearGRPOLoss

        assert getattr(item.module, NAME) is AdaptiveFusedLinearGRPOLoss


# -- the summary -------------------------------------------------------------------------------------
TARGETS = ("stock", "adaptive")


def read_outcomes(directory: str, target: str) -> dict[str, tuple[str, str]]:
    """``{node id: (outcome, first line of the message)}`` from the JUnit files of ``target``'s shards."""
    outcomes = {}
    for path in sorted(glob.glob(os.path.join(directory, f"{target}-*.xml"))):
        for case in ET.parse(path).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            outcome, message = "passed", ""
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                    message = (child.get("message") or "").strip().splitlines()[0:1]
                    message = message[0][:160] if message else ""
                    break
            outcomes[name] = (outcome, message)
    return outcomes


def summary(directory: str, expected: int) -> int:
    results = {target: read_outcomes(directory, target) for target in TARGETS}
    status = 0
    for target, outcomes in results.items():
        if not outcomes:
            continue
        counts = collections.Counter(outcome for outcome, _ in outcomes.values())
        line = ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "error", "skipped") if counts[k])
        print(f"{target}: {len(outcomes)}/{expected} cases: {line}")
        if len(outcomes) < expected:
            print(f"  INCOMPLETE: {expected - len(outcomes)} cases have no result (a shard died or timed out)")
            status = 1
        for reason, n in collections.Counter(m for o, m in outcomes.values() if o == "skipped").most_common():
            print(f"  skipped {n:4d}: {reason}")
        for name, (outcome, message) in sorted(outcomes.items()):
            if outcome in ("failed", "error"):
                print(f"  {outcome.upper()} {name}: {message}")
    if all(results.values()):
        stock, adaptive = results["stock"], results["adaptive"]
        differ = sorted(n for n in stock.keys() | adaptive.keys() if stock.get(n, ("missing",))[0] != adaptive.get(n, ("missing",))[0])
        print(f"stock vs adaptive: {len(differ)} cases differ in outcome")
        for name in differ:
            print(f"  {name}: stock {stock.get(name, ('missing',))[0]}, adaptive {adaptive.get(name, ('missing',))[0]}")
    worse = [n for n, (o, _) in results["adaptive"].items() if o in ("failed", "error") and results["stock"].get(n, ("passed",))[0] not in ("failed", "error")]
    if worse:
        print(f"FAIL: the drop-in fails {len(worse)} cases that stock Liger passes (or that the control did not run)")
        status = 1
    return status


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "summary":
        sys.exit("usage: python liger_conformance.py summary DIR EXPECTED")
    sys.exit(summary(sys.argv[2], int(sys.argv[3])))
