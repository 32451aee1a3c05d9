"""A full disk, reported as one line: what was being written, where, and what is kept.

Any write can meet a full disk (ENOSPC) or an exhausted quota (EDQUOT): a checkpoint's save (in
a worker rank too: its error comes back with the OSError as its ``cause``), a metrics record, a
step's rollouts, an output file. :func:`writing` turns that into a :class:`DiskFullError` naming
the path and the thing written; the command (or the trainer, which adds the last complete
checkpoint and the resume command) says what is kept; megarl/cli.py prints it as one ``error:``
line. :func:`disk_full_cause` finds the full disk in an exception's chain, for the failures no
writer wrapped. Left out: making room (megarl never deletes what the user owns to free space)."""

from __future__ import annotations

import errno
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

FULL = (errno.ENOSPC, errno.EDQUOT)
FULL_TEXT = ("No space left on device", "Disk quota exceeded")  # pyarrow's IO errors carry no errno


class DiskFullError(OSError):
    """Writing ``what`` to ``path`` met a full disk; ``kept``: what is there to go on from."""

    def __init__(self, path: str | Path, what: str, reason: str, kept: str = "", fix: str = ""):
        super().__init__(errno.ENOSPC, reason)
        self.path, self.what, self.reason, self.kept = str(path), what, reason, kept
        self.fix = fix or "free space on that disk (megarl deletes nothing of yours to make room), then run the same command again"

    def __str__(self) -> str:
        kept = f"; kept: {self.kept}" if self.kept else ""
        return f"the disk is full: writing {self.what} to {self.path} failed ({self.reason}){kept}; {self.fix}"

    def with_kept(self, kept: str, fix: str | None = None) -> DiskFullError:
        """The same error, saying what is kept (and how to go on)."""
        return DiskFullError(self.path, self.what, self.reason, kept, fix or self.fix)


def disk_full_cause(exc: BaseException | None) -> BaseException | None:
    """The full-disk error in ``exc``'s chain (its causes, contexts and a worker error's ``cause``),
    or None: an OSError with ENOSPC or EDQUOT, or any error that says so (pyarrow's IO errors,
    torch's distributed-checkpoint errors, which gather the ranks' failures as text)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if getattr(exc, "errno", None) in FULL or any(text in str(exc) for text in FULL_TEXT):
            return exc
        exc = getattr(exc, "cause", None) or exc.__cause__ or exc.__context__
    return None


def reason_of(exc: BaseException) -> str:
    """The system's words for the full disk ``exc`` met."""
    if isinstance(exc, OSError) and exc.errno in FULL and exc.strerror:
        return exc.strerror
    return FULL_TEXT[1] if "quota" in str(exc).lower() else FULL_TEXT[0]


@contextmanager
def writing(path: str | Path, what: str, *, kept: str = "", fix: str = "") -> Iterator[None]:
    """Inside, a full disk met writing ``what`` to ``path`` raises DiskFullError (an error that is
    already one stays as it is)."""
    try:
        yield
    except DiskFullError:
        raise
    except BaseException as exc:
        full = disk_full_cause(exc)
        if full is None:
            raise
        raise DiskFullError(path, what, reason_of(full), kept, fix) from exc  # the path the user knows, not a temporary file's


@contextmanager
def quiet_threads() -> Iterator[None]:
    """Inside, a thread that dies of a full disk (TensorBoard's event writer) prints no traceback:
    its owner raises the error again on its next call, which ends the run in one line."""
    before = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if disk_full_cause(args.exc_value) is None:
            before(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = before
