"""The worker processes of `megarl convert` (its orchestration: megarl/commands/convert.py).

Both directions go through the bridge, the same code that loads HF weights for training and
exports them for weight sync, and both end with a bit-for-bit check in the same processes:

- ``ExportRank`` (Megatron -> HF): the model is rebuilt with a layout (the run's, for a
  training checkpoint; the recorded or a chosen one, for a model checkpoint), its weights are
  loaded, and the weights go out through the weight-sync export (gather TP shards, collect PP
  stages, HF names and layouts) into safetensors files; then the written directory is
  imported back into a fresh model of the same layout and every parameter must equal the
  loaded one. The config and tokenizer files are copied from the model directory.
- ``ImportRank`` (HF -> Megatron): the HF weights are loaded into the layout's model (each rank
  reads only its slices), saved as a dist-checkpoint, then loaded back into a fresh model of
  the same layout and compared with the HF import.

A mismatch is a ConversionError, never a silent mis-conversion.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from megarl.config.rollout_sections import WeightSyncConfig
from megarl.config.train_sections import ActorConfig
from megarl.kept_files import write_atomically

INDEX = "model.safetensors.index.json"


class ConversionError(RuntimeError):
    """The written files do not reproduce the weights they were written from."""


def compare_parameters(expected: torch.nn.Module, got: torch.nn.Module, source: str,
                       counted: Callable[[torch.nn.Parameter], bool] = lambda _: True) -> int:  # fmt: skip
    """Every parameter of ``got`` must equal ``expected``'s bit for bit; returns how many of them
    ``counted`` (all by default) were checked."""
    want = dict(expected.named_parameters())
    checked = 0
    for name, param in got.named_parameters():
        if not torch.equal(param.detach().cpu(), want[name].detach().cpu()):
            diff = (param.detach().float().cpu() - want[name].detach().float().cpu()).abs().max()
            raise ConversionError(f"{source}: {name} differs from the converted weights after re-import (max |diff| {float(diff):.3g})")
        # The last stage's copy of tied embeddings (PP > 1; Megatron marks it shared) is one
        # parameter with the first stage's embedding: compared, not counted again.
        checked += 0 if getattr(want[name], "shared", False) or not counted(want[name]) else 1
    return checked  # this rank's parameters (its shards)


def verify_rebuilt(model: Any, path: str, actor_cfg: ActorConfig, dtype: torch.dtype, seed: int) -> int:
    """Build the weights at ``path`` (an HF directory or a model checkpoint just written) into a
    fresh model of ``model``'s layout; every parameter must equal ``model``'s (a MegatronModel;
    with LoRA, its adapters merged into its weights first: ``merge_into_base``).
    Returns how many of the model's parameters this rank is the one to count (:func:`counted_here`)."""
    from megarl.megatron_runtime.model import MegatronModel

    # Without adapters: the files hold a plain model (a LoRA model's merged into its weights, merge_into_base).
    rebuilt = MegatronModel.build(path, actor_cfg.model_copy(update={"lora": None}), dtype, seed)
    return compare_parameters(model.core, rebuilt.core, path, counted_here())


def counted_here() -> Callable[[torch.nn.Parameter], bool]:
    """Which of this rank's checked parameters count in the reported total: every rank compares
    its own, but a TP shard or a DP copy is no other parameter. A dense parameter counts on the
    first TP rank of the first data-parallel replica of its stage; an expert's (which Megatron
    marks ``allreduce=False`` at EP > 1: its copies are over the expert-data-parallel group, and
    other EP ranks, possibly of other DP replicas, hold the other experts) on the first
    expert-tensor-parallel rank of the first expert-data-parallel replica."""
    from megatron.core import parallel_state as ps

    dense = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0
    expert = ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0
    return lambda param: expert if not getattr(param, "allreduce", True) else dense


class ProgressFile:
    """Rank 0's ``done total`` in a file the driver polls for its progress bar (a Ray actor's output
    goes to its log, not the user's terminal). Written at most every ``every_s`` seconds, and at
    the end, by rename (the reader never sees half a line); other ranks write nothing."""

    def __init__(self, path: str | None, every_s: float = 0.5) -> None:
        import os

        self.path = path if path is not None and os.environ.get("RANK", "0") == "0" else None
        self.every_s, self._last = every_s, -float("inf")  # the first call writes, however long the machine has been up

    def __call__(self, done: int, total: int) -> None:
        import time

        if self.path is None or (done < total and time.monotonic() - self._last < self.every_s):
            return
        self._last = time.monotonic()
        write_atomically(self.path, f"{done} {total}\n")


class ConversionRank:
    """What ExportRank and ImportRank both answer (the controller calls them through
    megarl/actors/clients.py ``ConversionClient``, by these functions)."""

    def write(self, target: str) -> dict[str, float] | None:
        """The loaded weights in the other format under ``target`` (collective)."""
        raise NotImplementedError

    def verify(self, written: str) -> int:
        """Load ``written`` back into a fresh model; every parameter must be identical."""
        raise NotImplementedError

    def write_adapter(self, directory: str, base: str) -> None:
        """The LoRA adapters as an HF PEFT adapter directory (ExportRank of a LoRA checkpoint only)."""
        raise NotImplementedError


class ExportRank(ConversionRank):
    """One process of the Megatron -> HF group: the model of ``model_path`` in ``actor_cfg``'s
    layout, with the trained policy of ``checkpoint`` (a step_NNNNNN directory) loaded on top
    when given; else the weights of ``model_path`` itself (a model checkpoint)."""

    def __init__(self, model_path: str, actor_cfg: ActorConfig, dtype: str, seed: int, bucket_mb: float,
                 checkpoint: str | None = None, progress_file: str | None = None) -> None:  # fmt: skip
        from megarl.actors.policy import lora_base_identity
        from megarl.megatron_runtime.model import MegatronModel, dtype_of
        from megarl.megatron_runtime.training import check_lora_base, load_trained_weights
        from megarl.models.lora import lora_of

        self.actor_cfg, self.dtype, self.seed, self.bucket_mb = actor_cfg, dtype, seed, bucket_mb
        self.model_path = model_path
        # A training checkpoint's weights replace model_path's, which are not read at all; its
        # optimizer state is neither built nor read. model_path still gives config and tokenizer.
        # A LoRA checkpoint holds adapters only: model_path is their base, loaded and checked.
        lora = checkpoint is not None and actor_cfg.lora is not None
        self.model = MegatronModel.build(model_path, actor_cfg, dtype_of(dtype), seed, load_weights=checkpoint is None or lora)
        if checkpoint is not None:
            if lora:
                check_lora_base(Path(checkpoint) / "policy", lora_base_identity(self.model, model_path))
            load_trained_weights(self.model.core, Path(checkpoint) / "policy")
        adapters = lora_of(self.model.core)
        if adapters is not None:  # the export and its check: the merged model as plain weights
            self.adapters = adapters.peft_tensors()
            adapters.merge_into_base()
        self.rank = self.model.info.rank
        self.progress = ProgressFile(progress_file)

    def _export(self) -> Iterator[tuple[str, torch.Tensor]]:
        from megarl.models.bridge import has_value_head
        from megarl.weight_sync.stream import MIB

        bridge, core = self.model.bridge, self.model.core
        total = len(bridge.export_names(self.model.hf_config, has_value_head(core)))
        gather = int(WeightSyncConfig().gather_mb * MIB)  # TP gather groups as a push's by default
        tensors = bridge.export_hf_tensors(core, gather_bytes=gather, collect="leader")
        for done, item in enumerate(tensors, 1):
            yield item
            self.progress(done, total)

    def write(self, staging: str) -> dict[str, float]:
        """Export into ``staging/v0`` through the disk transport (collective; rank 0 writes)."""
        import torch.distributed as dist

        from megarl.weight_sync.stream import WeightStream
        from megarl.weight_sync.transports import DiskTransport

        stream = WeightStream(self._export, self.bucket_mb)
        disk = DiskTransport(stream, staging, writer=self.rank == 0, hf_dir=self.model_path,
                             engines_of=lambda _: [], barrier=dist.barrier)  # fmt: skip
        disk.connect(None)
        return disk.push(0)

    def verify(self, hf_dir: str) -> int:
        """Import ``hf_dir`` into a fresh model of this layout; every parameter must be identical."""
        from megarl.megatron_runtime.model import dtype_of

        return verify_rebuilt(self.model, hf_dir, self.actor_cfg, dtype_of(self.dtype), self.seed)

    def write_adapter(self, directory: str, base: str) -> None:
        """A LoRA checkpoint's adapters as an HF PEFT adapter directory of the HF model ``base``
        (rank 0 writes; every rank holds the full adapters, gathered when the model was loaded)."""
        from megarl.models.lora import write_peft_adapter

        assert self.actor_cfg.lora is not None
        if self.rank == 0:
            write_peft_adapter(directory, self.adapters, self.actor_cfg.lora, base)


class ImportRank(ConversionRank):
    """One process of the HF -> Megatron group: the HF model in ``actor_cfg``'s layout."""

    def __init__(self, hf_dir: str, actor_cfg: ActorConfig, dtype: str, seed: int, progress_file: str | None = None) -> None:
        from megarl.megatron_runtime.model import MegatronModel, dtype_of

        self.actor_cfg, self.dtype, self.seed = actor_cfg, dtype, seed
        self.model = MegatronModel.build(hf_dir, actor_cfg, dtype_of(dtype), seed, progress=ProgressFile(progress_file))

    def write(self, weights_dir: str) -> None:
        """The loaded weights as a dist-checkpoint in ``weights_dir`` (collective)."""
        from megarl.checkpoint.model_checkpoint import save_model_weights

        save_model_weights(self.model.core, weights_dir)

    def verify(self, checkpoint_dir: str) -> int:
        """Load the finished model checkpoint into a fresh model; every parameter must equal the HF import."""
        from megarl.megatron_runtime.model import dtype_of

        return verify_rebuilt(self.model, checkpoint_dir, self.actor_cfg, dtype_of(self.dtype), self.seed)


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
