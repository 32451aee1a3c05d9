"""Raw JSONL / CSV -> verl-schema rows: answer extraction and errors naming file, line, field."""

from __future__ import annotations

import json

import pytest

from megarl.data.convert import (
    GSM8K_INSTRUCTION,
    generic_rows,
    gsm8k_final_answer,
    gsm8k_rows,
    last_boxed,
    math_rows,
    write_rows,
)
from megarl.data.datasets import DataError, read_prompt_file


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" if isinstance(r, dict) else r for r in records))
    return str(path)


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("She has 3 + 4 = <<3+4=7>>7 apples.\n#### 7", "7"),
        ("... so 1,234 in total\n#### 1,234", "1234"),
        ("#### -5 ", "-5"),
        ("a #### b\n#### 12", "12"),  # the last marker wins
        ("no marker 7", None),
        ("####   ", None),
    ],
)
def test_gsm8k_final_answer(answer, expected):
    assert gsm8k_final_answer(answer) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so $\\boxed{5}$.", "5"),
        ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\sqrt{x^{2}+1}} done", "\\sqrt{x^{2}+1}"),
        ("answer $\\boxed 7$", "7"),
        ("\\fbox{a{b}c}", "a{b}c"),
        ("unbalanced \\boxed{1 + {2}", None),
        ("no box here", None),
    ],
)
def test_last_boxed_handles_nested_braces(text, expected):
    assert last_boxed(text) == expected


def test_gsm8k_rows_follow_the_schema(tmp_path):
    src = _jsonl(tmp_path / "g.jsonl", [{"question": "How many?", "answer": "2+2=4\n#### 4"}, "\n", {"question": "Q2", "answer": "#### 1,000"}])
    rows = gsm8k_rows(src, split="test")
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["4", "1000"]
    assert rows[0]["data_source"] == "openai/gsm8k" and rows[0]["ability"] == "math"
    assert rows[0]["prompt"] == [{"role": "user", "content": f"How many? {GSM8K_INSTRUCTION}"}]
    assert rows[1]["extra_info"] == {"split": "test", "index": 1, "question": "Q2", "answer": "#### 1,000"}
    out = write_rows(rows, tmp_path / "g.parquet", src)
    assert [r.ground_truth for r in read_prompt_file(out)] == ["4", "1000"]


def test_gsm8k_errors_name_line_and_field(tmp_path):
    src = _jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "#### 1"}, {"question": "q", "answer": "forgot"}])
    with pytest.raises(DataError, match=r"^g.jsonl: line 2: field 'answer' has no final answer after '####'"):
        gsm8k_rows(src)
    src = _jsonl(tmp_path / "h.jsonl", [{"question": "q", "answer": "#### 1"}, {"q": "x", "answer": "#### 2"}])
    with pytest.raises(DataError, match=r"^h.jsonl: line 2: missing field 'question'; the record has fields \['answer', 'q'\]"):
        gsm8k_rows(src)
    src = _jsonl(tmp_path / "j.jsonl", [{"question": "q", "answer": "#### 1"}, "{broken\n"])
    with pytest.raises(DataError, match=r"^j.jsonl: line 2: not valid JSON"):
        gsm8k_rows(src)


@pytest.mark.parametrize("final", ["18 dollars", "3/4", "5%"])
def test_a_gsm8k_final_answer_the_gsm8k_reward_cannot_match_is_refused(tmp_path, final):
    # The gsm8k reward compares numbers: such a ground truth would score every response 0.
    src = _jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "#### $1,234"}, {"question": "q", "answer": f"x\n#### {final}"}])
    with pytest.raises(DataError, match=rf"^g.jsonl: line 2: field 'answer' ends with '#### {final}', which is not a number"):
        gsm8k_rows(src)


def test_math_rows(tmp_path):
    src = _jsonl(tmp_path / "m.jsonl", [{"problem": "Half of 1?", "solution": "It is $\\boxed{\\frac{1}{2}}$."}])
    (row,) = math_rows(src)
    assert row["data_source"] == "math" and row["reward_model"]["ground_truth"] == "\\frac{1}{2}"
    assert row["prompt"][0]["content"].startswith("Half of 1? ") and "\\boxed{}" in row["prompt"][0]["content"]
    bad = _jsonl(tmp_path / "n.jsonl", [{"problem": "p", "solution": "no box"}])
    with pytest.raises(DataError, match=r"^n.jsonl: line 1: field 'solution' has no complete \\boxed"):
        math_rows(bad)
    empty = _jsonl(tmp_path / "e.jsonl", [{"problem": "p", "solution": "\\boxed{1}"}, {"problem": "p", "solution": "so \\boxed{ }."}])
    with pytest.raises(DataError, match=r"^e.jsonl: line 2: field 'solution' has an empty last \\boxed\{\}"):
        math_rows(empty)  # a blank ground truth would score every response 0


def test_generic_csv_with_system_and_suffix(tmp_path):
    src = tmp_path / "qa.csv"
    src.write_text('q,a,other\n"What is 2+2, really?",4,x\nCapital of France?,Paris,y\n')
    rows = generic_rows(src, prompt_field="q", answer_field="a", data_source="my_qa", system="Be brief.", suffix="Answer:")
    assert rows[0]["prompt"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2, really? Answer:"},
    ]
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["4", "Paris"]
    assert {r["data_source"] for r in rows} == {"my_qa"}
    with pytest.raises(DataError, match=r"^qa.csv: line 2: missing field 'question'.*choose the field with --prompt-field"):
        generic_rows(src, prompt_field="question", answer_field="a", data_source="my_qa")


def test_a_csv_cell_holding_messages_as_text_is_refused(tmp_path):
    # pandas' to_csv writes a list of messages as its repr; as text it would be one user message.
    src = tmp_path / "chat.csv"
    src.write_text('q,a\nplain question,1\n"[{\'role\': \'user\', \'content\': \'hi\'}]",2\n')
    with pytest.raises(DataError, match=r"^chat.csv: line 3: field 'q': the text is chat messages written out as a string"):
        generic_rows(str(src), prompt_field="q", answer_field="a", data_source="d")


def test_a_spreadsheets_byte_order_mark_and_a_null_field(tmp_path):
    src = tmp_path / "excel.csv"
    src.write_bytes("\ufeffq,a\nCapital of France?,Paris\n".encode())  # what Excel's "CSV UTF-8" writes
    (row,) = generic_rows(src, prompt_field="q", answer_field="a", data_source="qa")
    assert row["reward_model"]["ground_truth"] == "Paris"
    src = _jsonl(tmp_path / "n.jsonl", [{"q": "b", "a": None}])
    with pytest.raises(DataError, match=r"^n.jsonl: line 1: field 'a' is null; give it a value or drop the record$"):
        generic_rows(src, prompt_field="q", answer_field="a", data_source="qa")


def test_a_csv_row_with_another_number_of_cells_than_the_header_is_named(tmp_path):
    src = tmp_path / "qa.csv"
    src.write_text("q,a,note\nWhat is 2+2?,4,x\n\nWhat is 3+3?\n")  # a blank line, then a short row
    with pytest.raises(DataError, match=r"^qa.csv: line 4: the row has 1 cell where the header has 3; add the missing "
                                        r"cells or drop the row$"):  # fmt: skip
        generic_rows(src, prompt_field="q", answer_field="a", data_source="qa")
    src.write_text("q,a\nWhat is 2,000 + 1?,2001\n")  # an unquoted comma: every later cell shifted
    with pytest.raises(DataError, match=r"^qa.csv: line 2: the row has 3 cells where the header has 2; quote any cell "
                                        r"that holds a comma$"):  # fmt: skip
        generic_rows(src, prompt_field="q", answer_field="a", data_source="qa")
    src.write_text('\nq,a\n"What is 2,000 + 1?",2001\n\n')  # blank lines before the header too
    assert generic_rows(src, prompt_field="q", answer_field="a", data_source="qa")[0]["reward_model"]["ground_truth"] == "2001"


def test_generic_jsonl_keeps_message_prompts_and_checks_types(tmp_path):
    msgs = [{"role": "user", "content": "hi"}]
    src = _jsonl(tmp_path / "c.jsonl", [{"p": msgs, "a": 3}, {"p": "plain", "a": 1.5}])
    rows = generic_rows(src, prompt_field="p", answer_field="a", data_source="chat")
    assert rows[0]["prompt"] == msgs and rows[0]["reward_model"]["ground_truth"] == "3"
    assert rows[1]["reward_model"]["ground_truth"] == "1.5"
    bad = _jsonl(tmp_path / "d.jsonl", [{"p": "x", "a": ["list"]}])
    with pytest.raises(DataError, match=r"^d.jsonl: line 1: field 'a' must be a string or a number, got list"):
        generic_rows(bad, prompt_field="p", answer_field="a", data_source="chat")


def test_a_numeric_ground_truth_is_stored_as_its_string_form(tmp_path):
    src = _jsonl(tmp_path / "n.jsonl", [{"p": "a", "a": 7}, {"p": "b", "a": -2.5}, {"p": "c", "a": 12345678901234567890},
                                        {"p": "d", "a": " 0.5 "}])  # fmt: skip
    rows = generic_rows(src, prompt_field="p", answer_field="a", data_source="math")
    expected = ["7", "-2.5", "12345678901234567890", "0.5"]
    assert [r["reward_model"]["ground_truth"] for r in rows] == expected
    out = write_rows(rows, tmp_path / "n.parquet", src)
    assert [r.ground_truth for r in read_prompt_file(out)] == expected  # a string column, not a number one


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("true", "field 'a' must be a string or a number, got bool (True); write the answer as one string, quoted in the JSON"),
        ("false", "field 'a' must be a string or a number, got bool (False); write the answer as one string, quoted in the JSON"),
        ('[1, 2]', "field 'a' must be a string or a number, got list ([1, 2]); write the answer as one string, quoted in the JSON"),
        ('{"x": 1}', "field 'a' must be a string or a number, got dict ({'x': 1}); write the answer as one string, quoted in the JSON"),
        ("NaN", "field 'a' is nan, not a finite number; give the answer"),
        ("null", "field 'a' is null; give it a value or drop the record"),
    ],
)  # fmt: skip
def test_a_ground_truth_that_is_no_string_or_number_is_refused(tmp_path, answer, expected):
    src = tmp_path / "b.jsonl"
    src.write_text(f'{{"p": "x", "a": "1"}}\n{{"p": "y", "a": {answer}}}\n')
    with pytest.raises(DataError) as err:
        generic_rows(src, prompt_field="p", answer_field="a", data_source="qa")
    assert str(err.value) == f"b.jsonl: line 2: {expected}"


@pytest.mark.parametrize("prompt, shown", [("42", "int (42)"), ("2.5", "float (2.5)"), ("true", "bool (True)"),
                                           ('{"role": "user", "content": "hi"}', "dict ({'role': 'user', 'content': 'hi'})")])  # fmt: skip
def test_a_prompt_must_be_text_or_messages(tmp_path, prompt, shown):
    src = tmp_path / "p.jsonl"
    src.write_text(f'{{"p": {prompt}, "a": "1"}}\n')
    with pytest.raises(DataError) as err:
        generic_rows(src, prompt_field="p", answer_field="a", data_source="qa")
    assert str(err.value) == (f"p.jsonl: line 1: field 'p': expected a string or a list of {{role, content}} messages, got "
                              f"{shown}; give text as a string (quote a number) or messages as a list")


def test_a_number_is_no_text_field_of_gsm8k_but_a_csv_cell_is_text(tmp_path):
    src = _jsonl(tmp_path / "g.jsonl", [{"question": 12, "answer": "#### 1"}])
    with pytest.raises(DataError) as err:
        gsm8k_rows(src)
    assert str(err.value) == "g.jsonl: line 1: field 'question' must be a string, got int (12); quote it in the JSON if it is meant as text"
    csv_src = tmp_path / "d.csv"
    csv_src.write_text("p,a\n472,274\n")  # CSV has no numbers: every cell is text, as the demo's digit prompts are
    (row,) = generic_rows(csv_src, prompt_field="p", answer_field="a", data_source="reverse_digits")
    assert row["prompt"] == [{"role": "user", "content": "472"}] and row["reward_model"]["ground_truth"] == "274"


def test_unsupported_or_missing_input(tmp_path):
    (tmp_path / "x.txt").write_text("question,answer\n")
    with pytest.raises(DataError, match="unsupported input format '.txt'; give a .jsonl or .csv file"):
        gsm8k_rows(tmp_path / "x.txt")
    with pytest.raises(DataError, match="no such file"):
        gsm8k_rows(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="no records found"):
        write_rows([], tmp_path / "o.parquet", tmp_path / "empty.jsonl")


@pytest.mark.parametrize("name", ["latin1.jsonl", "latin1.csv"])
def test_a_file_that_is_not_utf8_is_named_with_its_line_and_byte(tmp_path, capsys, name):
    from megarl.cli import EXIT_USER, main

    src = tmp_path / name
    first = '{"q": "a", "a": "b"}\n' if name.endswith(".jsonl") else "q,a\na,b\n"
    line = '{"q": "Caf\u00e9?", "a": "yes"}\n' if name.endswith(".jsonl") else "Caf\u00e9?,yes\n"
    src.write_bytes(first.encode() + line.encode("latin1"))
    n = first.count("\n") + 1
    column = line.index("\u00e9") + 1
    out = tmp_path / "out.parquet"
    args = ["data", "convert", str(src), str(out), "--prompt-field", "q", "--answer-field", "a", "--data-source", "qa"]
    assert main(args) == EXIT_USER
    err = capsys.readouterr().err
    assert err == (f"error: {name}: line {n}: not UTF-8 (byte 0xe9 at column {column}); re-encode the file (e.g. iconv "
                   f"-f latin1 -t utf-8 {name} > {src.stem}.utf8{src.suffix})\n")
    assert not out.exists()


def test_a_csv_header_naming_a_column_twice_is_refused(tmp_path):
    src = tmp_path / "qa.csv"
    src.write_text("q,a,q\nWhat is 2+2?,4,ignored\n")  # a dict of the row would keep only the last 'q'
    with pytest.raises(DataError, match=r"^qa.csv: line 1: the header names the column 'q' twice \(again in column 3\); "
                                        r"give each column its own name$"):  # fmt: skip
        generic_rows(src, prompt_field="q", answer_field="a", data_source="qa")


@pytest.mark.parametrize(
    "messages, expected",
    [
        ([{"role": "sytem", "content": "Be brief."}, {"role": "user", "content": "hi"}],
         "message 0 has role 'sytem' (did you mean 'system'?); roles are system, user, assistant, tool"),
        ([{"role": "user", "content": "hi"}, {"role": "narrator", "content": "x"}],
         "message 1 has role 'narrator'; roles are system, user, assistant, tool"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": 5}],
         "message 1 has content 5 (int); a message's content must be a string (quote a number, join a list of parts "
         "into one text; null only in an assistant message with tool_calls)"),
        ([{"role": "user", "content": "a"}, {"role": "user", "text": "b"}],
         "message 1 has no 'content' key (it has ['role', 'text']); give each message a role and a content"),
        ([{"role": "user", "content": "a"}, "b"], "message 1 is str ('b'); give each message as a {role, content} object"),
        ([], "expected a non-empty list of {role, content} messages, got an empty list"),
    ],
)  # fmt: skip
def test_a_bad_chat_message_is_named_by_line_message_and_key(tmp_path, messages, expected):
    good = {"p": [{"role": "user", "content": "fine"}], "a": "1"}
    src = _jsonl(tmp_path / "c.jsonl", [good, "\n", {"p": messages, "a": "2"}])  # line 3: blank lines count
    with pytest.raises(DataError) as err:
        generic_rows(src, prompt_field="p", answer_field="a", data_source="chat")
    assert str(err.value) == f"c.jsonl: line 3: field 'p': {expected}"


def test_a_bad_chat_message_is_one_error_line_and_exit_code_2(tmp_path, capsys):
    from megarl.cli import EXIT_USER, main

    src = _jsonl(tmp_path / "train.jsonl", [{"p": [{"role": "user", "content": "hi"}, {"role": "asistant", "content": "x"}], "a": "1"}])
    out = tmp_path / "out.parquet"
    args = ["data", "convert", src, str(out), "--prompt-field", "p", "--answer-field", "a", "--data-source", "chat"]
    assert main(args) == EXIT_USER
    assert capsys.readouterr().err == ("error: train.jsonl: line 1: field 'p': message 1 has role 'asistant' (did you mean "
                                       "'assistant'?); roles are system, user, assistant, tool\n")  # fmt: skip
    assert not out.exists()


def test_system_and_suffix_apply_to_message_prompts_as_to_text_prompts(tmp_path):
    calls = [{"id": "c0", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}]
    prompts = [
        "What is 2+2?",
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 3+3?"}],
        [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": None, "tool_calls": calls},
         {"role": "tool", "content": "5"}],
    ]  # fmt: skip
    src = _jsonl(tmp_path / "c.jsonl", [{"p": p, "a": "1"} for p in prompts])
    out = tmp_path / "c.parquet"
    args = ["data", "convert", src, str(out), "--prompt-field", "p", "--answer-field", "a", "--data-source", "chat",
            "--system", "Be brief.", "--suffix", "Answer with a number."]  # fmt: skip
    from megarl.cli import main

    assert main(args) == 0
    system = {"role": "system", "content": "Be brief."}
    assert [r.prompt for r in read_prompt_file(out)] == [
        [system, {"role": "user", "content": "What is 2+2? Answer with a number."}],
        [system, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
         {"role": "user", "content": "What is 3+3? Answer with a number."}],
        [system, {"role": "user", "content": "Add 2 and 3. Answer with a number."},
         {"role": "assistant", "content": "", "tool_calls": calls}, {"role": "tool", "content": "5"}],
    ]  # fmt: skip


def test_system_for_messages_with_a_system_message_or_suffix_for_messages_without_a_user_one_is_refused(tmp_path, capsys):
    from megarl.cli import EXIT_USER, main

    own = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be long."}, {"role": "user", "content": "Go"}]
    src = _jsonl(tmp_path / "c.jsonl", [{"p": "fine", "a": "1"}, {"p": own, "a": "2"}])
    out = tmp_path / "c.parquet"
    args = ["data", "convert", src, str(out), "--prompt-field", "p", "--answer-field", "a", "--data-source", "chat"]
    assert main([*args, "--system", "Be brief."]) == EXIT_USER
    assert capsys.readouterr().err == ("error: c.jsonl: line 2: field 'p': --system is given but the messages already have a "
                                       "system message (message 1); drop --system, or that message from the row\n")  # fmt: skip
    assert not out.exists()
    assert main([*args, "--suffix", "Answer:"]) == 0  # without --system the row's own system message is kept
    assert read_prompt_file(out)[1].prompt == [*own[:2], {"role": "user", "content": "Go Answer:"}]
    src = _jsonl(tmp_path / "d.jsonl", [{"p": [{"role": "system", "content": "Be brief."}], "a": "1"}])
    with pytest.raises(DataError) as err:
        generic_rows(src, prompt_field="p", answer_field="a", data_source="chat", suffix="Answer:")
    assert str(err.value) == ("d.jsonl: line 1: field 'p': --suffix is given but the messages have no user message to append "
                              "it to; drop --suffix, or add a user message to the row")  # fmt: skip


@pytest.mark.parametrize(
    "literal, stored, answer",
    [
        ("3.0", "3", "3"),
        ("1.50", "1.5", "1.5"),
        ("-2.50", "-2.5", "-2.5"),
        ("1e-5", "0.00001", "0.00001"),
        ("2.5E3", "2500", "2500"),
        ("12345678901234567890", "12345678901234567890", "12345678901234567890"),
        ("12345678901234567890.0", "12345678901234567890", "12345678901234567890"),
        ("3.14159265358979323846", "3.14159265358979323846", "3.14159265358979323846"),  # more digits than a float
    ],
)
def test_a_json_number_ground_truth_is_written_as_answers_are_and_scores_against_them(tmp_path, literal, stored, answer):
    from megarl.rewards.registry import compute_score

    src = tmp_path / "n.jsonl"
    src.write_text(f'{{"p": "q", "a": {literal}}}\n')
    out = write_rows(generic_rows(src, prompt_field="p", answer_field="a", data_source="math"), tmp_path / "n.parquet", src)
    (record,) = read_prompt_file(out)
    assert record.ground_truth == stored
    assert compute_score("openai/gsm8k", f"So the answer is\n#### {answer}", record.ground_truth) == 1.0
    assert compute_score("math", f"So the answer is $\\boxed{{{answer}}}$.", record.ground_truth) == 1.0


@pytest.mark.parametrize(
    "literal, shown",
    [
        ("1e-999999", "1E-999999 has 999999 digits after the point"),  # a million digits, were it written out
        ("1e400", "1E+400 has 401 digits before the point"),  # finite: more than a float holds, not more
        ("1e-101", "1E-101 has 101 digits after the point"),
        ("-2.5e100", "-2.5E+100 has 101 digits before the point"),
        ("1" * 101, "1.111111E+100 has 101 digits before the point"),  # a long number shown short
    ],
)
def test_a_json_number_too_long_to_write_out_is_refused(tmp_path, literal, shown):
    src = tmp_path / "n.jsonl"
    src.write_text(f'{{"p": "q", "a": "1"}}\n{{"p": "q", "a": {literal}}}\n')
    with pytest.raises(DataError) as err:
        generic_rows(src, prompt_field="p", answer_field="a", data_source="math")
    assert str(err.value) == (f"n.jsonl: line 2: field 'a': {shown} written out (an answer has at most 100); write the "
                              "answer as a string, quoted in the JSON")  # fmt: skip


@pytest.mark.parametrize("literal, stored", [("1e-100", "0." + "0" * 99 + "1"), ("9" * 100, "9" * 100),
                                             ("1.2500e-98", "0." + "0" * 97 + "125")])  # fmt: skip
def test_a_json_number_of_up_to_100_digits_either_side_is_written_out(tmp_path, literal, stored):
    src = tmp_path / "n.jsonl"
    src.write_text(f'{{"p": "q", "a": {literal}}}\n')
    (row,) = generic_rows(src, prompt_field="p", answer_field="a", data_source="math")
    assert row["reward_model"]["ground_truth"] == stored


def test_a_json_integer_longer_than_python_reads_is_refused(tmp_path):
    import sys

    src = tmp_path / "n.jsonl"
    src.write_text('{"p": "q", "a": ' + "7" * (sys.get_int_max_str_digits() + 1) + "}\n")
    with pytest.raises(DataError) as err:
        generic_rows(src, prompt_field="p", answer_field="a", data_source="math")
    assert str(err.value) == (f"n.jsonl: line 1: a number has more than {sys.get_int_max_str_digits()} digits; write it "
                              "as a string, quoted in the JSON")  # fmt: skip
