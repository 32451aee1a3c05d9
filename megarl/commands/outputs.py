"""What the commands write for the user: an output is never written over what the user has,
unless they ask (``--overwrite``); checked before any work, so a refusal costs nothing."""

from __future__ import annotations

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
