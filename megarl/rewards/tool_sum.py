"""The tool-use demo's reward: add two numbers with the calculator (megarl/data/tool_sums.py).

``solution_str`` is the whole trajectory after the prompt, decoded with special tokens kept and
a final EOS dropped; a correct one reads
``<tool_call>123+45</tool_call><|im_end|><|im_start|>168<|im_end|><|im_start|>168``: the call,
the calculator's answer between ``<|im_start|>`` and ``<|im_end|>``, and the final answer.
``ground_truth`` is the sum ("168"), ``extra_info["expression"]`` the prompt ("123+45").

Half the score is the call, half the final answer, each with dense partial credit (the
demo's reversal scorer's: 1/(n+1) per correct position plus 1/(n+1) for the right length), so
that a policy which copies part of the numbers already earns more than one that copies none:
- the call: the text of a ``<tool_call>...</tool_call>`` closed within the first turn (before its
  ``<|im_end|>``) against the expression. A call left open is not read up to a closing marker in
  what follows: the calculator's error message ends with one, and a policy rewarded for that
  learned to leave its calls open;
- the final answer: the text after the last tool answer against the sum. A trajectory without
  a tool answer earns nothing here: answering without the tool is not the task.
A perfect trajectory scores 1.0.
"""

from __future__ import annotations

import re

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_TOOL_ANSWER = "<|im_start|>"  # opens the tool's answer; the model's next turn follows the last one
_END_OF_TURN = "<|im_end|>"


def compute_score(data_source, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """0.5 x credit for the call + 0.5 x credit for the final answer, in [0, 1]."""
    truth = str(ground_truth)
    if not truth.isdigit():
        raise ValueError(f"tool_sum ground_truth must be a string of digits, got {truth!r}")
    expression = str((extra_info or {}).get("expression", ""))
    if not expression:
        raise ValueError("tool_sum needs extra_info.expression, the sum the prompt asks for (e.g. '123+45')")
    call = _CALL.search(solution_str.split(_END_OF_TURN, 1)[0])
    call_credit = _credit(call.group(1), expression) if call else 0.0
    _, opened, final = solution_str.rpartition(_TOOL_ANSWER)
    answer_credit = _credit(final, truth) if opened and call else 0.0
    return 0.5 * call_credit + 0.5 * answer_credit


def _credit(text: str, truth: str) -> float:
    """1/(n+1) per position where ``text`` matches ``truth``, plus 1/(n+1) for the same length."""
    n = len(truth)
    return (sum(1 for i in range(min(n, len(text))) if text[i] == truth[i]) + (len(text) == n)) / (n + 1)
