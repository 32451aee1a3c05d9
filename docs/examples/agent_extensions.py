"""Examples of agent extensions (docs/agents.md): a tool-call parser, a tool and an interaction.

``digit_calls`` reads the compact call syntax of a small task vocabulary, where the model writes
``<tool_call>DIGITS</tool_call>`` (each marker one token) to call the tool ``calc`` with the
digits; the test suite trains a tiny model with it (tests/distributed/test_agent_trainer.py).
"""

from __future__ import annotations

import re
import uuid

from megarl.rollout.agents.tool_base import Tool
from megarl.rollout.agents.tool_calls import ParsedCalls, ToolCall

_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def digit_calls(text: str) -> ParsedCalls:
    """``<tool_call>1 2 3</tool_call>`` -> calc(expression="123"): the digits after the opening
    marker, up to the closing one or the end of the turn (other tokens between are skipped);
    a call without a digit is malformed."""
    items: list[ToolCall | str] = []
    for match in _CALL.finditer(text):
        digits = "".join(ch for ch in match.group(1) if ch.isdigit())
        items.append(ToolCall("calc", {"expression": str(int(digits))}) if digits else "Error: write <tool_call>DIGITS</tool_call>")
    return ParsedCalls(items)


class EchoUser:
    """An interaction (verl's BaseInteraction methods): asks once for another try, then ends."""

    def __init__(self, config: dict):
        self.config = config
        self.turns: dict[str, int] = {}

    def start_interaction(self, instance_id: str, **kwargs) -> str:
        self.turns[instance_id] = 0
        return instance_id

    def generate_response(self, instance_id: str, messages: list[dict], **kwargs) -> tuple[bool, str, float, dict]:
        self.turns[instance_id] += 1
        done = self.turns[instance_id] > 1
        return done, "" if done else "1", float(done), {}

    def finalize_interaction(self, instance_id: str) -> None:
        self.turns.pop(instance_id, None)


class AnswerCheck(Tool):
    """verl's gsm8k tool, ported: the sample's ground truth comes in through
    ``extra_info.tools_kwargs.<tool>.create_kwargs``; the model submits ``{"answer": ...}``.
    Its methods are async, as verl's are (plain methods work too)."""

    def __init__(self, config: dict, tool_schema: dict):
        super().__init__(config, tool_schema)
        self.truth: dict[str, str] = {}

    async def create(self, instance_id: str | None = None, ground_truth: str = "", **kwargs) -> str:
        instance_id = instance_id or uuid.uuid4().hex
        self.truth[instance_id] = str(ground_truth)
        return instance_id

    async def execute(self, instance_id: str, parameters: dict, **kwargs) -> tuple[str, float, dict]:
        right = str(parameters.get("answer", "")).strip() == self.truth[instance_id]
        return ("correct" if right else "wrong"), float(right), {}

    async def release(self, instance_id: str, **kwargs) -> None:
        self.truth.pop(instance_id, None)

