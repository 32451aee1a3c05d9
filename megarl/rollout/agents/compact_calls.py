"""A compact tool-call syntax for small task vocabularies: ``<tool_call>123+45</tool_call>``.

A tiny model whose vocabulary is a task alphabet plus the two markers (megarl/models/tiny.py,
``markers=``) cannot write the JSON the ``hermes`` parser reads; this parser takes the text
between the markers as the ``expression`` of the ``calculator`` tool. The tool-use demo
(configs/tiny_tool_agent.yaml) names it by import path, as a parser of your own would be
named: ``rollout.agent.tool_parser: megarl.rollout.agents.compact_calls:calculator_calls``.
"""

from __future__ import annotations

import re

from megarl.rollout.agents.tool_calls import HERMES_CLOSE, HERMES_OPEN, ParsedCalls, ToolCall

_CALL = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(" + re.escape(HERMES_CLOSE) + r"|$)", re.DOTALL)


def calculator_calls(text: str) -> ParsedCalls:
    """Each ``<tool_call>EXPR</tool_call>`` of the turn, in order, as calculator(expression=EXPR);
    a call that is never closed or holds nothing is malformed (the model is told so)."""
    items: list[ToolCall | str] = []
    for match in _CALL.finditer(text):
        expression = match.group(1).strip()
        if not match.group(2):
            items.append(f"Error: the tool call is not closed with {HERMES_CLOSE}")
        elif not expression:
            items.append(f"Error: write the sum between the markers, {HERMES_OPEN}12+34{HERMES_CLOSE}")
        else:
            items.append(ToolCall("calculator", {"expression": expression}))
    return ParsedCalls(items)
