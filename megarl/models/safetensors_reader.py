"""Read slices of tensors from an HF model directory's safetensors shards, without loading them.

``model.safetensors`` or ``model.safetensors.index.json`` + shards. :class:`SafetensorsReader`
opens files lazily with ``safe_open`` and reads only the requested row / column range of a
tensor, so a rank loads its own TP shard of its own PP stage and nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open


class SafetensorsReader:
    def __init__(self, hf_path: str | Path) -> None:
        self.path = Path(hf_path)
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"no *.safetensors (nor model.safetensors.index.json) in {self.path}; "
                    f"use a Hugging Face model directory saved with safetensors"
                )
            weight_map = {}
            for f in files:
                with _open(f) as h:
                    weight_map.update({k: f.name for k in h.keys()})
        self.weight_map = weight_map
        self._handles: dict[str, object] = {}

    def names(self) -> set[str]:
        return set(self.weight_map)

    def _slice(self, name: str):
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} is not in the safetensors files of {self.path}")
        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = _open(self.path / file)
        return self._handles[file].get_slice(name)  # type: ignore[attr-defined]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str) -> torch.Tensor:
        return self._slice(name)[:]

    def read_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows ``[start, end)`` of dim 0 (works for 1-D and 2-D tensors)."""
        return self._slice(name)[start:end]

    def read_cols(self, name: str, start: int, end: int) -> torch.Tensor:
        """Columns ``[start, end)`` of dim 1 of a 2-D tensor."""
        return self._slice(name)[:, start:end]


def _open(file: Path):
    """``safe_open`` of ``file``; a file that is not whole safetensors (a download or copy cut
    short) raises ValueError naming it, not safetensors' own error without the file's name."""
    try:
        return safe_open(file, framework="pt")
    except SafetensorError as exc:
        raise ValueError(f"{file} is not a readable safetensors file ({exc}); it may be truncated: copy or "
                         "download it again") from None
