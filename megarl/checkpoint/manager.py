"""Atomic, verified checkpoints under <output_dir>/checkpoints/step_<NNNNNN>/.

A save happens in `with manager.saving(step) as ckpt_dir:`. The block (the trainer, and the
policy / critic workers from their own processes) writes each component into a
subdirectory (or file) of `ckpt_dir`, which is a temp dir `.tmp_step_<NNNNNN>_<pid>` next
to the final ones. When the block succeeds the manager fsyncs every file, writes
manifest.json last (step, time, megarl version, components, every file's size and the
sha256 of small files), and renames the temp dir to `step_<NNNNNN>` (one atomic rename on
POSIX filesystems); when it raises, the temp dir is removed and nothing else changes. So a
crash mid-save leaves at worst a `.tmp_*` dir, which the next manager removes at start-up;
the last good checkpoint is never touched before the new one is complete.

A checkpoint is valid when its manifest is present, parses, names the same step as its
directory and a format this megarl reads, and every listed file exists with its recorded size
(and checksum, when one was recorded): megarl/checkpoint/verification.py. `resolve_resume("auto")` returns the latest valid checkpoint, logging a warning
for each newer one it skips and why. Retention keeps the newest `keep_last` valid
checkpoints (the newest valid one is never removed) and removes only the files a checkpoint's
manifest lists: anything else put inside one is kept as `step_NNNNNN.pruned`; directories that fail verification are
reported, never deleted, so nothing a person might still want disappears silently:
- when step directories exist and none verifies, `resume=auto` refuses (listing each one and
  why) instead of starting again from step 0 over them;
- a save of a step whose directory fails verification keeps that directory as
  `step_NNNNNN.unverified` (reported) and writes the new one beside it;
- a new run (`resume=disable`, or another run's checkpoint) over existing checkpoints is refused;
- a resume from an older checkpoint of the run (an explicit path) keeps the newer step
  directories as `step_NNNNNN.abandoned`: its saves do not replace them and `resume=auto` does
  not pick them afterwards;
- a save first checks that the disk has room for it (the previous checkpoint's size, or the
  caller's estimate, plus a margin: space_for_a_save) and refuses with the numbers, naming the
  set-aside directories above (never deleted by megarl) and their size; `megarl launch` makes
  the same check before Ray starts (megarl/plan/disk_space.py).
`plan_resume()` makes these decisions without touching the disk, so `megarl launch` refuses
before Ray starts (megarl/plan/preflight.py).

One trainer process manages one output_dir. Left out: what goes inside the components
(Megatron dist-checkpoint, trainer_state.pt), remote object stores, async saving.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import megarl
from megarl.checkpoint.verification import (
    CHECKPOINTS_DIR,
    MANIFEST,
    MANIFEST_VERSION,
    STEP_RE,
    Checkpoint,
    CheckpointError,
    file_sha256,
    is_valid,
    read_manifest,
    step_dir_name,
    too_new,
    verify_checkpoint,
    why_invalid,
)
from megarl.kept_files import kept_name, kept_tag

log = logging.getLogger(__name__)


class NoSpaceForCheckpoint(CheckpointError):
    """A save refused before it wrote anything: its disk cannot hold the checkpoint (the trainer
    adds what is kept and the resume command)."""


_TEMP_PREFIX = ".tmp_"
_TRASH_PREFIX = ".trash_"
# Names of step directories set aside (kept_files.kept_name: step_NNNNNN.<tag>, -1, -2, ... when taken):
UNVERIFIED = "unverified"  # one that failed verification when its step was saved again
ABANDONED = "abandoned"  # a step after the one an explicit trainer.resume went back to
PRUNED = "pruned"  # what a removed checkpoint directory held besides its own files
FREE_SPACE_MARGIN = 1.05  # a save needs its size plus this share (an estimate's error; a checkpoint a little larger than the last)
SPACE_SLACK_BYTES = 64 * 1024 * 1024  # and this much more, left for what the run writes beside it (metrics, logs, TensorBoard)
DEFAULT_CHECKSUM_MAX_BYTES = 16 * 1024 * 1024  # sha256 for files up to this size


class CheckpointManager:
    """Saves, verifies, finds and prunes the checkpoints of one run."""

    def __init__(self, output_dir: str | Path, keep_last: int = 3, *,
                 checksum_max_bytes: int = DEFAULT_CHECKSUM_MAX_BYTES):
        if keep_last < 1:
            raise ValueError(f"trainer.keep_last ({keep_last}) must be >= 1")
        self.root = Path(output_dir) / CHECKPOINTS_DIR
        self.keep_last = keep_last
        self.checksum_max_bytes = checksum_max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self._recover_leftovers()

    # ---- saving ---------------------------------------------------------------------

    @contextmanager
    def saving(self, step: int, metadata: dict[str, Any] | None = None, *,
               expected_bytes: int | None = None) -> Iterator[Path]:
        """Yield a temp dir to write the components of `step` into; commit it on success.

        metadata: JSON-able extras recorded in the manifest (e.g. the config, a run id).
        expected_bytes: the checkpoint's estimated size; the free-space check uses the larger of
        it and the newest checkpoint's size (from its manifest), and refuses before anything is written.

        On an exception inside the block, the temp dir is removed and the exception goes on.
        Saving a step that already exists replaces it only once the new one is complete; one
        that fails verification is kept as step_NNNNNN.unverified, never replaced.
        """
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        self.check_free_space(step, expected_bytes)
        final = self.root / step_dir_name(step)
        temp = self.root / f"{_TEMP_PREFIX}{final.name}_{os.getpid()}"
        if temp.exists():
            shutil.rmtree(temp)
        temp.mkdir()
        try:
            yield temp
            self._commit(step, temp, final, metadata or {})
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        self.prune()

    def check_free_space(self, step: int, expected_bytes: int | None = None) -> None:
        """Refuse (CheckpointError with the numbers) when the disk cannot hold another checkpoint."""
        need = max(expected_bytes or 0, self._last_size())
        short = space_shortfall(need, shutil.disk_usage(self.root).free) if need else None
        if short:
            raise NoSpaceForCheckpoint(
                f"not enough disk space to save step {step} in {self.root}: {short}; free some space (a lower "
                f"trainer.keep_last keeps fewer checkpoints{self._set_aside_hint()}) or point trainer.output_dir at a "
                "larger disk, then resume"
            )

    def _set_aside_hint(self) -> str:
        """The directories megarl set aside and never deletes (.abandoned, .unverified, .pruned):
        named with their size, since they are the first thing a full disk's owner may remove."""
        tags = (ABANDONED, UNVERIFIED, PRUNED)
        kept = sorted(p for p in self.root.glob("step_*.*") if p.is_dir() and kept_tag(p.name) in tags)
        if not kept:
            return ""
        size = sum(os.lstat(os.path.join(self.root, p.name, f)).st_size for p in kept for f in _list_files(p))
        names = ", ".join(p.name for p in kept[:3]) + (f" and {len(kept) - 3} more" if len(kept) > 3 else "")
        return f"; {names} ({_sizes(size)[0]}) are kept aside, never deleted by megarl: remove them if not needed"

    def _commit(self, step: int, temp: Path, final: Path, metadata: dict[str, Any]) -> None:
        files = _list_files(temp)
        if not files:
            raise CheckpointError(f"checkpoint step {step}: nothing was written into {temp}")
        entries = []
        for rel in files:
            path = temp / rel
            _fsync_file(path)
            size = path.stat().st_size
            entry: dict[str, Any] = {"path": rel, "size": size}
            if size <= self.checksum_max_bytes:
                entry["sha256"] = file_sha256(path)
            entries.append(entry)
        manifest = {
            "manifest_version": MANIFEST_VERSION,
            "step": step,
            "time": time.time(),
            "megarl_version": megarl.__version__,
            "components": sorted(p.name for p in temp.iterdir()),
            "files": entries,
            "metadata": metadata,
        }
        _write_json_durably(temp / MANIFEST, manifest)
        for d in sorted({(temp / rel).parent for rel in files}, reverse=True):
            _fsync_dir(d)
        _fsync_dir(temp)
        old = None
        if final.exists() and not is_valid(final):
            kept = kept_name(final, UNVERIFIED)
            log.warning("checkpoint: %s fails verification (%s); kept as %s, not replaced",
                        final, why_invalid(final), kept.name)
            os.rename(final, kept)
        elif final.exists():
            old = self.root / f"{_TRASH_PREFIX}{final.name}_{os.getpid()}"
            os.rename(final, old)
        os.rename(temp, final)
        _fsync_dir(self.root)
        if old is not None:
            _discard(old, final.name)
        log.info("checkpoint: saved step %d to %s (%d files)", step, final, len(entries))

    def _last_size(self) -> int:
        return newest_checkpoint_bytes(self.root.parent)

    # ---- finding and verifying ------------------------------------------------------

    def step_dirs(self) -> list[tuple[int, Path]]:
        """Every step_* directory, oldest first (valid or not)."""
        found = []
        for p in self.root.iterdir():
            m = STEP_RE.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def valid_checkpoints(self) -> list[Checkpoint]:
        """Checkpoints that pass verification, oldest first."""
        out = []
        for _, path in self.step_dirs():
            try:
                out.append(verify_checkpoint(path))
            except CheckpointError:
                continue
        return out

    def latest_valid(self, quiet: bool = False) -> Checkpoint | None:
        """The newest valid checkpoint; a warning names each newer one skipped and why."""
        for _, path in reversed(self.step_dirs()):
            try:
                return verify_checkpoint(path)
            except CheckpointError as exc:
                if not quiet:
                    log.warning("checkpoint: skipping %s: %s", path, exc)
        return None

    def resolve_resume(self, resume: str | Path) -> Checkpoint | None:
        """trainer.resume -> the checkpoint to load, or None to start fresh (see plan_resume).
        The trainer sets newer checkpoints aside (set_aside_newer) once this one has loaded."""
        found = plan_resume(self.root.parent, resume)
        if found is None:
            log.info("checkpoint: no checkpoint in %s; starting from step 0", self.root)
        return found

    def set_aside_newer(self, ckpt: Checkpoint) -> list[Path]:
        """Rename this run's step directories newer than ``ckpt`` to step_NNNNNN.abandoned; returns
        the new names. Going back to an older checkpoint starts another history from its step:
        left in place, the newer steps would be replaced by the re-run's saves of the same step, or
        picked by a later resume=auto, mixing the two histories. Kept, never deleted: retention and
        resume=auto see only step_NNNNNN names. Called once ``ckpt`` has loaded (a failed load
        changes nothing), and not by a validation-only run, which starts no history."""
        kept = []
        for path in newer_step_dirs(self.root.parent, ckpt):
            target = kept_name(path, ABANDONED)
            os.rename(path, target)
            kept.append(target)
        if kept:
            _fsync_dir(self.root)
            log.warning("checkpoint: resuming from %s (step %d), an older checkpoint of this run; the newer %s kept "
                        "as %s (not resumed from, not pruned)", ckpt.path.name, ckpt.step,
                        "one is" if len(kept) == 1 else f"{len(kept)} are", ", ".join(p.name for p in kept))
        return kept

    # ---- retention and leftovers ----------------------------------------------------

    def prune(self) -> list[Path]:
        """Remove valid checkpoints beyond the newest `keep_last`; returns what was removed."""
        valid = self.valid_checkpoints()
        removed = []
        for ckpt in valid[: max(0, len(valid) - self.keep_last)]:
            # Rename first: a crash mid-delete leaves a .trash_ dir, never a half step dir.
            trash = self.root / f"{_TRASH_PREFIX}{ckpt.path.name}_{os.getpid()}"
            os.rename(ckpt.path, trash)
            _discard(trash, ckpt.path.name)
            removed.append(ckpt.path)
            log.info("checkpoint: removed %s (keep_last=%d)", ckpt.path, self.keep_last)
        return removed

    def _recover_leftovers(self) -> None:
        """Remove temp dirs of crashed saves; finish interrupted replacements / deletions."""
        for p in sorted(self.root.iterdir()):
            if p.name.startswith(_TEMP_PREFIX):
                log.warning("checkpoint: removing %s, left by a save that did not finish", p)
                shutil.rmtree(p, ignore_errors=True)
            elif p.name.startswith(_TRASH_PREFIX) and p.is_dir():
                name = p.name[len(_TRASH_PREFIX):].rsplit("_", 1)[0]
                final = self.root / name
                if not final.exists() and is_valid(p):
                    # Crash between "move old aside" and "move new in": the old one is it.
                    log.warning("checkpoint: restoring %s from %s", final, p)
                    os.rename(p, final)
                else:
                    _discard(p, name)


def scan_step_dirs(output_dir: str | Path) -> list[tuple[int, Path, str | None]]:
    """(step, directory, why it fails verification or None) of every step_* directory under
    ``output_dir``/checkpoints, oldest first. Reads only: nothing is created or removed."""
    root = Path(output_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p, why_invalid(p)))
    return sorted(found)


def newest_checkpoint_bytes(output_dir: str | Path) -> int:
    """Bytes of ``output_dir``'s newest checkpoint whose manifest reads (0: none); no hashing (this
    runs every save), nothing created."""
    root = Path(output_dir) / CHECKPOINTS_DIR
    dirs = sorted((int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else ()) if (m := STEP_RE.match(p.name)) and p.is_dir())
    for _, path in reversed(dirs):
        size = manifest_bytes(path)
        if size is not None:
            return size
    return 0


def space_for_a_save(checkpoint_bytes: int) -> int:
    """The free bytes a save of a checkpoint of ``checkpoint_bytes`` needs (the margins above)."""
    return int(checkpoint_bytes * FREE_SPACE_MARGIN) + SPACE_SLACK_BYTES


def space_shortfall(checkpoint_bytes: int, free: int) -> str | None:
    """Why ``free`` bytes cannot hold a save of a checkpoint of ``checkpoint_bytes`` (every number
    in one unit, the margins stated), or None."""
    need = space_for_a_save(checkpoint_bytes)
    if free >= need:
        return None
    size, needed, left = _sizes(checkpoint_bytes, need, free)
    return (f"a checkpoint takes about {size} and a save needs {needed} free (it, 5% more and {SPACE_SLACK_BYTES >> 20} MiB "
            f"kept for the run's logs and metrics), but {left} are free")


def _sizes(*counts: int) -> list[str]:
    """``counts`` of bytes in one unit: GiB when the largest is at least one, else MiB."""
    unit, name = (2**30, "GiB") if max(counts) >= 2**30 else (2**20, "MiB")
    return [f"{n / unit:.3g} {name}" for n in counts]


def manifest_bytes(path: Path) -> int | None:
    """The bytes a checkpoint's manifest lists (None when it does not read); nothing is hashed."""
    try:
        return sum(int(e["size"]) for e in read_manifest(path)["files"])
    except (ValueError, KeyError, TypeError):
        return None


def starts_new_history(resume: str | Path, val_only: bool) -> bool:
    """Whether a run resumed with ``resume`` sets the newer checkpoints aside (set_aside_newer):
    an explicit checkpoint path does; ``auto`` takes the latest, and a validation-only run trains
    nothing."""
    return str(resume) not in ("auto", "disable") and not val_only


def newer_step_dirs(output_dir: str | Path, ckpt: Checkpoint) -> list[Path]:
    """The step directories (valid or not) of ``output_dir``'s run after ``ckpt``, when ``ckpt`` is
    one of that run's own checkpoints (an explicit trainer.resume going back); else none."""
    root = Path(output_dir) / CHECKPOINTS_DIR
    if not root.is_dir() or ckpt.path.resolve().parent != root.resolve():
        return []
    # From a directory set aside earlier (step_N.abandoned), the step_N in place is another
    # history's: it goes aside too.
    canonical = ckpt.path.name == step_dir_name(ckpt.step)
    return [path for step, path, _ in scan_step_dirs(output_dir) if step > ckpt.step or (step == ckpt.step and not canonical)]


def plan_resume(output_dir: str | Path, resume: str | Path, *, quiet: bool = False) -> Checkpoint | None:
    """What ``trainer.resume`` means for ``output_dir``: the checkpoint to load, None to start at
    step 0, or CheckpointError (one message: what is there, why it cannot be used, the ways on).

    - "auto": the newest valid checkpoint (newer broken ones are skipped with a warning); when
      step directories exist and none verifies, refused (never started again over them);
    - "disable": a new run; refused when output_dir already holds checkpoints;
    - a path: that checkpoint, which must verify; refused when output_dir holds checkpoints of
      another run (the path is not one of them). Newer checkpoints of the run are set aside when
      the trainer resumes (CheckpointManager.set_aside_newer; newer_step_dirs names them).
    Reads only, so `megarl launch` can decide before Ray starts (quietly: the trainer's own
    call warns about the skipped directories once).
    """
    out = Path(output_dir)
    dirs = scan_step_dirs(out)
    where = out / CHECKPOINTS_DIR
    if str(resume) == "auto":
        for _, path, why in reversed(dirs):
            if why is None:
                return verify_checkpoint(path)
            if too_new(read_manifest(path)):  # not broken: going back past it would train its steps again, in this megarl
                raise CheckpointError(f"trainer.resume=auto: {why}; this run's latest checkpoint is of it")
            if not quiet:
                log.warning("checkpoint: skipping %s: %s", path, why)
        if dirs:
            raise CheckpointError(_none_valid_message(where, dirs))
        return None
    existing = ", ".join(p.name for _, p, _ in dirs[-3:]) + (", ..." if len(dirs) > 3 else "")
    if str(resume) == "disable":
        if dirs:
            raise CheckpointError(
                f"trainer.resume=disable starts a new run, but trainer.output_dir ({out}) holds the checkpoints of "
                f"another run ({existing}); resume it with trainer.resume=auto, or give the new run its own trainer.output_dir"
            )
        return None
    path = Path(resume).expanduser()
    if not path.is_dir():
        raise CheckpointError(
            f"trainer.resume={str(resume)!r}: no such checkpoint directory; give a "
            f"{where}/step_NNNNNN directory, 'auto' (latest valid) or 'disable'"
        )
    try:
        found = verify_checkpoint(path)
    except CheckpointError as exc:
        raise CheckpointError(
            f"trainer.resume={str(resume)!r} is not a valid checkpoint: {exc}. Pick another "
            "step directory, or use trainer.resume=auto to take the latest valid one"
        ) from None
    if dirs and path.resolve().parent != where.resolve():
        raise CheckpointError(
            f"trainer.resume={str(resume)!r} starts from another run's checkpoint, but trainer.output_dir ({out}) "
            f"holds checkpoints of its own ({existing}); give this run a new trainer.output_dir"
        )
    return found


def _none_valid_message(where: Path, dirs: list[tuple[int, Path, str | None]]) -> str:
    listed = "; ".join(f"{p.name}: {why}" for _, p, why in dirs)
    return (
        f"trainer.resume=auto: {where} holds {len(dirs)} checkpoint(s) and none verifies ({listed}). "
        "Nothing was changed. Repair or restore one of them (e.g. copy back the missing file), or start a new run "
        "with trainer.resume=disable and a new trainer.output_dir"
    )


def _discard(path: Path, name: str) -> None:
    """Delete what a checkpoint directory holds of its own: the files its manifest lists, then the
    manifest, then links and the folders left empty. Anything else (a file a person put there,
    e.g. an evaluation's output, or one that could not be removed) is kept: the directory is
    renamed <name>.pruned and a warning names the files. A listed path that leads out through a
    symlink is not followed (the link goes, its target stays). Never raises: retention runs after
    a save has committed, and a file it cannot remove must not end the run."""
    try:
        listed = [str(e["path"]) for e in json.loads((path / MANIFEST).read_text())["files"]]
    except (OSError, ValueError, KeyError, TypeError):
        listed = []  # (a removal cut short after the manifest went: what is left is not ours)
    real = path.resolve()
    for f in [path / rel for rel in listed if (path / rel).resolve().parent.is_relative_to(real)] + [path / MANIFEST]:
        _quietly(f.unlink, missing_ok=True)
    for dirpath, dirs, files in os.walk(path, topdown=False):
        for n in [*dirs, *files]:
            if os.path.islink(os.path.join(dirpath, n)):
                _quietly(os.unlink, os.path.join(dirpath, n))
        if dirpath != str(path):
            _quietly(os.rmdir, dirpath)  # (refused while not empty: what is left stays)
    left = _list_files(path)
    if not left and _quietly(path.rmdir):
        return
    kept = kept_name(path.with_name(name), PRUNED)
    if not _quietly(os.rename, path, kept):
        kept = path
    log.warning("checkpoint: %s is removed, but it also held files the checkpoint does not list or that could not "
                "be removed (%s%s); they are kept in %s", name, ", ".join(left[:3]), ", ..." if len(left) > 3 else "", kept)


def _quietly(action: Any, *args: Any, **kwargs: Any) -> bool:
    """Run a file-system action; False (with a warning naming it) when the OS refuses."""
    try:
        action(*args, **kwargs)
        return True
    except OSError as exc:
        if exc.errno != errno.ENOTEMPTY:  # (a folder still holding kept files: said once, below)
            log.warning("checkpoint: could not remove %s (%s)", exc.filename or (args[0] if args else ""), exc.strerror or exc)
        return False


def _list_files(root: Path) -> list[str]:
    """Relative paths of every regular file under root (symlinks followed), sorted."""
    out = []
    for dirpath, _, names in os.walk(root, followlinks=True):
        for n in names:
            out.append(os.path.relpath(os.path.join(dirpath, n), root))
    return sorted(out)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories
    finally:
        os.close(fd)


def _write_json_durably(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
