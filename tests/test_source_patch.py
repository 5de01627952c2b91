"""Patch plans: which anchor set a version family gets, and that every anchor stays strict."""

import pytest

from unsloth_adaptive_kl._source_patch import ALLOW_UNTESTED_ENV, AnchorSet, PatchError, Plan, Rewrite


class Library:
    """A stand-in for a patched library class."""

    def loss(self, x):
        y = x + 1
        return y * 2


def family(name, versions, anchor, replacement="        y = x + 10\n"):
    return AnchorSet(name, versions, (Rewrite("Library.loss", "trl", anchor, replacement, "test"),))


OWNERS = {"Library": Library}
OLD = family("trl 0.24", {"trl": ">=0.24,<0.25"}, "        y = x - 1\n")  # an older release's line
NEW = family("trl 1.x", {"trl": ">=1.0,<1.17"}, "        y = x + 1\n")


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)


def test_the_family_covering_the_installed_version_is_chosen():
    plan = Plan("trl", (OLD, NEW))
    assert plan.select(OWNERS, installed=lambda d: "1.16.0") is NEW
    assert plan.select(OWNERS, installed=lambda d: "0.24.0") is OLD


def test_where_several_families_cover_a_version_the_one_whose_anchors_match_is_chosen():
    plan = Plan("trl", (family("any a", {}, "        y = x - 1\n"), family("any b", {}, "        y = x + 1\n")))
    assert plan.select(OWNERS, installed=lambda d: "1.15.0").family == "any b"
    built = plan.build(OWNERS)["Library.loss"]
    assert built(None, 1) == 22  # (1 + 10) * 2: the replacement ran


def test_a_version_no_family_covers_is_refused_naming_library_and_version():
    with pytest.raises(PatchError, match=r"trl 0\.30\.0: no anchor set of the trl backend covers this version.*trl 0\.24, trl 1\.x"):
        Plan("trl", (OLD, NEW)).select(OWNERS, installed=lambda d: "0.30.0")


def test_with_the_override_an_uncovered_version_gets_the_family_whose_anchors_match(monkeypatch):
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    assert Plan("trl", (OLD, NEW)).select(OWNERS, installed=lambda d: "0.30.0") is NEW


def test_an_anchor_found_twice_or_not_at_all_raises_naming_it():
    twice = family("twice", {}, "        ")  # indentation occurs on every line
    with pytest.raises(PatchError, match=r"expected the anchor .* exactly once in Library.loss, found it 2 times"):
        Plan("trl", (twice,)).build(OWNERS)
    with pytest.raises(PatchError, match=r"anchor 'y = x - 1'.*found it 0 times"):
        Plan("trl", (OLD,)).build(OWNERS, anchor_set=OLD)


def test_a_traceback_from_inside_a_patched_function_shows_its_rewritten_line():
    """TRL's rewritten ``_compute_loss``: its source is in ``linecache`` under a name that says what it is."""
    import inspect
    import traceback
    import types

    import unsloth_adaptive_kl  # noqa: F401  (patches)
    from trl import GRPOTrainer

    rewritten = GRPOTrainer._compute_loss.__wrapped__  # behind the dispatch to stock TRL / loss_class=
    code = rewritten.__code__
    assert code.co_filename == "<unsloth_adaptive_kl:trl.trainer.grpo_trainer.GRPOTrainer._compute_loss>"
    assert "self._adaptive_kl" in inspect.getsource(code)  # the rewritten source, not TRL's
    trainer = types.SimpleNamespace(_adaptive_kl=object(), _adaptive_loss_module=None)
    with pytest.raises(KeyError) as raised:  # no inputs: fails inside, at its first read of them
        GRPOTrainer._compute_loss(trainer, None, {})
    (frame,) = [f for f in traceback.extract_tb(raised.value.__traceback__) if f.filename == code.co_filename]
    assert frame.name == "_compute_loss" and frame.line and frame.line in inspect.getsource(code)
    assert frame.line in "".join(traceback.format_exception(raised.value))  # what the user sees


# -- the names a replacement reads (issue 39, item 10) ---------------------------------------------------
import math  # noqa: E402  (a global of this module, which Library.loss may read)


def library_rewrite(replacement, anchor="        y = x + 1\n"):
    return Plan("trl", (family("trl 1.x", {}, anchor, replacement),))


@pytest.mark.parametrize(
    "replacement",
    [
        "        y = x + 1\n        z = y * 2\n        y = z + len([x]) + math.pi\n",  # a local, a builtin, a global
        "        y = self.offset if hasattr(self, 'offset') else x\n",  # parameters
        "        y = sum(k for k in range(x))\n",  # the comprehension's own variable
    ],
)
def test_a_replacement_reading_only_the_functions_own_names_builds(replacement):
    library_rewrite(replacement).build(OWNERS)


def test_a_replacement_reading_a_name_the_function_does_not_define_is_refused_naming_library_version_and_name():
    from unsloth_adaptive_kl._source_patch import version_of

    with pytest.raises(PatchError) as info:
        library_rewrite("        y = x + 1\n        y = y + offset\n").build(OWNERS)
    message = str(info.value)
    assert message.startswith(f"trl {version_of('trl')}: the rewrite of Library.loss reads 'offset' ('y = y + offset')")
    assert "Library.loss does not define" in message and "not supported by unsloth_adaptive_kl" in message


class Lazy:
    """A library function that reads a global its module defines only later (``set_scale``)."""

    def loss(self, x):
        y = x + 1
        return y * scale  # noqa: F821


def test_only_what_a_replacement_adds_is_checked_not_the_names_its_anchor_already_reads():
    anchor = "        return y * scale  # noqa: F821\n"
    kept = Plan("trl", (AnchorSet("any", {}, (Rewrite("Lazy.loss", "trl", anchor, "        y = y + 0\n" + anchor, "test"),)),))
    kept.build({"Lazy": Lazy})  # 'scale' is in the anchor: the library's own read
    added = Plan("trl", (AnchorSet("any", {}, (Rewrite("Lazy.loss", "trl", anchor, "        return y * scale * shift\n", "test"),)),))
    with pytest.raises(PatchError, match="reads 'shift'"):
        added.build({"Lazy": Lazy})


def test_trls_plan_refuses_a_trl_whose_compute_loss_renamed_a_variable_its_replacement_reads():
    """A mutated copy of the installed TRL's _compute_loss, ``mask`` renamed throughout (every anchor still
    matches): before the check the rewrite compiled, and failed with a NameError at the first step."""
    import inspect
    import linecache
    import re

    import unsloth_adaptive_kl  # noqa: F401  (patches)
    from unsloth_adaptive_kl._source_patch import compile_target, original, version_of
    from unsloth_adaptive_kl.backends import trl as trl_backend

    owners = trl_backend.owners()
    stock = original(owners["GRPOTrainer"], "_compute_loss")
    anchor_set = trl_backend.PLAN.select(owners)
    renamed = "class GRPOTrainer:\n" + re.sub(r"\bmask\b", "loss_mask", inspect.getsource(stock))
    filename = "<a TRL release that renamed mask>"
    linecache.cache[filename] = (len(renamed), None, renamed.splitlines(keepends=True), filename)
    namespace = dict(stock.__globals__)
    exec(compile(renamed, filename, "exec"), namespace)
    mutated_owners = {**owners, "GRPOTrainer": namespace["GRPOTrainer"]}
    # every anchor of _compute_loss still matches (the copy has no other method: kl_monitor's generation target is absent)
    assert trl_backend.PLAN.mismatches(anchor_set, mutated_owners) in ([], ["GRPOTrainer._generate_and_score_completions"])
    with pytest.raises(PatchError) as info:
        compile_target(mutated_owners, "GRPOTrainer._compute_loss", anchor_set.targets()["GRPOTrainer._compute_loss"])
    assert str(info.value).startswith(f"trl {version_of('trl')}: the rewrite of GRPOTrainer._compute_loss reads 'mask'")
    compile_target(owners, "GRPOTrainer._compute_loss", anchor_set.targets()["GRPOTrainer._compute_loss"])  # the installed TRL's own builds
