"""Prompt building: a stored prompt -> the text the model sees -> token ids, length-checked.

With ``apply_chat_template`` (the default) a prompt is rendered by the tokenizer's own chat
template with ``add_generation_prompt=True`` (a plain-string prompt becomes one user message),
then tokenized without adding special tokens again (the template already holds them); with
rollout.agent.tools_file the template also gets the tools' schemas (``tools=``). Without
it the prompt text is tokenized as is, with the tokenizer's usual special tokens (e.g. BOS);
a message list is accepted there only when it holds a single message.

Length policy (``data.max_prompt_length``): ``filter_overlong`` drops long prompts when a
dataset is loaded (and reports how many); otherwise ``truncation`` decides per prompt:
``error`` refuses, ``left`` keeps the last tokens, ``right`` keeps the first tokens. This module
does not pad: padding happens where a Batch is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from megarl.data.datasets import DataError, Prompt

if TYPE_CHECKING:
    from megarl.config.sections import DataConfig

Truncation = Literal["error", "left", "right"]
TRUNCATIONS = ("error", "left", "right")
LENGTH_CHUNK = 1024


class PromptBuilder:
    """Render and tokenize prompts for one tokenizer under one length policy."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_prompt_length: int,
        truncation: Truncation = "error",
        apply_chat_template: bool = True,
        tools: Sequence[dict[str, Any]] = (),
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if truncation not in TRUNCATIONS:
            raise DataError(f"data.truncation is {truncation!r}; use one of {', '.join(TRUNCATIONS)}")
        if max_prompt_length < 1:
            raise DataError(f"data.max_prompt_length must be >= 1, got {max_prompt_length}")
        if apply_chat_template and not getattr(tokenizer, "chat_template", None):
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            raise DataError(
                f"data.apply_chat_template is true but the tokenizer {name!r} has no chat template; "
                "set data.apply_chat_template=false to feed raw prompt text, or use a tokenizer with a template"
            )
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.truncation: Truncation = truncation
        self.apply_chat_template = apply_chat_template
        self.tools = list(tools) or None  # tool schemas the chat template shows (rollout.agent.tools_file)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})  # data.apply_chat_template_kwargs

    @classmethod
    def from_config(cls, cfg: DataConfig, tokenizer: Any, tools: Sequence[dict[str, Any]] = ()) -> PromptBuilder:
        return cls(
            tokenizer,
            max_prompt_length=cfg.max_prompt_length,
            truncation=cfg.truncation,
            apply_chat_template=cfg.apply_chat_template,
            tools=tools,
            chat_template_kwargs=cfg.apply_chat_template_kwargs,
        )

    def render(self, prompt: Prompt, where: str = "prompt") -> str:
        """The text the model sees (chat template applied when configured)."""
        if self.apply_chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            try:
                return self.tokenizer.apply_chat_template(messages, tools=self.tools, add_generation_prompt=True, tokenize=False,
                                                          **self.chat_template_kwargs)
            except Exception as exc:  # jinja raises for e.g. a role the template refuses
                given = f" with data.apply_chat_template_kwargs {self.chat_template_kwargs}" if self.chat_template_kwargs else ""
                raise DataError(f"{where}: the tokenizer's chat template failed on this prompt{given} ({exc})") from exc
        if isinstance(prompt, str):
            return prompt
        if len(prompt) != 1:
            raise DataError(
                f"{where}: data.apply_chat_template is false but the prompt holds {len(prompt)} chat messages; "
                "set data.apply_chat_template=true, or store the prompt as one string"
            )
        return prompt[0]["content"]

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of rendered texts, untruncated (batched: the fast tokenizer runs in Rust)."""
        if not texts:
            return []
        # A rendered chat template already carries its special tokens.
        encoded = self.tokenizer(list(texts), add_special_tokens=not self.apply_chat_template)
        return [list(ids) for ids in encoded["input_ids"]]

    def fit(self, ids: list[int], where: str = "prompt") -> list[int]:
        """Apply the truncation policy to one prompt's ids."""
        limit = self.max_prompt_length
        if len(ids) <= limit:
            return ids
        if self.truncation == "left":
            return ids[-limit:]
        if self.truncation == "right":
            return ids[:limit]
        raise DataError(
            f"{where}: the prompt has {len(ids)} tokens > data.max_prompt_length ({limit}); raise "
            "data.max_prompt_length, set data.filter_overlong_prompts=true to drop such prompts, "
            "or set data.truncation=left|right"
        )

    def encode(self, prompts: Sequence[Prompt], wheres: Sequence[str] | None = None) -> tuple[list[list[int]], list[str]]:
        """Token ids (truncation applied) and the rendered text of each prompt.

        ``wheres`` name each prompt in errors (``data.train_files[0] (x.parquet): row 17``).
        The text of a truncated prompt is the decoded kept tokens.
        """
        wheres = list(wheres) if wheres is not None else [f"prompt {i}" for i in range(len(prompts))]
        texts = [self.render(p, w) for p, w in zip(prompts, wheres, strict=True)]
        all_ids = self.tokenize(texts)
        out_ids: list[list[int]] = []
        for i, (ids, where) in enumerate(zip(all_ids, wheres, strict=True)):
            kept = self.fit(ids, where)
            if len(kept) != len(ids):
                texts[i] = self.tokenizer.decode(kept)
            out_ids.append(kept)
        return out_ids, texts

    def lengths(self, prompts: Sequence[Prompt], wheres: Sequence[str] | None = None) -> list[int]:
        """Untruncated token counts of ``prompts`` (after templating)."""
        wheres = list(wheres) if wheres is not None else [f"prompt {i}" for i in range(len(prompts))]
        out: list[int] = []
        # Chunked so that a large dataset never holds every prompt's ids at once.
        for start in range(0, len(prompts), LENGTH_CHUNK):
            chunk = zip(prompts[start : start + LENGTH_CHUNK], wheres[start : start + LENGTH_CHUNK], strict=True)
            out.extend(len(ids) for ids in self.tokenize([self.render(p, w) for p, w in chunk]))
        return out

    def overlong(self, prompts: Sequence[Prompt], wheres: Sequence[str] | None = None) -> list[bool]:
        """Which prompts exceed ``max_prompt_length`` tokens (what filter_overlong_prompts drops)."""
        return [n > self.max_prompt_length for n in self.lengths(prompts, wheres)]
