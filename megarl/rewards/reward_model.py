"""Reward-model scoring: an HF sequence-classification model reads prompt + response text.

Used by the reward workers when ``reward.model`` is set. The model and tokenizer load once per
worker process (torch and transformers are imported only there, never by the rule scorers).
The score of a sample is the model's single logit (``num_labels=1``) at the last non-padding
token of ``prompt + response``; texts longer than the model's context are cut from the left,
so the response end is always seen.

Left out: pairwise / multi-head reward models, chat-template re-rendering (pass the prompt as
the engine saw it, template included), dtype options (the model's saved dtype is used).
"""

from __future__ import annotations

from typing import Any

_LOADED: dict[tuple[str, str], tuple[Any, Any]] = {}


def load_reward_model(path: str, device: str = "cpu") -> tuple[Any, Any]:
    """(model, tokenizer) for ``path`` on ``device``, cached per process."""
    key = (path, device)
    if key not in _LOADED:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
        if model.config.num_labels != 1:
            raise ValueError(
                f"reward.model.path: {path} has num_labels={model.config.num_labels}; a reward model has 1"
            )
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


def score_texts(path: str, device: str, texts: list[str]) -> list[float]:
    """One forward over ``texts`` (one batch); returns the scalar reward of each."""
    import torch

    model, tokenizer = load_reward_model(path, device)
    max_len = getattr(model.config, "max_position_embeddings", None) or tokenizer.model_max_length
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
