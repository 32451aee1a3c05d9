"""Where the driver is in a step: the phase timer (``time/<phase>_s``) and the progress marker
the hang watchdog reads (megarl/trainer/watchdog.py). Plain Python, no torch: the rollout's
collectors and the trainer's loop both time their phases with it. Also what a user sees while
waiting: the progress display of long offline commands (:func:`counting`) and the lines of any
other long wait (:func:`still_waiting`: Ray's start, the ranks' build, an engine's start, a
checkpoint's save or load, a weight push), the same on a terminal and a pipe: one log line once
the wait has lasted NOTE_FIRST_S, then one every NOTE_EVERY_S (a pipe's log stays readable; on a
terminal the lines print above the training bar)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_log = logging.getLogger(__name__)
NOTE_FIRST_S = 5.0  # a wait this long says what it waits for: "saving checkpoint step 20 ... (5 s)"
NOTE_EVERY_S = 10.0  # then a line this often, never more (a log, not a flood)


class Progress:
    """Where the driver is: the phase it entered or left last, and when (for the hang watchdog)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.phase, self.since, self.step = "start", time.monotonic(), 0

    def mark(self, phase: str, step: int | None = None) -> None:
        with self._lock:
            self.phase, self.since = phase, time.monotonic()
            if step is not None:
                self.step = step

    def snapshot(self) -> tuple[str, float, int]:
        """(phase, seconds since it was entered or left, step)."""
        with self._lock:
            return self.phase, time.monotonic() - self.since, self.step


PROGRESS = Progress()


class PhaseTimer:
    """Times the phases of a step: ``with timer.phase("generate"): ...`` -> time/generate_s."""

    def __init__(self, *, mark_progress: bool = True) -> None:
        self.times: dict[str, float] = {}
        self.mark_progress = mark_progress  # False in a thread beside the loop (the watchdog follows the loop)

    def phase(self, name: str) -> _Phase:
        return _Phase(self, name)

    def metrics(self) -> dict[str, float]:
        return {f"time/{name}_s": seconds for name, seconds in self.times.items()}


class _Phase:
    def __init__(self, timer: PhaseTimer, name: str):
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        if self.timer.mark_progress:
            PROGRESS.mark(self.name)
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.timer.times[self.name] = self.timer.times.get(self.name, 0.0) + time.perf_counter() - self.start
        if self.timer.mark_progress:
            PROGRESS.mark(f"after {self.name}")


class WaitNotes:
    """The lines of one wait: ``<what> ... (N s)`` once it has lasted ``first_s``, then every
    ``every_s``; ``<what>: done in N s`` at its end (:meth:`end`), only when it said anything (a
    short wait stays silent). ``what``: text, or a function giving it (a count that moves; ""
    when there is nothing to say yet: no line then); ``clock``: the seconds' source (a test's own)."""

    def __init__(self, what: str | Callable[[], str], *, first_s: float = NOTE_FIRST_S, every_s: float = NOTE_EVERY_S,
                 clock: Callable[[], float] = time.monotonic, say: Callable[[str], None] | None = None) -> None:  # fmt: skip
        self.what, self.every_s, self.clock = what, every_s, clock
        self.say = say or (lambda line: _log.info("%s", line))
        self._lock = threading.Lock()
        self.start = self.last = clock()  # last: when a line was said (by either)
        self.next = self.start + first_s
        self.said = 0

    def text(self) -> str:
        return self.what() if callable(self.what) else self.what

    def tick(self) -> None:
        """Say where the wait is if a line is due."""
        with self._lock:
            now = self.clock()
            text = self.text() if now >= self.next else ""
            if not text:
                return
            self.next, self.last, self.said = now + self.every_s, now, self.said + 1
        self.say(f"{text} ... ({now - self.start:.0f} s)")

    def said_now(self) -> None:
        """Its owner printed a line of its own (a count that advanced): the next is due every_s later."""
        with self._lock:
            self.last = self.clock()
            self.next = self.last + self.every_s

    def quiet_for(self) -> float:
        """Seconds since the last line (or the start)."""
        with self._lock:
            return self.clock() - self.last

    def end(self) -> None:
        if self.said:
            self.say(f"{self.text()}: done in {self.clock() - self.start:.0f} s")


# The waits now running, each with the thread that entered it: a line about a wait inside another
# (a slow import inside "checking the config and its files") makes the outer one's next line due
# every_s later, so the user reads one stream of lines, not two interleaved.
_ACTIVE: list[tuple[int, WaitNotes]] = []
_ACTIVE_LOCK = threading.Lock()


def said_inside(owner: int | None = None, inner: WaitNotes | None = None) -> None:
    """A line about a wait inside the running ones of thread ``owner`` (None: this thread) was just
    said: theirs are due every_s from now. ``inner``: that wait's own notes, when it is one of them
    (only the waits entered before it are outer ones)."""
    owner = threading.get_ident() if owner is None else owner
    with _ACTIVE_LOCK:
        outer = [notes for thread, notes in _ACTIVE if thread == owner]
    if inner is not None and inner in outer:
        outer = outer[: outer.index(inner)]
    for notes in outer:
        notes.said_now()


@contextmanager
def still_waiting(what: str | Callable[[], str], *, first_s: float = NOTE_FIRST_S, every_s: float = NOTE_EVERY_S,
                  done_line: bool = True) -> Iterator[WaitNotes]:  # fmt: skip
    """A wait the user sees: a thread ticks :class:`WaitNotes` while the body runs. ``done_line``:
    a line at the end of a wait that said anything (not when the body raised: its error says)."""
    notes = WaitNotes(what, first_s=first_s, every_s=every_s)
    stop, owner = threading.Event(), threading.get_ident()

    def watch() -> None:
        while not stop.wait(min(1.0, first_s, every_s)):
            said = notes.said
            notes.tick()
            if notes.said != said:
                said_inside(owner, notes)

    thread = threading.Thread(target=watch, name="megarl-wait-notes", daemon=True)
    with _ACTIVE_LOCK:
        _ACTIVE.append((owner, notes))
    thread.start()
    finished = False
    try:
        yield notes
        finished = True
    finally:
        stop.set()
        thread.join(timeout=5)
        with _ACTIVE_LOCK:
            _ACTIVE.remove((owner, notes))
        if finished and done_line:
            notes.end()


@contextmanager
def counting(total: int, label: str, unit: str, done: int = 0) -> Iterator[Callable[[int], None]]:
    """Progress of long offline work (`megarl generate`, `megarl evaluate`): yields ``advance(n)``.
    A rich bar on a terminal; otherwise a log line per advance at most every NOTE_FIRST_S (and the
    last), and between two slow advances one every NOTE_EVERY_S: a long batch is no silent pipe, and
    many quick ones no flood."""
    import sys

    if not sys.stdout.isatty():
        state = {"done": done}
        line = lambda: f"{label}: {state['done']}/{total} {unit}"  # noqa: E731
        with still_waiting(line, first_s=NOTE_EVERY_S, every_s=NOTE_EVERY_S, done_line=False) as notes:

            def log_line(n: int) -> None:
                if not n:  # nothing new (a caller's last advance after its callback told every one): no second line
                    return
                state["done"] += n
                if state["done"] >= total or notes.quiet_for() >= NOTE_FIRST_S:
                    _log.info("%s", line())
                    notes.said_now()

            yield log_line
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.progress import Progress as Bar

    bar = Bar(TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn(unit), TimeElapsedColumn(),
              TimeRemainingColumn())  # fmt: skip
    task = bar.add_task(label, total=total, completed=done)
    with bar:
        yield lambda n: bar.advance(task, n)
