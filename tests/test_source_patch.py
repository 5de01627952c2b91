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
