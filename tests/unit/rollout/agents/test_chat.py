"""The ids appended after a model turn, rendered by the model's own chat template."""

from __future__ import annotations

import pytest

from megarl.models.tiny import build_tokenizer
from megarl.rollout.agents.chat import ChatTemplateError, TurnEncoder

# Like Qwen3's: the last assistant turn gets an (empty) think block, earlier ones do not, so the
# conversation's rendering of a turn changes once messages follow it.
THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def tok():
    return build_tokenizer()


def _ids(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def test_a_closed_turn_gets_the_rest_of_the_closing_the_messages_and_the_next_turns_opening(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    enc = TurnEncoder(tok, [eos])
    closed = enc.after_turn(_ids(tok, "hi") + [eos], [{"role": "tool", "content": "42"}])
    assert closed == _ids(tok, "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    cut = enc.after_turn(_ids(tok, "hi"), [{"role": "tool", "content": "42"}])  # cut by length: closed for the model
    assert cut == [eos] + closed


def test_a_template_that_rerenders_earlier_turns_still_gives_the_appended_part(tok):
    tok.chat_template = THINKING
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    got = TurnEncoder(tok, [eos]).after_turn([eos], [{"role": "user", "content": "again"}])
    assert tok.decode(got) == "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"


def test_a_turn_ended_by_another_eos_still_gets_the_templates_end_of_turn(tok):
    im_end, endoftext = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    enc = TurnEncoder(tok, [im_end, endoftext])  # Qwen2.5 lists both as EOS
    got = tok.decode(enc.after_turn(_ids(tok, "x") + [endoftext], [{"role": "tool", "content": "1"}]))
    assert got == "<|im_end|>\n<|im_start|>tool\n1<|im_end|>\n<|im_start|>assistant\n"


def test_the_tools_reach_the_template(tok):
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                         "{% if m['role'] == 'tool' %} of {{ tools | length }} tools{% endif %}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip
    schema = {"type": "function", "function": {"name": "calc"}}
    enc = TurnEncoder(tok, [tok.convert_tokens_to_ids("<|im_end|>")], [schema, schema])
    assert "1 of 2 tools" in tok.decode(enc.after_turn([], [{"role": "tool", "content": "1"}]))


def test_a_template_without_assistant_content_is_refused(tok):
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="does not render an assistant message's content"):
        TurnEncoder(tok, [0])
