"""Where the driver is in a step: the phase timer (``time/<phase>_s``) and the progress marker
the hang watchdog reads (megarl/trainer/watchdog.py). Plain Python, no torch: the rollout's
collectors and the trainer's loop both time their phases with it. Also the progress display of
long offline commands (:func:`counting`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_log = logging.getLogger(__name__)


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


@contextmanager
def counting(total: int, label: str, unit: str, done: int = 0) -> Iterator[Callable[[int], None]]:
    """Progress of long offline work (`megarl generate`, `megarl evaluate`): yields ``advance(n)``.
    A rich bar on a terminal; otherwise one log line per advance (logs and CI stay readable)."""
    import sys

    if not sys.stdout.isatty():
        state = {"done": done}

        def log_line(n: int) -> None:
            state["done"] += n
            _log.info("%s: %d/%d %s", label, state["done"], total, unit)

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
