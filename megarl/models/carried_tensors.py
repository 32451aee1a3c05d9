"""HF tensors that no Megatron parameter holds and `megarl convert` carries through untouched:
DeepSeek-V3's multi-token-prediction layers (``model.layers.{L + j}.*``; which tensors a bridge
carries is its ``carried_names``, megarl/models/deepseek_v3.py).

hf-to-megatron copies them, bytes and dtypes as they are, into :data:`CARRIED_FILE` beside the
dist-checkpoint; megatron-to-hf writes that file back as one more safetensors shard of the HF
directory (:data:`HF_CARRIED_FILE`, listed in the index), so HF -> Megatron -> HF keeps them bit
for bit. Training does not touch them: a policy trained by megarl is exported with the MTP layers
it started from (a run checkpoint takes them from ``model.path``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

CARRIED_FILE = "carried_tensors.safetensors"  # in a model checkpoint
HF_CARRIED_FILE = "model-carried.safetensors"  # in an HF directory megarl writes


def carried_tensors(hf_dir: Path) -> dict:
    """The carried tensors of the HF model at ``hf_dir`` by name (none for most models)."""
    from transformers import AutoConfig

    from megarl.models.bridges import get_bridge
    from megarl.models.safetensors_reader import SafetensorsReader

    hf_config = AutoConfig.from_pretrained(str(hf_dir))
    reader = SafetensorsReader(str(hf_dir))
    return {n: reader.read(n) for n in sorted(get_bridge(hf_config).carried_names(hf_config, reader.names()))}


def save_carried(hf_dir: Path, checkpoint_dir: Path) -> int:
    """Copy ``hf_dir``'s carried tensors into ``checkpoint_dir``/CARRIED_FILE; how many (0: no file)."""
    from safetensors.torch import save_file

    tensors = carried_tensors(hf_dir)
    if tensors:
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(checkpoint_dir / CARRIED_FILE), metadata={"format": "pt"})
    return len(tensors)


def write_carried(source: Path, hf_out: Path) -> int:
    """Put the carried tensors of ``source`` (a model checkpoint with CARRIED_FILE, or an HF
    directory) into the HF directory ``hf_out`` as HF_CARRIED_FILE, before its index is written;
    how many files (0 or 1)."""
    if (source / CARRIED_FILE).is_file():
        shutil.copyfile(source / CARRIED_FILE, hf_out / HF_CARRIED_FILE)
        return 1
    if not (source / "config.json").is_file() or not any(source.glob("*.safetensors")):
        return 0
    from safetensors.torch import save_file

    tensors = carried_tensors(source)
    if tensors:
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(hf_out / HF_CARRIED_FILE), metadata={"format": "pt"})
    return int(bool(tensors))
