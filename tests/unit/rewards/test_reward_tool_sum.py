"""The tool-use demo's scorer: half for the call, half for the final answer after the tool's."""

import pytest

from megarl.rewards import compute_score

INFO = {"expression": "123+45"}
TOOL = "<|im_end|><|im_start|>168<|im_end|><|im_start|>"  # the calculator's answer, as the template renders it


@pytest.mark.parametrize(
    ("response", "score"),
    [
        (f"<tool_call>123+45</tool_call>{TOOL}168", 1.0),
        (f"<tool_call>123+45</tool_call>{TOOL}16", 0.5 + 0.5 * 2 / 4),  # two digits right, too short
        ("<tool_call>123+46</tool_call><|im_end|><|im_start|>169<|im_end|><|im_start|>169", 0.5 * 6 / 7 + 0.5 * 3 / 4),  # a wrong copy: its answer one digit off
        ("<tool_call>123+45</tool_call>", 0.5),  # the call, but no tool answer came back
        # a call left open, closed only by the marker in the calculator's error message
        ("<tool_call>123+45<|im_end|><|im_start|></tool_call><|im_end|><|im_start|>168", 0.0),
        ("168", 0.0),  # answering without the tool is not the task
        (f"168{TOOL}168", 0.0),  # no call before the answer
        ("", 0.0),
    ],
)
def test_credit_table(response, score):
    assert compute_score("tool_sum", response, "168", INFO) == pytest.approx(score)


def test_a_row_without_its_expression_is_refused():
    with pytest.raises(ValueError, match="tool_sum needs extra_info.expression"):
        compute_score("tool_sum", "168", "168", {})
