"""The built-in rule scorers by name, the data sources they serve, and verl-style dispatch.

A sample's scorer is found from its ``data_source``: ``reward.functions`` (data_source ->
scorer name, or a user function as ``path/to/file.py:function``) first, then the known dataset
names below, then the data_source itself as a scorer name. Everything here is a plain function
with verl's signature ``(data_source, solution_str, ground_truth, extra_info=None) -> float | dict``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import megarl.rewards.code_sandbox as code_sandbox
import megarl.rewards.gsm8k as gsm8k
import megarl.rewards.math as math_answer
import megarl.rewards.qa_em as qa_em
import megarl.rewards.reverse_digits as reverse_digits
import megarl.rewards.tool_sum as tool_sum
from megarl.rewards.answers import answer_text

ScoreFn = Callable[..., Any]

SCORERS: dict[str, ScoreFn] = {
    "gsm8k": gsm8k.compute_score_strict,
    "gsm8k_flexible": gsm8k.compute_score_flexible,
    "math": math_answer.compute_score,
    "code": code_sandbox.compute_score,
    "reverse_digits": reverse_digits.compute_score,
    "tool_sum": tool_sum.compute_score,
    "qa_em": qa_em.compute_score,
}
# Scorers that take milliseconds: the pool sends them in chunks (see scorer.py).
CHEAP_SCORERS = frozenset({"gsm8k", "gsm8k_flexible", "math", "reverse_digits", "tool_sum", "qa_em"})
# Scorers that give reward.format_score to a formatted but wrong answer (verl's format_score).
FORMAT_SCORERS = frozenset({"gsm8k", "gsm8k_flexible", "qa_em"})

DATA_SOURCES: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "hendrycks/competition_math": "math",
    "EleutherAI/hendrycks_math": "math",
    "math_dapo": "math",
    "aime": "math",
    "codecontests": "code",
    "apps": "code",
    "taco": "code",
    "deepmind/code_contests": "code",
    **{f"searchR1_{name}": "qa_em" for name in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")},
}


def user_function(name: str) -> tuple[str, str] | None:
    """(file, function) of a ``reward.functions`` value naming a user function
    (``path/to/file.py:function``, or ``path/to/file.py`` for its compute_score); None for a
    built-in scorer's name."""
    path, _, function = name.rpartition(":") if not name.endswith(".py") else (name, ":", "compute_score")
    return (path, function) if path.endswith(".py") and function.isidentifier() else None


def resolve(data_source: str, functions: Mapping[str, str] | None = None) -> str:
    """The scorer name for ``data_source``; an unknown one raises with the known names and the fix."""
    name = (functions or {}).get(data_source) or DATA_SOURCES.get(data_source) or data_source
    if name in SCORERS or (data_source in (functions or {}) and user_function(name)):
        return name
    raise ValueError(
        f"no reward scorer for data_source {data_source!r}. Built-in scorers: {', '.join(sorted(SCORERS))}; "
        f"known data sources: {', '.join(sorted(DATA_SOURCES))}. Map it with reward.functions "
        f"({{{data_source!r}: <scorer or file.py:function>}}) or give your own function in reward.custom."
    )


def check_functions(functions: Mapping[str, str]) -> None:
    """Refuse ``reward.functions`` entries that name no built-in scorer, or a user function
    whose file does not exist (whether it defines the function is checked where it loads)."""
    for source, name in functions.items():
        user = user_function(name)
        if user is not None and not Path(user[0]).expanduser().is_file():
            raise ValueError(
                f"reward.functions[{source!r}] = {name!r}: {user[0]} is not a file; give the path of a Python "
                "file (relative to the working directory) as path/to/file.py:function"
            )
        if user is None and name not in SCORERS:
            raise ValueError(
                f"reward.functions[{source!r}] = {name!r} is not a built-in scorer; use one of "
                f"{', '.join(sorted(SCORERS))}, your own function as path/to/file.py:function, or reward.custom "
                "for one function that scores every sample"
            )


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    functions: Mapping[str, str] | None = None,
) -> float | dict:
    """Score one response with the built-in scorer for ``data_source`` (verl's signature)."""
    return score(resolve(data_source, functions), data_source, solution_str, ground_truth, extra_info)


def can_match(name: str, ground_truth: Any) -> bool:
    """Whether some response could score on ``ground_truth`` with the built-in scorer ``name``, as
    far as a cheap look tells: the gsm8k scorers compare numbers only ("18 dollars", "3/4" or a
    list never matches); the others are not judged here."""
    if name in ("gsm8k", "gsm8k_flexible"):
        return gsm8k.reference_number(answer_text(ground_truth)) is not None
    return True


# A right response in the format each built-in scorer reads, from the answer text (the pre-launch
# check that the model's tokenizer can write it: megarl/plan/token_checks.py), from the answer
# text and the row's extra_info (tool_sum's trajectory holds the call of the row's sum); code has none.
_MODEL_ANSWERS: dict[str, Callable[[str, dict | None], str | None]] = {
    "gsm8k": lambda truth, _: f"#### {truth}",
    "gsm8k_flexible": lambda truth, _: f"The answer is {truth}",
    "math": lambda truth, _: f"\\boxed{{{truth}}}",
    "reverse_digits": lambda truth, _: truth,
    "tool_sum": tool_sum.model_answer,
    "qa_em": lambda truth, _: f"<answer>{truth}</answer>",
}


def model_answer(name: str, ground_truth: Any, extra_info: dict | None = None) -> str | None:
    """A response the built-in scorer ``name`` should score full on ``ground_truth`` and the row's
    ``extra_info`` (None for code, or a row with no answer text): the format the scorer reads."""
    make = _MODEL_ANSWERS.get(name)
    truth = answer_text(ground_truth)
    return make(truth, extra_info) if make is not None and isinstance(truth, str) and truth.strip() else None


def score(name: str, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
          format_score: float = 0.0) -> Any:
    """Built-in scorer ``name`` on one response. A number ground truth (a float or int parquet
    column) is compared as the answer text ``megarl data convert`` writes (megarl/rewards/answers.py:
    1e-05 as "0.00001"), so a number scores the same whichever way it came; ``reward.custom``
    functions get the value as read, as verl passes it. ``format_score``: what a formatted but
    wrong answer scores with the scorers of FORMAT_SCORERS (``reward.format_score``)."""
    if name in FORMAT_SCORERS:
        return SCORERS[name](data_source, solution_str, answer_text(ground_truth), extra_info, format_score=format_score)
    return SCORERS[name](data_source, solution_str, answer_text(ground_truth), extra_info)
