"""A trainable Megatron model: DDP, optimizer, LR schedule, the update loop, checkpoints, offload.

Shared by the policy and the critic (they differ only in their head and loss). Wraps a
:class:`MegatronModel` in Megatron's ``DistributedDataParallel`` with a SUMMING gradient
reduction (``calculate_per_token_loss=True`` makes DDP skip its 1/DP pre-scaling, and
``average_in_collective=False``), so that ``finalize_model_grads`` can divide by the global
token/sequence count once.

``train``: for each of ``ppo_epochs`` passes, the batch is cut into consecutive mini-batches of
``mini_batch_size`` samples (all DP ranks together; no shuffling, so runs are reproducible), and
each mini-batch is one optimizer step: zero grads, set the step's LR, forward+backward over the
replica's micro-batches, clip, step, advance the schedule.

Checkpoints are Megatron ``dist_checkpointing`` directories (torch_dist format) holding the
model's and the optimizer's sharded state dicts plus the schedule's step counter. The
dist-checkpoint writer starts helper processes with "spawn": a script that saves must guard its
entry point with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from megarl.actors.megatron_runtime.micro_batches import MicroBatch
from megarl.actors.megatron_runtime.model import MegatronModel, merge_metric, metric_value
from megarl.actors.megatron_runtime.offload import (
    StorageOffloader,
    model_tensors,
    on_device,
    optimizer_tensors,
)
from megarl.actors.megatron_runtime.optim import LRSchedule, build_optimizer
from megarl.config.sections import ActorConfig
from megarl.data.batch import Batch

# Distributed-optimizer state saved per DP buffer: fully parallel, no gather; a resume keeps
# TP/PP (DP may change). megatron-core 0.16 refuses its default (flattened-range) format.
CHECKPOINT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}

LossHead = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


class TrainableModel:
    """DDP-wrapped :class:`MegatronModel` with optimizer and schedule (see module docstring)."""

    def __init__(self, model: MegatronModel, cfg: ActorConfig, dtype: torch.dtype, total_optimizer_steps: int | None) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        self.model = model
        self.cfg = cfg
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=cfg.optimizer.distributed,
            average_in_collective=False,  # a sum: finalize_model_grads divides by the global count
        )
        model.module = DistributedDataParallel(config=model.tcfg, ddp_config=ddp_cfg, module=model.module)
        self.optimizer = build_optimizer(cfg.optimizer, [model.module], dtype)
        if dtype == torch.float16:
            model.tcfg.grad_scale_func = self.optimizer.scale_loss
        self.schedule = LRSchedule(cfg.optimizer, total_optimizer_steps)
        self._offloader = StorageOffloader()

    # ---- the update loop --------------------------------------------------------------------
    def train(self, batch: Batch, loss_head: LossHead, *, mini_batch_size: int | None, ppo_epochs: int | None) -> dict[str, float]:
        """Optimizer steps over ``batch`` (see module docstring); metrics equal on every rank.

        Returns each loss metric as global ``sum / count`` over all steps (``*_max`` / ``*_min``:
        the extreme), ``grad_norm`` (mean over
        steps), ``lr`` (of the last step), ``optimizer_steps`` and ``skipped_steps``.
        """
        size = mini_batch_size or self.cfg.mini_batch_size or len(batch)
        epochs = ppo_epochs or self.cfg.ppo_epochs
        if len(batch) % size:
            raise ValueError(
                f"mini_batch_size ({size}) must divide the number of samples in the step ({len(batch)}); "
                f"pick a divisor of {len(batch)}"
            )
        totals: dict[str, tuple[float, float]] = {}
        grad_norms: list[float] = []
        skipped, lr = 0, self.schedule.current_lr
        for _ in range(epochs):
            for mini in batch.split(size):
                parts, grad_norm, ok, lr = self._step(mini, loss_head)
                for name, pair in parts.items():
                    totals[name] = merge_metric(name, totals[name], pair) if name in totals else pair
                if ok:
                    grad_norms.append(grad_norm)
                skipped += 0 if ok else 1
        metrics = {name: metric_value(name, pair) for name, pair in totals.items()}
        metrics["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
        metrics["lr"] = lr
        metrics["optimizer_steps"] = float(epochs * (len(batch) // size))
        metrics["skipped_steps"] = float(skipped)
        return metrics

    def _step(self, mini: Batch, loss_head: LossHead) -> tuple[dict[str, tuple[float, float]], float, bool, float]:
        self.model.module.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self.schedule.apply(self.optimizer)
        parts = self.model.forward_backward(
            mini, loss_head, micro_batch_size=self.cfg.micro_batch_size, max_tokens=self.cfg.max_tokens_per_gpu
        )
        ok, grad_norm, _ = self.optimizer.step()
        self.schedule.advance()
        return parts, float(grad_norm) if grad_norm is not None else float("nan"), bool(ok), lr

    # ---- checkpoints ------------------------------------------------------------------------
    def _sharded_state(self, is_loading: bool) -> dict[str, Any]:
        model_sd = self.model.core.sharded_state_dict(metadata=CHECKPOINT_METADATA)
        return {
            "model": model_sd,
            "optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=CHECKPOINT_METADATA),
            "schedule": self.schedule.state_dict(),
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write a dist-checkpoint of model + optimizer + schedule into directory ``path`` (collective)."""
        from megatron.core import dist_checkpointing

        os.makedirs(path, exist_ok=True)
        dist_checkpointing.save(self._sharded_state(is_loading=False), str(path))

    def load(self, path: str | os.PathLike) -> None:
        """Restore what :meth:`save` wrote (collective; same TP/PP/DP layout or a reshardable one)."""
        from megatron.core import dist_checkpointing

        if not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoint directory {path} does not exist")
        _materialise_optimizer_state(self.optimizer)
        state = dist_checkpointing.load(self._sharded_state(is_loading=True), str(path))
        # no_grad: with fp32 params the optimizer's main params are views of the model's leaf
        # params, which Megatron's loader fills in place.
        with torch.no_grad():
            self.model.core.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        _restore_adam_steps(self.optimizer, state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])

    # ---- offload ----------------------------------------------------------------------------
    def offload(self) -> int:
        """Params, grads and optimizer state to host memory (CUDA only; a no-op on CPU).
        Returns the bytes moved."""
        device = self.model.info.device
        if device.type == "cpu" or self._offloader.offloaded:
            return 0
        tensors = list(model_tensors(self.model.module)) + list(optimizer_tensors(self.optimizer))
        return self._offloader.offload(on_device(tensors, device))

    def onload(self) -> None:
        """Undo :meth:`offload` (no-op when nothing is offloaded)."""
        self._offloader.onload()


def _materialise_optimizer_state(optimizer: Any) -> None:
    """Give a never-stepped optimizer its state tensors (``step``, moments) so that Megatron can
    describe them for loading (without apex/TE it reads ``step`` from the state). A step with
    zero gradients, zero LR and zero weight decay changes no parameter; the load overwrites it."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        if len(inner.state) > 0:
            continue
        saved = [(g["lr"], g.get("weight_decay", 0.0)) for g in inner.param_groups]
        for group in inner.param_groups:
            group["lr"], group["weight_decay"] = 0.0, 0.0
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        inner.step()
        for group, (lr, wd) in zip(inner.param_groups, saved):
            group["lr"], group["weight_decay"] = lr, wd
            for p in group["params"]:
                p.grad = None


def _restore_adam_steps(optimizer: Any, loaded: Any) -> None:
    """Set torch Adam's per-parameter ``step`` to the checkpoint's value, one tensor each.

    Without apex/TE, Megatron keeps the step in the saved param groups; on load (0.16) the value
    did not reach an already materialised state (seen in the checkpoint test), and on a fresh
    state it assigns one tensor to all parameters, which Adam then increments in place."""
    steps: set[float] = set()

    def collect(node: Any) -> None:
        if isinstance(node, dict):
            for group in node.get("param_groups", []) if isinstance(node.get("param_groups"), list) else []:
                if "step" in group and group["step"] is not None:
                    steps.add(float(group["step"]))
            for value in node.values():
                collect(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                collect(value)

    collect(loaded)
    if not steps:
        return
    assert len(steps) == 1, steps
    step = steps.pop()
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for param_state in opt.optimizer.state.values():
            if "step" in param_state:
                param_state["step"] = torch.tensor(step, dtype=torch.float32)


class TrainedWorker:
    """What every trained worker (policy, critic) exposes of its TrainableModel ``self.trainer``."""

    trainer: TrainableModel

    def save(self, path: str | os.PathLike) -> None:
        """Dist-checkpoint of model, optimizer and LR schedule into directory ``path`` (collective)."""
        self.trainer.save(path)

    def load(self, path: str | os.PathLike) -> None:
        self.trainer.load(path)

    def offload(self) -> int:
        """Params, grads and optimizer state to host memory (CUDA; no-op on CPU); bytes moved."""
        return self.trainer.offload()

    def onload(self) -> None:
        self.trainer.onload()
