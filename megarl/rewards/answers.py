"""Answers as text: how a number ground truth is written and compared.

``megarl data convert`` writes a JSON number ground truth as this text, and the built-in
scorers compare against it whichever way the number came (a float or int parquet column of a
file written elsewhere reaches them as this text too): 1e-05 as "0.00001", not str's "1e-05",
which the math scorer reads as another answer.
"""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any

# The most digits a number's answer text has before or after the point; no real answer comes
# near it, and 1e-999999 written out would be a million digits.
ANSWER_DIGITS = 100


def number_text(value: int | float | Decimal) -> str:
    """A number as answer text, as the scorers and people write answers: an integral value as an
    integer (3.0 -> "3"), any other in plain notation without trailing zeros (1.50 -> "1.5",
    1e-5 -> "0.00001"); exact (a JSONL number is read as a Decimal, not rounded to a float).
    Raises ValueError for a number that is not finite, or whose text would have more than
    ANSWER_DIGITS digits before or after the point."""
    # A float as its shortest round-trip form; an int as is (its repr stops at 4300 digits).
    exact = value if isinstance(value, Decimal) else Decimal(value if isinstance(value, int) else repr(value))
    if not exact.is_finite():
        raise ValueError(f"{value} is not a finite number")
    _, digits, exponent = exact.as_tuple()  # read from the tuple: plain text of 1e-999999 is never built
    assert isinstance(exponent, int)  # finite: 'n', 'N' and 'F' mark NaN and infinity only
    significant = "".join(map(str, digits)).rstrip("0")
    exponent += len(digits) - len(significant)  # trailing zeros are not digits after the point
    for count, side in ((len(significant) + exponent, "before"), (-exponent, "after")):
        if significant and count > ANSWER_DIGITS:
            shown = str(exact) if len(digits) <= 30 else f"{exact:.6E}"
            raise ValueError(f"{shown} has {count} digits {side} the point written out (an answer has at most {ANSWER_DIGITS})")
    if exact == exact.to_integral_value():
        return str(int(exact))
    return format(exact, "f").rstrip("0")  # a fractional digit is not 0: the point stays


def answer_text(ground_truth: Any) -> Any:
    """``ground_truth`` as a built-in scorer compares it: a number as :func:`number_text` writes
    it; anything else as read (a bool is no number here). A number with no such text (NaN, or
    too many digits) stays as read: the pre-launch check names NaN for the built-in scorers."""
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, int | float | Decimal):
        return ground_truth
    if isinstance(ground_truth, float) and not math.isfinite(ground_truth):
        return ground_truth
    try:
        return number_text(ground_truth)
    except ValueError:
        return ground_truth


def no_answer(ground_truth: Any) -> bool:
    """A ground truth no built-in scorer can compare with: null, blank, or NaN (how pandas writes
    a missing float); read as the text "None" or "nan", every response would score 0, silently."""
    return ground_truth is None or (isinstance(ground_truth, float) and math.isnan(ground_truth)) or str(ground_truth).strip() == ""
