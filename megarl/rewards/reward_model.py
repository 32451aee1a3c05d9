"""Reward-model scoring: an HF sequence-classification model reads prompt + response text.

Used by the reward workers when ``reward.model`` is set. The model and tokenizer load once per
worker process (torch and transformers are imported there, never by the rule scorers).
The score of a sample is the model's single logit (``num_labels=1``) at the last non-padding
token of ``prompt + response``; texts longer than the model's context are cut from the left,
so the response end is always seen.

:func:`model_dir_problem` reads config.json and looks for the tokenizer's files (no weights, no
tokenizer loaded; the transformers import is most of its cost): the launch's preflight and
`megarl evaluate` call it in the driver, and the loader first, so a directory the workers would
refuse is refused before anything starts.

With ``reward.model.chat_template`` (the default) a sample is re-rendered in the reward model's own
chat template from the prompt as the data file holds it (:func:`model_text`); ``reward.model.max_length``
bounds the tokens read, cut from the left.

Left out: pairwise / multi-head reward models, dtype options (the model's saved dtype is used).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from megarl.models.hf_files import tokenizer_files_problem

FIX = "give an HF sequence-classification model directory (config.json, weights, tokenizer) with num_labels 1"
_LOADED: dict[tuple[str, str], tuple[Any, Any]] = {}


def load_reward_model(path: str, device: str = "cpu") -> tuple[Any, Any]:
    """(model, tokenizer) for ``path`` on ``device``, cached per process."""
    key = (path, device)
    if key not in _LOADED:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        problem = model_dir_problem(path)
        if problem:
            raise ValueError(f"reward.model.path: {problem}")
        tokenizer = AutoTokenizer.from_pretrained(path)
        from megarl.terminal import hf_progress_bars_off

        with hf_progress_bars_off():
            model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
        if model.config.pad_token_id is None:
            pad = (
                tokenizer.pad_token_id
                if tokenizer.pad_token_id is not None
                else tokenizer.eos_token_id
            )
            if pad is None:
                raise ValueError(
                    f"reward.model.path: the tokenizer of {path} has neither a pad nor an eos token"
                )
            model.config.pad_token_id = pad
        tokenizer.padding_side = "right"
        tokenizer.truncation_side = "left"
        _LOADED[key] = (model, tokenizer)
    return _LOADED[key]


def move_reward_model(path: str, source: str, target: str) -> None:
    """Move the model loaded on ``source`` to ``target`` (a colocated role's offload and onload): its
    parameters and buffers move, the tokenizer stays; a device's freed blocks go back to it."""
    if source == target:
        return
    model, tokenizer = _LOADED.pop((path, source))
    _LOADED[(path, target)] = (model.to(target), tokenizer)
    if source.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()  # else the allocator keeps the blocks from the policy that needs them next


def model_dir_problem(path: str) -> str | None:
    """Why ``path`` cannot be loaded as :func:`load_reward_model` loads it, from config.json and the
    names of its tokenizer files: one line that starts with ``(path)`` and ends with the fix (the
    caller prefixes the field), or None."""
    if not Path(path).is_dir():
        return f"({path}) is not a directory; {FIX}"
    if not (Path(path) / "config.json").is_file():
        return f"({path}) has no config.json; {FIX}"
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    try:
        config = AutoConfig.from_pretrained(path)  # what AutoModelForSequenceClassification reads first
    except Exception as exc:  # noqa: BLE001 - invalid JSON, no or an unknown model_type, a value of the wrong type
        reason = re.split(r"(?<=\.)\s", " ".join(str(exc).split()), maxsplit=1)[0]  # its first sentence
        return f"({path}) has a config.json transformers {transformers.__version__} cannot read: {reason.rstrip('.')}; {FIX}"
    built = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(config.model_type)
    if built is None:
        return (f"({path}) is a {config.model_type} model, and transformers {transformers.__version__} has no "
                f"sequence-classification class for it; {FIX}")
    saved = getattr(config, "architectures", None) or []
    saved = [saved] if isinstance(saved, str) else list(saved)
    if saved and built not in saved:
        # saved from another head (a causal LM, a custom reward class): the loader would build
        # ``built`` with a randomly initialised score head, and score noise
        return (f"({path}) holds a {', '.join(saved)} (config.json's architectures), not a {built}: a reward model "
                f"needs the trained score head of a sequence classifier; {FIX}")
    if config.num_labels != 1:
        return f"({path}) has num_labels={config.num_labels}; a reward model has 1 (one score per sample); {FIX}"
    tokenizer = tokenizer_files_problem(Path(path))
    if tokenizer:  # else the workers would fail at the first score, after the whole run started
        return f"({path}) {tokenizer}; copy the reward model's tokenizer files into it (its tokenizer's save_pretrained writes them)"
    return None


def model_text(tokenizer: Any, raw_prompt: Any, prompt_text: str, response: str, chat_template: bool) -> str:
    """What the reward model reads of one sample: with ``chat_template`` and a tokenizer that has one,
    the prompt as the data holds it (text: one user turn; chat messages as they are) and the response
    as the assistant's turn, in the reward model's own template (verl's input_tokenizer); else the
    prompt as the policy's engine saw it, then the response."""
    if chat_template and raw_prompt is not None and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": raw_prompt}] if isinstance(raw_prompt, str) else [dict(m) for m in raw_prompt]
        return str(tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": response}], tokenize=False))
    return str(prompt_text) + response


def score_samples(path: str, device: str, samples: list[tuple], chat_template: bool, max_length: int | None) -> list[float]:
    """The reward of each (raw prompt or None, prompt text, response), rendered by :func:`model_text`."""
    _, tokenizer = load_reward_model(path, device)
    return score_texts(path, device, [model_text(tokenizer, raw, text, response, chat_template) for raw, text, response in samples], max_length)


def score_texts(path: str, device: str, texts: list[str], max_length: int | None = None) -> list[float]:
    """One forward over ``texts`` (one batch); returns the scalar reward of each. A text longer than
    ``max_length`` tokens (None: the model's context) loses its start: the response's end is read."""
    import torch

    model, tokenizer = load_reward_model(path, device)
    max_len = max_length or getattr(model.config, "max_position_embeddings", None) or tokenizer.model_max_length
    enc = tokenizer(
        texts,
        padding=True,
        truncation=True,
        max_length=max_len,
        add_special_tokens=False,
        return_tensors="pt",
    ).to(device)
    with torch.no_grad():
        logits = model(
            input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]
        ).logits  # [B, 1]
    return [float(x) for x in logits[:, 0].float().cpu()]
