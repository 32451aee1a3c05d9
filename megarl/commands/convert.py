"""`megarl convert CHECKPOINT OUT`: a checkpoint's policy as a verified Hugging Face directory.

Rebuilds the policy group with the run's layout (megarl/checkpoint/hf_export.py: ExportRank),
writes the HF files into a staging directory, re-imports and compares them bit for bit, then
moves the result into place.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="export a training checkpoint's policy as a Hugging Face model directory (verified)",
        description="Rebuilds the policy with the run's layout, loads CHECKPOINT (a <output_dir>/checkpoints/step_NNNNNN "
        "directory), writes HF safetensors + index with the config and tokenizer of model.path, then imports the "
        "written files back and checks every parameter equals the trained one bit for bit.",
    )
    p.add_argument("checkpoint", help="a step_NNNNNN checkpoint directory (a torn one is refused)")
    p.add_argument("out", help="the HF model directory to write")
    p.add_argument("--config", default=None, help="the run's config (default: the config.yaml saved in the checkpoint)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.set_defaults(handler=lambda args: print(convert_checkpoint(args.checkpoint, args.out, args.config, args.overwrite)) or 0)


def convert_checkpoint(checkpoint: str | Path, out: str | Path, config: str | Path | None = None, overwrite: bool = False) -> Path:
    """Write the policy of ``checkpoint`` (a step_NNNNNN directory) as an HF directory ``out``."""
    from megarl.actors.ray_groups.placement import role_placements
    from megarl.actors.ray_groups.session import ray_session
    from megarl.actors.ray_groups.worker_group import GroupOptions, WorkerGroup
    from megarl.checkpoint.hf_export import ExportRank, write_index
    from megarl.checkpoint.manager import verify_checkpoint
    from megarl.config.loading import load_config
    from megarl.config.planner import make_plan

    ckpt = verify_checkpoint(checkpoint)  # a torn checkpoint is refused here, naming what is wrong
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; choose another directory or pass --overwrite")
    saved = ckpt.path / "config.yaml"  # written with every checkpoint; older ones: the run's
    cfg_path = Path(config) if config else saved if saved.is_file() else ckpt.path.parent.parent / "config.yaml"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"no run config at {cfg_path}; pass --config with the config the run was launched with")
    cfg = load_config(cfg_path)
    plan = make_plan(cfg)
    staging = out.parent / f".{out.name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    placements, _ = role_placements(cfg, plan)
    local_cpus = None if cfg.cluster.ray_address else len(plan.roles["policy"].gpus) + 1
    with ray_session(cfg.cluster.ray_address, num_cpus=local_cpus):
        group = WorkerGroup(ExportRank, placements[0], cfg, str(ckpt.path), group_options=GroupOptions(log_dir=staging / "logs"))
        try:
            group.call("write", str(staging))
            written = staging / "v0"
            write_index(written)
            group.call("verify", str(written))
        finally:
            group.shutdown()
    if out.exists():
        shutil.rmtree(out)
    written.rename(out)
    shutil.rmtree(staging, ignore_errors=True)
    return out
