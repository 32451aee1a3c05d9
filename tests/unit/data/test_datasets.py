"""Reading verl-schema parquet files: good rows come back typed, bad ones name file/row/column."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.data.datasets import (
    DataError,
    check_messages,
    check_prompt_file,
    file_label,
    read_prompt_file,
)

LABEL = "data.train_files[0] (bad.parquet)"


def _write_table(path: Path, columns: dict) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def test_reads_chat_and_string_prompts(prompt_file):
    chat = prompt_file("chat.parquet", [[{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]])
    text = prompt_file("text.parquet", ["plain prompt"], truths=["42"])
    (rec,) = read_prompt_file(chat)
    assert rec.prompt == [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    assert (rec.data_source, rec.ground_truth, rec.ability, rec.style, rec.row) == ("src", "0", "test", "rule", 0)
    assert rec.extra_info == {"index": 0}
    (rec,) = read_prompt_file(text)
    assert rec.prompt == "plain prompt" and rec.ground_truth == "42"


def test_optional_columns_and_custom_prompt_key(tmp_path):
    path = _write_table(
        tmp_path / "min.parquet",
        {"data_source": ["a"], "question": ["q?"], "reward_model": [{"ground_truth": "1", "style": "rule"}]},
    )
    (rec,) = read_prompt_file(path, prompt_key="question")
    assert rec.prompt == "q?" and rec.extra_info == {} and rec.ability == ""


def test_missing_column_names_file_column_and_found_columns(tmp_path):
    path = _write_table(tmp_path / "bad.parquet", {"data_source": ["a"], "prompt": ["q"]})
    with pytest.raises(DataError) as err:
        read_prompt_file(path, label=file_label("data.train_files[0]", path))
    msg = str(err.value)
    assert msg.startswith(f"{LABEL}: missing column 'reward_model'")
    assert "['data_source', 'prompt']" in msg


def test_missing_prompt_key_column_mentions_the_setting(prompt_file):
    path = prompt_file("bad.parquet", ["q"])
    with pytest.raises(DataError, match=r"missing column 'question' \(data.prompt_key is 'question'\)"):
        read_prompt_file(path, prompt_key="question")


def test_prompt_of_wrong_type_names_row_and_column(tmp_path):
    path = _write_table(
        tmp_path / "bad.parquet",
        {"data_source": ["a"], "prompt": [17], "reward_model": [{"ground_truth": "1", "style": "rule"}]},
    )
    with pytest.raises(DataError) as err:
        read_prompt_file(path, label=LABEL)
    assert str(err.value).startswith(
        f"{LABEL}: row 0, column 'prompt': expected a string or a list of {{role, content}} messages, got int"
    )


@pytest.mark.parametrize(
    "text",
    ['[{"role": "user", "content": "What is 2+2?"}]',  # json.dumps of the messages
     "[{'role': 'user', 'content': 'What is 2+2?'}]",  # Python's repr: pandas' to_csv of a list cell
     '[\n  {"role": "system", "content": "s"},\n  {"role": "user", "content": "q"}\n]\n'],
)
def test_a_text_prompt_that_is_messages_written_out_is_refused(tmp_path, text):
    # As text it would reach the model, brackets and keys included, as one user message.
    plain = ["[{x}] is a set", '[{"a": 1}]', "Sort [{3}, {1}]"]  # brackets alone are text
    path = _write_table(
        tmp_path / "bad.parquet",
        {"data_source": ["a"] * 4, "prompt": [*plain, text], "reward_model": [{"ground_truth": "1", "style": "rule"}] * 4},
    )
    with pytest.raises(DataError, match=re.escape(f"{LABEL}: row 3, column 'prompt': the text is chat messages written "
                                                  "out as a string (")):  # fmt: skip
        read_prompt_file(path, label=LABEL)


def test_malformed_message_in_a_later_row(tmp_path):
    good = [{"role": "user", "content": "hi"}]
    prompts = [good] * 17 + [[{"role": "user", "content": None}]] + [good]
    rm = [{"ground_truth": "1", "style": "rule"}] * len(prompts)
    path = _write_table(tmp_path / "bad.parquet", {"data_source": ["a"] * len(prompts), "prompt": prompts, "reward_model": rm})
    with pytest.raises(DataError) as err:
        read_prompt_file(path, label=LABEL)
    assert str(err.value) == (f"{LABEL}: row 17, column 'prompt': message 0 has content None (null); a message's content "
                              "must be a string (quote a number, join a list of parts into one text; null only in an "
                              "assistant message with tool_calls)")  # fmt: skip


@pytest.mark.parametrize(
    "role, expected",
    [
        ("sytem", "message 1 has role 'sytem' (did you mean 'system'?); roles are system, user, assistant, tool"),
        ("User", "message 1 has role 'User' (did you mean 'user'?); roles are system, user, assistant, tool"),
        ("narrator", "message 1 has role 'narrator'; roles are system, user, assistant, tool"),
        # Other chat formats' roles get the one that plays their part.
        ("developer", "message 1 has role 'developer' (use 'system' for it); roles are system, user, assistant, tool"),
        ("function", "message 1 has role 'function' (use 'tool' for it); roles are system, user, assistant, tool"),
        ("gpt", "message 1 has role 'gpt' (use 'assistant' for it); roles are system, user, assistant, tool"),
    ],
)
def test_an_unknown_role_is_refused_with_the_closest_one(tmp_path, role, expected):
    # A chat template drops a role it does not know (Qwen2.5's does): such a turn would vanish unseen.
    prompts = [[{"role": "user", "content": "hi"}], [{"role": "system", "content": "s"}, {"role": role, "content": "q"}]]
    rm = [{"ground_truth": "1", "style": "rule"}] * 2
    path = _write_table(tmp_path / "bad.parquet", {"data_source": ["a"] * 2, "prompt": prompts, "reward_model": rm})
    with pytest.raises(DataError) as err:
        read_prompt_file(path, label=LABEL)
    assert str(err.value) == f"{LABEL}: row 1, column 'prompt': {expected}"


def test_an_assistant_tool_call_may_have_no_text():
    # OpenAI's format: the assistant turn that calls a tool has content null (or none at all).
    call = [{"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}]
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": None, "tool_calls": call},
                {"role": "tool", "content": "4"}, {"role": "assistant", "tool_calls": call}]  # fmt: skip
    assert [m["content"] for m in check_messages(messages, "f")] == ["2+2?", "", "4", ""]
    with pytest.raises(DataError, match="message 1 has content None"):  # without tool_calls, null is no text
        check_messages([messages[0], {"role": "assistant", "content": None}], "f")
    with pytest.raises(DataError, match="message 0 has no 'content' key"):
        check_messages([{"role": "user", "tool_calls": call}], "f")


def test_every_supported_role_is_read(tmp_path):
    prompt = [{"role": r, "content": r} for r in ("system", "user", "assistant", "tool", "user")]
    path = _write_table(tmp_path / "ok.parquet", {"data_source": ["a"], "prompt": [prompt],
                                                  "reward_model": [{"ground_truth": "1", "style": "rule"}]})  # fmt: skip
    assert read_prompt_file(path)[0].prompt == prompt


@pytest.mark.parametrize(
    "column, value, expected",
    [
        ("data_source", [""], "row 0, column 'data_source': expected a non-empty string"),
        ("reward_model", ["just text"], "row 0, column 'reward_model': expected a struct {ground_truth, style}, got str"),
        ("reward_model", [{"style": "rule"}], "row 0, column 'reward_model': expected a struct {ground_truth, style}, got dict"),
        ("extra_info", [[1, 2]], "row 0, column 'extra_info': expected a struct (dict) or null, got list"),
    ],
)
def test_malformed_metadata_columns(tmp_path, column, value, expected):
    columns = {"data_source": ["a"], "prompt": ["q"], "reward_model": [{"ground_truth": "1", "style": "rule"}]}
    columns[column] = value
    path = _write_table(tmp_path / "bad.parquet", columns)
    with pytest.raises(DataError) as err:
        read_prompt_file(path, label=LABEL)
    assert expected in str(err.value)


def test_missing_and_non_parquet_files(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_prompt_file(tmp_path / "nope.parquet", label=LABEL)
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    with pytest.raises(DataError, match=r"cannot read .* as parquet"):
        read_prompt_file(junk, label=LABEL)
    (tmp_path / "shards").mkdir()  # a folder of parquet files: it exists, it is no file
    with pytest.raises(DataError, match=r"shards is a directory, not a parquet file; give the file itself$"):
        read_prompt_file(tmp_path / "shards", label=LABEL)


def test_a_column_given_twice_is_named(tmp_path):
    """pyarrow cannot read such a file and dumps its schema; an older `megarl evaluate --scored` run
    twice wrote one."""
    path = tmp_path / "scored.parquet"
    table = pa.table({"data_source": ["a"], "prompt": ["p"], "reward_model": [{"ground_truth": "1", "style": "rule"}]})
    pq.write_table(table.append_column("scores", pa.array([[1.0]])).append_column("scores", pa.array([[0.0]])), path)
    with pytest.raises(DataError, match=rf"^{re.escape(LABEL)}: {path} has the column\(s\) scores more than once \(an older"):
        read_prompt_file(path, label=LABEL)


def test_a_ground_truth_is_read_as_stored(tmp_path):
    """Rows keep the file's values (a custom reward gets them as verl passes them); the built-in
    scorers compare numbers as answer text (tests/unit/rewards/test_reward_registry.py)."""
    truths = pa.array([1e-05, 3.0, math.nan], pa.float64())
    reward_model = pa.StructArray.from_arrays([truths, pa.array(["rule"] * 3)], ["ground_truth", "style"])
    path = _write_table(tmp_path / "n.parquet", {"data_source": ["math"] * 3, "prompt": ["q"] * 3, "reward_model": reward_model})
    records = read_prompt_file(path)
    assert [r.ground_truth for r in records][:2] == [1e-05, 3.0] and math.isnan(records[2].ground_truth)
    assert check_prompt_file(path)[:2] == records[:2]  # the pre-launch check reads as training reads
