"""A model directory that a command writes (`megarl convert` both ways, `megarl sft`): refused
before any work when writing it could destroy what the user owns, staged next to itself, and
swapped in by rename once complete. What it leaves out: what goes into the directory and how it
is verified (the commands), and outputs that are single files (megarl/commands/outputs.py).

- OUT may not be a symbolic link, the current directory or one of its parents, a run's
  checkpoints directory (or anything inside one), or a directory the caller protects (the
  model it is converted from);
- an existing, non-empty OUT is replaced only with --overwrite, and only when it is a previous
  output of the same kind (recognised by its record: megarl_export.json or megarl_megatron.json)
  holding no other file, and never when it holds weights `megarl sft` trained;
- the files are written into a staging directory next to OUT and swapped in by rename; the
  staging directory goes whatever happened; one that a killed command left is removed by the
  next staging of OUT when its name says it was made on this machine by a process that no
  longer runs (one named with another host is only mentioned); a previous output that a kill
  during the swap left as ``.OUT.megarl-old-PID`` is named by the next staging, never removed;
- the written files get the modes of any new file (0666 minus the umask).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from megarl.checkpoint.model_checkpoint import (
    RECORD as MODEL_RECORD,  # stdlib only: the CLI stays fast
)
from megarl.checkpoint.model_checkpoint import trained_by_sft
from megarl.commands.outputs import OutputError, OutputExistsError, check_outside_checkpoints
from megarl.process_signals import pid_alive

EXPORT_MANIFEST = "megarl_export.json"  # the record of a megatron-to-hf output
log = logging.getLogger(__name__)


def check_output_target(target: Path, overwrite: bool, protected: dict[str, Path], manifest: str = EXPORT_MANIFEST) -> None:
    """Refuse (OutputError) an OUT whose writing could destroy anything but a previous megarl
    output of the same kind (recognised by its ``manifest`` file, which lists what it wrote)."""
    from megarl.plan.preflight import writable_dir_problem

    if target.is_symlink():  # the swap renames OUT itself: the link, not what it points to, would be replaced
        real = target.resolve()
        raise OutputError(f"{target} is a symbolic link to {os.readlink(target)}; give {real} itself, or another path")
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
    check_outside_checkpoints(target, flag="")  # another run's: its retention would delete OUT too
    if target.is_dir() and any(target.iterdir()):
        _check_previous_output(target, overwrite, manifest)
    problem = writable_dir_problem(target.parent)
    if problem:
        raise OutputError(f"cannot write {target}: {problem}; choose a writable place")


def _check_previous_output(target: Path, overwrite: bool, manifest_name: str) -> None:
    if not overwrite:
        raise OutputExistsError(f"{target} exists and is not empty; choose another directory, or pass --overwrite to "
                          "replace a previous megarl convert output")
    manifest = target / manifest_name
    present = sorted(str(p.relative_to(target)) for p in target.rglob("*") if not p.is_dir())
    if not manifest.is_file():
        other = next((n for n in _OUTPUT_RECORDS if n != manifest_name and (target / n).is_file()), None)
        if other is not None:
            raise OutputError(f"{target} is a {_OUTPUT_RECORDS[other]} output ({other}), and --overwrite here replaces "
                              f"only a previous {_OUTPUT_RECORDS[manifest_name]} output; choose another directory")
        raise OutputError(f"--overwrite replaces only a previous megarl convert output, and {target} has no "
                          f"{manifest_name} (it holds {_listing(present)}); choose another directory")
    try:
        record = json.loads(manifest.read_text())
        listed = set(record["files"]) | {manifest_name}
    except (ValueError, KeyError, TypeError) as exc:
        raise OutputError(f"{manifest} is unreadable ({exc}); choose another directory") from None
    if trained_by_sft(record):  # trained weights: no conversion makes them again
        raise OutputError(f"{target} holds the weights `megarl sft` trained ({manifest_name}: {record['source']}), and "
                          "--overwrite here replaces only a conversion's output; choose another directory")  # fmt: skip
    others = [p for p in present if p not in listed]
    if others:
        raise OutputError(f"{target} holds files that megarl convert did not write ({_listing(others)}); "
                          "move them away or choose another directory")


# The record each direction writes into its output, and the direction's name.
_OUTPUT_RECORDS = {EXPORT_MANIFEST: "megatron-to-hf", MODEL_RECORD: "hf-to-megatron"}


def _listing(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "") if names else "nothing"


@contextmanager
def staged_output(target: Path, report: Callable[[str], None] | None = None) -> Iterator[Path]:
    """A staging directory next to ``target``, removed at the end whatever happened (but not
    after a kill -9: the next staging of ``target`` removes those, see _clear_dead_staging)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _clear_dead_staging(target, report or log.warning)
    _mention_kept_outputs(target, report or log.warning)
    staging = target.parent / f"{_staging_prefix(target)}{os.getpid()}"
    staging.mkdir()
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _staging_prefix(target: Path) -> str:
    """``.OUT.megarl-staging-HOST-PIDNS-`` + the pid: the process namespace (a container's) is part
    of the name, as a pid says whether a process lives only in its own namespace."""
    import socket

    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc (macOS): the host's one namespace
        namespace = 0
    return f".{target.name}.megarl-staging-{socket.gethostname()}-{namespace}-"


def _clear_dead_staging(target: Path, say: Callable[[str], None]) -> None:
    """Remove the staging directories of ``target`` that a killed convert left. Only those named
    with this host and process namespace (others may be a live convert's on another node sharing
    the filesystem) whose pid no longer runs; the others are named, not touched."""
    ours = _staging_prefix(target)
    for path in sorted(target.parent.glob(f".{glob.escape(target.name)}.megarl-staging-*")):
        pid = path.name[len(ours):] if path.name.startswith(ours) else ""
        if not pid.isdigit() or path.is_symlink() or not path.is_dir():
            say(f"note: {path} is left as it is: it may be the staging directory of a convert or sft on another machine "
                f"(or of an older megarl); remove it once no convert or sft writes {target.name}")
            continue
        if pid_alive(int(pid)):
            continue  # a convert to the same OUT is running now: its rename will tell
        shutil.rmtree(path)
        say(f"removed {path}: the staging directory of an interrupted convert or sft (pid {pid}, no longer running)")


def _kept_prefix(target: Path) -> str:
    """``.OUT.megarl-old-`` + a pid: where _swap_in keeps the previous output until the new one is in."""
    return f".{target.name}.megarl-old-"


def _mention_kept_outputs(target: Path, say: Callable[[str], None]) -> None:
    """Name each previous output of ``target`` that a convert killed during its swap left aside.
    It is the user's data (a kill between the two renames leaves it the only copy), so it is never
    removed here, unlike a dead staging directory, which holds nothing the user had."""
    for path in sorted(target.parent.glob(f"{glob.escape(_kept_prefix(target))}*")):
        back = "" if os.path.lexists(target) else f" (or rename it back to {target.name})"
        say(f"warning: {path} is the previous output of an interrupted convert or sft, kept; delete it when you no "
            f"longer need it{back}")



def finish_output(written: Path, target: Path) -> None:
    """Put ``written`` (complete and verified) at ``target``, with the modes of new files."""
    _normalize_modes(written)
    _swap_in(written, target)


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
        old = target.parent / f"{_kept_prefix(target)}{os.getpid()}"
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


def read_hf_config(source: Path, name: str = "--hf") -> dict[str, Any]:
    """``source``'s config.json; ``name`` is what the user gave it as (an option or a config key)."""
    try:
        return json.loads((source / "config.json").read_text())
    except FileNotFoundError:
        raise OutputError(f"{name} {source} has no config.json; give a Hugging Face model directory") from None
    except (OSError, ValueError) as exc:
        raise OutputError(f"{source / 'config.json'} is unreadable ({exc})") from None
