"""What a Hugging Face model directory holds besides its weights, and which of those files
megarl copies into the directories it writes (disk weight pushes, `megarl convert` outputs,
model checkpoints). Torch-free: the config checks read it (tokenizer_files_problem imports
transformers only for a directory without a tokenizer.json)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

# The tokenizer vocabularies of the causal LMs megarl writes (fast, sentencepiece, BPE); which
# files a directory's tokenizer needs is tokenizer_files_problem's to say.
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")

HF_SIDE_FILES = ("config.json", "generation_config.json", *TOKENIZER_VOCAB_FILES, "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "merges.txt",
                 "added_tokens.json")  # fmt: skip


def copy_side_files(source: Path, target: Path) -> None:
    """The HF_SIDE_FILES ``source`` has, copied into ``target`` (SGLang loads a pushed version as a model)."""
    for name in HF_SIDE_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)


# Where config.json names its weights' dtype: transformers 5 writes ``dtype``, 4.x ``torch_dtype``.
CONFIG_DTYPE_KEYS = ("dtype", "torch_dtype")


def config_dtype(config: dict[str, Any]) -> Any:
    """The dtype config.json names for its weights (``dtype`` first, as transformers 5 reads it);
    None when it names none."""
    return next((config[k] for k in CONFIG_DTYPE_KEYS if config.get(k) is not None), None)


def set_config_dtype(directory: Path, dtype: str) -> None:
    """Make ``directory``'s config.json name ``dtype`` (e.g. "float32") as its weights' dtype.
    transformers (by default from version 5) and SGLang load a model in its config's dtype, so
    fp32 weights beside a config.json copied from a bf16 model would be rounded to bf16 at load.
    Every dtype key present is set (transformers 5 prefers ``dtype`` when both are); a config
    with none gets ``torch_dtype``, which every transformers version reads."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    keys = [k for k in CONFIG_DTYPE_KEYS if k in config] or ["torch_dtype"]
    if all(config.get(k) == dtype for k in keys):
        return  # left byte for byte as copied
    config.update(dict.fromkeys(keys, dtype))
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# Tokenizer classes tokenizer_config.json may name that read any vocabulary (transformers 5 writes
# TokenizersBackend): what the model type's class reads is enough for them.
GENERIC_TOKENIZERS = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def tokenizer_files_problem(path: Path) -> str | None:
    """Why AutoTokenizer would find no tokenizer files in the HF directory ``path``, as a clause
    ("has no tokenizer files: ..."), or None; no tokenizer is loaded. A tokenizer.json is enough
    (save_pretrained writes one from a fast tokenizer, which AutoTokenizer loads back from it
    alone). Without one, transformers' own tables say which files: the tokenizer class that
    tokenizer_config.json names, else AutoTokenizer's class for config.json's model_type, else
    its fallback, and that class's ``vocab_files_names`` (vocab.txt for BERT, spm.model for
    DeBERTa-v2, vocab.json + merges.txt for GPT-2). transformers is imported only then."""
    if (path / "tokenizer.json").is_file():
        return None
    tokenizer_config = _json_object(path / "tokenizer_config.json")
    if tokenizer_config.get("auto_map"):
        return None  # the model's own tokenizer code decides what it reads
    classes, named = _tokenizer_classes(tokenizer_config.get("tokenizer_class"), _json_object(path / "config.json"))
    options = _file_options(classes)
    if any(all((path / name).is_file() for name in option) for option in options):
        return None
    wanted = " or ".join(" + ".join(option) for option in options)
    return f"has no tokenizer files: {named} reads {wanted}"


def token_ids_problem(tokenizer: Any, rows: int | None, own: Any | None, whose: str) -> str | None:
    """Why a model with ``rows`` token embeddings and tokenizer ``own`` (None: it has none)
    cannot read the token ids ``tokenizer`` (``whose``: e.g. "model.path's") makes, as a clause,
    or None: fewer rows than the tokenizer has tokens, or base-vocabulary tokens with other ids
    (another model family). Added tokens are not compared: models of one family rename their
    reserved special tokens (Llama 3 and 3.1), and a policy's own added tokens have rows anyway."""
    if rows is not None and len(tokenizer) > rows:
        return f"has {rows} token embeddings (config.json's vocab_size), fewer than the {len(tokenizer)} tokens of {whose} tokenizer"
    if own is None:
        return None
    added, theirs = set(tokenizer.get_added_vocab()), own.get_vocab()
    base = {t: i for t, i in tokenizer.get_vocab().items() if t not in added}
    moved = sorted((i, t, theirs[t]) for t, i in base.items() if t in theirs and theirs[t] != i)
    if not moved:
        return None
    mine, token, its = moved[0]
    return (f"has another tokenizer: {len(moved)} of the {len(base)} base tokens of {whose} tokenizer have other ids in "
            f"its own (e.g. {token!r} is {mine} in {whose}, {its} in its own)")


def _json_object(file: Path) -> dict:
    try:
        value = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _tokenizer_classes(name: Any, config: dict) -> tuple[list[type], str]:
    """The classes AutoTokenizer may build (slow and fast where transformers 4 has both), and
    which they are, in words."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import (
        TOKENIZER_MAPPING_NAMES,
        tokenizer_class_from_name,
    )

    entry = TOKENIZER_MAPPING_NAMES.get(str(config.get("model_type")))
    typed = list(entry) if isinstance(entry, tuple) else [entry]  # transformers 4: (slow, fast)
    names: list[str | None]  # (a None among them is skipped below)
    if isinstance(name, str) and name:
        names, named = [name, f"{name.removesuffix('Fast')}Fast"], f"{name} (tokenizer_config.json)"
        if name in GENERIC_TOKENIZERS:  # no vocabulary format of its own: the model type's files load too
            names += typed
    else:
        names, named = typed, f"the tokenizer of a {config.get('model_type')} model"
    classes = [cls for cls in (tokenizer_class_from_name(n) for n in names if n) if cls is not None]
    if not classes:  # what AutoTokenizer falls back to
        return [PreTrainedTokenizerFast], "a fast tokenizer"
    return classes, named


def _file_options(classes: list[type]) -> list[tuple[str, ...]]:
    """The sets of files any of ``classes`` loads from (each set complete on its own)."""
    options: list[tuple[str, ...]] = [("tokenizer.json",)]
    for cls in classes:
        files = tuple(name for key, name in getattr(cls, "vocab_files_names", {}).items() if key != "tokenizer_file")
        if files and files not in options:
            options.append(files)
    return options
