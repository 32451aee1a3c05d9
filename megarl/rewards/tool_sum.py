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
  what follows: the calculator's error message for an open call ends with one, so reading on
  would pay the policy for leaving its calls open;
- the final answer: the text after the last tool answer against the sum. A trajectory without
  a tool answer earns nothing here: answering without the tool is not the task.
A perfect trajectory scores 1.0.
"""

from __future__ import annotations

import re
from typing import Any

from megarl.rewards.reverse_digits import position_credit

# The call markers, one token each in the demo's vocabulary: the data (megarl/data/tool_sums.py)
# and the compact parser (megarl/rollout/agents/compact_calls.py) take them from here, the
# lowest layer all three may import.
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + "(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
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
    call_credit = position_credit(call.group(1), expression) if call else 0.0
    _, opened, final = solution_str.rpartition(_TOOL_ANSWER)
    answer_credit = position_credit(final, truth) if opened and call else 0.0
    return 0.5 * call_credit + 0.5 * answer_credit


def model_answer(truth: str, extra_info: dict[str, Any] | None) -> str | None:
    """The correct trajectory for the row (the call, the tool's answer, the final answer), as this
    scorer reads it; None without the row's expression (the scorer refuses such a row)."""
    expression = str((extra_info or {}).get("expression", ""))
    if not expression:
        return None
    return f"{CALL_OPEN}{expression}{CALL_CLOSE}{_END_OF_TURN}{_TOOL_ANSWER}{truth}{_END_OF_TURN}{_TOOL_ANSWER}{truth}"
