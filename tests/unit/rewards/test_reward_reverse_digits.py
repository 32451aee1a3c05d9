import itertools

import pytest

from megarl.rewards import compute_score


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("321", 1.0),  # all positions + stopped after 3 characters
        ("3210", 0.75),  # right digits, did not stop
        ("320", 0.75),  # two positions + stop
        ("300", 0.5),
        ("000", 0.25),  # only the stop credit
        ("0000", 0.0),
        ("", 0.0),
        ("3", 0.25),  # one position, did not produce 3 characters
        ("32", 0.5),
        ("123", 0.5),  # the unreversed input: middle digit + stop
    ],
)
def test_credit_table(response, score):
    assert compute_score("reverse_digits", response, "321") == score


def test_constant_output_scores_low_on_average():
    targets = ["".join(d) for d in itertools.product("0123456789", repeat=3)]
    for constant in ("000", "555", "0000"):
        mean = sum(compute_score("reverse_digits", constant, t) for t in targets) / len(targets)
        assert mean <= 0.325 + 1e-9
    perfect = sum(compute_score("reverse_digits", t, t) for t in targets) / len(targets)
    assert perfect == 1.0


def test_other_lengths_share_credit_equally():
    assert compute_score("reverse_digits", "54321", "54321") == 1.0
    assert compute_score("reverse_digits", "54000", "54321") == pytest.approx(3 / 6)
    assert compute_score("reverse_digits", "9", "7") == 0.5


def test_bad_ground_truth_names_the_format():
    with pytest.raises(ValueError, match="string of digits"):
        compute_score("reverse_digits", "123", "12a")
