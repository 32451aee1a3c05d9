"""GSM8K answer checking: the final number of a response against the reference number.

Two extraction modes:
- strict: the number after the last ``#### `` marker (GSM8K's own answer format); a response
  without the marker scores 0.
- flexible: the last number anywhere in the response.

Thousands separators and dollar signs are stripped; numbers compare by value ("42.0" == "42").
A wrong answer in the right format (an answer was extracted, strict: after ``#### ``) scores
``format_score`` (``reward.format_score``; 0.0 by default, as verl's). Left out: units, and word
numbers ("forty-two").
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

_STRICT = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")
_NUMBER = re.compile(r"-?\$?\s?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")


def _clean(number: str) -> str:
    return number.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer string of ``solution_str`` (commas and $ removed), or None when there is none."""
    if method == "strict":
        found = _STRICT.findall(solution_str)
    elif method == "flexible":
        found = [m for m in _NUMBER.findall(solution_str) if any(ch.isdigit() for ch in m)]
    else:
        raise ValueError(f"gsm8k method {method!r} is not one of strict, flexible")
    return _clean(found[-1]) if found else None


def reference_number(ground_truth: Any) -> Decimal | None:
    """The number a response's answer is compared with: ``ground_truth`` with commas and $
    removed (or its "#### n" part); None when it is no finite number ("18 dollars", "3/4", a
    list), which no response can ever match."""
    truth = str(ground_truth)
    reference = extract_answer(truth, "strict") if "####" in truth else _clean(truth.strip())
    try:
        value = Decimal(reference) if reference is not None else None
    except InvalidOperation:
        return None
    return value if value is not None and value.is_finite() else None


def compute_score(solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0) -> float:
    """1.0 when the extracted answer equals ``ground_truth`` (a number, "#### n" accepted);
    ``format_score`` when an answer was extracted but differs (verl's); 0.0 without an answer."""
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    reference = reference_number(ground_truth)
    # the regex makes answer a number
    return 1.0 if reference is not None and Decimal(answer) == reference else float(format_score)


def compute_score_strict(data_source, solution_str, ground_truth, extra_info=None, format_score: float = 0.0) -> float:
    return compute_score(solution_str, ground_truth, "strict", format_score)


def compute_score_flexible(data_source, solution_str, ground_truth, extra_info=None, format_score: float = 0.0) -> float:
    return compute_score(solution_str, ground_truth, "flexible", format_score)
