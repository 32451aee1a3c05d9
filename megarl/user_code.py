"""The user's own code run in the driver (tools, interactions, data.custom_cls, a generate
function), reported as the user's: what it did to end the process and where it lives.

Python's ways for code to end its process (``sys.exit``, ``raise KeyboardInterrupt`` /
``SystemExit`` / ``GeneratorExit``, or a BaseException subclass of its own) would otherwise pass
through megarl as if they were megarl's own ending: the function's exit code, "stopped by SIGINT
(Ctrl-C)" blaming the user's keyboard, or a traceback. Each place that calls user code catches
what :func:`ends_process` names and says it as the code's (:func:`exit_description`): one
`error:` line with exit code 2 naming the function, its file, what it did and the fix. A
KeyboardInterrupt that a signal raised (the user's own Ctrl-C) is left alone: see :func:`raised_by_code`.

What such code prints goes to a log file, not the terminal: :func:`user_output_to` puts a
:class:`RoutedStream` in place of sys.stdout and sys.stderr, which sends a write made while
:func:`running` marks user code (a contextvar: it follows the call, its asyncio tasks and the
threads megarl starts for it) to ``logs/user_code.log`` and any other write (megarl's own lines,
its progress bars) to the terminal as before (log records skip it: megarl/terminal.py); an error
about the code quotes the head of what it printed (:func:`printed_head`). :func:`call_with_deadline` bounds a call of user code in time.
After a stop request (the driver's first signal inside a step) the main thread's waits on user code
(:func:`wait_for_user`, :func:`give_up_after_stop`) and a generate function it runs itself
(:func:`running_here`) last at most STOP_GRACE_S more: code that hangs does not hold a stop for its
whole timeout.

Left out: reward functions, which run in worker processes (megarl/rewards/worker.py reports
them the same way), and code that ends its process at the C level (os._exit): in the driver that
ends the run as the process's own exit, which only a separate process could survive. Threads the
user's code starts itself, and writes to the file descriptors (os.write(1, ...), a C library's
printf), are not marked: they reach the terminal.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from megarl.output_cap import MB, marker, warn_once
from megarl.signal_kinds import STOPS, signal_name
from megarl.std_streams import file_of, moves
from megarl.stop_origin import announced_unclaimed

EXITS = (SystemExit, KeyboardInterrupt, GeneratorExit)  # user code trying to end its process
log = logging.getLogger(__name__)
_WARNED: set[str] = set()  # the process-state warnings given (one per piece of user code and kind)


class SignalInterrupt(KeyboardInterrupt):  # noqa: N818 - a KeyboardInterrupt, named as its kind is
    """The KeyboardInterrupt megarl's own signal and hang handlers raise (megarl/trainer/watchdog.py):
    the user's Ctrl-C or a stop request, never the code that happened to be running."""


class UserCodeError(RuntimeError):
    """The user's own code (a tool, an interaction, a dataset class, a generate function) tried to
    end the process or failed; the message names it, its file, what it did and the fix."""


def exit_description(exc: BaseException) -> str:
    """How code tried to end its process, for an error line: "called sys.exit(3)", "raised KeyboardInterrupt",
    "raised Boom (a BaseException, which only ends a process): ..."."""
    if isinstance(exc, SystemExit):
        frames = traceback.extract_tb(exc.__traceback__)
        called = bool(frames) and "exit(" in (frames[-1].line or "")
        return f"called sys.exit({exc.code!r})" if called else f"raised SystemExit({exc.code!r})"
    if isinstance(exc, EXITS):
        return f"raised {type(exc).__name__}"
    if isinstance(exc, asyncio.CancelledError):
        return "let an asyncio cancellation (CancelledError) escape it, which only ends a process"
    return f"raised {type(exc).__name__} (a BaseException, which only ends a process){f': {exc}' if str(exc) else ''}"


def ends_process(exc: BaseException) -> bool:
    """Whether ``exc``, out of user code, is the code trying to end its process: no Exception (one
    of EXITS, or a BaseException subclass of its own) and raised by the code, not by a signal's
    handler (:func:`raised_by_code`)."""
    return not isinstance(exc, Exception) and raised_by_code(exc)


def raised_by_code(exc: BaseException) -> bool:
    """Whether ``exc`` came from the code (``raise``, ``sys.exit``) rather than a signal: never a
    SignalInterrupt (megarl's handlers); off the main thread always (signals reach the main thread
    only); on it, a plain KeyboardInterrupt counts as the code's only when its innermost frame is a
    ``raise`` statement (Python's own SIGINT handler raises it wherever the main thread was)."""
    if isinstance(exc, SignalInterrupt):
        return False
    if (
        not isinstance(exc, KeyboardInterrupt)
        or threading.current_thread() is not threading.main_thread()
    ):
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and re.search(r"\braise\b", frames[-1].line or "") is not None  # (one-liners too: `def f(): raise X`)


def source_file(obj: Any) -> str:
    """The file that defines ``obj`` (a function, method, class or instance), or "its file" when unknown."""
    target = obj if inspect.isroutine(obj) or inspect.isclass(obj) else type(obj)
    try:
        return inspect.getsourcefile(inspect.unwrap(target)) or "its file"
    except TypeError:
        return "its file"


@contextmanager
def process_state_kept(who: str) -> Iterator[None]:
    """Meanwhile user code ``who`` runs in this thread: the process's working directory and, in the
    main thread, megarl's stop signal handlers and the process's stdout and stderr (fds 1 and 2, and
    sys.stdout and sys.stderr) are put back afterwards when the code changed them, with a warning naming it (megarl's relative
    paths, a run's output folder, would point elsewhere; a Ctrl-C would be ignored; the run's
    checkpoint and error lines would go to /dev/null). A stop the supervisor passed on that the
    code's handler took meanwhile is delivered again, to megarl's, once all else is put back (its
    handler may raise). (Off the main thread the streams are left alone: a concurrent tool may
    redirect them for the length of its own call.)"""
    main = threading.current_thread() is threading.main_thread()
    handlers = {s: signal.getsignal(s) for s in STOPS} if main else {}
    streams = _stream_copies() if main else {}
    objects = {"stdout": sys.stdout, "stderr": sys.stderr} if main else {}
    try:
        cwd: str | None = os.getcwd()
    except OSError:  # (already gone: nothing to put back)
        cwd = None
    try:
        yield
    finally:
        changed = [s for s, handler in handlers.items() if signal.getsignal(s) != handler]
        for s in changed:
            signal.signal(s, handlers[s])
        _restore_streams(streams, objects, who)
        _restore_cwd(cwd, who)
        if changed:
            _warn_once(f"handlers:{who}", "%s replaced megarl's handler of %s; put back: megarl's stop signals are its own (a "
                      "Ctrl-C stops after the step)", who, ", ".join(signal_name(s) for s in changed))  # fmt: skip
            for s in announced_unclaimed():
                if s in changed:
                    signal.raise_signal(s)


def _warn_once(key: str, message: str, *args: Any) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(message, *args)


def _stream_copies() -> dict[int, tuple[int, int]]:
    """Each of fds 1 and 2 that is open: a copy of it (to put back, :func:`_restore_streams`) and
    how many times megarl itself had pointed it at /dev/null."""
    copies = {}
    for fd in (1, 2):
        try:
            copies[fd] = (os.dup(fd), moves(fd))  # (the copy non-inheritable: not passed to what the code starts)
        except OSError:
            pass
    return copies


def _restore_streams(copies: dict[int, tuple[int, int]], objects: dict[str, Any], who: str) -> None:
    """Put fds 1 and 2 back where ``copies`` point when the code closed them or pointed them
    elsewhere (not when megarl did meanwhile: a terminal that hung up, megarl/trainer/watchdog.py),
    and sys.stdout and sys.stderr when it replaced them (``objects``: what they were)."""
    changed = []
    for fd, (copy, moved) in copies.items():
        try:
            if moves(fd) == moved and file_of(fd) != file_of(copy):
                os.dup2(copy, fd)  # (inheritable, as a standard stream is)
                changed.append("stdout" if fd == 1 else "stderr")
        finally:
            os.close(copy)
    for name, before in objects.items():
        # (None, open(os.devnull, "w"): megarl's lines would vanish) put back only to megarl's own
        # stream: one taken while another call's redirect_stdout was in force is that call's
        if getattr(sys, name) is not before and (isinstance(before, RoutedStream) or before is getattr(sys, f"__{name}__")):
            setattr(sys, name, before)
            changed.append(f"sys.{name}")
    if changed:
        _warn_once(f"streams:{who}", "%s closed or redirected the process's %s; put back: megarl's lines (a checkpoint "
                   "saved, an error) go there", who, " and ".join(changed))  # fmt: skip


def _restore_cwd(cwd: str | None, who: str) -> None:
    try:
        now = os.getcwd()
    except OSError:
        now = None
    if cwd is not None and now != cwd:
        try:
            os.chdir(cwd)
        except OSError as exc:  # (removed meanwhile): said, and the code's own exception, if any, goes on
            log.warning("%s changed the working directory to %s; %s cannot be put back (%s)", who, now, cwd, exc.strerror)
            return
        _warn_once(f"cwd:{who}", "%s changed the working directory to %s; put back to %s (megarl's paths, the run's "
                  "output folder among them, are relative to it)", who, now or "a folder since removed", cwd)  # fmt: skip


def named_generate_function(fn: Any, name: str, returns: type) -> Any:
    """``fn`` (the user's rollout.generate_function ``name``) called so that an exit or an exception
    of the user's own is one UserCodeError naming it and its file (megarl's own errors pass as they
    are), and so is a result that is no ``returns`` (megarl's Batch: this layer cannot import it)."""

    @functools.wraps(fn)  # logs and the run's phases name the user's function, not this wrapper
    def generate(*args: Any, **kwargs: Any) -> Any:
        what = f"rollout.generate_function {name} ({source_file(fn)})"
        try:
            with running(what), running_here(what), process_state_kept(what):  # (running_here: a stop's grace)
                result = fn(*args, **kwargs)
        except Exception as exc:
            # megarl's own (an engine's, a user error it names) passes as it is, and so does
            # anything raised inside a megarl call the function made (an engine actor's death, a
            # Ray or HTTP error, an out-of-memory there): not the function's fault
            if type(exc).__module__.startswith("megarl.") or _raised_in_megarl(exc):
                exc.add_note(f"(raised while {what} ran)")
                raise
            raise UserCodeError(
                f"{what} raised {type(exc).__name__}: {exc}; fix the function (the traceback is in "
                f"{traceback_to_log(what, exc)}){printed_head(what)}"
            ) from exc
        except BaseException as exc:  # sys.exit, KeyboardInterrupt, GeneratorExit, a BaseException of its own
            # the user's own Ctrl-C passes, and so does megarl's own (an asyncio cancellation of megarl's)
            if not ends_process(exc) or type(exc).__module__.startswith("megarl.") or _raised_in_megarl(exc):
                raise
            fix = ("a generate function must return a Batch or raise, never end the process" if isinstance(exc, EXITS)
                   else f"raise an Exception (the traceback is in {traceback_to_log(what, exc)})")  # fmt: skip
            raise UserCodeError(f"{what} {exit_description(exc)}; {fix}{printed_head(what)}") from exc
        if not isinstance(result, returns):  # else the first use of it fails deep in megarl, in a traceback
            raise UserCodeError(
                f"{what} returned {_short(result)}, not a {returns.__module__}.{returns.__qualname__}; a generate "
                f"function must return a {returns.__qualname__} of the responses (one row per response, "
                f"as megarl.rollout.single_turn.generate_batch builds it) or raise{printed_head(what)}"
            )
        return result

    return generate


def _short(value: Any) -> str:
    """``value`` for a message: its type and the head of its repr."""
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return text if value is None else f"a {type(value).__name__} ({text})"


_MEGARL_DIR = os.path.dirname(os.path.abspath(__file__))


def _raised_in_megarl(exc: BaseException) -> bool:
    """Whether ``exc`` passed through megarl's own code below the user's function (the traceback's
    first frame is the wrapper, the next the user's)."""
    frames = list(traceback.walk_tb(exc.__traceback__))[2:]
    return any(os.path.abspath(frame.f_code.co_filename).startswith(_MEGARL_DIR + os.sep) for frame, _ in frames)


_RUNNING: contextvars.ContextVar[str | None] = contextvars.ContextVar("megarl_user_code", default=None)
HEAD_CHARS = 300  # of what a piece of user code printed, quoted in an error about it


class _UserOutput:
    """The log file user code's output goes to (opened at its first write), and the head of what
    each piece of code printed."""

    def __init__(self, path: Path, max_mb: float = 0):
        self.path = path
        self.file: TextIO | None = None
        self.heads: dict[str, str] = {}
        self.lock = threading.Lock()  # tools run in threads
        self.max_mb = max_mb  # the log's cap (reward.output_log_max_mb; 0: none): past it prints are dropped
        self.size = 0  # the file's, in bytes
        self.full = False

    def write(self, who: str | None, text: str) -> None:
        """``text`` into the log; ``who``'s head too (None: megarl's own note, no print of the code's,
        written past the cap too: a traceback is never dropped)."""
        with self.lock:
            head = self.heads.get(who, "") if who is not None else ""
            if who is not None and len(head) < HEAD_CHARS:
                self.heads[who] = head + text[: HEAD_CHARS - len(head)]
            try:
                if self.file is None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    self.file = open(self.path, "a", encoding="utf-8", errors="replace")  # noqa: SIM115 - closed by close()
                    self.size = self.path.stat().st_size
                capped = self._capped(text) if who is not None else text
                self.file.write(capped)
                self.file.flush()  # (a run that dies keeps what was printed)
                self.size += len(capped.encode("utf-8", errors="replace"))
            except OSError:  # a full disk: the print is dropped, never the user's code failing on it
                pass
        if self.full:
            warn_once(self.path, "user code", self.max_mb)

    def _capped(self, text: str) -> str:
        """What of ``text`` fits under the cap: past it, the marker line once, then nothing."""
        limit = int(self.max_mb * MB)
        if not limit or self.size + 4 * len(text) <= limit or self.size + len(text.encode("utf-8", errors="replace")) <= limit:
            return text  # (a char is at most 4 bytes: most prints are under the cap without encoding them)
        if self.full:
            return ""
        self.full = True
        room = text.encode("utf-8", errors="replace")[: max(0, limit - self.size)]
        return room.decode("utf-8", errors="ignore") + marker("user code", self.max_mb)

    def close(self) -> None:
        with self.lock:
            try:
                if self.file is not None:
                    self.file.close()
            except OSError:
                pass


_OUTPUT: _UserOutput | None = None


class RoutedStream:
    """sys.stdout / sys.stderr while :func:`user_output_to` is active: a write of user code
    (:func:`running`) goes to the user-code log, any other to ``original`` (the terminal)."""

    def __init__(self, original: TextIO):
        self.original = original

    def write(self, text: str) -> int:
        who, output = _RUNNING.get(), _OUTPUT
        if who is None or output is None:
            return self.original.write(text)
        output.write(who, str(text))
        return len(text)

    def flush(self) -> None:
        self.original.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, encoding, fileno, ...: the terminal's
        return getattr(self.original, name)


@contextmanager
def user_output_to(path: str | Path, max_mb: float = 0) -> Iterator[None]:
    """Meanwhile, what user code prints in this process goes to ``path``, not the terminal; past
    ``max_mb`` MB (reward.output_log_max_mb; 0: no cap) it is dropped, with a marker line there."""
    global _OUTPUT
    previous, _OUTPUT = _OUTPUT, _UserOutput(Path(path), max_mb)
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (s if isinstance(s, RoutedStream) else RoutedStream(s) for s in streams)
    try:
        yield
    finally:
        output, _OUTPUT = _OUTPUT, previous
        sys.stdout, sys.stderr = streams
        output.close()


def routed_again() -> None:
    """A RoutedStream on top of sys.stdout / sys.stderr again, after something replaced them while
    :func:`user_output_to` is active: a live rich bar's proxies print through the bar's console
    into the RoutedStream below them, so user code's prints would reach its log with the bar's
    cursor codes and the bar itself. (The bar restores what it replaced when it stops.)"""
    if _OUTPUT is None:
        return
    if not isinstance(sys.stdout, RoutedStream):
        sys.stdout = RoutedStream(sys.stdout)
    if not isinstance(sys.stderr, RoutedStream):
        sys.stderr = RoutedStream(sys.stderr)


@contextmanager
def running(who: str) -> Iterator[None]:
    """Meanwhile this context (and the asyncio tasks it starts) runs user code ``who``: its prints
    go to the user-code log."""
    token = _RUNNING.set(who)
    try:
        yield
    finally:
        _RUNNING.reset(token)


def traceback_to_log(who: str, exc: BaseException) -> str:
    """Where the traceback of ``exc`` (raised by ``who``) is: written into the user-code log when
    one is active (`megarl generate` has no other log: its <OUT>.user_code.log), and the run's log
    otherwise (the driver logs a user error's traceback)."""
    output = _OUTPUT
    if output is None:
        return "the run's log"
    lines = "".join(traceback.format_exception(exc))
    output.write(None, f"[megarl] {who} raised:\n{lines}")
    return str(output.path)


def printed_head(who: str) -> str:
    """For an error about ``who``: "; it printed: '<head>' (all of it in <log>)", or "" when it printed nothing."""
    output = _OUTPUT
    head = output.heads.get(who, "") if output is not None else ""
    if not head:
        return ""
    return f"; it printed: {head[:HEAD_CHARS]!r}{'...' if len(head) >= HEAD_CHARS else ''} (all of it in {output.path})"  # type: ignore[union-attr]


class DeadlinePassed(Exception):  # noqa: N818 - said as what happened
    """A call of user code did not return within its deadline (:func:`call_with_deadline`)."""


def start_user_call(invoke: Callable[[], Any], who: str) -> Future[Any]:
    """``invoke()`` in a daemon thread, marked as ``who`` (its prints go to the user-code log): a
    future of its value, or of what it raised (SystemExit too). A thread cannot be killed: a
    caller that stops waiting abandons it."""
    future: Future[Any] = Future()

    def work() -> None:
        with running(who), process_state_kept(who):
            try:
                value = invoke()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller as it is
                if not future.done():  # (a caller may have given up on it)
                    future.set_exception(exc)
                return
            if not future.done():
                future.set_result(value)

    threading.Thread(target=work, name=f"user-code {who[:40]}", daemon=True).start()
    return future


def call_with_deadline(invoke: Callable[[], Any], seconds: float, who: str) -> Any:
    """``invoke()`` in a daemon thread (:func:`start_user_call`): its value, or what it raised
    (SystemExit too); DeadlinePassed after ``seconds``, WaitAbandoned sooner after a stop request
    (:func:`wait_for_user`). The thread is then abandoned: the caller stops or goes on without it."""
    future = start_user_call(invoke, who)
    wait_for_user([future], seconds, who)
    if not future.done():
        raise DeadlinePassed(f"{who} did not return within {seconds:g} s")
    return future.result()


# A stop asked for during a step (the driver's first Ctrl-C / SIGTERM / SIGHUP: megarl/trainer/
# watchdog.py) waits for the step's end, but not for user code that does not return: each wait of
# the main thread on user code lasts at most STOP_GRACE_S after the stop (or after the wait's start,
# when it started later; a pool that returns something starts a new wait), then WaitAbandoned
# abandons the step as a second signal would. Another thread's wait (the asynchronous rollout
# producer's) is recorded for the main thread, which waits on that thread: it gives up the same way
# while that thread waits on user code (megarl/rollout/producer.py).
STOP_GRACE_S = 10.0
_POLL_S = 0.25  # a wait looks for a stop request this often (a signal's handler cannot end the wait itself)
_STOP_AT: float | None = None  # time.monotonic() of the stop request, None: no stop asked
_WAITING: tuple[str, float] | None = None  # the main thread's current wait on user code: (who, since)
_THREAD_WAITS: dict[int, tuple[str, float]] = {}  # other threads' current waits on user code, by thread id


# User code the main thread runs itself (a generate function: no wait of megarl's polls for the
# stop), as (who, since); the identity of the tuple tells one call from the next. After a stop a
# timer calls _INTERRUPT when the same call still runs STOP_GRACE_S later; _OVERDUE is then what
# the signal's handler raises.
_IN_MAIN: tuple[str, float] | None = None
_INTERRUPT: Callable[[], None] | None = None
_OVERDUE: tuple[tuple[str, float], str] | None = None


class WaitAbandoned(SignalInterrupt):
    """The main thread stopped waiting for user code STOP_GRACE_S after a stop request (a signal's
    consequence, not the code's doing: a SignalInterrupt); the message names the code and how long it was waited on."""


def stop_requested(at: float | None, interrupt: Callable[[], None] | None = None) -> None:
    """Record a stop request made at ``at`` (time.monotonic()), or forget it (None: a run's end);
    ``interrupt`` (RunControl's) interrupts the main thread when user code it runs itself
    (:func:`running_here`) is overdue: the signal's handler then raises :func:`overdue`'s WaitAbandoned."""
    global _STOP_AT, _INTERRUPT
    _STOP_AT, _INTERRUPT = at, interrupt
    call = _IN_MAIN
    if at is not None and call is not None:
        _arm(call)


def current_wait() -> tuple[str, float] | None:
    """What the main thread waits on now, as (who, seconds so far), or None."""
    waiting = _WAITING
    return None if waiting is None else (waiting[0], time.monotonic() - waiting[1])


def give_up_after_stop(who: str, since: float) -> None:
    """WaitAbandoned when a stop was requested and ``who``, waited on since ``since``
    (time.monotonic()), has not returned within STOP_GRACE_S of the later of the two; main thread only."""
    stop_at = _STOP_AT
    if stop_at is None or threading.current_thread() is not threading.main_thread():
        return
    now = time.monotonic()
    if now - max(stop_at, since) >= STOP_GRACE_S:
        raise WaitAbandoned(f"{who} was waited on for {now - since:.0f} s and did not return within {STOP_GRACE_S:g} s of the stop")


@contextmanager
def waiting_on(who: str) -> Iterator[float]:
    """Meanwhile this thread waits on user code ``who``, as :func:`current_wait` tells the signal
    handler (the main thread) and :func:`thread_wait` the main thread (another thread); yields when
    the wait began (time.monotonic())."""
    global _WAITING
    start = time.monotonic()
    main = threading.current_thread() is threading.main_thread()
    ident = threading.get_ident()
    previous = _WAITING if main else _THREAD_WAITS.get(ident)
    if main:
        _WAITING = (who, start)
    else:
        _THREAD_WAITS[ident] = (who, start)
    try:
        yield start
    finally:
        if main:
            _WAITING = previous
        elif previous is None:
            _THREAD_WAITS.pop(ident, None)
        else:
            _THREAD_WAITS[ident] = previous


@contextmanager
def running_here(who: str) -> Iterator[None]:
    """Meanwhile this thread runs user code ``who`` itself (a generate function), a wait on it (the
    first signal's line names it): in the main thread a stop gives it STOP_GRACE_S (from the stop,
    or from the call's start when later), then :func:`stop_requested`'s ``interrupt`` abandons the
    step; in another (the rollout producer) the main thread waiting on that thread gives up (:func:`thread_wait`)."""
    global _IN_MAIN
    with waiting_on(who) as since:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous, call = _IN_MAIN, (who, since)
        _IN_MAIN = call
        try:
            if _STOP_AT is not None:
                _arm(call)
            yield
        finally:
            _IN_MAIN = previous


def _arm(call: tuple[str, float]) -> None:
    """A timer that interrupts the main thread when ``call`` still runs STOP_GRACE_S after the stop (or its start)."""
    stop_at = _STOP_AT
    if stop_at is None:
        return
    start = max(stop_at, call[1])
    timer = threading.Timer(max(0.0, start + STOP_GRACE_S - time.monotonic()), _interrupt_if_running, (call,))
    timer.daemon = True  # (a run that ends meanwhile does not wait for it)
    timer.start()


def _interrupt_if_running(call: tuple[str, float]) -> None:
    global _OVERDUE
    interrupt = _INTERRUPT
    if _IN_MAIN is not call or interrupt is None:
        return  # it returned, or the run ended
    who, since = call
    _OVERDUE = (call, f"{who} ran for {time.monotonic() - since:.0f} s and did not return within {STOP_GRACE_S:g} s of the stop")
    interrupt()


def overdue() -> WaitAbandoned | None:
    """In the main thread's signal handler: the WaitAbandoned to raise when user code it runs
    itself was found overdue and runs still (not when it returned meanwhile); None otherwise."""
    global _OVERDUE
    found, _OVERDUE = _OVERDUE, None
    if found is None or found[0] is not _IN_MAIN:
        return None
    return WaitAbandoned(found[1])


def thread_wait(thread: threading.Thread | None) -> tuple[str, float] | None:
    """What ``thread`` (not the main one) waits on now, as (who, since: time.monotonic()), or None."""
    return None if thread is None or thread.ident is None else _THREAD_WAITS.get(thread.ident)


def wait_for_user(futures: list[Future[Any]], timeout: float, who: str, return_when: str = ALL_COMPLETED) -> set[Future[Any]]:
    """``concurrent.futures.wait(futures, timeout, return_when)``'s done set, for futures of user
    code ``who``; WaitAbandoned (:func:`give_up_after_stop`) when a stop was requested and they did
    not finish within STOP_GRACE_S of it."""
    with waiting_on(who) as since:
        end = since + timeout
        while True:
            remaining = end - time.monotonic()
            done, pending = wait_futures(futures, timeout=max(0.0, min(_POLL_S, remaining)), return_when=return_when)
            if not pending or (done and return_when == FIRST_COMPLETED) or remaining <= _POLL_S:
                return done
            give_up_after_stop(who, since)
