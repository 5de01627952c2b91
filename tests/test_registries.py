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
SEARCHED = ("unsloth_adaptive_kl", "tests", "scripts", "bench", "examples")


def registries() -> dict[str, set[str]]:
    """Each registry's built-in names (an estimator's aliases with it), by what they name."""
    return {
        "β controllers": {name for name in controller_names() if CONTROLLERS[name].builtin},
        "shaping methods": {name for name in shaping_names() if SHAPING[name].builtin},
        "methods": {"none", *(n for n in shaping_names() if SHAPING[n].builtin), *(n for n in controller_names() if CONTROLLERS[n].builtin)},
        "estimators": {a for name in builtin_estimator_names() for a in (name, *estimator_aliases(name))},
        "parameters": {p.name for p in registered_parameters(builtin=True)},
    }


def hand_lists(source: str, names: dict[str, set[str]]) -> list[tuple[int, str, list[str]]]:
    """The literal lists, tuples and sets of strings in ``source`` that spell out a registry by hand: three or more
    of its names, or two β controllers (the hand list was ``("dynamic", "target")``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.List, ast.Tuple, ast.Set)) or len(node.elts) < 2:
            continue
        if not all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            continue
        values = [e.value for e in node.elts]
        for kind, registered in names.items():
            if set(values) <= registered and (len(values) >= 3 or (kind == "β controllers" and len(set(values)) >= 2)):
                found.append((node.lineno, kind, values))
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
    ],
)
def test_the_hand_list_check_finds_a_list_it_is_meant_to_find(source):
    assert hand_lists(source, registries())


@pytest.mark.parametrize("source", ['CASES = [("none", "k3"), ("clip", "k2")]', 'pair = ("fixed", "dynamic")', 'one = ["clip", "k3"]'])
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
