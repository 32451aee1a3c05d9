"""Competition-math answer checking: the last \\boxed{...} of a response, compared by value.

Extraction takes the last ``\\boxed{...}`` (nested braces matched) or the brace-less form
``\\boxed 5``, and only without any \\boxed the last ``\\fbox{...}`` (verl's order); a response
without one scores 0. Equivalence goes through
math-verify (sympy): fractions, decimals, LaTeX forms, percentages written in the ground
truth, intervals, sets and equations ("x=3" vs "3") compare by value.

math-verify bounds its own parsing/verification time with SIGALRM, which only works in a
process's main thread: there (a reward worker, a script) its timeout is kept; elsewhere it is
disabled and the caller's bound applies (megarl.rewards.scorer times every task out itself).
Left out: answers not in a box ("The answer is 5."), multiple-answer credit, units.
"""

from __future__ import annotations

import functools
import re
import threading
from fractions import Fraction
from typing import Any

BOX_COMMANDS = ("\\boxed", "\\fbox")
MATH_VERIFY_TIMEOUT_S = 5
# Plain numbers decide without sympy: exactly equal -> equal; further apart than this relative
# gap -> different (math-verify's float tolerance is far tighter); anything else -> math-verify.
CLEARLY_DIFFERENT = 1e-3
_NUMBER = r"-?(?:\d+(?:\.\d*)?|\.\d+)"
_RATIONAL = re.compile(
    rf"(?P<sign>-?)(?:\\[dt]?frac\{{(?P<fn>{_NUMBER})\}}\{{(?P<fd>{_NUMBER})\}}|(?P<n>{_NUMBER})(?:/(?P<d>{_NUMBER}))?)"
)


def _braced(text: str, start: int) -> str | None:
    """The contents of the brace group opening at ``text[start] == "{"`` (nesting matched)."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
    return None


def last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} / \\boxed x in ``text``, else of its last
    \\fbox{...} (as verl reads a response: a \\boxed anywhere wins), or None."""
    cmd = next((c for c in BOX_COMMANDS if c in text), None)
    if cmd is None:
        return None
    start = text.rfind(cmd)
    rest = start + len(cmd)
    if rest < len(text) and text[rest] == "{":
        return _braced(text, rest)
    if rest < len(text) and text[rest] == " ":  # "\boxed 5": up to "$" or the end of the line
        tail = text[rest + 1 :]
        return tail.split("$")[0].split("\n")[0].strip() or None
    return None


def _timeout() -> int | None:
    """math-verify's SIGALRM timeout where signals work (main thread), else None (disabled)."""
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _parse(expr: str) -> list[Any]:
    from math_verify import parse

    return parse(f"\\boxed{{{expr}}}", parsing_timeout=_timeout())


@functools.lru_cache(maxsize=4096)
def _parse_truth(ground_truth: str) -> tuple[Any, ...]:
    # The n samples of a prompt share a ground truth: parse it once.
    boxed = last_boxed(ground_truth)
    return tuple(_parse(boxed if boxed is not None else ground_truth))


def _normalise(expr: str) -> str:
    return "".join(expr.split()).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")


def as_rational(expr: str) -> Fraction | None:
    """``expr`` as an exact number when it is a plain integer, decimal, a/b or \\frac{a}{b}."""
    match = _RATIONAL.fullmatch("".join(expr.split()).strip("$"))
    if match is None:
        return None
    num, den = (
        (match["fn"], match["fd"]) if match["fn"] is not None else (match["n"], match["d"] or "1")
    )
    if Fraction(den) == 0:
        return None
    value = Fraction(num) / Fraction(den)
    return -value if match["sign"] else value


def is_equivalent(answer: str, ground_truth: str) -> bool:
    """Whether ``answer`` (box contents) equals ``ground_truth`` (a bare or boxed answer) by value."""
    truth = last_boxed(ground_truth) or ground_truth
    if _normalise(answer) == _normalise(truth):
        return True  # the common case needs no sympy
    mine, theirs = as_rational(answer), as_rational(truth)
    if mine is not None and theirs is not None:
        if mine == theirs:
            return True
        if abs(mine - theirs) > CLEARLY_DIFFERENT * max(Fraction(1), abs(theirs)):
            return False
    from math_verify import verify

    gold = list(_parse_truth(ground_truth))
    pred = _parse(answer)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=_timeout()))


def compute_score(data_source, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """1.0 when the response's last boxed answer equals ``ground_truth``, else 0.0."""
    answer = last_boxed(solution_str)
    if answer is None or not answer.strip():
        return 0.0
    return 1.0 if is_equivalent(answer, str(ground_truth)) else 0.0
