"""No hand-kept list of methods, estimators or parameters: everything that lists them reads the registries
(:mod:`~unsloth_adaptive_kl.shaping`, :mod:`~unsloth_adaptive_kl.controllers`, :mod:`~unsloth_adaptive_kl.estimators`,
their parameters declared once in :mod:`~unsloth_adaptive_kl.declarations`). A test fails when such a list appears
in the package, its tests, scripts or benchmarks; a user controller registered outside the package works as the
built-ins do."""

import ast
import pathlib

import pytest

import unsloth_adaptive_kl
from unsloth_adaptive_kl.config import registered_parameters
from unsloth_adaptive_kl.controllers import CONTROLLERS, controller_names
from unsloth_adaptive_kl.estimators import ESTIMATORS, builtin_estimator_names, estimator_aliases
from unsloth_adaptive_kl.shaping import SHAPING, shaping_names

ROOT = pathlib.Path(unsloth_adaptive_kl.__file__).resolve().parent.parent
#: Where lists are searched: the package, its tests, the scripts, benches, examples, the demo and the research tree
#: (where the study code and its tests move, issue 54).
SEARCHED = ("unsloth_adaptive_kl", "tests", "scripts", "bench", "examples", "blackwell", "research")


def registries() -> dict[str, set[str]]:
    """Each registry's built-in names (an estimator's aliases with it), by what they name."""
    return {
        "β controllers": {name for name in controller_names() if CONTROLLERS[name].builtin},
        "shaping methods": {name for name in shaping_names() if SHAPING[name].builtin},
        "methods": {"none", *(n for n in shaping_names() if SHAPING[n].builtin), *(n for n in controller_names() if CONTROLLERS[n].builtin)},
        "estimators": {a for name in builtin_estimator_names() for a in (name, *estimator_aliases(name))},
        "parameters": {p.name for p in registered_parameters(builtin=True)},
    }


#: ``kl_adaptation_method``'s name for "no β controller": not a registry's name, so it is left out before a list is
#: judged (``["fixed", "dynamic", "ziegler"]`` lists two β controllers by hand; ``("fixed", "dynamic")`` one).
NO_CONTROLLER = "fixed"


def _strings(node) -> list[str] | None:
    """The strings of a literal list, tuple or set of string constants; None for anything else."""
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)) and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
        return [e.value for e in node.elts]
    return None


def _row(node) -> list[str] | None:
    """One row of a table of cases: a literal list or tuple of string constants (possibly empty), or
    ``pytest.param(...)`` of them; None for anything else."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "param":
        node = ast.Tuple(elts=node.args)
    if isinstance(node, (ast.List, ast.Tuple)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return None


def _candidates(tree):
    """``(line, strings)`` for every literal that could spell out a registry: a list, tuple or set of strings; a
    dict's string keys; a list or tuple of rows (a ``pytest.mark.parametrize`` table, ``[[], ["dynamic"]]``): all
    its strings, and each column of rows of equal length. The last two only without a repeated name: a table of
    chosen cases repeats its names (``[("k3", ...), ("k3", ...), ("k2", ...)]``), an enumeration does not."""
    for node in ast.walk(tree):
        strings = _strings(node)
        if strings is not None:
            yield node.lineno, strings
            continue
        if isinstance(node, ast.Dict) and node.keys and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
            yield node.lineno, [k.value for k in node.keys]
            continue
        if not (isinstance(node, (ast.List, ast.Tuple, ast.Set)) and node.elts):
            continue
        rows = [_row(e) for e in node.elts]
        if any(row is None for row in rows):
            continue
        tables = [[value for row in rows for value in row]]
        if len({len(row) for row in rows}) == 1 and len(rows[0]) > 1:
            tables += [list(column) for column in zip(*rows)]
        for table in tables:
            if len(set(table)) == len(table):
                yield node.lineno, table


#: A literal that names a registry's entries on purpose says why, in a comment on its first line or the line above:
#: a table of float64 references that a test reads by the registry's names (a new built-in without an entry fails
#: there), or cases chosen for what they show.
EXEMPT = "# not a registry list:"


def hand_lists(source: str, names: dict[str, set[str]]) -> list[tuple[int, str, list[str]]]:
    """The literals in ``source`` (:func:`_candidates`) that spell out a registry by hand: three or more of its names,
    or two β controllers (the hand list was ``("dynamic", "target")``), ``"fixed"`` left out; unless marked
    :data:`EXEMPT`."""
    lines = ["", *source.splitlines()]
    found = []
    for line, strings in _candidates(ast.parse(source)):
        if any(EXEMPT in text for text in lines[max(line - 1, 0) : line + 1]):
            continue
        values = [value for value in strings if value != NO_CONTROLLER]
        if len(values) < 2:
            continue
        for kind, registered in names.items():
            if set(values) <= registered and (len(values) >= 3 or (kind == "β controllers" and len(set(values)) >= 2)):
                found.append((line, kind, values))
                break
    return found


def test_no_hand_kept_list_of_methods_estimators_or_parameters():
    names = registries()
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {values} lists {kind} by hand (read the registry)"
        for folder in SEARCHED
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, kind, values in hand_lists(path.read_text(), names)
    ]
    assert offenders == [], "\n".join(offenders)


@pytest.mark.parametrize(
    "source",
    [
        'METHODS = ["none", "clip", "dynamic"]',
        'CONTROLLERS = ("dynamic", "target")',
        'ESTIMATORS = ["k1", "k2", "k3", "abs"]',
        'pytest.mark.parametrize("name", ["dynamic", "target"])',
        'FIELDS = {"kl_clip_threshold", "beta_min", "kl_horizon"}',
        # what tests/test_fuzz.py drew before issue 54 (2 of the 4 built-in controllers; the guard read none of it):
        'controller = st.sampled_from([[], ["dynamic"], ["ziegler"]])',
        'name = st.sampled_from(["fixed", "dynamic", "ziegler"])',
        'expected = {"fixed": fixed64, "dynamic": dynamic64, "ziegler": target64}[name](cfg, steps)',
        # a parametrize table, one column of which enumerates a registry
        '@pytest.mark.parametrize("name, value", [("k1", 1.0), ("k2", 2.0), pytest.param("k3", 3.0)])\ndef f(name, value): pass',
        'REFERENCES = {"k1": 1, "k2": 2, "abs": 3}',
    ],
)
def test_the_hand_list_check_finds_a_list_it_is_meant_to_find(source):
    assert hand_lists(source, registries())


@pytest.mark.parametrize(
    "source",
    [
        'CASES = [("none", "k3"), ("clip", "k2")]',
        'pair = ("fixed", "dynamic")',
        'one = ["clip", "k3"]',
        '@pytest.mark.parametrize("e, c", [("k3", 1), ("k3", 2), ("k2", 1), ("abs", 0)])\ndef f(e, c): pass',  # chosen: k3 twice
        'REFERENCES = {"k1": 1, "k2": 2, "abs": 3}  # not a registry list: read by the registry\'s names',
        '# not a registry list: cases chosen for what they show\nCASES = ["k1", "k2", "k3"]',
    ],
)
def test_the_hand_list_check_leaves_chosen_cases_alone(source):
    assert not hand_lists(source, registries())


# -- the usage of issue 35: a controller registered outside the package -------------------------------------------
@pytest.fixture
def halve():
    """The controller of the issue's example, registered as a user would, with a declared parameter besides."""
    from user_controllers import register_halve

    from unsloth_adaptive_kl import unregister_controller

    yield register_halve()
    unregister_controller("halve")


def test_a_user_controller_joins_the_grammar_and_trains_with_shaping_and_resumes_exactly(tiny_checkpoint, tmp_path, halve):
    from test_resume import EDITED_STEPS, SAVED_AT, _resumed, train

    from unsloth_adaptive_kl import parse_method

    assert parse_method("clip+halve").controller == "halve" and "halve" in controller_names()
    fields = dict(kl_adaptation_method="halve+clip", kl_clip_threshold=0.05, max_steps=EDITED_STEPS)
    full, _, betas = train(tiny_checkpoint, tmp_path / "full", **fields)
    assert betas == {1: 0.04, 2: 0.02, 3: 0.01, 4: 0.005}  # halved at every optimizer step
    assert all(h["adaptive_kl/adapted_kl"] <= 0.05 + 1e-9 for h in full.state.log_history if "adaptive_kl/adapted_kl" in h)
    resumed, _, resumed_betas = train(tiny_checkpoint, tmp_path / "resumed", resume_from=str(tmp_path / "full" / f"checkpoint-{SAVED_AT}"), **fields)
    assert _resumed(resumed_betas) == {3: 0.01, 4: 0.005}  # the checkpoint's β, not the configured 0.04
    assert resumed.state.log_history[-1]["step"] == EDITED_STEPS


def test_a_user_controllers_declared_parameter_is_set_in_kl_shaping_kwargs_and_validated():
    from types import SimpleNamespace

    from unsloth_adaptive_kl import AdaptiveKL, BetaController, Parameter, register_controller, unregister_controller
    from unsloth_adaptive_kl.config import DEFAULTS

    factor = Parameter("halve_factor", default=0.5, check=lambda v: 0 < v < 1, allowed="a number in (0, 1)")

    @register_controller("scaled", parameters=(factor,))
    class Scaled(BetaController):
        """β times halve_factor at every step."""

        adapts_beta = True

        def update(self, *, global_step, kl, num_completions):
            self.beta = self.beta * self.config.halve_factor
            return self.beta

    try:
        config = SimpleNamespace(**{**DEFAULTS, "kl_adaptation_method": "scaled", "kl_shaping_kwargs": {"halve_factor": 0.25}}, beta=0.08)
        state = AdaptiveKL(config)
        assert state.end_step(1) == 0.02 and CONTROLLERS["scaled"].summary == "β times halve_factor at every step."
        with pytest.raises(ValueError, match=r"kl_shaping_kwargs\['halve_factor'\]=1\.5 is not valid; allowed: a number in \(0, 1\)"):
            AdaptiveKL(SimpleNamespace(**{**config.__dict__, "kl_shaping_kwargs": {"halve_factor": 1.5}}))
        with pytest.raises(ValueError, match="already registered"):
            register_controller("clip")(Scaled)  # a shaping method's name
        with pytest.raises(ValueError, match="BetaController"):
            register_controller("not_a_controller")(object)
    finally:
        unregister_controller("scaled")
    from unsloth_adaptive_kl.declarations import DECLARED

    assert "scaled" not in controller_names() and "halve_factor" not in DECLARED
    with pytest.raises(ValueError, match="not a registered user controller"):
        unregister_controller("dynamic")


def test_a_parameter_shared_by_two_registries_is_one_declaration():
    """kl_target: the sigmoid shaping's centre and the target controller's aim, declared once."""
    target = CONTROLLERS["target"].parameters
    assert next(p for p in target if p.name == "kl_target") is next(p for p in SHAPING["sigmoid"].parameters if p.name == "kl_target")
    assert [f for f in registered_parameters(builtin=True)].count(next(p for p in target if p.name == "kl_target")) == 1
