"""How a registered (user) shaping method is run and checked, and what the registry records of it: the copy an
inference tensor gets, the probe the check at build time runs, the errors it raises (their field, value and what is
allowed), the summary line of the method table, the split of parameters between built-ins and users, and a name
freed by its unregistration. The shaping math itself is tested in tests/test_shaping.py."""

import pytest
import torch

from unsloth_adaptive_kl.method import parse_method
from unsloth_adaptive_kl.shaping import (
    PROBE_KL,
    SHAPING,
    Parameter,
    apply_user_step,
    check_user_steps,
    register_shaping,
    shape_per_token,
    shaping_parameters,
    unregister_shaping,
)

GAIN = Parameter("user_gain", default=1.0, check=lambda v: v > 0, allowed="a number > 0", keyword="gain")


@pytest.fixture
def registered():
    """``registered(name, fn, **register_kwargs)`` registers ``fn`` as a user would; all are removed after the test."""
    names = []

    def register(name, fn, **kwargs):
        register_shaping(name, **kwargs)(fn)
        names.append(name)
        return name

    yield register
    for name in names:
        if name in SHAPING:
            unregister_shaping(name)


def test_on_an_inference_tensor_a_user_step_gets_a_copy_and_its_parameter(registered):
    """Under torch.inference_mode (no version counter to read) the step gets a copy: its in-place scaling reaches
    the copy only, and the caller's raw KL is kept."""

    def scale_in_place(kl, gain):
        return kl.mul_(gain)

    registered("scale_in_place", scale_in_place, parameters=(GAIN,))
    with torch.inference_mode():
        kl = torch.tensor([[0.5, 2.0], [1.0, 4.0]])
        shaped = shape_per_token(kl, parse_method("scale_in_place"), {"user_gain": 0.25})
    assert kl.is_inference() and shaped.tolist() == [[0.125, 0.5], [0.25, 1.0]]
    assert kl.tolist() == [[0.5, 2.0], [1.0, 4.0]]


def test_the_check_at_build_time_runs_each_user_step_once_on_the_probe_kl_with_a_gradient(registered):
    """Behind a built-in step (clip applies first), the user's step is still checked: it gets PROBE_KL itself,
    float32, connected to a graph."""
    seen = []

    def spy(kl, gain):
        seen.append((kl.detach().clone(), kl.requires_grad))
        return kl * gain

    registered("spy", spy, parameters=(GAIN,))
    check_user_steps(parse_method("clip+spy"), {"kl_clip_threshold": 1.0, "user_gain": 2.0})
    assert len(seen) == 1
    values, requires_grad = seen[0]
    assert requires_grad and values.dtype == torch.float32
    probe = [[0.0, 1e-4, 0.01, 0.1, 0.5], [1.0, 2.0, 5.0, 10.0, 30.0]]  # 0, k3's usual range, past Unsloth's cap of 10
    assert torch.equal(values, torch.tensor(probe, dtype=torch.float32)) and torch.equal(values, torch.tensor(PROBE_KL))


def test_a_step_changing_its_input_in_place_is_refused_with_the_name_and_what_is_allowed(registered):
    registered("cap_in_place", lambda kl: kl.clamp_(max=1.0))
    kl = torch.tensor([0.5, 3.0])
    with pytest.raises(ValueError) as refused:
        apply_user_step(SHAPING["cap_in_place"], kl, {})
    message = str(refused.value)
    assert message.startswith("shaping method 'cap_in_place' changed its input in place")
    assert message.endswith("allowed: return a new tensor (kl.clamp(...), not kl.clamp_(...))")


def test_a_step_changing_its_input_behind_the_version_counter_is_refused_at_build_time(registered):
    """``kl.data`` changes the values without the version counter: the check at build time compares the values."""

    def halve_through_data(kl):
        kl.data.mul_(0.5)
        return kl * 1.0

    registered("halve_through_data", halve_through_data)
    with pytest.raises(ValueError) as refused:
        check_user_steps(parse_method("halve_through_data"), {})
    assert str(refused.value) == (
        "shaping method 'halve_through_data' changed its input in place; allowed: return a new tensor, leave the input as it is"
    )


def test_a_step_returning_nan_on_the_probe_is_refused_naming_the_probe_and_what_it_returned(registered):
    registered("nan_above_one", lambda kl: torch.where(kl > 1.0, torch.nan, kl))
    with pytest.raises(ValueError) as refused:
        check_user_steps(parse_method("nan_above_one"), {})
    message = str(refused.value)
    assert message.startswith("shaping method 'nan_above_one' returned NaN or inf for a finite KL")
    assert f"checked on kl = {[(0.0, 1e-4, 0.01, 0.1, 0.5), (1.0, 2.0, 5.0, 10.0, 30.0)]}" in message
    assert "got [[0.0, 9.999999747378752e-05, 0.009999999776482582, 0.10000000149011612, 0.5], [1.0, nan, nan, nan, nan]]" in message
    assert message.endswith("allowed: a finite value for every finite KL")


def test_the_method_table_summary_is_the_one_given_else_the_docstrings_first_line(registered):
    def documented(kl):
        """Halve the KL.

        More words the table does not show."""
        return kl * 0.5

    registered("given_summary", documented, summary="Scales by one half.")
    registered("documented", documented)
    registered("undocumented", lambda kl: kl * 0.5)
    assert SHAPING["given_summary"].summary == "Scales by one half."
    assert SHAPING["documented"].summary == "Halve the KL."
    assert SHAPING["undocumented"].summary == ""


def test_shaping_parameters_splits_the_builtins_parameters_from_the_users(registered):
    registered("gained", lambda kl, gain: kl * gain, parameters=(GAIN,))
    assert SHAPING["gained"].builtin is False and SHAPING["clip"].builtin is True
    builtin = [p.name for p in shaping_parameters(builtin=True)]
    users = [p.name for p in shaping_parameters(builtin=False)]
    assert builtin == ["kl_clip_threshold", "kl_target"]  # clip and soft_clip's cap, then sigmoid's centre
    assert "user_gain" in users and not {"kl_clip_threshold", "kl_target"} & set(users)
    assert [p.name for p in shaping_parameters()][:2] == builtin and "user_gain" in [p.name for p in shaping_parameters()]


def test_an_unregistered_methods_name_and_parameters_are_free_again():
    """Unregistering releases the name and the parameter it declared: the same name can be registered again, with
    that parameter declared anew (another default)."""
    register_shaping("reused", parameters=(Parameter("reused_scale", default=1.0),))(lambda kl, reused_scale: kl * reused_scale)
    unregister_shaping("reused")
    register_shaping("reused", parameters=(Parameter("reused_scale", default=2.0),))(lambda kl, reused_scale: kl * reused_scale)
    try:
        assert SHAPING["reused"].parameters[0].default == 2.0
    finally:
        unregister_shaping("reused")
