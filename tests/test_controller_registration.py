"""The β-controller registry at run time: what :func:`register_controller` records for a controller registered from a
test (the built-ins are registered at import), what it refuses, and :func:`unregister_controller` undoing it exactly."""

import pytest

from unsloth_adaptive_kl import BetaController, Parameter, register_controller, unregister_controller
from unsloth_adaptive_kl.controllers import (
    CONTROLLERS,
    ControllerConfig,
    ControllerSpec,
    controller_names,
    controller_parameters,
    make_controller,
    user_controller_names,
)
from unsloth_adaptive_kl.declarations import DECLARED, METHOD_NAMES

NAME = "scale_by_factor"
FACTOR = Parameter("scale_factor", default=0.5, check=lambda v: 0 < v < 1, allowed="a number in (0, 1)")


def scaling_controller():
    """A fresh user controller class (registration sets its ``name``), with a two-line docstring."""

    class Scale(BetaController):
        """β times scale_factor at every step.

        This second line is not the summary."""

        adapts_beta = True

        def update(self, *, global_step, kl, num_completions):
            self.beta = self.beta * self.config.scale_factor
            return self.beta

    return Scale


def builtin_names():
    return [name for name in controller_names() if CONTROLLERS[name].builtin]


def test_a_registered_controller_is_recorded_with_its_name_class_parameters_and_summary_then_unregistered_exactly():
    cls = scaling_controller()
    assert register_controller(NAME, parameters=(FACTOR,))(cls) is cls
    try:
        assert CONTROLLERS[NAME] == ControllerSpec(NAME, cls, (FACTOR,), "β times scale_factor at every step.", False)
        assert cls.name == NAME and NAME in controller_names()
        assert NAME in user_controller_names() and not set(user_controller_names()) & set(builtin_names())
        # its parameter is the users' (a kl_shaping_kwargs key), not the built-ins' (a GRPOConfig field)
        assert FACTOR in controller_parameters(builtin=False) and FACTOR not in controller_parameters(builtin=True)
        assert set(controller_parameters(builtin=True)) == {p for n in builtin_names() for p in CONTROLLERS[n].parameters}
        assert DECLARED[FACTOR.name] is FACTOR and METHOD_NAMES[NAME] == "β controller"
        controller = make_controller(NAME, ControllerConfig(beta=0.08, scale_factor=0.25))
        assert controller.name == NAME and controller.update(global_step=1, kl=None, num_completions=4) == 0.02
        with pytest.raises(ValueError, match=rf"^β controller '{NAME}' is already registered \(as a β controller\); allowed: another name$"):
            register_controller(NAME)(scaling_controller())
    finally:
        unregister_controller(NAME)
    assert NAME not in CONTROLLERS and NAME not in METHOD_NAMES and NAME not in user_controller_names()
    assert FACTOR.name not in DECLARED  # read by no one any more: its declaration goes
    again = scaling_controller()  # the name and the parameter are free again
    register_controller(NAME, parameters=(FACTOR,))(again)
    unregister_controller(NAME)


def test_the_summary_is_the_one_given_else_the_docstrings_first_line_else_empty():
    cases = [
        ({"summary": "Given."}, scaling_controller(), "Given."),
        ({}, scaling_controller(), "β times scale_factor at every step."),
        ({}, type("Bare", (BetaController,), {}), ""),  # no docstring: no invented text
    ]
    for index, (kwargs, cls, summary) in enumerate(cases):
        name = f"{NAME}_{index}"
        register_controller(name, **kwargs)(cls)
        try:
            assert CONTROLLERS[name].summary == summary and CONTROLLERS[name].builtin is False
        finally:
            unregister_controller(name)


def function_controller():
    return 0.1


@pytest.mark.parametrize("thing", [object, dict, function_controller], ids=["object", "dict", "function"])
def test_registering_what_is_not_a_beta_controller_subclass_is_refused_naming_it_and_records_nothing(thing):
    with pytest.raises(ValueError) as info:
        register_controller(NAME)(thing)
    assert str(info.value) == f"β controller {NAME!r}: {thing!r} is not valid; allowed: a subclass of unsloth_adaptive_kl.BetaController"
    assert NAME not in CONTROLLERS and NAME not in METHOD_NAMES


def test_unregistering_a_built_in_or_an_unknown_controller_is_refused_naming_the_user_controllers():
    builtin = builtin_names()[0]
    cls = scaling_controller()
    register_controller(NAME)(cls)
    try:
        for name in (builtin, "no_such_controller"):
            with pytest.raises(ValueError) as info:
                unregister_controller(name)
            assert str(info.value) == f"β controller {name!r} is not a registered user controller; allowed: {list(user_controller_names())}"
            allowed = str(info.value).split("allowed: ", 1)[1]
            assert repr(NAME) in allowed and repr(builtin) not in allowed
        assert CONTROLLERS[builtin].builtin and builtin in METHOD_NAMES  # the built-in is untouched
    finally:
        unregister_controller(NAME)


def test_an_unknown_controller_name_is_refused_naming_the_registered_ones():
    with pytest.raises(ValueError) as info:
        make_controller("no_such_controller", ControllerConfig(beta=0.1))
    assert str(info.value) == f"β controller 'no_such_controller' is unknown; allowed: {list(controller_names())}"
    assert all(name in str(info.value) for name in builtin_names())
