"""The disk a run saves to, checked before Ray starts: trainer.output_dir's filesystem must have
room for one save (the checkpoint's estimated size, or the run's newest checkpoint's when larger,
plus the margins a save asks for: megarl/checkpoint/manager.py space_for_a_save), the very check
each save makes again before writing. Torch-free, like the planner. Left out: the later saves
(retention frees space as it goes; each save checks its own) and the other files of a run
(metrics, logs), which the margin covers."""

from __future__ import annotations

import shutil
from pathlib import Path

from megarl.checkpoint.manager import newest_checkpoint_bytes, space_shortfall
from megarl.config.architectures import ArchError, resolve_arch
from megarl.config.sections import MegaRLConfig
from megarl.plan.gpu_memory import DTYPE_BYTES, lora_params
from megarl.plan.issues import Finding

OPTIMIZER_BYTES = 12  # per trained parameter: its fp32 master copy and Adam's two moments


def checkpoint_bytes(cfg: MegaRLConfig) -> int:
    """The estimated size of one checkpoint of ``cfg``'s run: per trained model its weights, fp32
    master weights and Adam's two moments (under actor.lora the policy's adapters alone, which is
    all a LoRA checkpoint holds of it); 0 when the model's size is unknown."""
    try:
        arch = resolve_arch(cfg.model.path, cfg.model.arch)
    except ArchError:
        return 0
    per_param = DTYPE_BYTES[cfg.model.dtype] + OPTIMIZER_BYTES
    lora = cfg.actor.lora
    policy = lora_params(arch, lora.rank, lora.modules) if lora is not None else arch.num_params
    critic = arch.num_params if cfg.critic_enabled else 0
    return int((policy + critic) * per_param)


def check_disk_space(cfg: MegaRLConfig, findings: list[Finding]) -> None:
    """trainer.output_dir's disk can hold the run's first save (a validation-only run saves none)."""
    t = cfg.trainer
    if t.val_only:
        return
    need = max(checkpoint_bytes(cfg), newest_checkpoint_bytes(t.output_dir))
    probe = Path(t.output_dir).absolute()
    while not probe.exists():  # the folder the run would create it in
        probe = probe.parent
    if not need or not probe.is_dir():  # (a path that cannot be a folder: the writable check names it)
        return
    short = space_shortfall(need, shutil.disk_usage(probe).free)
    if short:
        findings.append(Finding("trainer.output_dir", f"{t.output_dir} has no room for a checkpoint: {short}; free some "
                                "space there, or point trainer.output_dir at a larger disk"))  # fmt: skip
