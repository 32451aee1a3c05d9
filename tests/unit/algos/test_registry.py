import pytest

from megarl.algos import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES
from megarl.algos.registry import Registry, UnknownNameError
from megarl.config import algorithm_sections as sections
from megarl.config import rollout_sections


def test_registries_hold_exactly_the_config_names():
    assert set(ADVANTAGE_ESTIMATORS.names()) == set(sections.ESTIMATORS)
    assert len(ADVANTAGE_ESTIMATORS) == len(sections.ESTIMATORS)
    assert set(POLICY_LOSSES.names()) == set(sections.POLICY_LOSSES)
    assert set(LOSS_AGGREGATIONS.names()) == set(sections.LOSS_AGGS)
    assert set(KL_ESTIMATORS.names()) == set(sections.KL_ESTIMATORS)
    assert set(sections.GROUP_ESTIMATORS) <= set(ADVANTAGE_ESTIMATORS.names())
    from megarl.rollout.agents.loops import LOOPS
    from megarl.rollout.agents.tool_calls import PARSERS

    assert tuple(LOOPS) == rollout_sections.AGENT_LOOPS and tuple(PARSERS.names()) == rollout_sections.TOOL_PARSERS


def test_lookup_miss_lists_valid_names():
    with pytest.raises(UnknownNameError) as err:
        ADVANTAGE_ESTIMATORS.get("grpoo")
    msg = str(err.value)
    assert "grpoo" in msg and "advantage estimator" in msg
    for name in sections.ESTIMATORS:
        assert name in msg
    with pytest.raises(KeyError):  # usable where a KeyError is expected
        POLICY_LOSSES["vanilla"]


def test_double_registration_is_an_error():
    reg: Registry = Registry("thing")
    reg.register("a")(len)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(abs)
    assert "a" in reg and list(reg) == ["a"]
