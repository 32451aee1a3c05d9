"""A well-formed call in each tool-call format megarl knows, for the pre-launch check that the
model's tokenizer can write one (megarl/plan/token_checks.py)."""

from __future__ import annotations

import json

from megarl.rollout.agents.compact_calls import COMPACT_PARSER, SAMPLE_CALL, calculator_calls
from megarl.rollout.agents.tool_calls import HERMES_CLOSE, HERMES_OPEN, ToolCallParser, parse_hermes


def sample_call(parser: str, tool: str) -> tuple[str, ToolCallParser] | None:
    """A call of ``tool`` as ``parser`` reads it, and that parser: the built-in ``hermes`` or the
    tool-use demo's compact parser (named by import path; it calls only ``calculator``). None for
    a parser of the user's, whose format is not known here."""
    if parser == "hermes":
        return f"{HERMES_OPEN}\n{json.dumps({'name': tool, 'arguments': {}})}\n{HERMES_CLOSE}", parse_hermes
    if parser == COMPACT_PARSER and tool == "calculator":
        return SAMPLE_CALL, calculator_calls
    return None
