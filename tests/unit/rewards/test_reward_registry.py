import math
from decimal import Decimal

import pytest

from megarl.rewards import SCORERS, compute_score, resolve
from megarl.rewards.answers import answer_text
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


@pytest.mark.parametrize(
    "truth, text",
    [
        (1e-05, "0.00001"), (3.0, "3"), (-2.5, "-2.5"), (1e20, "100000000000000000000"), (7, "7"),
        (Decimal("1.50"), "1.5"),
        (True, True),  # a bool is no number: kept
        ("1e-05", "1e-05"),  # text is the user's: kept as written
        (1.5e-300, 1.5e-300),  # 301 digits written out: no answer text, kept as read
    ],
)  # fmt: skip
def test_a_number_ground_truth_is_compared_as_answer_text(truth, text):
    assert answer_text(truth) == text and type(answer_text(truth)) is type(text)
    assert math.isnan(answer_text(math.nan))


def test_a_float_ground_truth_scores_like_the_answer_written_out():
    """A float64 parquet column's 1e-05 reached the math scorer as str's "1e-05", which it reads
    as another answer than 0.00001: the correct response scored 0."""
    assert compute_score("math", "So it is $\\boxed{0.00001}$.", 1e-05) == 1.0
    assert compute_score("math", "So it is $\\boxed{0.0001}$.", 1e-05) == 0.0
    assert compute_score("openai/gsm8k", "... #### 3", 3.0) == 1.0  # not "3.0"
