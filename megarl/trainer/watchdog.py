"""Ending a run on purpose: interrupts (Ctrl-C, SIGTERM) and hangs, always through the trainer's
own shutdown, with one message that says what was saved and how to go on.

``RunControl`` holds the driver's signal handlers (installed in the main thread for the whole
run). Outside the step loop a signal stops at once (KeyboardInterrupt: nothing is half done).
Inside it the first SIGINT / SIGTERM (Slurm's preemption signal) / SIGHUP (a closed terminal, an
ssh connection dropped: the shell passes it to its jobs) / any other signal whose default would
end the driver without a word (SIGALRM, SIGXCPU, a real-time signal: megarl/signal_kinds.py
``OTHER_STOPS``, a SIGTERM of its own name and exit code) only asks to stop: the step
finishes, a checkpoint is written if ``trainer.checkpoint_on_signal`` (and the step did not
already save one), then ``RunStopped`` ends the run; a second signal abandons the step at once,
and so does user code (an interaction, tools, reward functions, a generate function) the step
waits on that does not return within STOP_GRACE_S of the stop (megarl/user_code.py ``WaitAbandoned``;
a generate function runs in the main thread itself: a timer interrupts it). The handlers' own lines
reach the terminal also while user code, whose prints go to its log, runs.
A stop signal repeated within ``REPEAT_WINDOW_S`` counts as the same request (all but SIGINT
and SIGQUIT, which a person sends): on preemption Slurm signals every process of the job and the
batch script forwards the TERM too (launch/); the kernel and the hung-up shell both send SIGHUP;
the kernel resends SIGXCPU about once a CPU-second past the limit, and an interval timer repeats
SIGALRM, SIGVTALRM and SIGPROF. The watchdog's own interrupt (HANG_SIGNAL) sent from outside,
with no hang found, is a stop like those. After a SIGHUP the terminal is gone (a
write to it fails with EIO), so stdout and stderr, where they were that terminal, go to
/dev/null: the run ends in <output_dir>/logs/driver.log.
While shutting down, further signals are ignored (Ray and the worker processes are cleaned up
either way; after SIGKILL the session's reaper does it, megarl/ray_cluster/session.py).

``Watchdog`` is a thread that reads ``megarl.progress.PROGRESS`` (the phase the driver entered or
left last): when nothing moved for ``trainer.hang_timeout_s``, it makes every rank write its
Python stacks to its log (``WorkerGroup.dump_stacks``), writes the driver's to
``<output_dir>/logs/driver_stacks.log``, and interrupts the main thread, which raises
``HangError`` naming the phase and the ranks that did not answer.
"""

from __future__ import annotations

import contextvars
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any

from megarl import user_code
from megarl.driver_supervisor import command_pid
from megarl.process_signals import stops_handled
from megarl.progress import PROGRESS
from megarl.signal_kinds import (
    HANG_SIGNAL,
    OTHER_STOPS,
    STACKS_SIGNALS,
    STOPS,
    exit_code,
    signal_name,
    unclaimed,
)
from megarl.std_streams import to_devnull
from megarl.stop_origin import group_sender, passed_on, user_code_in_driver
from megarl.terminal import EXIT_USER
from megarl.user_code import SignalInterrupt, current_wait, stop_requested

log = logging.getLogger(__name__)

# Ctrl-\ (SIGQUIT) stops at once, as a second Ctrl-C does: Python's default would kill the driver
# with no line (and a core), nothing of the step's end saved, Ray's processes left to the reaper.
AT_ONCE = (signal.SIGQUIT,)
_NAMES: dict[int, str] = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGHUP: "SIGHUP (terminal closed)",
                          signal.SIGQUIT: "SIGQUIT (Ctrl-\\)"}  # where the name alone says too little  # fmt: skip
REPEAT_WINDOW_S = 5.0  # a repeat this soon after the first (but a Ctrl-C's, Ctrl-\\'s) is the same request, not "stop at once"
ONCE_MORE_AT_ONCE = (signal.SIGINT, signal.SIGQUIT)  # sent by a person: a repeat is meant, at once
# A supervised driver's first stop that its supervisor did not announce waits at most this long for
# the sentinel's record of who sent it (megarl/stop_origin.py), which comes within milliseconds for a
# signal to the driver's whole group; a stop to the driver's pid alone has none and waits it out.
HOLD_S = 2.0


class RunStopped(Exception):
    """The run stopped on a signal; the message says what was saved and the resume command."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class HangError(RuntimeError):
    """No phase made progress for trainer.hang_timeout_s."""


class RunControl:
    """The driver's signal handling for one run; ``resume_command`` is quoted when it stops."""

    def __init__(self, resume_command: str = "", save_on_signal: bool = True, saves: str = "a checkpoint"):
        self.resume_command = resume_command
        self.save_on_signal = save_on_signal
        self.saves = saves  # what a stop writes, named in the first signal's line ("the model" for megarl sft)
        self.signal: int | None = None  # the first stop signal received (STOPS, OTHER_STOPS)
        self.signal_at = 0.0  # when it came (time.monotonic())
        self.deferred = False  # inside the step loop: the first signal waits for the step's end
        self.cleaning = False  # shutting down: signals are ignored
        self.hang: str | None = None  # the watchdog's finding
        self.interrupted: tuple[str, float] | None = None  # the user code the main thread waited on when a signal abandoned it
        self.again: int | None = None  # a second stop, other than the first, that abandoned the step
        self._again_passed_on = False  # ... and whether it came through the megarl command (a person's: "Ctrl-C")
        self.installed = False
        self._overdue_sent = False  # HANG_SIGNAL sent for user code past the stop's grace (_interrupt_overdue)
        # A stop from the driver's own process group or to its pid, not through its supervisor (user
        # code's os.killpg(os.getpgrp(), ...)): what it says, once no announced stop came after it.
        self.inside: str | None = None
        self._judged: deque[tuple[int, str | None]] = deque()  # unannounced stops judged, for the main thread (HANG_SIGNAL)
        self._unannounced_ok = False  # acting on one: not held again
        self._hang_lock = threading.Lock()  # installed's check and the hang interrupt, apart from putting the handlers back

    @property
    def stop_requested(self) -> bool:
        return self.signal is not None

    @property
    def exit_code(self) -> int:
        # a stop user code sent is its error (the user's mistake), not the user's stop
        return EXIT_USER if self.inside else exit_code(self.signal or signal.SIGINT)

    def stopped(self, message: str) -> RunStopped:
        """The RunStopped ending a stopped command: ``message`` (what was kept, how to go on), after
        the ``error:`` line of a stop that user code in the driver sent."""
        if self.inside is None:
            return RunStopped(message, self.exit_code)
        fix = (f"let user code signal only the processes it starts (start them with start_new_session=True and "
               f"signal their group); to stop a run, signal the megarl command (pid {command_pid()})")
        return RunStopped(f"error: {self.inside}; {fix}\n{message}", self.exit_code)

    @property
    def signal_name(self) -> str:
        signum = self.signal or signal.SIGINT
        return signal_name(signum) if self.inside else _NAMES.get(signum) or signal_name(signum)  # (no "(Ctrl-C)" then)

    @property
    def abandoned_by(self) -> str:
        """"SIGINT (Ctrl-C) received" when a second stop, not the first one's signal, abandoned the
        step (the first one, named by the stop line, had asked to stop after it), else ""."""
        if self.again is None:
            return ""
        return f"{(_NAMES.get(self.again) if self._again_passed_on else None) or signal_name(self.again)} received"

    @property
    def meanwhile(self) -> str:
        """For a stop line: " (data.custom_cls DS.__getitem__(5) had run for 28 s)" when the signal
        abandoned a wait on user code (user_code.waiting_on), else "": a stop during start-up names what it cut short."""
        if self.interrupted is None:
            return ""
        who, seconds = self.interrupted
        return f" ({who} had run for {seconds:.0f} s)"

    @contextmanager
    def handlers(self) -> Iterator[RunControl]:
        """Install the handlers (main thread only; elsewhere Python's defaults stay)."""
        if self.installed or threading.current_thread() is not threading.main_thread():
            yield self
            return
        # OTHER_STOPS (SIGALRM, SIGXCPU, the real-time signals, ...) stop as SIGTERM does, where
        # nothing else handles them (a library's handler, an ignore the parent chose): their
        # default would end the driver without a word, nothing saved, Ray's processes left behind.
        stops = (*STOPS, *unclaimed(OTHER_STOPS, owner=RunControl))
        previous = {s: signal.getsignal(s) for s in (*stops, HANG_SIGNAL)}
        for s in stops:
            signal.signal(s, self._on_signal)
        signal.signal(HANG_SIGNAL, self._on_hang)
        self.installed = True
        try:
            with stops_handled((*stops, HANG_SIGNAL)):  # what a child forked in a save passes on (megarl/process_signals.py)
                yield self
        finally:
            # Not installed before a handler is put back: a watchdog thread that outlived its join
            # would send HANG_SIGNAL to a process whose default action for it is to die.
            try:
                with self._hang_lock:  # (its wait may raise the interrupt sent meanwhile)
                    self.installed = False
            finally:
                self.installed = False
                for s, handler in previous.items():
                    signal.signal(s, handler)
                stop_requested(None)  # (a later run in this process starts with no stop asked)

    def reclaim(self) -> None:
        """Put the handlers back after a library replaced them: ray.init installs Ray's own
        SIGTERM handler, which ends the driver at once (exit 15) instead of after the step. Only
        the four named STOPS are taken back: Ray sets handlers for SIGINT and SIGTERM (SIGHUP and
        SIGQUIT go with them); a handler a library set for one of the OTHER_STOPS (a profiler's
        SIGPROF) stays the library's, as one set before the run's does."""
        if self.installed:
            for s in STOPS:
                signal.signal(s, self._on_signal)

    def enter_starting(self, stack: ExitStack, session: AbstractContextManager[Any], stopped: Callable[[], Exception]) -> None:
        """Enter ``session`` (Ray's start) on ``stack``; a Ctrl-C / SIGTERM meanwhile raises
        ``stopped()``, also when Python swallowed its interrupt but the handler recorded it (a
        signal inside ray.init's at-fork callbacks: megarl/ray_cluster/session.py)."""
        try:
            stack.enter_context(session)
        except KeyboardInterrupt:
            raise stopped() from None
        self.reclaim()
        if self.stop_requested:
            raise stopped()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGHUP:
            _leave_hung_up_terminal()
        if self.signal is None and not self._unannounced_ok and not self.cleaning and passed_on(signum) is False:
            self._hold_unannounced(signum)
            return
        first = self.signal is None
        if first or (signum in AT_ONCE and not self.cleaning):  # the stop line names the stop at once
            self.signal, self.signal_at = signum, time.monotonic()
        elif (signum == self.signal and signum not in ONCE_MORE_AT_ONCE
              and time.monotonic() - self.signal_at < REPEAT_WINDOW_S):
            return  # the same request delivered twice (Slurm and the batch script; the kernel and the shell; a timer)
        if self.cleaning:
            _say("\nmegarl: shutting down, please wait")
            return
        if first and self.deferred and signum not in AT_ONCE:
            stop_requested(self.signal_at, self._interrupt_overdue)  # user code the step waits on gets STOP_GRACE_S more, not its whole timeout
            save = f" and saving {self.saves}" if self.save_on_signal else ""
            waiting = current_wait()
            meanwhile = (f"; waiting at most {user_code.STOP_GRACE_S:g} s more for {waiting[0]} (waited on for {waiting[1]:.0f} s)"
                         if waiting is not None else "")
            received = self.inside or f"{_NAMES.get(signum) or signal_name(signum)} received"
            _say(f"\nmegarl: {received}: stopping after this step{save}{meanwhile}; "
                 f"send it again{'' if signum in ONCE_MORE_AT_ONCE else ' after 5 s'} to stop at once")
            return
        self.interrupted = self.interrupted or current_wait()
        if not first and signum != self.signal and self.again is None:
            self.again, self._again_passed_on = signum, passed_on(signum) is not False
        raise SignalInterrupt  # abandon what runs now (Ray's waits turn it into KeyboardInterrupt too)

    def _hold_unannounced(self, signum: int) -> None:
        """A stop the supervisor did not announce: judged by a thread of its own (the sentinel's
        record may come after this handler runs); the user code the step waits on is noted now,
        while the code that sent the stop may still run."""
        waiting = current_wait()
        running = f"{waiting[0]}, which ran then" if waiting else user_code_in_driver()
        threading.Thread(target=self._judge_unannounced, args=(signum, running), name="megarl-stop-origin", daemon=True).start()

    def _judge_unannounced(self, signum: int, running: str | None) -> None:
        """The driver's own doing only when the sentinel saw its group get ``signum`` from the
        driver or a descendant; else (a sender outside, no record within HOLD_S) the user's stop.
        The main thread acts on it (:meth:`_on_hang`)."""
        deadline = time.monotonic() + HOLD_S
        while (sender := group_sender(signum)) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        said = None
        if sender is not None and sender[1]:
            itself = sender[0] == os.getpid()
            who = "the driver itself" if itself else f"pid {sender[0]}, a process the driver started"
            how = ("os.killpg(os.getpgrp(), ...), os.kill(0, ...)" if itself
                   else f"kill -{signal_name(signum).removeprefix('SIG')} 0, os.killpg(0, ...) in a process it started")  # fmt: skip
            code = f"user code in the driver ({running})" if running else "code in the driver"
            said = (f"{signal_name(signum)} was sent to the driver's process group (pid {os.getpid()}) by {who}, not through the "
                    f"megarl command (pid {command_pid()}): {code} signalled its own process group ({how})")  # fmt: skip
        with self._hang_lock:
            if self.installed and self.signal is None and not self.cleaning:
                self._judged.append((signum, said))
                signal.pthread_kill(threading.main_thread().ident, HANG_SIGNAL)  # type: ignore[arg-type]

    def _on_hang(self, signum: int, frame: Any) -> None:
        if self._judged:
            while self._judged:  # (a deque: the judges append from their threads meanwhile)
                stop, said = self._judged.popleft()
                if self.signal is None and not self.cleaning:
                    self.inside, self._unannounced_ok = said, True
                    try:
                        self._on_signal(stop, frame)
                    finally:
                        self._unannounced_ok = False
            if not self._overdue_sent and self.hang is None:  # (one handler call may answer two sends of it)
                return
        if self._overdue_sent:  # user code the main thread runs itself is past the stop's grace
            self._overdue_sent = False
            abandoned = user_code.overdue()
            if abandoned is not None and not self.cleaning:  # (None: it returned meanwhile)
                raise abandoned
            return
        if self.hang is None:  # sent from outside: a stop, as every other real-time signal
            if signum not in STACKS_SIGNALS:  # (without SIGRTMIN it is SIGUSR2: a stacks request, no stop)
                self._on_signal(signum, frame)
        elif not self.cleaning:
            raise SignalInterrupt

    def _interrupt_overdue(self) -> None:
        """From user_code's timer: the main thread raises WaitAbandoned (:meth:`_on_hang`)."""
        with self._hang_lock:
            if self.installed:
                self._overdue_sent = True
                signal.pthread_kill(threading.main_thread().ident, HANG_SIGNAL)  # type: ignore[arg-type]

    def interrupt_for_hang(self, message: str) -> None:
        """From the watchdog thread: the main thread raises (and the run ends in HangError)."""
        self.hang = message
        with self._hang_lock:
            if self.installed:
                signal.pthread_kill(threading.main_thread().ident, HANG_SIGNAL)  # type: ignore[arg-type]


def run_stoppable(work: Callable[[], Any], stopped: str) -> Any:
    """``work()`` (a command with no steps: evaluate, convert) under RunControl's handlers: a
    Ctrl-C, SIGTERM or SIGHUP stops it at once, the ``finally`` blocks and context managers on
    the way out running (Python's default SIGTERM / SIGHUP would end the process there and then:
    no line, a reward pool's workers or Ray's left to the reaper), and ends in RunStopped:
    ``stopped by <signal> <stopped>``, with the signal's exit code, 128 + its number (130 / 143 /
    129; 142 for SIGALRM)."""
    control = RunControl()
    try:
        with control.handlers():
            return work()
    except KeyboardInterrupt:
        raise control.stopped(f"stopped by {control.signal_name} {stopped}") from None
    except Exception:
        if control.signal is None:
            raise
        # The stop's interrupt was swallowed inside a library (a signal in ray.init's at-fork
        # callbacks), which then failed of the stop (its GCS, sent the Ctrl-C too, was gone):
        # the stop is what the user asked for, not an error of the command.
        raise control.stopped(f"stopped by {control.signal_name} {stopped}") from None


def _say(line: str) -> None:
    """``line`` to the terminal (stderr), also from a handler that interrupted user code: in an
    empty context the routing of user code's prints (megarl/user_code.py) sends it there, not to
    the user-code log."""
    contextvars.Context().run(print, line, file=sys.stderr, flush=True)


def _leave_hung_up_terminal() -> None:
    """stdout / stderr on a terminal that hung up go to /dev/null: every write there fails (EIO,
    even one of zero bytes, which is how it is told: isatty is False by then), and a failing print
    would end the run wherever it stands instead of after the step. Files, pipes (nohup, a
    redirect, Slurm's output) and a terminal still there (a `kill -HUP`) stay."""
    import errno
    import os

    for fd in (1, 2):
        try:
            os.write(fd, b"")
        except OSError as exc:
            if exc.errno == errno.EIO:
                to_devnull(fd)


class Watchdog:
    """Stops the run when no phase makes progress for ``timeout_s`` (see the module docstring)."""

    def __init__(self, control: RunControl, timeout_s: float, groups: dict[str, Any], log_dir: Path):
        self.control, self.timeout_s, self.groups, self.log_dir = control, timeout_s, groups, Path(log_dir)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="megarl-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        PROGRESS.mark("start")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _watch(self) -> None:
        poll = max(0.2, min(5.0, self.timeout_s / 10))
        while not self._stop.wait(poll):
            phase, idle, step = PROGRESS.snapshot()
            if idle > self.timeout_s:
                self.control.interrupt_for_hang(self._report(phase, idle, step))
                return

    def _report(self, phase: str, idle: float, step: int) -> str:
        waiting = [f"{role} rank(s) {ranks} did not answer {what}" for role, group in self.groups.items()
                   for what, ranks in group.pending_calls()]
        silent = []
        for role, group in self.groups.items():
            written = group.dump_stacks()
            silent += [f"{role} rank {r}" for r, ok in written.items() if not ok]
        driver = self._driver_stacks()
        parts = [f"no progress for {idle:.{0 if idle >= 10 else 1}f} s in phase '{phase}' of step {step} (trainer.hang_timeout_s={self.timeout_s:g})",
                 "; ".join(waiting) or "no worker call was in flight (the driver itself was stuck)",
                 f"every rank wrote its Python stacks to its log in {self.log_dir}" if not silent else
                 f"Python stacks are in the rank logs in {self.log_dir}, except {', '.join(silent)} (stopped or dead?)",
                 f"the driver's are in {driver}" if driver else "",
                 "raise trainer.hang_timeout_s if the phase is only slow"]
        message = "; ".join(p for p in parts if p)
        log.error("%s", message)
        return message

    def _driver_stacks(self) -> Path | None:
        path = self.log_dir / "driver_stacks.log"
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError:
            return None
        return path
