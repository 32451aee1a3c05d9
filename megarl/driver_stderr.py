"""A supervised driver's stderr, passed on to the terminal by its supervisor, less Ray's C++ lines.

Ray's core worker in the driver writes its own log lines to the process's stderr at the C level,
where no Python handler sees them: when its raylet dies, "[2026-11-29 19:51:17,280 E 14936 14936]
core_worker_process.cc:247: Failed to register worker to Raylet: ..." and the like, just before it
ends the driver (and its Python logger: "2026-11-29 20:33:14,340 INFO node.py:438 -- Failed to
get node info ...", 30 s after the raylet died as Ray started); and absl's failure-signal report ("*** SIGABRT received at time=... ***", its PC
and stack frames) when Ray's teardown aborts. Such lines came before megarl's one line. The
supervisor (megarl/driver_supervisor.py) gives the driver a pipe as its stderr and relays it: those
lines go to the command's log file instead (the one the driver reported: launch's and sft's
driver.log, convert's ray_reports.log beside its ranks' logs), or stay on the terminal while the
driver has named none (the supervisor reads the driver's reports every 0.2 s: a log named just
before is not known yet; Ray starts seconds after the driver names it); everything else passes at
once, partial lines included (a prompt, a progress bar's ``\r`` updates): only a partial line that
can still become one of Ray's or absl's (what has arrived so far fits their start) waits for its
end, and HOLD_S at most without more data. The driver's stdout is left as it is on a terminal (a progress bar's);
where stdout and stderr are one file or pipe, it goes through the relay too, which keeps their order.
"""

from __future__ import annotations

import os
import re
import select
import threading

# Ray's C++ log line (spdlog: [date time,ms level pid tid] file:line: ...) and absl's report of a fatal signal.
RAY_LINE = re.compile(rb"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [DIWEFC] \d+ \d+\] \S+:\d+: ")
ABSL_LINE = re.compile(rb"\*\*\* SIG[A-Z]+ received at time=\d+|PC: @ |    @ +0x[0-9a-f]+ ")
RAY_START = b"[0000-00-00 00:00:00,000 L"  # the fixed-width start of Ray's line: 0 a digit, L its level
# Ray's Python logger's line (its own format: "<date> <time>,<ms>\tLEVEL file.py:line -- msg"), as
# "INFO node.py:438 -- Failed to get node info b'GCS cannot find the node ...'" when the raylet died
# as Ray started. Ray's word on the cluster it joined (with its dashboard's address) stays on the
# terminal; its "Started a local Ray instance" goes to the log too (megarl's own lines say where
# Ray starts: launch's "starting an embedded Ray", the others' "starting Ray ..." on a slow start).
RAY_PY_LINE = re.compile(rb"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\s+(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+\.py:\d+ -- ")
RAY_PY_START = b"0000-00-00 00:00:00,000"
RAY_PY_KEPT = (b"-- Connected to Ray cluster",)
ABSL_STARTS = (b"*** SIG", b"PC: @ ", b"    @ ")
HOLD_S = 0.1  # how long a partial line that may be Ray's waits for more before it is passed on
JOIN_TIMEOUT_S = 5.0  # a process that kept the pipe open (none should, once the driver's tree is ended)
STOP_TIMEOUT_S = 1.0  # for the relay to stop after that (a write to a stalled terminal may hold it)


class StderrRelay:
    """The pipe a driver writes its stderr to (``write_fd``, for the child) and the thread that
    passes it on to this process's stderr; ``log_file``: where Ray's lines go (None: the terminal)."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        self.log_file: str | None = None
        self._thread = threading.Thread(target=self._relay, name="megarl-driver-stderr", daemon=True)
        self._stopped = threading.Event()  # set once the supervisor stops waiting: nothing more is passed on

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
        """Wait for the rest of what the driver wrote (after it ended), at most JOIN_TIMEOUT_S; then
        the relay stops (what a process still holding the pipe writes is dropped) and closes the
        pipe, so that nothing it passes on comes after the supervisor's own line."""
        self._thread.join(timeout=JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            self._stopped.set()
            self._thread.join(timeout=STOP_TIMEOUT_S)  # it looks at the flag every HOLD_S

    def _relay(self) -> None:
        poller = select.poll()
        poller.register(self.read_fd, select.POLLIN)
        pending = b""
        while not self._stopped.is_set():
            if not poller.poll(int(HOLD_S * 1000)):  # nothing more for HOLD_S: a held partial line goes on
                if pending:
                    self._pass(pending)
                    pending = b""
                continue
            try:
                chunk = os.read(self.read_fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                self._pass(line + b"\n")
            if pending and not may_become_ray(pending):
                self._pass(pending)
                pending = b""
        if pending:
            self._pass(pending)
        os.close(self.read_fd)

    def _pass(self, data: bytes) -> None:
        if self._stopped.is_set():  # the supervisor's line may be printing
            return
        if self.log_file and is_ray_s(data) and _appended(self.log_file, data):
            return
        try:
            while data:
                data = data[os.write(2, data) :]
        except OSError:  # a terminal that hung up: what the driver writes is dropped, never left to block it
            pass


def is_ray_s(line: bytes) -> bool:
    """Whether ``line`` is one of Ray's (its C++ log's, its Python logger's but for the cluster it
    joined) or absl's: for the log file."""
    if RAY_PY_LINE.match(line):
        return not any(kept in line for kept in RAY_PY_KEPT)
    return bool(RAY_LINE.match(line) or ABSL_LINE.match(line))


def may_become_ray(partial: bytes) -> bool:
    """Whether a partial line can still become one of Ray's or absl's lines: what arrived so far
    fits the start of one (a digit where Ray's date has one, its level letter)."""
    if any(partial[: len(start)] == start[: len(partial)] for start in ABSL_STARTS):
        return True
    return any(all(want == got or (want == ord("0") and 0x30 <= got <= 0x39) or (want == ord("L") and got in b"DIWEFC")
                   for want, got in zip(start, partial)) for start in (RAY_START, RAY_PY_START))  # fmt: skip


def _appended(path: str, data: bytes) -> bool:
    try:
        with open(path, "ab") as f:
            f.write(data)
        return True
    except OSError:  # (a full disk, a removed folder): the terminal then
        return False
