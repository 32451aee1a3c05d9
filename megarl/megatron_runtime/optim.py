"""Optimizer and learning-rate schedule of a Megatron worker, built from ``OptimizerConfig``.

The optimizer is Megatron's own (``get_megatron_optimizer``: Adam, fp32 main params and grads,
optionally the distributed optimizer that shards state over DP, global grad-norm clipping).
Megatron takes TE's or apex's FusedAdam whenever either package imports, torch's Adam/AdamW
otherwise; the two keep Adam's step count in different places, and :func:`adam_step_layout`
says where for the checkpoint restore (anything else is refused when the optimizer is built).

The schedule is ours, because Megatron's ``OptimizerParamScheduler`` warms up from an initial
LR at step 0 (a wasted step at ``init_lr = 0``) and wants its decay horizon up front. Here:

- warm-up: the ``k``-th optimizer step (``k = 0, 1, ...``) uses ``lr * (k + 1) / warmup_steps``
  while ``k < warmup_steps`` (``warmup_steps`` = ``int(warmup_ratio * total_steps)`` when the
  ratio is set);
- then ``constant`` stays at ``lr``; ``linear`` / ``cosine`` go from ``lr`` to ``min_lr``
  (``min_lr_ratio * lr`` when set) over the remaining ``total_steps - warmup_steps`` steps and
  stay at ``min_lr`` afterwards;
- ``wsd`` (verl's ``get_wsd_schedule_with_warmup``): of the ``remaining`` steps after warm-up,
  ``int(remaining * (1 - wsd_decay_ratio))`` stay at ``lr``, the others decay as ``cosine`` does
  (over their own count), then ``min_lr``.

The LR is a function of the step count alone, so a resume that restores ``step_count`` (and
has the same total steps) continues the schedule exactly.

``LRSchedule.apply`` writes the LR (times each group's ``lr_mult``) and weight decay (times
``wd_mult``) into the optimizer's param groups, honouring Megatron's per-group multipliers, and
Adam's betas and eps (a checkpoint's load puts back the groups it was saved with).
Its ``state_dict`` is a plain dict (the step counter) for checkpoints.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from megarl.config.train_sections import OptimizerConfig


class LRSchedule:
    """Warm-up then constant / linear / cosine / warmup-stable-decay to ``min_lr`` (see module docstring)."""

    def __init__(self, cfg: OptimizerConfig, total_steps: int | None = None) -> None:
        self.warmup_steps = cfg.warmup_steps_of(total_steps)
        if cfg.schedule != "constant" and (total_steps is None or total_steps <= self.warmup_steps):
            raise ValueError(
                f"actor.optimizer.schedule={cfg.schedule!r} needs the total number of optimizer "
                f"steps (> warmup_steps={self.warmup_steps}) to decay over, got {total_steps}; "
                f"pass total_optimizer_steps to the worker or use schedule='constant'"
            )
        if cfg.min_lr > cfg.lr:
            raise ValueError(f"actor.optimizer.min_lr ({cfg.min_lr}) must not exceed lr ({cfg.lr})")
        self.cfg = cfg
        self.min_lr = cfg.final_lr
        self.total_steps = total_steps
        # wsd: steps at lr after the warm-up, before the decay (verl's int(remaining x stable_ratio))
        remaining = (total_steps or 0) - self.warmup_steps
        self.stable_steps = int(remaining * (1.0 - cfg.wsd_decay_ratio)) if cfg.schedule == "wsd" else 0
        self.step_count = 0  # optimizer steps taken so far

    def lr_at(self, step: int) -> float:
        """The LR of the ``step``-th optimizer step (0-based)."""
        cfg, warmup = self.cfg, self.warmup_steps
        if step < warmup:
            return cfg.lr * (step + 1) / warmup
        if cfg.schedule == "constant":
            return cfg.lr
        assert self.total_steps is not None
        start = warmup + self.stable_steps  # where the decay starts (wsd: after its stable phase)
        if step < start:
            return cfg.lr
        frac = min(1.0, (step - start) / (self.total_steps - start))
        if cfg.schedule == "linear":
            scale = 1.0 - frac
        else:  # cosine, wsd
            scale = 0.5 * (1.0 + math.cos(math.pi * frac))
        return self.min_lr + (cfg.lr - self.min_lr) * scale

    @property
    def current_lr(self) -> float:
        return self.lr_at(self.step_count)

    def apply(self, optimizer: Any) -> float:
        """Set the current step's LR, weight decay and Adam's betas and eps on every param group;
        returns the LR. Betas and eps too: loading a checkpoint puts back the param groups it
        was saved with, and a resumed run trains with its own config's values."""
        lr = self.current_lr
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.cfg.weight_decay * group.get("wd_mult", 1.0)
            group["betas"] = tuple(self.cfg.betas)
            group["eps"] = self.cfg.eps
        return lr

    def advance(self) -> None:
        self.step_count += 1

    def state_dict(self) -> dict[str, int]:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step_count = int(state["step_count"])


FP16_INITIAL_LOSS_SCALE = 2.0**16


def megatron_optimizer_config(cfg: OptimizerConfig, *, bf16: bool, fp16: bool) -> Any:
    """Megatron's ``OptimizerConfig`` for our section (Adam; fp32 main params and grads)."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig

    return MegatronOptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.final_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.betas[0],
        adam_beta2=cfg.betas[1],
        adam_eps=cfg.eps,
        clip_grad=cfg.clip_grad,
        bf16=bf16,
        fp16=fp16,
        params_dtype=torch.bfloat16 if bf16 else (torch.float16 if fp16 else torch.float32),
        use_distributed_optimizer=cfg.distributed,
        # fp16's dynamic loss scale starts where torch's GradScaler and DeepSpeed's start, not at
        # Megatron's pretraining 2**32: every halving down from there skips a whole RL step
        # (a tiny CPU run skipped its first 21 steps; 5 from 2**16).
        initial_loss_scale=FP16_INITIAL_LOSS_SCALE,
    )


def build_optimizer(cfg: OptimizerConfig, model_chunks: list[Any], dtype: torch.dtype) -> Any:
    """Megatron's optimizer over DDP-wrapped ``model_chunks`` (the model's dtype picks mixed
    precision). Refuses, at build time, an Adam whose checkpoint restore megarl cannot make exact."""
    from megatron.core.optimizer import get_megatron_optimizer

    mcfg = megatron_optimizer_config(cfg, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    optimizer = get_megatron_optimizer(mcfg, model_chunks)
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        if chained.optimizer is not None:  # None on a rank without parameters
            adam_step_layout(chained.optimizer)
    return optimizer


AdamStepLayout = Literal["per_param", "per_group"]
# Where Megatron's Adam classes keep the step count (the bias correction of the next update):
# torch Adam/AdamW (no TE/apex installed) a tensor per parameter state; TE's and apex's
# FusedAdam (picked by megatron-core whenever either is importable) an int per param group.
_FUSED_ADAM_PACKAGES = ("transformer_engine", "apex")


def adam_step_layout(torch_optimizer: Any) -> AdamStepLayout:
    """``per_param`` (torch Adam/AdamW) or ``per_group`` (TE/apex FusedAdam); ValueError for
    any other class, whose state layout megarl's checkpoint restore does not know."""
    if isinstance(torch_optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return "per_param"
    cls = type(torch_optimizer)
    if cls.__name__ == "FusedAdam" and cls.__module__.split(".")[0] in _FUSED_ADAM_PACKAGES:
        return "per_group"
    raise ValueError(
        f"megatron-core built a {cls.__module__}.{cls.__qualname__} optimizer; megarl restores "
        f"checkpoints exactly only for torch Adam/AdamW and TE/apex FusedAdam, so it refuses to "
        f"train with it (install neither TE nor apex, or use a megatron-core that picks one of those)"
    )
