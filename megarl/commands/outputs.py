"""What the commands write for the user: an output is never written over what the user has,
unless they ask (``--overwrite``), nor inside a run's checkpoints folder; checked before any
work, so a refusal costs nothing. A folder that cannot be made is refused then too
(check_folder); a command makes it (make_folder) when it writes, or before long work that
writes as it goes."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


class OutputError(Exception):
    """An output megarl refuses to write, because writing it could destroy something."""


class OutputExistsError(OutputError, FileExistsError):
    """The output exists, and --overwrite was not given."""


def check_new_file(path: Path, overwrite: bool, *, flag: str = "--out", fix: str = "give another path",
                   in_existing_folder: bool = False) -> None:  # fmt: skip
    """A file output (``flag`` names it in the message, "" for a positional argument): not a
    folder, and an existing file is replaced only with ``overwrite``; ``in_existing_folder``:
    for a command that creates no folders, the folder must exist."""
    name = f"{flag} {path}" if flag else str(path)
    if in_existing_folder and not path.absolute().parent.is_dir():
        raise OutputError(f"{name}: the folder {path.parent} does not exist; create it, or {fix}")
    if path.is_dir():
        raise OutputError(f"{name} is a directory; {fix}")
    if path.exists() and not overwrite:
        raise OutputExistsError(f"{name} exists; pass --overwrite to replace it, or {fix}")


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file, however spelled: ``sub/../x``, a symbolic link, a hard link."""
    if a.absolute().resolve() == b.absolute().resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them is not there: only its spelling could have made it the other
        return False


def check_folder(path: Path, *, flag: str = "--out") -> None:
    """The folder of the file output ``path`` can be made: the nearest existing one of it and its
    parents is a folder (not a file, nor a dangling link) that can be written; refused in one line
    (``flag`` names the output, as check_new_file). Creates nothing: a later refusal leaves no
    empty folders behind."""
    folder = path.absolute().parent
    existing = next(p for p in [folder, *folder.parents] if os.path.lexists(p))
    name = f"{flag} {path}" if flag else str(path)
    if not existing.is_dir():
        raise OutputError(f"{name}: {existing} is not a folder; give another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"{name}: {existing} is not writable; give another path")


def make_folder(path: Path, *, flag: str = "--out") -> None:
    """The folder of the file output ``path``, created with its parents if missing (checked as
    check_folder does)."""
    check_folder(path, flag=flag)
    path.absolute().parent.mkdir(parents=True, exist_ok=True)


def check_outside_checkpoints(path: Path, *, flag: str = "--out", runs: Iterable[Path] = ()) -> None:
    """Refuse an output inside a run's checkpoints folder: megarl manages it (retention removes
    step directories, a file left in one is moved aside to step_NNNNNN.pruned; a resume going
    back renames newer ones), so the user's file would not stay where they put it.
    ``runs``: checkpoints folders the caller knows (a config's, even before its first save); any
    other is recognised by its name and the step_NNNNNN directories it holds."""
    real = path.absolute().resolve()
    known = {Path(r).absolute().resolve() for r in runs}
    for folder in [real, *real.parents]:
        if folder in known or _holds_checkpoints(folder):
            name = f"{flag} {path}" if flag else str(path)
            where = "is" if folder == real else "is inside"
            raise OutputError(f"{name} {where} the checkpoints folder of a run ({folder}), whose step directories "
                              "retention removes (megarl manages that folder); give a path outside it")  # fmt: skip


def _holds_checkpoints(folder: Path) -> bool:
    from megarl.checkpoint.verification import CHECKPOINTS_DIR, is_step_dir_name

    if folder.name != CHECKPOINTS_DIR:
        return False
    try:
        return any(is_step_dir_name(p.name) and p.is_dir() for p in folder.iterdir())
    except OSError:  # not there, or unreadable: nothing retention could delete from here
        return False
