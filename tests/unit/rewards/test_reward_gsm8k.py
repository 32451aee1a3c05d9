from decimal import Decimal

import pytest

from megarl.rewards import compute_score
from megarl.rewards.gsm8k import compute_score as gsm8k_score
from megarl.rewards.gsm8k import extract_answer, reference_number


@pytest.mark.parametrize(
    ("response", "truth", "strict", "flexible"),
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", "7", 1.0, 1.0),
        ("#### 1,000", "1000", 1.0, 1.0),  # thousands separator stripped
        ("#### $18", "18", 1.0, 1.0),  # dollar sign stripped
        ("#### 18.00", "18", 1.0, 1.0),  # compared by value
        ("#### -5", "-5", 1.0, 1.0),
        ("The answer is 72.", "72", 0.0, 1.0),  # no #### marker: strict fails, flexible finds it
        ("#### 70\nwait, actually 72", "72", 0.0, 1.0),  # flexible takes the last number
        ("#### 10\n#### 12", "12", 1.0, 1.0),  # the last marker wins
        ("#### 12", "13", 0.0, 0.0),
        ("I do not know", "5", 0.0, 0.0),
        ("Costs $1,234.50 in total.", "1234.5", 0.0, 1.0),
    ],
)
def test_gsm8k_strict_and_flexible(response, truth, strict, flexible):
    assert gsm8k_score(response, truth, "strict") == strict
    assert gsm8k_score(response, truth, "flexible") == flexible


def test_ground_truth_in_gsm8k_answer_format():
    # GSM8K's raw "answer" column ends with "#### n"; it is accepted as ground truth too.
    assert gsm8k_score("#### 7", "3 + 4 = 7\n#### 7") == 1.0
    assert gsm8k_score("#### 4", "3 + 4 = 7\n#### 7") == 0.0


@pytest.mark.parametrize(
    ("truth", "number"),
    [("1,234", "1234"), ("$18", "18"), (" -0.50 ", "-0.5"), ("2+2=4\n#### 4", "4"), (7, "7"),
     ("18 dollars", None), ("3/4", None), ("5%", None), (["1", "2"], None), ("NaN", None), ("", None)],
)
def test_reference_number_is_none_for_a_ground_truth_no_response_matches(truth, number):
    assert reference_number(truth) == (None if number is None else Decimal(number))
    if number is not None:  # what it gives is what scores
        assert gsm8k_score(f"#### {number}", truth) == 1.0


def test_extract_answer_none_without_number():
    assert extract_answer("no digits here", "flexible") is None
    assert extract_answer("no marker 5", "strict") is None
    with pytest.raises(ValueError, match="strict, flexible"):
        extract_answer("#### 1", "loose")


def test_data_source_dispatch():
    assert compute_score("openai/gsm8k", "#### 42", "42") == 1.0
    assert compute_score("gsm8k", "the answer is 42", "42") == 0.0  # gsm8k is strict
    assert compute_score("gsm8k_flexible", "the answer is 42", "42") == 1.0
