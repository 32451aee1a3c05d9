"""GSM8K answer checking: the final number of a response against the reference number.

Two extraction modes:
- strict: the number after the last ``#### `` marker (GSM8K's own answer format); a response
  without the marker scores 0.
- flexible: the last number anywhere in the response.

Thousands separators and dollar signs are stripped; numbers compare by value ("42.0" == "42").
Left out: partial or format credit (a wrong answer in the right format scores 0, as in verl's
default), units, and word numbers ("forty-two").
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

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


def _same_number(a: str, b: str) -> bool:
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return a == b


def compute_score(solution_str: str, ground_truth: str, method: str = "strict") -> float:
    """1.0 when the extracted answer equals ``ground_truth`` (a number, "#### n" accepted), else 0.0."""
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    reference = extract_answer(truth, "strict") if "####" in truth else _clean(truth.strip())
    return 1.0 if reference is not None and _same_number(answer, reference) else 0.0


def compute_score_strict(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return compute_score(solution_str, ground_truth, "strict")


def compute_score_flexible(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return compute_score(solution_str, ground_truth, "flexible")
