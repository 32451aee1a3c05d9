"""Shared fixtures of the data tests: tiny tokenizers saved once as real HF directories."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from megarl.data.datasets import write_prompt_file


def _saved_tokenizer(root: Path, task_vocab: str | None) -> Any:
    from transformers import AutoTokenizer

    from megarl.models.tiny import build_tokenizer

    build_tokenizer(task_vocab).save_pretrained(root)
    return AutoTokenizer.from_pretrained(str(root))


@pytest.fixture(scope="session")
def digit_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("digit_tok")
    _saved_tokenizer(root, "0123456789")
    return root


@pytest.fixture(scope="session")
def digit_tokenizer(digit_tokenizer_dir: Path) -> Any:
    """One token per digit, the demo's task template."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(digit_tokenizer_dir))


@pytest.fixture(scope="session")
def byte_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("byte_tok")
    _saved_tokenizer(root, None)
    return root


@pytest.fixture(scope="session")
def byte_tokenizer(byte_tokenizer_dir: Path) -> Any:
    """Byte-level, ChatML template (ASCII text: one token per character)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(byte_tokenizer_dir))


def make_rows(prompts: list[Any], source: str = "src", truths: list[Any] | None = None) -> list[dict[str, Any]]:
    """verl-schema rows with the given prompts (ground truth = the row number as text by default)."""
    truths = truths if truths is not None else [str(i) for i in range(len(prompts))]
    return [
        {
            "data_source": source,
            "prompt": p,
            "ability": "test",
            "reward_model": {"ground_truth": t, "style": "rule"},
            "extra_info": {"index": i},
        }
        for i, (p, t) in enumerate(zip(prompts, truths, strict=True))
    ]


@pytest.fixture
def prompt_file(tmp_path: Path) -> Callable[..., Path]:
    """``prompt_file(name, prompts, source=..., truths=...)`` writes a verl-schema parquet file."""

    def write(name: str, prompts: list[Any], **kw: Any) -> Path:
        return write_prompt_file(make_rows(prompts, **kw), tmp_path / name)

    return write
