"""A training checkpoint -> a Hugging Face model directory, verified (the workers of `megarl convert`,
whose orchestration is megarl/commands/convert.py).

The policy group is rebuilt with the run's own layout (from the run's config.yaml), the
checkpoint is loaded, and the weights go out through the same export as weight sync (gather TP
shards, collect PP stages, HF names and layouts). Then the written directory is imported back
through the bridge into a fresh model of the same layout and every parameter must equal the
trained one bit for bit; a mismatch is an error, never a silent mis-conversion. The model's
config and tokenizer files are copied from ``model.path``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megarl.config.sections import MegaRLConfig

INDEX = "model.safetensors.index.json"


class ConversionError(RuntimeError):
    """The exported directory does not reproduce the trained weights."""


class ExportRank:
    """One process of the conversion group: the trained policy, restored from the checkpoint."""

    def __init__(self, cfg: MegaRLConfig, checkpoint: str) -> None:
        from megarl.actors.policy import PolicyWorker

        self.cfg = cfg
        self.policy = PolicyWorker(cfg.model.path, cfg.actor, cfg.model.dtype, cfg.trainer.seed, total_optimizer_steps=1)
        self.policy.load(Path(checkpoint) / "policy")
        self.rank = self.policy.info.rank

    def write(self, staging: str) -> dict[str, float]:
        """Export into ``staging/v0`` through the disk transport (collective; rank 0 writes)."""
        import torch.distributed as dist

        from megarl.rollout.transports import DiskTransport
        from megarl.rollout.weight_stream import WeightStream

        stream = WeightStream(self.policy.export_weights, self.cfg.rollout.weight_sync.bucket_mb)
        disk = DiskTransport(stream, staging, writer=self.rank == 0, hf_dir=self.cfg.model.path,
                             engines_of=lambda _: [], barrier=dist.barrier)  # fmt: skip
        disk.connect(None)
        return disk.push(0)

    def verify(self, hf_dir: str) -> int:
        """Import ``hf_dir`` into a fresh model of this layout; every parameter must be identical."""
        from megarl.actors.reference import ReferenceWorker

        imported = ReferenceWorker(hf_dir, self.cfg.actor, self.cfg.model.dtype, self.cfg.trainer.seed)
        trained = dict(self.policy.model.core.named_parameters())
        checked = 0
        for name, param in imported.model.core.named_parameters():
            if not torch.equal(param.detach().cpu(), trained[name].detach().cpu()):
                diff = (param.detach().float().cpu() - trained[name].detach().float().cpu()).abs().max()
                raise ConversionError(f"{hf_dir}: {name} differs from the trained weights after re-import (max |diff| {float(diff):.3g})")
            checked += 1
        return checked  # this rank's parameters


def write_index(directory: Path) -> None:
    """The weight map transformers needs to load a directory of several safetensors files."""
    from safetensors import safe_open

    weight_map, total = {}, 0
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                weight_map[key] = path.name
                t = f.get_slice(key)
                total += _numel(t.get_shape()) * _dtype_bytes(t.get_dtype())
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _dtype_bytes(name: str) -> int:
    return {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8, "I32": 4}.get(name, 4)
