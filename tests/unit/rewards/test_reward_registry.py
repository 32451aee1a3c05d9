import pytest

from megarl.rewards import SCORERS, compute_score, resolve
from megarl.rewards.registry import check_functions


def test_unknown_data_source_lists_scorers_and_fix():
    with pytest.raises(ValueError) as info:
        compute_score("my/dataset", "x", "y")
    message = str(info.value)
    assert "my/dataset" in message and "reward.functions" in message and "reward.custom" in message
    for name in SCORERS:
        assert name in message


def test_functions_mapping_overrides_and_is_checked():
    assert resolve("my/dataset", {"my/dataset": "gsm8k_flexible"}) == "gsm8k_flexible"
    assert (
        compute_score("my/dataset", "answer: 9", "9", functions={"my/dataset": "gsm8k_flexible"})
        == 1.0
    )
    with pytest.raises(ValueError, match=r"reward.functions\['my/dataset'\] = 'gsm9k'"):
        check_functions({"my/dataset": "gsm9k"})
