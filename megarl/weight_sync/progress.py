"""Where each policy rank is in a weight push, and the report when a push misses its deadline.

A push is collective: every policy rank exports (TP gathers, PP broadcasts), and some send to
the engines. When one rank stalls, the others wait for it inside a collective, so the driver
only sees that no rank finished. To name the rank that is behind, each rank writes its place
in the push (:class:`PushProgress`: the version, the phase, e.g. ``exporting bucket 3`` or
``sending bucket 3``, and when it got there) to a small file beside its log. When the push's
deadline (``rollout.weight_sync.timeout_s``) passes, the driver reads every rank's file and
stack dump (:func:`push_report`): a rank that did not write its stacks is stopped or dead; of
the others, those at the earliest place are the ones the rest wait for.

The file is ``<rank log>.push``; the worker group puts the rank's log path in
``MEGARL_RANK_LOG`` (megarl/ray_cluster/worker_group.py). Without it (tests, scripts)
nothing is written.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.kept_files import write_atomically
from megarl.ray_cluster.rank_env import RANK_LOG_ENV


class WeightPushTimeout(RuntimeError):
    """A weight push missed rollout.weight_sync.timeout_s; the message names who it waited for."""


def progress_path(rank_log: str | Path) -> Path:
    return Path(f"{rank_log}.push")


def push_group(pp_rank: int, collects_stages: bool) -> str:
    """The group of a rank's place: its pipeline stage, with apart from it the stage's rank
    whose stream also carries the other stages' buckets (``collects_stages``: the replica's
    leader of an in_process or disk push at PP > 1), which writes more places than its stage
    peers for the same progress."""
    return f"{pp_rank}, receiving every stage" if collects_stages else str(pp_rank)


class PushProgress:
    """This rank's place in the current push, in ``<rank log>.push`` (written on every move,
    by rename, so the driver never reads half a line). ``group`` names the ranks whose places
    compare, those whose streams carry the same buckets: the pipeline stage (stages export
    different tensors, and the distributed transport sends them one stage after another), and
    apart from it the rank that also receives the other stages' tensors (``push_group``)."""

    def __init__(self, rank_log: str | None = None, group: str = "0") -> None:
        rank_log = rank_log if rank_log is not None else os.environ.get(RANK_LOG_ENV)
        self.path = progress_path(rank_log) if rank_log else None
        self.group = group
        self.order = 0  # how far the push got: compared between ranks of one group

    def start(self, version: int) -> None:
        self.order = 0
        self.mark(version, "starting")

    def mark(self, version: int, phase: str) -> None:
        self.order += 1
        if self.path is None:
            return
        try:
            write_atomically(self.path, f"{version}\t{self.group}\t{self.order}\t{time.time():.3f}\t{phase}\n")
        except OSError:  # a full or read-only disk must not fail the push itself
            pass


@dataclass(frozen=True)
class RankPlace:
    """What a rank's progress file says."""

    version: int
    group: str  # the pipeline stage (see PushProgress): only places of one group compare
    order: int
    since: float  # time.time() of the move
    phase: str


def read_place(rank_log: str | Path) -> RankPlace | None:
    try:
        version, group, order, since, phase = progress_path(rank_log).read_text().rstrip("\n").split("\t", 4)
        return RankPlace(int(version), group, int(order), float(since), phase)
    except (OSError, ValueError):
        return None


def late_push(version: int, timeout_s: float, group: Any, waiting: list[int]) -> WeightPushTimeout:
    """The error of a push that missed its deadline: ``group`` (a WorkerGroup) writes every
    rank's stacks to its log, and each rank's progress file says where it was; ``waiting``:
    the ranks that had not returned."""
    stacks = group.dump_stacks()
    places = {r: read_place(path) for r, path in enumerate(group.log_paths)}
    whose = "every rank's Python stacks are" if all(stacks.values()) else "the other ranks' Python stacks are"
    return WeightPushTimeout(
        f"weight push {version} did not finish within {timeout_s:g} s (rollout.weight_sync.timeout_s): "
        f"{push_report(version, places, stacks, waiting)}; {whose} at the end of their logs in {group.log_dir}; "
        "the run stops (raise rollout.weight_sync.timeout_s if pushes are only slow)"
    )


def push_report(version: int, places: dict[int, RankPlace | None], stacks: dict[int, bool], waiting: list[int]) -> str:
    """One paragraph naming the rank(s) the push waits for and where every rank is. Of the
    ``waiting`` ranks, those that could not write their stacks are stopped or dead; else those
    whose push raised (their place says why: e.g. an engine that died) hold the others in a
    collective; else, within a pipeline stage, those at the earliest place are the ones the rest
    of the stage waits for."""
    now = time.time()
    silent = sorted(r for r in waiting if not stacks.get(r, False))
    current = {r: p for r, p in places.items() if p is not None and p.version == version}
    failed = sorted(r for r in waiting if r in current and current[r].phase.startswith("failed"))
    behind: list[int] = []
    for stage in sorted({p.group for p in current.values()}):
        mine = {r: p.order for r, p in current.items() if p.group == stage and r in waiting}
        if len(set(mine.values())) > 1:
            behind += [r for r, order in mine.items() if order == min(mine.values())]
    never = sorted(r for r in places if r not in current)
    lines = []
    if waiting and all(r in current and current[r].phase == "done" for r in waiting):
        lines.append("every policy rank had finished its part: the results did not reach the driver within the "
                     "deadline, which is shorter than a push's round trip")  # fmt: skip
    elif silent:
        lines.append(f"policy rank(s) {silent} did not write their stacks: stopped or dead (the others wait for them)")
    elif failed:
        lines.append(f"policy rank(s) {failed} failed their push and wait for the others in the export check, "
                     "while the others wait for them (the cause is in their place below)")  # fmt: skip
    elif behind:
        lines.append(f"policy rank(s) {sorted(behind)} are behind the others of their pipeline stage (the rest wait "
                     "for them in a collective)")  # fmt: skip
    if never:
        lines.append(f"policy rank(s) {never} never started push {version}")
    for r, p in sorted(current.items()):
        state = "" if r in waiting else ", returned"
        lines.append(f"policy rank {r} (stage {p.group}): {p.phase} (for {max(0.0, now - p.since):.0f} s{state})")
    return "; ".join(lines)
