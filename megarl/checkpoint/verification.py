"""What makes a directory a training checkpoint: its manifest (step, megarl version, checkpoint
format, components, every file's size and the sha256 of small files), written last by a save
(megarl/checkpoint/manager.py), and every file it lists present as listed. Reads only; a path
that is no checkpoint is named for what it is (a torn save, a run's folder, a checkpoint's part,
an sft.output_dir)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import megarl

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
CHECKPOINTS_DIR = "checkpoints"
STEP_RE = re.compile(r"^step_(\d+)$")

class CheckpointError(ValueError):
    """A checkpoint (or a resume setting) is invalid; the message says what and how to fix it."""


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint on disk."""

    step: int
    path: Path
    manifest: dict[str, Any] = field(repr=False)

    @property
    def components(self) -> list[str]:
        return list(self.manifest["components"])

    def component(self, name: str) -> Path:
        """Path of a component (subdirectory or file) saved in this checkpoint."""
        if name not in self.manifest["components"]:
            raise CheckpointError(
                f"checkpoint {self.path} has no component '{name}'; it holds {self.components}"
            )
        return self.path / name


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def is_step_dir_name(name: str) -> bool:
    """Whether ``name`` is a checkpoint's directory name (step_NNNNNN), which retention may delete."""
    return STEP_RE.match(name) is not None



def verify_checkpoint(path: str | Path) -> Checkpoint:
    """Check a checkpoint directory against its manifest; raises CheckpointError saying why not."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a directory"
        raise CheckpointError(f"{path} {what}; give a checkpoint directory (<output_dir>/checkpoints/step_NNNNNN)")
    if not manifest_path.is_file():
        raise CheckpointError(_missing_manifest(path))
    try:
        manifest = json.loads(manifest_path.read_text())
        step, files = int(manifest["step"]), list(manifest["files"])
        if not isinstance(manifest["components"], list):
            raise TypeError("components is not a list")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest_path} is unreadable ({type(exc).__name__}: {exc})") from None
    if too_new(manifest):  # a layout this megarl does not know
        written = manifest.get("manifest_version")
        raise CheckpointError(f"{path} was written by megarl {manifest.get('megarl_version', '?')} in checkpoint format "
                              f"{written}, which this megarl ({megarl.__version__}) cannot read (it reads format "
                              f"{MANIFEST_VERSION}); use megarl {manifest.get('megarl_version', '?')} or newer")  # fmt: skip
    m = STEP_RE.match(path.name)
    if m and int(m.group(1)) != step:
        raise CheckpointError(f"{manifest_path} says step {step} but the directory is {path.name}")
    for entry in files:
        _verify_file(path, entry)
    return Checkpoint(step=step, path=path, manifest=manifest)


def _missing_manifest(path: Path) -> str:
    """Why ``path`` without a manifest is no checkpoint: a torn save, or not a step directory at
    all (a run's folder, one of a checkpoint's components, an sft.output_dir), naming the one to give."""
    from megarl.checkpoint.model_checkpoint import sft_output_hint

    if path.name in _components_of(path.parent):  # policy/ or critic/: saved whole, with the manifest one level up
        return f"{path} is the {path.name} part of the checkpoint {path.parent}, not a checkpoint; give {path.parent}"
    problem = run_folder_problem(path)
    if problem:
        return problem
    hint = sft_output_hint(path)
    return f"{path} is not a checkpoint; {hint}" if hint else f"{MANIFEST} is missing in {path} (the save did not finish)"


def run_folder_problem(path: Path) -> str | None:
    """When ``path`` is a run's output_dir or its checkpoints folder (given where a step directory
    goes), why it is no checkpoint, naming the latest valid step directory to give; else None."""
    root = path if path.name == CHECKPOINTS_DIR else path / CHECKPOINTS_DIR
    try:
        steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_RE.match(p.name)) and p.is_dir())
    except OSError:  # no checkpoints folder
        return None
    if not steps:
        return None
    what = "the checkpoints folder of a run" if root == path else "a run's output_dir"
    latest = next((p for _, p in reversed(steps) if is_valid(p)), None)
    if latest is None:
        return f"{path} is {what}, not a checkpoint, and none of its {len(steps)} step directories in {root} verifies; repair one, or give another checkpoint"
    return f"{path} is {what}, not a checkpoint; give one of its step directories, e.g. the latest valid one: {latest}"


def _components_of(path: Path) -> list[str]:
    """The components (policy, critic, ...) the manifest in ``path`` lists; [] without a readable one."""
    components = read_manifest(path).get("components")
    return components if isinstance(components, list) else []


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest in ``path`` as read, unchecked; {} without a readable one."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _verify_file(root: Path, entry: dict[str, Any]) -> None:
    f = root / entry["path"]
    if not f.is_file():
        raise CheckpointError(f"file {entry['path']} listed in the manifest is missing")
    size = f.stat().st_size
    if size != entry["size"]:
        raise CheckpointError(f"file {entry['path']} has {size} bytes, the manifest says {entry['size']} (truncated?)")
    if "sha256" in entry and file_sha256(f) != entry["sha256"]:
        raise CheckpointError(f"file {entry['path']} does not match its sha256 in the manifest (corrupted)")


def is_valid(path: Path) -> bool:
    return why_invalid(path) is None


def too_new(manifest: dict[str, Any]) -> bool:
    """Whether ``manifest`` names a checkpoint format newer than this megarl's (none: format 1)."""
    written = manifest.get("manifest_version", MANIFEST_VERSION)
    return not isinstance(written, int) or written > MANIFEST_VERSION


def why_invalid(path: Path) -> str | None:
    try:
        verify_checkpoint(path)
        return None
    except CheckpointError as exc:
        return str(exc)



def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read in chunks (a file can be larger than memory)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
