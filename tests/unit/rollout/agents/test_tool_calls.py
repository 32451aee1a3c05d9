"""The Hermes / Qwen tool-call parser on valid, malformed and multiple calls."""

from __future__ import annotations

from megarl.rollout.agents.tool_calls import PARSERS, ToolCall, parse_hermes


def test_one_call_with_json_arguments():
    text = 'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "2+3"}}\n</tool_call>'
    parsed = parse_hermes(text)
    assert parsed.calls == [ToolCall("calc", {"expression": "2+3"})] and parsed.errors == []


def test_several_calls_in_order_and_arguments_as_a_json_string():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
            '<tool_call>{"name": "b", "arguments": "{\\"y\\": [2]}"}</tool_call>')  # fmt: skip
    assert parse_hermes(text).calls == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": [2]})]


def test_arguments_absent_or_null_are_none():
    text = '<tool_call>{"name": "now"}</tool_call><tool_call>{"name": "now", "arguments": null}</tool_call>'
    parsed = parse_hermes(text)
    assert parsed.calls == [ToolCall("now", {}), ToolCall("now", {})] and parsed.errors == []


def test_no_call_is_nothing_attempted():
    parsed = parse_hermes("The answer is 5.")
    assert parsed.calls == [] and parsed.errors == [] and parsed.attempted == 0


def test_malformed_calls_become_one_error_each_and_the_good_one_is_kept():
    text = ('<tool_call>{"name": "calc", "arguments": {"expression": "1"}</tool_call>'  # JSON cut short
            '<tool_call>{"arguments": {}}</tool_call>'  # no name
            '<tool_call>{"name": "calc", "arguments": [1, 2]}</tool_call>'  # arguments not an object
            '<tool_call>{"name": "calc", "arguments": {"expression": "4"}}</tool_call>'
            '<tool_call>{"name": "calc"')  # never closed  # fmt: skip
    parsed = parse_hermes(text)
    assert parsed.calls == [ToolCall("calc", {"expression": "4"})]
    assert len(parsed.errors) == 4 and parsed.attempted == 5
    assert "not valid JSON" in parsed.errors[0]
    assert '"name"' in parsed.errors[1]
    assert "must be a JSON object, got list" in parsed.errors[2]
    assert "not closed" in parsed.errors[3]


def test_the_registry_names_the_builtin_and_loads_an_import_path():
    assert PARSERS.get("hermes") is parse_hermes
    assert PARSERS.get("megarl.rollout.agents.tool_calls:parse_hermes") is parse_hermes
