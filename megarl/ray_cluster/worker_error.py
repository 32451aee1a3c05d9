"""The error of a worker-group rank that raised or died, whichever group ran it (a Ray
WorkerGroup, megarl/ray_cluster/worker_group.py, or the in-process group of
megarl/actors/clients.py): the CLI tells it in one line (megarl/cli.py), unless what the rank
raised is a broken invariant (an AssertionError: a bug, shown whole)."""

from __future__ import annotations


class WorkerError(RuntimeError):
    """A rank of a worker group raised or died; ``summary`` is one line naming it and the cause,
    the message adds the last lines of its log. ``cause``: what the rank raised (None when it
    died), so the CLI tells a user's mistake met in a worker from a bug in one."""

    def __init__(self, message: str, role: str, rank: int, summary: str | None = None,
                 cause: BaseException | None = None):  # fmt: skip
        super().__init__(message)
        self.role = role
        self.rank = rank
        self.summary = summary or message.splitlines()[0]
        self.cause = cause
