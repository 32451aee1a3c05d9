"""What says, cheaply, which weights a model directory holds (and whether it holds any): read by the resume checks of
`megarl launch` (is model.path still the model the run was trained from?) and `megarl generate`
(are the weights at --model still those the written parts were generated with?)."""

from __future__ import annotations

import hashlib
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".distcp", ".bin")
HF_WEIGHT_SUFFIXES = (".safetensors", ".bin")  # what transformers and SGLang load an HF directory's weights from


def has_hf_weights(model_dir: Path) -> bool:
    """Whether an HF directory holds weight files (one file, or shards with or without an index)."""
    return any(p.suffix in HF_WEIGHT_SUFFIXES and p.is_file() for p in model_dir.iterdir())


def weights_fingerprint(model_dir: Path, edge: int = 1 << 20) -> list[tuple[str, int, str]]:
    """Each weight file's name, size and a hash of its first and last MiB: a fine-tuned model
    and its base have the same names and sizes but not the same bytes; reads a few MiB."""
    out = []
    for path in sorted(p for p in model_dir.rglob("*") if p.suffix in WEIGHT_SUFFIXES and p.is_file()):
        size = path.stat().st_size
        with path.open("rb") as f:
            digest = hashlib.sha256(f.read(edge))
            f.seek(max(0, size - edge))
            digest.update(f.read(edge))
        out.append((str(path.relative_to(model_dir)), size, digest.hexdigest()))
    return out
