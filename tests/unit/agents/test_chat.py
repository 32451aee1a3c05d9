"""The ids appended after a model turn, rendered by the model's own chat template."""

from __future__ import annotations

import pytest

from megarl.agents.chat import ChatTemplateError, TurnEncoder
from megarl.models.tiny import build_tokenizer

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


def test_the_tools_reach_the_template(tok):
    schema = {"type": "function", "function": {"name": "calc"}}
    enc = TurnEncoder(tok, [tok.convert_tokens_to_ids("<|im_end|>")], [schema])
    text = tok.decode(enc.after_turn([], [{"role": "tool", "content": "1"}]))
    assert text.startswith("<|im_end|>\n<|im_start|>tool\n1")  # the tools block sits before the turn, not in the delta


def test_a_template_without_assistant_content_is_refused(tok):
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="does not render an assistant message's content"):
        TurnEncoder(tok, [0])
