"""The LLM judge's text side: its instruction template (``reward.judge.prompt_template``) and the
parsers that read a score from its output. Pure Python: the planner renders a template on a data
row before launch with these same functions, and the tests run the parsers on hand-written text.

The judge's engine, its chat template and the counting of failures are megarl/rollout/judge.py's.
"""

from __future__ import annotations

import math
import re
import string
from pathlib import Path
from typing import Any

PLACEHOLDERS = ("prompt", "response", "ground_truth")
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


class JudgeOutputError(ValueError):
    """A judge output the parser cannot read a score from (the sample scores 0 and is counted)."""


def template_text(value: str) -> str:
    """reward.judge.prompt_template's text: the file it names (``~`` expanded), or the value itself."""
    path = Path(value).expanduser()
    if "\n" not in value and len(value) < 4096 and path.is_file():
        return path.read_text()
    return value


def template_problem(template: str) -> str | None:
    """Why ``template`` cannot be rendered (an unknown or positional placeholder, an unmatched
    brace), as one line ending with the fix; None when it can."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:  # a single { or }
        return f"{exc}; write a literal brace twice ({{{{ or }}}}), as in Python's str.format"
    unknown = sorted({f for f in fields if f not in PLACEHOLDERS})
    if unknown:
        shown = ", ".join("{" + f + "}" for f in unknown)
        return (f"unknown placeholder {shown}; use {', '.join('{' + p + '}' for p in PLACEHOLDERS)}, "
                "and write a literal brace twice ({{ or }}), as in Python's str.format")  # fmt: skip
    return None


def prompt_as_text(raw: Any) -> str:
    """A prompt as the judge reads it: a string as it is; chat messages as their contents, each after
    its role when there are several."""
    if isinstance(raw, str):
        return raw
    messages = [m for m in raw if isinstance(m, dict)] if isinstance(raw, (list, tuple)) else []
    if not messages:
        return str(raw)
    if len(messages) == 1:
        return str(messages[0].get("content", ""))
    return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in messages)


def render(template: str, prompt: Any, response: str, ground_truth: Any) -> str:
    """The judge's instruction for one sample (``template`` passed :func:`template_problem`)."""
    truth = "" if ground_truth is None else str(ground_truth)
    return template.format(prompt=prompt_as_text(prompt), response=response, ground_truth=truth)


def parse_score(text: str, parser: str, verdicts: dict[str, float], score_range: tuple[float, float] | None = None) -> float:
    """The score in a judge's output; JudgeOutputError (with what was looked for) when there is
    none, when it is not finite (1e400, inf, nan: a reward that would poison the advantages), or
    when it is outside ``score_range`` (reward.judge.score_range, for number and boxed)."""
    if parser == "number":
        numbers = re.findall(_NUMBER, text)
        if not numbers:
            raise JudgeOutputError("no number in the judge's output")
        return _in_range(_finite(float(numbers[-1]), numbers[-1]), numbers[-1], score_range)
    if parser == "boxed":
        boxed = _BOXED.findall(text)
        if not boxed:
            raise JudgeOutputError("no \\boxed{...} in the judge's output")
        try:
            value = float(boxed[-1].strip())
        except ValueError:
            raise JudgeOutputError(f"\\boxed{{{boxed[-1]}}} holds no number") from None
        return _in_range(_finite(value, boxed[-1].strip()), boxed[-1].strip(), score_range)
    if parser == "verdict":
        words = {w.lower(): s for w, s in verdicts.items()}
        pattern = r"\b(" + "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)) + r")\b"
        found = re.findall(pattern, text, flags=re.IGNORECASE)
        if not found:
            raise JudgeOutputError(f"none of the verdicts ({', '.join(verdicts)}) in the judge's output")
        return words[found[-1].lower()]
    raise ValueError(f"reward.judge.parser {parser!r} is none of number, verdict, boxed")


def _in_range(value: float, said: str, score_range: tuple[float, float] | None) -> float:
    if score_range is not None and not score_range[0] <= value <= score_range[1]:
        raise JudgeOutputError(f"the judge's score {said!r} is outside reward.judge.score_range "
                               f"[{score_range[0]:g}, {score_range[1]:g}]")
    return value


def _finite(value: float, said: str) -> float:
    if not math.isfinite(value):
        raise JudgeOutputError(f"the judge's score {said!r} is not a finite number")
    return value
