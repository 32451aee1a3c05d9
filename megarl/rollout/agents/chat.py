"""Token ids of the messages appended between model turns, from the model's own chat template.

A trajectory is never re-tokenized: the prompt's ids, then each turn's sampled ids exactly as
the engine returned them, then the ids of the appended tool / user messages, tokenized once
here. To render just the appended part, the template renders a fixed conversation that ends
with an assistant turn followed by the new messages (with the generation prompt), and the text
after that assistant turn's content is taken: it closes the turn (Qwen: ``<|im_end|>\n``), holds
the new messages and opens the next model turn. When the model's turn already ended with the
end-of-turn token, only the rest of the closing (``\n``) is added. Only the text after the
assistant's content is used, so a template that renders earlier turns differently once later
ones follow (Qwen3 drops the empty think block of an assistant turn that is no longer the last)
works as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megarl.rollout.agents.errors import AgentError

_USER = "MEGARL-USER-TURN"
_ASSISTANT = "MEGARL-ASSISTANT-TURN"


class ChatTemplateError(AgentError):
    """A chat template that cannot render appended messages as a suffix of the conversation."""


class TurnEncoder:
    """Renders and tokenizes the messages that follow a model turn."""

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int], tools: Sequence[dict] = (),
                 chat_template_kwargs: dict[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})  # data.apply_chat_template_kwargs, as the prompts had
        self.eos = {int(t) for t in eos_token_ids}
        self.tools = list(tools) or None
        self._base = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
        if _ASSISTANT not in self._render(self._base, add_generation_prompt=False):
            raise ChatTemplateError("the tokenizer's chat template does not render an assistant message's content")

    def _render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=add_generation_prompt, tokenize=False, **self.kwargs
        )

    def after_turn(self, turn_ids: Sequence[int], messages: list[dict[str, str]]) -> list[int]:
        """Ids that close the model turn ``turn_ids``, add ``messages`` and open the next model turn."""
        try:
            full = self._render(self._base + messages, add_generation_prompt=True)
        except Exception as exc:  # jinja raises for a role the template refuses (e.g. strict user/assistant alternation)
            roles = ", ".join(sorted({m["role"] for m in messages}))
            raise ChatTemplateError(f"the tokenizer's chat template cannot render a {roles} message after an assistant "
                                    f"turn ({type(exc).__name__}: {exc}); use a model whose template has that role") from exc
        if full.count(_ASSISTANT) != 1:
            raise ChatTemplateError("the chat template drops (or repeats) an earlier assistant turn once other messages "
                                    "follow it, so the text after the model's turn cannot be found")  # fmt: skip
        text = full[full.index(_ASSISTANT) + len(_ASSISTANT) :]  # closing + messages + generation prompt
        if turn_ids and int(turn_ids[-1]) in self.eos:  # the model ended its turn itself
            sampled = self.tokenizer.decode([int(turn_ids[-1])])
            # Only the end-of-turn text it sampled is already there: a model that ended with
            # another EOS (Qwen2.5: <|endoftext|>) still gets the template's <|im_end|>.
            text = text[len(sampled) :] if sampled and text.startswith(sampled) else text
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def turn_text(self, turn_ids: Sequence[int]) -> str:
        """A model turn's text for parsing and for the conversation (a final EOS dropped)."""
        ids = list(turn_ids)
        if ids and int(ids[-1]) in self.eos:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)
