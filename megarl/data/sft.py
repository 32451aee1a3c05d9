"""Supervised fine-tuning data (`megarl sft`): parquet rows to token ids with a loss mask that
covers the response (assistant) tokens only, and batches of them in the RL loop's Batch.

A row is either
- a prompt (``sft.prompt_key``: text or chat messages, templated exactly as RL prompts are,
  megarl/data/prompts.py) and a response (``sft.response_key``: text; a dotted key reads a
  struct column, e.g. ``reward_model.ground_truth`` trains on an RL file's answers); the
  response is followed by the model's first EOS id, so the model learns to stop; or
- a conversation (``sft.messages_key``: ``[{role, content}, ...]``) rendered whole by the
  chat template; every assistant turn is trained on (its tokens, end-of-turn marker included),
  everything else (system, user, tool turns, the assistant header) is not.

In the Batch, the tokens before the first trained token are the prompt and the rest is the
response, with ``response_mask`` 1 exactly on the trained tokens: the policy's log-prob forward
and loss machinery need nothing else.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megarl.data.datasets import DataError, check_messages, check_prompt, file_label, short_repr
from megarl.data.prompts import PromptBuilder

log = logging.getLogger(__name__)
# Where the longest row's bound comes from (megarl/plan/planner.py: sft_max_length): a row of the
# model's positions dropped under "sft.max_length" would send the user to a setting already larger.
MAX_LENGTH_SOURCE = "sft.max_length, or the model's max_position_embeddings when fewer"


@dataclass(frozen=True)
class SFTExample:
    """One tokenized row: the untrained head, then the rest with its loss mask."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]  # 1 = trained token, aligned with response_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def read_sft_file(path: str | Path, *, label: str, builder: PromptBuilder, eos_id: int, prompt_key: str = "prompt",
                  response_key: str = "response", messages_key: str = "messages", max_length: int | None = None) -> list[SFTExample]:  # fmt: skip
    """Every row of ``path`` tokenized; rows longer than ``max_length`` tokens are dropped (and
    counted in a warning). Malformed rows raise DataError naming the file, row and column."""
    import pyarrow.parquet as pq

    where = file_label(label, path)
    if Path(path).is_dir():
        raise DataError(f"{where}: {path} is a directory, not a parquet file; give the file itself")
    if not Path(path).is_file():
        raise DataError(f"{where}: no such file; give a parquet file with {prompt_key} + {response_key} columns or {messages_key}")
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a file that is not parquet
        raise DataError(f"{where}: cannot read it as parquet ({exc})") from None
    top = response_key.split(".")[0]
    if messages_key in table.column_names and top not in table.column_names:
        examples = [conversation_example(m, builder, f"{where}: row {i}", messages_key) for i, m in
                    enumerate(table.column(messages_key).to_pylist())]  # fmt: skip
    elif prompt_key in table.column_names and top in table.column_names:
        prompts, responses = table.column(prompt_key).to_pylist(), table.column(top).to_pylist()
        examples = [prompt_response_example(p, _dig(r, response_key, f"{where}: row {i}"), builder, eos_id, f"{where}: row {i}", prompt_key)
                    for i, (p, r) in enumerate(zip(prompts, responses, strict=True))]  # fmt: skip
    else:
        raise DataError(f"{where}: expected columns {prompt_key!r} and {top!r} (sft.prompt_key, sft.response_key) or "
                        f"{messages_key!r} (sft.messages_key); found {', '.join(table.column_names)}")  # fmt: skip
    kept = [e for e in examples if max_length is None or len(e) <= max_length]
    if len(kept) < len(examples):
        log.warning("%s: dropped %d of %d rows longer than %d tokens (%s)", where, len(examples) - len(kept), len(examples),
                    max_length, MAX_LENGTH_SOURCE)  # fmt: skip
    if not examples:
        raise DataError(f"{where}: no rows to train on; give a parquet file with rows")
    if not kept:
        raise DataError(f"{where}: no usable rows ({len(examples)} read, all longer than {max_length} tokens: {MAX_LENGTH_SOURCE})")
    return kept


def _dig(value: Any, key: str, where: str) -> str:
    """``value`` at the dotted ``key`` below the column (``reward_model.ground_truth``)."""
    for part in key.split(".")[1:]:
        if not isinstance(value, dict) or part not in value:
            raise DataError(f"{where}, column {key!r}: no field {part!r} in {short_repr(value)}")
        value = value[part]
    if not isinstance(value, str) or not value:
        raise DataError(f"{where}, column {key!r}: expected a non-empty string response, got {short_repr(value)}")
    return value


def prompt_response_example(prompt: Any, response: str, builder: PromptBuilder, eos_id: int, where: str,
                            prompt_key: str = "prompt") -> SFTExample:  # fmt: skip
    """A templated prompt (as in RL) and its response + EOS, all response tokens trained."""
    checked = check_prompt(prompt, f"{where}, column {prompt_key!r}")
    prompt_ids = builder.tokenize([builder.render(checked, where)])[0]
    response_ids = [*builder.tokenizer(response, add_special_tokens=False)["input_ids"], eos_id]
    return SFTExample(prompt_ids, response_ids, [1] * len(response_ids))


def conversation_example(messages: Any, builder: PromptBuilder, where: str, messages_key: str = "messages") -> SFTExample:
    """A whole conversation; the tokens of every assistant turn are trained.

    Turn boundaries come from rendering the prefixes (up to a turn's generation prompt, and
    through the turn) and tokenizing them; a template whose prefixes do not tokenize as a
    prefix of the whole conversation is refused rather than trained on shifted masks."""
    # Checked as RL prompts are, and rendered as they are: keys besides role and content (e.g.
    # tool_calls) kept, the nulls parquet adds for keys other rows have dropped.
    messages = check_messages(messages, f"{where}, column {messages_key!r}")
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise DataError(f"{where}, column {messages_key!r}: no assistant message to train on")
    if turns[0] == 0:  # its head would be the rendering of no messages, which chat templates refuse
        raise DataError(f"{where}, column {messages_key!r}: message 0 is an assistant turn, so nothing before it shows "
                        "where its header ends and its content starts; start the conversation with a system or user "
                        "message")  # fmt: skip
    tok = builder.tokenizer
    if not getattr(tok, "chat_template", None):
        raise DataError(f"{where}, column {messages_key!r}: conversations need the tokenizer's chat template, and "
                        "this tokenizer has none; give prompt + response rows instead (sft.response_key)")  # fmt: skip

    def ids(upto: int, generation_prompt: bool) -> list[int]:
        try:
            text = tok.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=generation_prompt,
                                           **builder.chat_template_kwargs)
        except Exception as exc:  # jinja raises for e.g. roles that do not alternate, or a system turn it refuses
            raise DataError(f"{where}, column {messages_key!r}: the tokenizer's chat template failed on messages 0 to "
                            f"{upto - 1} ({type(exc).__name__}: {exc}); give conversations it accepts, or prompt + "
                            "response rows (sft.response_key)") from exc  # fmt: skip
        return list(tok(text, add_special_tokens=False)["input_ids"])

    whole = ids(len(messages), False)
    mask = [0] * len(whole)
    for i in turns:
        head, through = ids(i, True), ids(i + 1, False)
        # Both prefixes must be prefixes of the whole conversation (a template that adds e.g. an
        # empty <think> block to the generation prompt only would shift the mask), and the turn
        # must add tokens after its header.
        if whole[: len(through)] != through or whole[: len(head)] != head or len(head) >= len(through):
            raise DataError(f"{where}: the chat template does not render the conversation up to message {i} "
                            "(with and without its generation prompt) as a prefix of the whole one, so the assistant "
                            "turn cannot be masked exactly; give prompt + response rows instead (sft.response_key)")  # fmt: skip
        mask[len(head) : len(through)] = [1] * (len(through) - len(head))
    first, last = mask.index(1), len(mask) - mask[::-1].index(1)
    return SFTExample(whole[:first], whole[first:last], mask[first:last])


def sft_batch(examples: Sequence[SFTExample], pad_id: int) -> Any:
    """Examples as a Batch: prompts left-padded, responses right-padded, ``response_mask`` the
    loss mask (each example its own group)."""
    from megarl.data.batch import Batch

    b = len(examples)
    p = max(len(e.prompt_ids) for e in examples)
    r = max(len(e.response_ids) for e in examples)
    prompt_ids = torch.full((b, p), pad_id, dtype=torch.long)  # [B, P]
    prompt_mask = torch.zeros((b, p), dtype=torch.long)
    response_ids = torch.full((b, r), pad_id, dtype=torch.long)  # [B, R]
    response_mask = torch.zeros((b, r), dtype=torch.float32)
    for row, e in enumerate(examples):
        if e.prompt_ids:
            prompt_ids[row, p - len(e.prompt_ids) :] = torch.tensor(e.prompt_ids)
            prompt_mask[row, p - len(e.prompt_ids) :] = 1
        response_ids[row, : len(e.response_ids)] = torch.tensor(e.response_ids)
        response_mask[row, : len(e.loss_mask)] = torch.tensor(e.loss_mask, dtype=torch.float32)
    lengths = torch.tensor([len(e.response_ids) for e in examples], dtype=torch.long)  # [B]
    return Batch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_lengths=lengths,
                 response_mask=response_mask, group_id=torch.arange(b))  # fmt: skip


def epoch_order(count: int, epoch: int, seed: int) -> list[int]:
    """A seeded permutation of ``range(count)``, a new one each epoch."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(count, generator=g).tolist()
