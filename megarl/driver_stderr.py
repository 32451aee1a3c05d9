"""A supervised driver's stderr, passed on to the terminal by its supervisor, less Ray's C++ lines.

Ray's core worker in the driver writes its own log lines to the process's stderr at the C level,
where no Python handler sees them: when its raylet dies, "[2026-11-29 19:51:17,280 E 14936 14936]
core_worker_process.cc:247: Failed to register worker to Raylet: ..." and the like, just before it
ends the driver; and absl's failure-signal report ("*** SIGABRT received at time=... ***", its PC
and stack frames) when Ray's teardown aborts. Such lines came before megarl's one line. The
supervisor (megarl/driver_supervisor.py) gives the driver a pipe as its stderr and relays it: those
lines go to the command's log file instead (the one the driver reported: launch's and sft's
driver.log, convert's ray_reports.log beside its ranks' logs), or stay on the terminal while the
driver has named none (the supervisor reads the driver's reports every 0.2 s: a log named just
before is not known yet; Ray starts seconds after the driver names it); everything else passes at once, partial lines included (a line that may
be Ray's waits for its end). The driver's stdout is left as it is on a terminal (a progress bar's);
where stdout and stderr are one file or pipe, it goes through the relay too, which keeps their order.
"""

from __future__ import annotations

import os
import re
import threading

# Ray's C++ log line (spdlog: [date time,ms level pid tid] file:line: ...) and absl's report of a fatal signal.
RAY_LINE = re.compile(rb"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [DIWEFC] \d+ \d+\] \S+:\d+: ")
ABSL_LINE = re.compile(rb"\*\*\* SIG[A-Z]+ received at time=\d+|PC: @ |    @ +0x[0-9a-f]+ ")
MAY_BE_RAY = (b"[", b"*", b"P", b" ")  # a partial line starting so may be one of those: kept until its end
JOIN_TIMEOUT_S = 5.0  # a process that kept the pipe open (none should, once the driver's tree is ended)


class StderrRelay:
    """The pipe a driver writes its stderr to (``write_fd``, for the child) and the thread that
    passes it on to this process's stderr; ``log_file``: where Ray's lines go (None: the terminal)."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        self.log_file: str | None = None
        self._thread = threading.Thread(target=self._relay, name="megarl-driver-stderr", daemon=True)

    def child_streams(self) -> tuple[int | None, int]:
        """Popen's (stdout, stderr) for the driver: its stderr through the relay; its stdout too
        where this process's stdout and stderr are one file that is no terminal (``2>&1`` into a
        log, a pipe, Slurm's output), so that the two stay in the order the driver wrote them. A
        terminal's stdout stays the driver's own (its progress bar needs the terminal)."""
        try:
            merged = os.path.samestat(os.fstat(1), os.fstat(2)) and not os.isatty(1)
        except OSError:  # a closed stdout or stderr: each as it is
            merged = False
        return (self.write_fd if merged else None), self.write_fd

    def start(self) -> None:
        """Once the driver holds ``write_fd``: this process's copy is closed (the end of the pipe
        is the end of the driver's tree) and the relay starts."""
        os.close(self.write_fd)
        self._thread.start()

    def finish(self) -> None:
        """Wait for the rest of what the driver wrote (after it ended), at most JOIN_TIMEOUT_S."""
        self._thread.join(timeout=JOIN_TIMEOUT_S)

    def _relay(self) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(self.read_fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                self._pass(line + b"\n")
            if pending and not pending.startswith(MAY_BE_RAY):
                self._pass(pending)
                pending = b""
        if pending:
            self._pass(pending)
        os.close(self.read_fd)

    def _pass(self, data: bytes) -> None:
        if self.log_file and (RAY_LINE.match(data) or ABSL_LINE.match(data)) and _appended(self.log_file, data):
            return
        try:
            while data:
                data = data[os.write(2, data) :]
        except OSError:  # a terminal that hung up: what the driver writes is dropped, never left to block it
            pass


def _appended(path: str, data: bytes) -> bool:
    try:
        with open(path, "ab") as f:
            f.write(data)
        return True
    except OSError:  # (a full disk, a removed folder): the terminal then
        return False
