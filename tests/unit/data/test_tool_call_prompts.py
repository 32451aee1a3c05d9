"""Chat messages with keys besides role and content (tool calls, tool names and ids) reach the
chat template as given, through `megarl data convert`'s parquet file, or are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.cli import main
from megarl.data.convert import generic_rows
from megarl.data.datasets import DataError, read_prompt_file
from megarl.data.prompts import PromptBuilder

# ChatML that renders what the tiny model's template leaves out: a message's name and
# tool_call_id, and an assistant turn's tool calls with their arguments as JSON. It tests keys
# with `in`, as e.g. Llama 3.1's does, so a key that is present but null renders differently.
TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}"
    "{% if 'name' in m %} name={{ m['name'] }}{% endif %}"
    "{% if 'tool_call_id' in m %} id={{ m['tool_call_id'] }}{% endif %}{{ '\\n' }}"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if 'tool_calls' in m %}{% for c in m['tool_calls'] %}"
    "<tool_call>{{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _call(call_id: str, name: str, arguments: object) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


TOOL_CONVERSATION = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "What is 2+3, and the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("call_0", "calculator", {"expression": "2+3"}),
                                                          _call("call_1", "weather", {"city": "Paris", "unit": "C"})]},
    {"role": "tool", "name": "calculator", "tool_call_id": "call_0", "content": "5"},
    {"role": "tool", "name": "weather", "tool_call_id": "call_1", "content": "18 C"},
]  # fmt: skip
PLAIN_CONVERSATION = [{"role": "user", "content": "Just say hi."}]


@pytest.fixture(scope="module")
def tool_tokenizer():
    from megarl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    return tok


def _jsonl(path: Path, prompts: list) -> str:
    path.write_text("".join(json.dumps({"p": p, "a": "5"}) + "\n" for p in prompts))
    return str(path)


def test_tool_calls_names_and_ids_reach_the_chat_template_through_data_convert(tmp_path, tool_tokenizer):
    src = _jsonl(tmp_path / "tools.jsonl", [TOOL_CONVERSATION, PLAIN_CONVERSATION])
    out = tmp_path / "tools.parquet"
    assert main(["data", "convert", src, str(out), "--prompt-field", "p", "--answer-field", "a", "--data-source", "t"]) == 0
    records = read_prompt_file(out)
    builder = PromptBuilder(tool_tokenizer, max_prompt_length=4096)
    ids, texts = builder.encode([r.prompt for r in records])
    expected = [tool_tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
                for m in (TOOL_CONVERSATION, PLAIN_CONVERSATION)]  # fmt: skip
    assert '<tool_call>weather {"city": "Paris", "unit": "C"}</tool_call>' in expected[0]  # the template shows them
    assert "<|im_start|>tool name=weather id=call_1\n18 C" in expected[0]
    assert texts == expected
    assert ids == [tool_tokenizer(t, add_special_tokens=False)["input_ids"] for t in expected]


def _with_arguments(*arguments: object) -> list[list[dict]]:
    return [[{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [_call("c", "f", a)]}]
            for a in arguments]  # fmt: skip


@pytest.mark.parametrize(
    "arguments, expected",
    [
        (({"a": 1, "b": 2}, {"b": 2, "a": 1}),
         r"^x.jsonl: line 2: field 'p': message 1's tool_calls\[0\].function.arguments would read back from parquet as "
         r"\{'a': 1, 'b': 2\}, not \{'b': 2, 'a': 1\} \(a parquet column keeps one key order and one number type for all "
         r"rows\); give it the key order and number type of the earlier rows$"),
        (({"n": 1}, {"n": 2.5}),
         r"^x.jsonl: line 1: field 'p': message 1's tool_calls\[0\].function.arguments.n would read back from parquet as "
         r"1.0, not 1 \(a parquet column"),
        (({"a": 1}, {"a": 2}, '{"a": 3}'),
         r"^x.jsonl: line 3: field 'p': its messages' keys do not fit one parquet column with the rows before \(.+\); "
         r"give each key the same type \(object, list, text or number\) in every row$"),
        (({"id": 1}, {"id": 2**70}),  # beyond int64: pyarrow raises OverflowError, not an ArrowException
         r"^x.jsonl: line 2: field 'p': its messages' keys do not fit one parquet column with the rows before"),
        (({}, {}),
         r"^x.jsonl: field 'p': the messages' keys cannot be stored in parquet \(.*no child field.*\); drop that key, or "
         r"give the object a key in some row$"),
    ],
)  # fmt: skip
def test_message_keys_that_parquet_would_change_are_refused_naming_the_line(tmp_path, arguments, expected):
    src = _jsonl(tmp_path / "x.jsonl", _with_arguments(*arguments))
    with pytest.raises(DataError, match=expected):
        generic_rows(src, prompt_field="p", answer_field="a", data_source="t")


def test_objects_with_other_keys_in_other_rows_read_back_as_given(tmp_path):
    prompts = _with_arguments({"city": "Paris"}, {"expression": "2+3"}, {})
    src = _jsonl(tmp_path / "x.jsonl", prompts)
    out = tmp_path / "x.parquet"
    assert main(["data", "convert", src, str(out), "--prompt-field", "p", "--answer-field", "a", "--data-source", "t"]) == 0
    assert [r.prompt for r in read_prompt_file(out)] == prompts


def test_an_sft_conversation_with_tool_calls_is_rendered_as_given(tmp_path, tool_tokenizer):
    from megarl.data.datasets import write_prompt_file
    from megarl.data.sft import read_sft_file

    chats = [[*TOOL_CONVERSATION, {"role": "assistant", "content": "5, and 18 C."}],
             [*PLAIN_CONVERSATION, {"role": "assistant", "content": "hi"}]]  # fmt: skip
    path = write_prompt_file([{"messages": c} for c in chats], tmp_path / "sft.parquet")  # the plain row gets null tool keys
    builder = PromptBuilder(tool_tokenizer, max_prompt_length=4096)
    examples = read_sft_file(path, label="sft.train_files[0]", builder=builder, eos_id=0)
    for chat, example in zip(chats, examples, strict=True):
        text = tool_tokenizer.apply_chat_template(chat, tokenize=False)
        assert example.prompt_ids + example.response_ids == tool_tokenizer(text, add_special_tokens=False)["input_ids"]
