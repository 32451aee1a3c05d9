"""Helpers of the agent-rollout tests (tests/unit/rollout/agents and tests/sglang): chat prompts as a
PromptBatch, a tool whose first call hangs, and a parser that calls one tool every turn."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from megarl.data.prompt_batch import PromptBatch
from megarl.rollout.agents.tool_calls import ParsedCalls, ToolCall
from megarl.rollout.agents.tools import Tool


def chat_ids(tok: Any, text: str) -> list[int]:
    """The ids of one user message with the generation prompt, as the data path renders them."""
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return list(tok.encode(rendered, add_special_tokens=False))


def chat_prompts(tok: Any, texts: Sequence[str], **fields: Any) -> PromptBatch:
    """One prompt per text (a user message through the chat template), with every field the data
    stream fills (the stored chat messages and an empty agent_name too, so no test takes a path
    real data never takes); ``fields`` override the rest."""
    n = len(texts)
    base = dict(prompt_ids=[chat_ids(tok, t) for t in texts], prompt_text=list(texts), data_source=["x"] * n,
                ground_truth=[""] * n, extra_info=[{} for _ in texts], index=list(range(n)), file_index=[0] * n,
                agent_name=[""] * n, raw_prompt=[[{"role": "user", "content": t}] for t in texts])  # fmt: skip
    return PromptBatch(**{**base, **fields})


class FirstCallHangs(Tool):
    """The first call of the rollout sleeps past any deadline; every call's start time is kept."""

    def __init__(self, config: dict, tool_schema: dict):
        super().__init__(config, tool_schema)
        self.starts: list[float] = []
        self.lock = threading.Lock()

    def execute(self, instance_id: str, parameters: dict, **kwargs: Any) -> str:
        with self.lock:
            self.starts.append(time.monotonic())
            first = len(self.starts) == 1
        if first:
            time.sleep(5.0)
        return "ok"


def always_call(name: str):
    """A parser that finds one call of tool ``name`` in every turn."""
    return lambda text: ParsedCalls([ToolCall(name, {})])
