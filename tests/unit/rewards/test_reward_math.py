from fractions import Fraction

import pytest

from megarl.rewards import compute_score
from megarl.rewards.math import as_rational, is_equivalent, last_boxed
from megarl.rewards.math import compute_score as math_score


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        ("so the answer is \\boxed{5}.", "5"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("nested \\boxed{\\sqrt{\\frac{a}{b}}} done", "\\sqrt{\\frac{a}{b}}"),
        ("first \\boxed{1} then \\boxed{2}", "2"),  # the last box wins
        ("$\\boxed 7$", "7"),
        ("\\fbox{x+1}", "x+1"),
        ("\\boxed{5} checked: \\fbox{6}", "5"),  # any \\boxed wins over a later \\fbox, as in verl
        ("\\fbox{1} then \\fbox{2}", "2"),
        ("no box at all: 5", None),
        ("unclosed \\boxed{3", None),
    ],
)
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        ("The answer is $\\boxed{0.5}$.", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
        ("\\boxed{0.1}", "10\\%", 1.0),  # the ground truth says percent: 0.1 == 10%
        ("\\boxed{[1, 2)}", "[1,2)", 1.0),  # intervals
        ("\\boxed{(1,2)}", "[1,2]", 0.0),  # open vs closed interval
        ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
        ("\\boxed{\\frac{\\sqrt2}{2}}", "\\sqrt{2}/2", 1.0),
        ("\\boxed{x=3}", "3", 1.0),
        ("\\boxed{1} no wait \\boxed{2}", "2", 1.0),  # last box wins
        ("\\boxed{2} no wait \\boxed{1}", "2", 0.0),
        ("The answer is 0.5", "0.5", 0.0),  # no box -> 0
        ("\\boxed{}", "0", 0.0),
        ("\\boxed{3}", "\\boxed{3}", 1.0),  # a boxed ground truth is unwrapped
        ("\\boxed{3.14159}", "\\pi", 0.0),
    ],
)
def test_math_equivalence(response, truth, score):
    assert math_score("math", response, truth) == score


def test_math_data_sources():
    for source in ("math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval"):
        assert compute_score(source, "\\boxed{\\frac{1}{2}}", "0.5") == 1.0


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("7", Fraction(7)),
        ("-0.25", Fraction(-1, 4)),
        ("3/4", Fraction(3, 4)),
        ("\\frac{1}{2}", Fraction(1, 2)),
        ("-\\dfrac{3}{4}", Fraction(-3, 4)),
        ("$5$", Fraction(5)),
        ("1/0", None),
        ("x+1", None),
        ("1,000", None),  # a tuple or a thousands separator: left to math-verify
    ],
)
def test_plain_numbers_skip_sympy(expr, value):
    assert as_rational(expr) == value


@pytest.mark.parametrize(
    ("answer", "truth"),
    [
        ("0.333333", "\\frac{1}{3}"),
        ("0.3333", "\\frac{1}{3}"),
        ("2.0000001", "2"),
        ("0.1", "10"),
        ("1.0", "1"),
    ],
)
def test_fast_path_agrees_with_math_verify(answer, truth):
    from math_verify import parse, verify

    reference = verify(parse(f"\\boxed{{{truth}}}"), parse(f"\\boxed{{{answer}}}"))
    assert is_equivalent(answer, truth) == reference
