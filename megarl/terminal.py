"""What the terminal shows: the command line's exit codes, and which log records and Python
warnings reach the terminal (megarl's and your own code's INFO, the libraries' warnings; a
library's INFO and installed packages' warnings only go to a command's log file)."""

from __future__ import annotations

import functools
import logging
import os
import sys
import sysconfig
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from megarl.std_streams import file_of

EXIT_OK, EXIT_INTERNAL, EXIT_USER = 0, 1, 2
EXIT_SIGINT, EXIT_SIGTERM, EXIT_BROKEN_PIPE = 130, 143, 141

# `megarl --log-level` (megarl/cli.py): megarl's loggers' level, in the driver and, through this
# variable (set in the driver, passed to Ray's workers by megarl/ray_cluster/session.py), in every
# worker process (worker_logging). Unset = info, the output as it always was.
LOG_LEVEL_ENV = "MEGARL_LOG_LEVEL"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# A record logged with ``extra=FILE_ONLY`` goes to the command's log file, never the terminal
# (a library's report that megarl's own line already says in one, e.g. a raylet's death).
FILE_ONLY = {"megarl_file_only": True}


_KEPT_STDERR: list[int] = []  # a copy of the command's stderr made at its start (keep_stderr)


def keep_stderr() -> None:
    """A copy of fd 2 as the command started, for its last line (error_line): user code in the
    driver may close or replace the process's stderr, and that line must still reach the user."""
    if not _KEPT_STDERR:
        try:
            _KEPT_STDERR.append(os.dup(2))  # (not inherited by children: Python's dup is non-inheritable)
        except OSError:
            pass


def error_line(text: str) -> None:
    """``text`` (a command's last line) on stderr, or on the copy keep_stderr made when the
    process's stderr was closed, broken or replaced meanwhile (fd 2 another file: a file opened
    after a close took its number)."""
    if not _KEPT_STDERR or file_of(2) == file_of(_KEPT_STDERR[0]):
        try:
            print(text, file=sys.stderr, flush=True)
            return
        except (OSError, ValueError, AttributeError):  # closed (EBADF), a None stream, a gone reader
            pass
    if _KEPT_STDERR:
        try:
            os.write(_KEPT_STDERR[0], (text + "\n").encode(errors="replace"))
        except OSError:
            pass


def setup_logging(level: str = "info") -> None:
    """The terminal's log: INFO and above of megarl and of your own code, the libraries'
    warnings. A library's INFO (Megatron's config dumps and gradient-bucket listings, in a run's
    own process with --in-process) goes only to the log file a command writes (a launch's or an
    SFT's driver.log), and so do installed packages' Python warnings where the command captures
    them (launch, sft). ``level`` (--log-level) debug adds megarl's DEBUG records (not the
    libraries'); warning and error leave out the INFO (and WARNING) of megarl and of your code."""
    terminal = StderrNowHandler()
    terminal.setFormatter(logging.Formatter(LOG_FORMAT, "%H:%M:%S"))
    terminal.addFilter(for_the_terminal)
    logging.basicConfig(level=logging.INFO, handlers=[terminal])  # (no-op where the root logger has handlers)
    if level != "info":
        logging.getLogger("megarl").setLevel(level.upper())
        if level != "debug":
            logging.getLogger().setLevel(level.upper())


class StderrNowHandler(logging.StreamHandler):
    """The terminal's log handler: it writes to ``sys.stderr`` as it is when a record comes, not
    as it was when logging was set up. A live progress bar (the training bar, rich) replaces
    sys.stderr on a terminal with a proxy that prints a line above the bar; written to the
    terminal directly, the line would land on the bar itself. A log record is written outside
    user code (in an empty context: megarl/user_code.py's marker unset), so the routing of user
    code's prints to their log, under the proxy or over it, sends it to the terminal: megarl's
    warnings from a call a generate function made still reach the terminal."""

    def emit(self, record: logging.LogRecord) -> None:
        import contextvars

        contextvars.Context().run(super().emit, record)

    @property
    def stream(self) -> Any:
        import sys

        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass  # (StreamHandler's __init__ and setStream: always the stderr of the moment)


class LogFileHandler(logging.FileHandler):
    """A command's log file (a launch's or an SFT's driver.log) that a failed write (a full disk)
    silences instead of printing a "--- Logging error ---" traceback per record to the terminal;
    ``failed``: the first such error (the command's ending then points at no traceback there).
    Any other error (a record that does not format) is shown as logging shows it."""

    failed: OSError | None = None

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        import sys

        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            self.failed = self.failed or error
            return
        super().handleError(record)

    def close(self) -> None:
        try:
            super().close()  # flushes what is buffered: on a full disk, that fails too
        except OSError as error:
            self.failed = self.failed or error


def worker_logging() -> None:
    """In a worker process (a Ray actor of megarl, its output already in its log file): megarl's
    loggers at the driver's --log-level (MEGARL_LOG_LEVEL). Unset or info: nothing changes (such
    a process shows megarl's warnings, as ever); debug also writes megarl's DEBUG and INFO records
    to the process's stderr, its log file."""
    level = os.environ.get(LOG_LEVEL_ENV, "").lower()
    if level not in LOG_LEVELS or level == "info":
        return
    megarl = logging.getLogger("megarl")
    megarl.setLevel(level.upper())
    if level == "debug" and not any(getattr(h, "megarl_worker", False) for h in megarl.handlers):
        handler = logging.StreamHandler()  # sys.stderr when it logs: the log file output_to_log made
        handler.setFormatter(logging.Formatter(LOG_FORMAT, "%Y-%m-%d %H:%M:%S"))
        handler.megarl_worker = True  # type: ignore[attr-defined]
        megarl.addHandler(handler)
        megarl.propagate = False  # (once, not again through a handler Ray may give the root logger)


def for_the_terminal(record: logging.LogRecord) -> bool:
    """Whether the terminal shows ``record``: not a library's INFO, nor a library's Python warning
    (logging.captureWarnings's "FILE:LINE: Category: ..."), nor a record logged with FILE_ONLY."""
    if getattr(record, "megarl_file_only", False):
        return False
    if record.name == "py.warnings":
        return not _in_a_library(record.getMessage().partition(":")[0])
    return record.levelno >= logging.WARNING or not _in_a_library(record.pathname)


@contextmanager
def hf_progress_bars_off() -> Iterator[None]:
    """transformers' progress bars ("Loading weights", "Writing model shards") off meanwhile: a bar
    per model load in every process that loads one (each reward worker, the engine's actor) is
    noise on the terminal and in logs; the setting is restored after."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


@contextmanager
def library_warnings_logged() -> Iterator[None]:
    """Python warnings go through logging while inside (``py.warnings``): the terminal leaves out
    the installed packages' (for_the_terminal), a command's log file keeps them. For commands that
    run Megatron in their own process (--in-process); a caller's capture stays on after."""
    captured = warnings.showwarning.__module__ == "logging"
    logging.captureWarnings(True)
    try:
        yield
    finally:
        logging.captureWarnings(captured)


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    import site

    dirs = {*site.getsitepackages(), site.getusersitepackages(), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    return tuple(os.path.join(d, "") for d in dirs if d)


MEGARL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")
# On CPU the CUDA-to-CPU mode forwards the libraries' torch calls: what torch warns about then
# points at its forwarding line.
CPU_COMPAT = os.path.join(MEGARL_DIR, "parallel", "cpu_compat.py")


def _in_a_library(path: str) -> bool:
    """Whether ``path`` is an installed package's file (megarl's own, installed or not, is not)."""
    return path == CPU_COMPAT or (path.startswith(_library_dirs()) and not path.startswith(MEGARL_DIR))
