"""`megarl convert CHECKPOINT OUT`: a checkpoint's policy as a verified Hugging Face directory.

Rebuilds the policy group with the run's layout (megarl/checkpoint/hf_export.py: ExportRank),
writes the HF files into a staging directory next to OUT, re-imports and compares them bit for
bit, then swaps the result in by rename. Nothing the user owns is ever deleted:

- OUT may not be the current directory or one of its parents, the checkpoints directory of the
  run (or anything inside it), or the model directory the checkpoint's config points at;
- an existing, non-empty OUT is replaced only with --overwrite, and only when it is a previous
  megarl output (recognised by its manifest, megarl_export.json) holding no other file;
- every check runs before Ray starts; a failure removes the staging directory and leaves OUT
  as it was (the worker logs are kept, and named in the error);
- relative paths in the checkpoint's config (model.path) resolve against the directory the
  run was launched from (recorded in the checkpoint), not the caller's;
- the written files get the modes of any new file (0666 minus the umask).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

EXPORT_MANIFEST = "megarl_export.json"


class OutputError(Exception):
    """An output megarl refuses to write, because writing it could destroy something."""


class OutputExistsError(OutputError, FileExistsError):
    """OUT exists and is not empty, and --overwrite was not given."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="export a training checkpoint's policy as a Hugging Face model directory (verified)",
        description="Rebuilds the policy with the run's layout, loads CHECKPOINT (a <output_dir>/checkpoints/step_NNNNNN "
        "directory), writes HF safetensors + index with the config and tokenizer of model.path, then imports the "
        "written files back and checks every parameter equals the trained one bit for bit. OUT is written next to "
        "itself and swapped in only once verified.",
    )
    p.add_argument("checkpoint", help="a step_NNNNNN checkpoint directory (a torn one is refused)")
    p.add_argument("out", help="the HF model directory to write (new or empty)")
    p.add_argument("--config", default=None, help="the run's config (default: the config.yaml saved in the checkpoint)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT when it holds a previous megarl convert output (and nothing else)")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    convert_checkpoint(args.checkpoint, args.out, args.config, args.overwrite, report=print)
    return 0


def convert_checkpoint(checkpoint: str | Path, out: str | Path, config: str | Path | None = None, overwrite: bool = False,
                       report: Any = None) -> Path:  # fmt: skip
    """Write the policy of ``checkpoint`` (a step_NNNNNN directory) as an HF directory ``out``."""
    from megarl.checkpoint.manager import verify_checkpoint
    from megarl.config.planner import make_plan

    ckpt = verify_checkpoint(checkpoint)  # a torn checkpoint is refused here, naming what is wrong
    cfg = run_config(ckpt, config)
    target = Path(out).absolute()
    check_output_target(target, overwrite, {"the run's checkpoints directory": ckpt.path.parent,
                                            "the model directory of model.path": Path(cfg.model.path)})
    plan = make_plan(cfg)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.megarl-staging-{os.getpid()}"
    logs = Path(tempfile.mkdtemp(prefix="megarl-convert-logs-"))
    try:
        written, checked = _export(cfg, plan, ckpt, staging, logs)
        _write_manifest(written, ckpt, checked)
        _normalize_modes(written)
        _swap_in(written, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(logs, ignore_errors=True)  # kept (and named by the error) when the export failed
    if report is not None:
        report(f"wrote {out} from {ckpt.path} (step {ckpt.step}); verified: {checked} parameters re-imported from the "
               "written files equal the trained ones bit for bit")
    return Path(out)


def _export(cfg: Any, plan: Any, ckpt: Any, staging: Path, logs: Path) -> tuple[Path, int]:
    """Write and verify the HF files in ``staging``/v0; returns it and the parameters checked."""
    from megarl.actors.clients import ExportClient
    from megarl.actors.ray_groups.placement import role_placements
    from megarl.actors.ray_groups.session import ray_session
    from megarl.actors.ray_groups.worker_group import GroupOptions, WorkerGroup
    from megarl.checkpoint.hf_export import ExportRank, write_index

    placements, _ = role_placements(cfg, plan)
    local_cpus = None if cfg.cluster.ray_address else len(plan.roles["policy"].gpus) + 1
    with ray_session(cfg.cluster.ray_address, num_cpus=local_cpus):
        group = WorkerGroup(ExportRank, placements[0], cfg, str(ckpt.path), group_options=GroupOptions(log_dir=logs))
        try:
            client = ExportClient(group)
            client.write(str(staging))
            written = staging / "v0"
            write_index(written)
            checked = client.verify(str(written))
        finally:
            group.shutdown()
    return written, checked


# ---- the run's config ---------------------------------------------------------------------------------


def run_config(ckpt: Any, config: str | Path | None = None) -> Any:
    """The config the checkpoint was trained with, its relative model paths made absolute
    against the run's launch directory (or, for --config, the current one first)."""
    from megarl.config.loading import ConfigError, load_config

    saved = ckpt.path / "config.yaml"  # written with every checkpoint; older ones: the run's
    cfg_path = Path(config) if config else saved if saved.is_file() else ckpt.path.parent.parent / "config.yaml"
    if not cfg_path.is_file():
        raise ConfigError(f"no run config at {cfg_path}; pass --config with the config the run was launched with")
    cfg = load_config(cfg_path)
    bases = ([Path.cwd()] if config else []) + launch_dirs(ckpt, cfg.trainer.output_dir) + [Path.cwd()]
    updates = {}
    for section, value in (("model", cfg.model.path), ("critic", cfg.critic.path)):
        if value is None or Path(value).is_absolute():
            continue
        found = next((b / value for b in bases if (b / value / "config.json").is_file()), None)
        if found is None:
            raise ConfigError(
                f"{section}.path ({value}) of {cfg_path} is relative, and no {value}/config.json exists under the run's "
                f"launch directory ({bases[0]}) or here; pass --config with a config whose {section}.path exists"
            )
        updates[section] = getattr(cfg, section).model_copy(update={"path": str(found.resolve())})
    return cfg.model_copy(update=updates)


def launch_dirs(ckpt: Any, output_dir: str) -> list[Path]:
    """Where the run was launched: recorded in the manifest, else what remains of the
    checkpoint's absolute path once <output_dir>/checkpoints/step_N is taken off its end."""
    found = []
    recorded = (ckpt.manifest.get("metadata") or {}).get("launch_dir")
    if recorded:
        found.append(Path(recorded))
    tail = (*Path(output_dir).parts, "checkpoints", ckpt.path.name)
    parts = ckpt.path.absolute().parts
    if not Path(output_dir).is_absolute() and parts[-len(tail):] == tail:
        found.append(Path(*parts[: -len(tail)]))
    return found


# ---- the output directory -----------------------------------------------------------------------------


def check_output_target(target: Path, overwrite: bool, protected: dict[str, Path]) -> None:
    """Refuse (OutputError) an OUT whose writing could destroy anything but a previous megarl output."""
    from megarl.config.preflight import writable_dir_problem

    real = target.resolve()
    if target.exists() and not target.is_dir():
        raise OutputError(f"{target} exists and is not a directory; choose a directory path for the model")
    cwd = Path.cwd().resolve()
    if real == cwd or real in cwd.parents:
        what = "the current directory" if real == cwd else "a parent of the current directory"
        raise OutputError(f"{target} is {what}; give the model a directory of its own, e.g. {cwd / 'hf_model'}")
    for name, path in protected.items():
        path = path.resolve()
        if real == path or path in real.parents or real in path.parents:
            relation = "is" if real == path else "is inside" if path in real.parents else "contains"
            raise OutputError(f"{target} {relation} {name} ({path}); choose a directory outside it")
    if target.is_dir() and any(target.iterdir()):
        _check_previous_output(target, overwrite)
    problem = writable_dir_problem(target.parent)
    if problem:
        raise OutputError(f"cannot write {target}: {problem}; choose a writable place")


def _check_previous_output(target: Path, overwrite: bool) -> None:
    if not overwrite:
        raise OutputExistsError(f"{target} exists and is not empty; choose another directory, or pass --overwrite to "
                          "replace a previous megarl convert output")
    manifest = target / EXPORT_MANIFEST
    present = sorted(str(p.relative_to(target)) for p in target.rglob("*") if not p.is_dir())
    if not manifest.is_file():
        raise OutputError(f"--overwrite replaces only a previous megarl convert output, and {target} has no "
                          f"{EXPORT_MANIFEST} (it holds {_listing(present)}); choose another directory")
    try:
        listed = set(json.loads(manifest.read_text())["files"]) | {EXPORT_MANIFEST}
    except (ValueError, KeyError, TypeError) as exc:
        raise OutputError(f"{manifest} is unreadable ({exc}); choose another directory") from None
    others = [p for p in present if p not in listed]
    if others:
        raise OutputError(f"{target} holds files that megarl convert did not write ({_listing(others)}); "
                          "move them away or choose another directory")


def _listing(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "") if names else "nothing"


def _write_manifest(written: Path, ckpt: Any, checked: int) -> None:
    import megarl

    files = sorted(str(p.relative_to(written)) for p in written.rglob("*") if p.is_file())
    manifest = {"kind": "megarl convert", "megarl_version": megarl.__version__, "checkpoint": str(ckpt.path.resolve()),
                "step": ckpt.step, "verified_parameters": checked, "files": files}
    (written / EXPORT_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def _normalize_modes(root: Path) -> None:
    """What a new file gets (0666 / 0777 minus the umask): some writers create theirs 0600."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [root, *root.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _swap_in(written: Path, target: Path) -> None:
    """Put ``written`` at ``target`` by rename; a previous output goes only once the new one is in."""
    old = None
    if target.is_dir() and any(target.iterdir()):
        old = target.parent / f".{target.name}.megarl-old-{os.getpid()}"
        os.rename(target, old)
    elif target.is_dir():
        target.rmdir()
    try:
        os.rename(written, target)
    except BaseException:
        if old is not None:
            os.rename(old, target)  # the previous output back where it was
        raise
    if old is not None:
        shutil.rmtree(old)
