"""What a Hugging Face model directory holds besides its weights, and which of those files
megarl copies into the directories it writes (disk weight pushes, `megarl convert` outputs,
model checkpoints). Torch-free: the config checks read it."""

from __future__ import annotations

import shutil
from pathlib import Path

# One of them holds any HF tokenizer's vocabulary (fast tokenizers, sentencepiece, BPE).
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")

HF_SIDE_FILES = ("config.json", "generation_config.json", *TOKENIZER_VOCAB_FILES, "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "merges.txt",
                 "added_tokens.json")  # fmt: skip


def copy_side_files(source: Path, target: Path) -> None:
    """The HF_SIDE_FILES ``source`` has, copied into ``target`` (SGLang loads a pushed version as a model)."""
    for name in HF_SIDE_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
