"""What the estimator registry says about its entries (names, aliases, parameters, one-line summaries) and the probe
batch on which a user estimator is checked once (issue 38: each test kills mutants that survived the core tests)."""

import pytest
import torch

from unsloth_adaptive_kl import Parameter, estimators
from unsloth_adaptive_kl.estimators import get_estimator, register_estimator, unregister_estimator


@pytest.fixture
def registered():
    """``registered(name, fn, *aliases, **kwargs)`` registers ``fn`` as a user would; all are removed after the test."""
    names = []

    def register(name, fn, *aliases, **kwargs):
        register_estimator(name, *aliases, **kwargs)(fn)
        names.append(name)
        return name

    yield register
    for name in names:
        unregister_estimator(name)


def test_the_built_in_estimators_are_those_registered_built_in_in_the_module_in_its_order_and_a_user_one_is_not_among_them(registered):
    import inspect
    import re

    registered("test_user_k1", lambda logp, ref_logp: logp - ref_logp)
    # the module's own built-in registrations, in source order (read from its text, not from the registry)
    source = inspect.getsource(estimators)
    declared = tuple(re.findall(r'^@?register_estimator\(\s*"([^"]+)"', source, re.M))  # at column 0: not the docstring's
    assert len(declared) >= 2 and "test_user_k1" not in declared
    assert estimators.builtin_estimator_names() == declared


def test_an_estimators_aliases_are_its_other_names_sorted_and_only_its_own(registered):
    registered("test_aliased", lambda logp, ref_logp: logp - ref_logp, "test_zeta", "test_alpha")
    assert estimators.estimator_aliases("k2") == ("mse", "squared")
    assert estimators.estimator_aliases("k3") == ("low_var_kl",)
    assert estimators.estimator_aliases("k1") == ()
    assert estimators.estimator_aliases("test_aliased") == ("test_alpha", "test_zeta")


def test_estimator_parameters_lists_each_parameter_once_split_by_built_in_and_user(registered):
    power, offset = Parameter("test_power", default=2.0, keyword="power"), Parameter("test_offset", default=0.0, keyword="offset")
    registered("test_powered", lambda logp, ref_logp, *, power, offset: (logp - ref_logp).abs() ** power + offset, parameters=(power, offset))
    registered("test_shifted", lambda logp, ref_logp, *, offset: logp - ref_logp + offset, parameters=(offset,))  # shares one
    users = [p.name for p in estimators.estimator_parameters(builtin=False)]
    assert sorted(users) == ["test_offset", "test_power"]
    assert [p.name for p in estimators.estimator_parameters(builtin=True)] == ["kl_bottom_q"]
    assert sorted(p.name for p in estimators.estimator_parameters()) == ["kl_bottom_q", "test_offset", "test_power"]


def test_an_estimators_summary_is_the_one_given_else_its_docstrings_first_line_else_empty(registered):
    def documented(logp, ref_logp):
        """First line of the docstring.

        More that the docs' table does not show.
        """
        return logp - ref_logp

    def undocumented(logp, ref_logp):
        return logp - ref_logp

    registered("test_documented", documented)
    registered("test_given", documented, summary="The summary given.")
    registered("test_undocumented", undocumented)
    assert get_estimator("test_documented").summary == "First line of the docstring."
    assert get_estimator("test_given").summary == "The summary given."
    assert get_estimator("test_undocumented").summary == ""


def test_a_user_estimator_is_probed_on_a_fixed_2x5_batch_of_log_probs_in_minus_3_to_0_with_a_gradient(registered):
    """The probe (check_user_estimator): a 2x5 float32 batch, log-probs in [-3, 0] spread over it, reference log-probs
    around them (log-ratios of both signs), ten distinct tokens, logp with a gradient; the same batch every time, drawn
    without touching torch's global random state (building the KL term must not shift a seeded run)."""
    seen = []

    def recorder(logp, ref_logp):
        seen.append((logp.detach().clone(), ref_logp.detach().clone(), logp.requires_grad))
        return logp - ref_logp

    registered("test_recorder", recorder)
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    estimators.check_user_estimator("test_recorder")
    assert torch.equal(torch.get_rng_state(), state)
    estimators.check_user_estimator("test_recorder")
    (logp, ref, grad), (logp_again, ref_again, _) = seen
    assert torch.equal(logp, logp_again) and torch.equal(ref, ref_again)
    assert grad and logp.shape == ref.shape == (2, 5) and logp.dtype == torch.float32
    assert (logp <= 0).all() and (logp >= -3).all() and logp.max() - logp.min() > 1.5
    ratio = ref - logp
    assert logp.unique().numel() == 10 and ratio.unique().numel() == 10
    assert (ratio > 0).any() and (ratio < 0).any()


def test_a_user_estimator_that_detaches_its_result_is_refused_by_name_when_probed(registered):
    registered("test_detached", lambda logp, ref_logp: (logp - ref_logp).detach())
    with pytest.raises(ValueError, match="'test_detached' returned a tensor with no gradient"):
        estimators.check_user_estimator("test_detached")
