"""Prompt building: chat template / raw text -> token ids, and the three truncation modes."""

from __future__ import annotations

import pytest

from megarl.data.datasets import DataError
from megarl.data.prompts import PromptBuilder
from megarl.models.tiny import build_tokenizer


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_task_template_gives_exact_ids(digit_tokenizer):
    builder = PromptBuilder(digit_tokenizer, max_prompt_length=16)
    ids, texts = builder.encode([[{"role": "user", "content": "472"}]])
    assert texts == ["<|im_start|>472<|im_end|><|im_start|>"]
    start, end = digit_tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    digit = {c: digit_tokenizer.convert_tokens_to_ids(c) for c in "0123456789"}
    assert ids == [[start, digit["4"], digit["7"], digit["2"], end, start]]


def test_chatml_template_matches_the_tokenizer_and_wraps_strings(byte_tokenizer):
    builder = PromptBuilder(byte_tokenizer, max_prompt_length=200)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    ids, texts = builder.encode([messages, "2+2?"])
    expected = byte_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert texts[0] == expected and texts[0].endswith("<|im_start|>assistant\n")
    assert ids[0] == _ids(byte_tokenizer, expected)
    # A plain-string prompt is one user message.
    assert texts[1] == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_raw_text_mode(byte_tokenizer):
    builder = PromptBuilder(byte_tokenizer, max_prompt_length=200, apply_chat_template=False)
    ids, texts = builder.encode(["Q: 2+2? A:", [{"role": "user", "content": "only message"}]])
    assert texts == ["Q: 2+2? A:", "only message"]
    assert ids[0] == _ids(byte_tokenizer, "Q: 2+2? A:")
    with pytest.raises(DataError, match=r"row 3: data.apply_chat_template is false but the prompt holds 2 chat messages"):
        builder.encode([[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]], ["f.parquet: row 3"])


def test_tokenizer_without_template_is_refused_with_the_fix(byte_tokenizer):
    tok = build_tokenizer()
    tok.chat_template = None
    with pytest.raises(DataError, match="set data.apply_chat_template=false"):
        PromptBuilder(tok, max_prompt_length=8)


@pytest.mark.parametrize("mode", ["left", "right"])
def test_truncation_keeps_the_configured_end(byte_tokenizer, mode):
    raw = PromptBuilder(byte_tokenizer, max_prompt_length=100, apply_chat_template=False)
    full = raw.encode(["abcdefghij"])[0][0]
    builder = PromptBuilder(byte_tokenizer, max_prompt_length=4, truncation=mode, apply_chat_template=False)
    ids, texts = builder.encode(["abcdefghij", "abc"])
    assert ids[0] == (full[-4:] if mode == "left" else full[:4])
    assert texts[0] == ("ghij" if mode == "left" else "abcd")
    assert ids[1] == full[:3] and texts[1] == "abc"  # short prompts untouched


def test_truncation_error_names_the_row_length_and_fixes(byte_tokenizer):
    builder = PromptBuilder(byte_tokenizer, max_prompt_length=4, truncation="error", apply_chat_template=False)
    with pytest.raises(DataError) as err:
        builder.encode(["abcdefghij"], ["data.train_files[0] (a.parquet): row 5"])
    msg = str(err.value)
    assert msg.startswith("data.train_files[0] (a.parquet): row 5: the prompt has 10 tokens > data.max_prompt_length (4)")
    assert "filter_overlong_prompts=true" in msg and "truncation=left|right" in msg


def test_lengths_and_overlong_count_template_tokens(digit_tokenizer):
    builder = PromptBuilder(digit_tokenizer, max_prompt_length=6)
    prompts = ["1", "1234", "12"]
    # 3 template tokens (<|im_start|> ... <|im_end|><|im_start|>) around one token per digit
    assert builder.lengths(prompts) == [4, 7, 5]
    assert builder.overlong(prompts) == [False, True, False]
