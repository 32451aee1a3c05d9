"""When a torch engine's weights may be replaced while it generates: the :class:`WeightGate`.

Generation uses the weights in stretches (one decode step with partial rollouts, a whole
``generate`` call without); a push (one or many ``load_weights`` calls, or one
``load_weights_from_disk``) replaces them. The gate lets a push in only between stretches and
keeps new stretches out while a push waits or runs, so a tight decode loop that starts a new
stretch at once cannot starve the loader (a bare lock would let it win every time). A push may
begin in one call and end in another (a stream of buckets), hence a condition and flags rather
than a lock held across calls.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class WeightGate:
    """A writer-preferring readers-writer gate: stretches of weight use share, a push is alone."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._users = 0  # stretches of weight use in progress
        self._pushes_waiting = 0
        self._pushing = False

    @contextmanager
    def use(self) -> Iterator[None]:
        """One stretch of weight use; waits while a push waits or runs."""
        with self._cond:
            self._cond.wait_for(lambda: not self._pushing and self._pushes_waiting == 0)
            self._users += 1
        try:
            yield
        finally:
            with self._cond:
                self._users -= 1
                self._cond.notify_all()

    def begin_push(self) -> None:
        """Wait until no stretch is in progress, then hold the weights until :meth:`end_push`."""
        with self._cond:
            self._pushes_waiting += 1
            try:
                self._cond.wait_for(lambda: self._users == 0 and not self._pushing)
            finally:
                self._pushes_waiting -= 1
            self._pushing = True

    def end_push(self) -> None:
        with self._cond:
            assert self._pushing, "end_push without begin_push"
            self._pushing = False
            self._cond.notify_all()
