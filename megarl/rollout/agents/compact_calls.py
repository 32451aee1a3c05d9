"""A compact tool-call syntax for small task vocabularies: ``<tool_call>123+45</tool_call>``.

A tiny model whose vocabulary is a task alphabet plus the two markers (megarl/models/tiny.py,
``markers=``) cannot write the JSON the ``hermes`` parser reads; this parser takes the text
between the markers as the ``expression`` of the ``calculator`` tool. The tool-use demo
(configs/tiny_tool_agent.yaml) names it by import path, as a parser of your own would be
named: ``rollout.agent.tool_parser: megarl.rollout.agents.compact_calls:calculator_calls``
(COMPACT_PARSER). Its format is known to the plan all the same (sample_calls.sample_call), so a
model that cannot write the markers or ``+`` is refused before launch.
"""

from __future__ import annotations

import re

from megarl.rewards.tool_sum import CALL_CLOSE, CALL_OPEN
from megarl.rollout.agents.tool_calls import ParsedCalls, ToolCall

COMPACT_PARSER = "megarl.rollout.agents.compact_calls:calculator_calls"  # its rollout.agent.tool_parser
SAMPLE_CALL = f"{CALL_OPEN}12+34{CALL_CLOSE}"  # a well-formed call: what the model must be able to write
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)(" + re.escape(CALL_CLOSE) + r"|$)", re.DOTALL)


def calculator_calls(text: str) -> ParsedCalls:
    """Each ``<tool_call>EXPR</tool_call>`` of the turn, in order, as calculator(expression=EXPR);
    a call that is never closed or holds nothing is malformed (the model is told so)."""
    items: list[ToolCall | str] = []
    for match in _CALL.finditer(text):
        expression = match.group(1).strip()
        if not match.group(2):
            items.append(f"Error: the tool call is not closed with {CALL_CLOSE}")
        elif not expression:
            items.append(f"Error: write the sum between the markers, {SAMPLE_CALL}")
        else:
            items.append(ToolCall("calculator", {"expression": expression}))
    return ParsedCalls(items)
