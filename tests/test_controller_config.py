"""``ControllerConfig``: β and every registered controller parameter, each checked against its declaration."""

import pytest

from unsloth_adaptive_kl.controllers import ControllerConfig, controller_parameters


def test_an_unknown_setting_is_refused_naming_it_and_the_registered_parameters():
    with pytest.raises(ValueError) as info:
        ControllerConfig(0.1, no_such_setting=1.0, reward_window=3)
    assert str(info.value) == (
        "unknown β-controller setting(s) ['no_such_setting']; allowed: the registered controllers' parameters "
        f"{sorted(p.name for p in controller_parameters())}"
    )


@pytest.mark.parametrize(
    "setting, value, allowed",
    [
        ("dynamic_beta_decay", 1.5, "a number in (0, 1]"),
        ("reward_window", 0, "an integer >= 1"),
        ("kl_horizon", -1.0, "a number > 0"),
        ("beta_schedule", "exponential", "'linear' or 'cosine'"),
    ],
)
def test_a_given_value_is_checked_against_its_declaration(setting, value, allowed):
    with pytest.raises(ValueError) as info:
        ControllerConfig(0.1, **{setting: value})
    assert str(info.value) == f"{setting}={value!r} is not valid; allowed: {allowed}"


def test_beta_min_may_not_exceed_beta():
    with pytest.raises(ValueError) as info:
        ControllerConfig(0.1, beta_min=0.2)
    assert str(info.value) == "beta_min=0.2 is not valid; allowed: a number >= 0, and <= beta=0.1"
    assert ControllerConfig(0.1, beta_min=0.1).beta_min == 0.1  # equal is allowed


def test_a_float_parameter_given_as_an_integer_is_kept_as_a_float_and_an_integer_one_as_an_integer():
    config = ControllerConfig(1, kl_horizon=100, beta_min=0, reward_threshold=1, reward_window=3)
    assert [type(v) for v in (config.beta, config.kl_horizon, config.beta_min, config.reward_threshold)] == [float] * 4
    assert config.kl_horizon == 100.0 and type(config.reward_window) is int and config.reward_window == 3


def test_the_repr_lists_beta_and_every_setting_with_its_value():
    config = ControllerConfig(0.1, kl_horizon=100, reward_window=3)
    text = repr(config)
    assert text.startswith("ControllerConfig(beta=0.1, ") and text.endswith(")")
    assert ", kl_horizon=100.0" in text and ", reward_window=3" in text
    assert all(f", {p.name}={getattr(config, p.name)!r}" in text for p in controller_parameters())
