"""SFT rows to tokens (megarl/data/sft.py): the loss mask covers exactly the response or the
assistant turns, checked token by token against hand-assembled pieces."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from megarl.data.datasets import DataError
from megarl.data.prompts import PromptBuilder
from megarl.data.sft import conversation_example, epoch_order, read_sft_file, sft_batch


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_two_turn_chat_trains_exactly_the_assistant_turns(byte_tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
                {"role": "assistant", "content": "6, of course"}]  # fmt: skip
    pieces = [  # (text, trained): the ChatML rendering cut by hand
        ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("4<|im_end|>\n", 1),
        ("<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("6, of course<|im_end|>\n", 1),
    ]
    tokens = [t for text, _ in pieces for t in _ids(byte_tokenizer, text)]
    mask = [m for text, m in pieces for _ in _ids(byte_tokenizer, text)]
    example = conversation_example(messages, PromptBuilder(byte_tokenizer, max_prompt_length=512), "row 0")
    assert example.prompt_ids + example.response_ids == tokens
    assert [0] * len(example.prompt_ids) + example.loss_mask == mask
    trained = byte_tokenizer.decode([t for t, m in zip(example.response_ids, example.loss_mask) if m])
    assert trained == "4<|im_end|>\n6, of course<|im_end|>\n"


def test_conversation_errors_name_the_row(byte_tokenizer):
    builder = PromptBuilder(byte_tokenizer, max_prompt_length=512)
    with pytest.raises(DataError, match="row 3, column 'messages': no assistant message"):
        conversation_example([{"role": "user", "content": "hi"}], builder, "row 3")
    with pytest.raises(DataError, match="^row 3, column 'messages': expected a non-empty list of \\{role, content\\} messages"):
        conversation_example("hi", builder, "row 3")
    # The same check as RL prompts (megarl/data/datasets.py): message, key and fix named.
    chat = [{"role": "user", "content": "hi"}, {"role": "asistant", "content": "hello"}]
    with pytest.raises(DataError) as err:
        conversation_example(chat, builder, "row 3")
    assert str(err.value) == ("row 3, column 'messages': message 1 has role 'asistant' (did you mean 'assistant'?); "
                              "roles are system, user, assistant, tool")  # fmt: skip
    with pytest.raises(DataError, match=r"^row 3, column 'messages': message 0 has no 'content' key \(it has \['role'\]\)"):
        conversation_example([{"role": "user"}, {"role": "assistant", "content": "x"}], builder, "row 3")


def test_prompt_and_dotted_response_key_with_eos(tmp_path, digit_tokenizer):
    rows = {"prompt": [[{"role": "user", "content": "472"}], [{"role": "user", "content": "90"}]],
            "reward_model": [{"ground_truth": "274", "style": "rule"}, {"ground_truth": "09", "style": "rule"}]}  # fmt: skip
    pq.write_table(pa.table(rows), tmp_path / "a.parquet")
    builder = PromptBuilder(digit_tokenizer, max_prompt_length=16)
    eos = digit_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    first, second = read_sft_file(tmp_path / "a.parquet", label="sft.train_files[0]", builder=builder, eos_id=eos,
                                  response_key="reward_model.ground_truth")  # fmt: skip
    assert first.prompt_ids == builder.encode([rows["prompt"][0]])[0][0]
    assert first.response_ids == [*_ids(digit_tokenizer, "274"), eos] and first.loss_mask == [1, 1, 1, 1]
    assert len(second) == len(builder.encode([rows["prompt"][1]])[0][0]) + 3
    short = read_sft_file(tmp_path / "a.parquet", label="x", builder=builder, eos_id=eos,
                          response_key="reward_model.ground_truth", max_length=len(second))  # fmt: skip
    assert short == [second]  # the longer row is dropped
    with pytest.raises(DataError, match=r"no usable rows \(2 read, all longer than 3 tokens: sft.max_length, or the "
                                        r"model's max_position_embeddings when fewer\)$"):  # fmt: skip
        read_sft_file(tmp_path / "a.parquet", label="x", builder=builder, eos_id=eos, response_key="reward_model.ground_truth",
                      max_length=3)  # fmt: skip
    with pytest.raises(DataError, match=r"row 0, column 'reward_model.answer': no field 'answer'"):
        read_sft_file(tmp_path / "a.parquet", label="x", builder=builder, eos_id=eos, response_key="reward_model.answer")
    with pytest.raises(DataError, match="expected columns 'prompt' and 'response'.*or 'messages'"):
        read_sft_file(tmp_path / "a.parquet", label="x", builder=builder, eos_id=eos)
    (tmp_path / "shards").mkdir()
    with pytest.raises(DataError, match=r"shards is a directory, not a parquet file; give the file itself$"):
        read_sft_file(tmp_path / "shards", label="x", builder=builder, eos_id=eos)
    pq.write_table(pa.table(rows).slice(0, 0), tmp_path / "empty.parquet")
    with pytest.raises(DataError, match=r"x \(.*empty.parquet\): no rows to train on"):
        read_sft_file(tmp_path / "empty.parquet", label="x", builder=builder, eos_id=eos, response_key="reward_model.ground_truth")


def test_batch_layout_and_seeded_epochs(byte_tokenizer):
    builder = PromptBuilder(byte_tokenizer, max_prompt_length=512)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    a = conversation_example(chat, builder, "a")
    b = conversation_example([{"role": "user", "content": "a longer question"}, *chat[1:]], builder, "b")
    batch = sft_batch([a, b], pad_id=0)
    assert batch.prompt_mask.sum(-1).tolist() == [len(a.prompt_ids), len(b.prompt_ids)]  # left-padded
    assert batch.prompt_ids[0, -len(a.prompt_ids):].tolist() == a.prompt_ids
    assert batch.response_lengths.tolist() == [len(a.response_ids), len(b.response_ids)]
    assert batch.response_mask[0, : len(a.loss_mask)].tolist() == [float(m) for m in a.loss_mask]
    assert torch.equal(batch.group_id, torch.arange(2))
    assert sorted(epoch_order(10, 0, 1)) == list(range(10)) and epoch_order(10, 0, 1) != epoch_order(10, 1, 1)
    assert epoch_order(10, 3, 7) == epoch_order(10, 3, 7)


def test_a_template_whose_generation_prompt_is_not_a_prefix_is_refused():
    from megarl.models.tiny import build_tokenizer

    # Qwen3-style: the generation prompt opens an empty think block the rendered turn lacks.
    tok = build_tokenizer()  # a fresh one: the template is changed below
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}")  # fmt: skip
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there, a long answer here"}]
    with pytest.raises(DataError, match="cannot be masked exactly"):
        conversation_example(chat, PromptBuilder(tok, max_prompt_length=512), "row 0")


def test_conversations_the_template_cannot_render_are_refused_with_the_row():
    from megarl.models.tiny import CHATML_TEMPLATE, build_tokenizer

    tok = build_tokenizer()  # a fresh one: the template is changed below
    builder = PromptBuilder(tok, max_prompt_length=512)
    first = [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]
    with pytest.raises(DataError, match=r"^row 2, column 'messages': message 0 is an assistant turn.*start the "
                                        r"conversation with a system or user message$"):  # fmt: skip
        conversation_example(first, builder, "row 2")
    # Gemma-style: the template raises for a system turn
    tok.chat_template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}" + CHATML_TEMPLATE
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(DataError, match=r"^row 5, column 'messages': the tokenizer's chat template failed on messages "
                                        r"0 to 2 \(TemplateError: System role not supported\)"):  # fmt: skip
        conversation_example(chat, builder, "row 5")
    assert conversation_example(chat[1:], builder, "row 5").loss_mask  # without the system turn it renders
