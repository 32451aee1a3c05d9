"""Search-R1's exact-match scorer for question answering (verl's ``search_r1_like_qa_em``).

The answer is the text inside the response's last ``<answer>...</answer>`` pair (across lines);
a response without one scores 0. It is compared with each golden answer after normalisation
(lower case, punctuation and the articles a / an / the removed, whitespace collapsed): equal to
one of them scores 1.0, a formatted answer equal to none scores ``format_score``
(``reward.format_score``, 0.0 by default). As in verl, a correct response holding more than 10
``<answer>`` or ``</answer>`` tags scores a quarter (no reward for spraying tags).

The golden answers (``reward_model.ground_truth``) are Search-R1's ``{"target": [...]}``, a list
of answers, or one answer as text.
"""

from __future__ import annotations

import re
import string
from typing import Any

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
MAX_TAGS = 10  # more <answer> or </answer> tags than this quarter a correct score (verl's)


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (SQuAD's normalisation)."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def extract_answer(solution_str: str) -> str | None:
    """The stripped text of the last ``<answer>...</answer>``, or None when there is none."""
    found = _ANSWER.findall(solution_str)
    return found[-1].strip() if found else None


def golden_answers(ground_truth: Any) -> list[str]:
    """The golden answers of a ground truth: ``{"target": [...]}``, a list, or one answer."""
    if isinstance(ground_truth, dict):
        ground_truth = ground_truth.get("target", [])
    if isinstance(ground_truth, str) or not hasattr(ground_truth, "__iter__"):
        return [str(ground_truth)]
    return [str(g) for g in ground_truth]


def exact_match(prediction: str, golden: list[str]) -> bool:
    normalized = normalize_answer(prediction)
    return any(normalize_answer(g) == normalized for g in golden)


def compute_score(data_source, solution_str, ground_truth, extra_info=None, format_score: float = 0.0) -> float:
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    if not exact_match(answer, golden_answers(ground_truth)):
        return float(format_score)
    if solution_str.count("<answer>") > MAX_TAGS or solution_str.count("</answer>") > MAX_TAGS:
        return 0.25
    return 1.0
