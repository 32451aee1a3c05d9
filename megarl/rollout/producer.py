"""Asynchronous rollouts (``rollout.max_staleness`` = k >= 1): a producer thread in the
controller keeps the engines generating while the trainer trains, into a buffer of scored groups.

    producer thread                                   trainer (main thread)
    draw G prompts (re-issued ones first)             take G groups at most k versions old
    generate + score them (the collector)    ----->   train, push version s
    keep the groups (dynamic sampling: with variance) the producer may draw again

**Staleness.** A group generated from weight version v and trained at step s (whose policy is
version s - 1) is ``s - 1 - v`` versions stale; with partial rollouts its later tokens may come
from newer versions, and its oldest token counts. The producer starts a draw only while
its last group, trained at step ``ceil((C + B + G) / G)`` (C: groups trained so far, B: groups
buffered), is at most k versions older than that step's policy; taken in FIFO order no group is
then ever too stale (a dropped group only moves later ones earlier). The trainer still checks
each group and drops a stale one, counted, re-issuing its prompt once.

**Accounting.** Every prompt drawn is *pending* until a step trains it or drops it for good
(dynamic sampling: no reward variance; stale twice). :meth:`RolloutProducer.state_dict` gives
the sampler's position with the pending prompts, taken together under the producer's lock, so a
checkpoint resumes by re-issuing exactly those (no prompt lost, none trained twice).

Every wait has a deadline: a trainer that waits longer than ``timeout_s`` for groups names the
producer's state (what it was doing, since when); an error in the producer thread is raised in
the trainer. After a stop request, a trainer waiting while the producer waits on user code (a
tool, a reward function) gives up STOP_GRACE_S later, as it would on that code itself
(megarl/user_code.py: WaitAbandoned).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.algos.dapo import dynamic_sampling_filter
from megarl.data.batch import Batch
from megarl.data.prompt_batch import PromptBatch
from megarl.engines.base import SamplingParams
from megarl.progress import PhaseTimer
from megarl.rollout.collect import add_counts
from megarl.user_code import give_up_after_stop, thread_wait

log = logging.getLogger(__name__)

PromptKey = tuple[int, int]  # (file index in data.train_files, row in that file)
STOP_POLL_S = 0.25  # how often a waiting trainer looks for a stop request (user code's grace after it)


class RolloutStalled(RuntimeError):
    """The trainer waited past its deadline for the producer, or the producer stopped early."""


@dataclass
class Group:
    """The ``n`` scored samples of one prompt, waiting in the buffer."""

    batch: Batch
    key: PromptKey
    version: int  # the oldest weight version of its tokens
    reissued: bool = False  # its prompt was dropped as stale once already


@dataclass
class Taken:
    """What one step took from the buffer."""

    batch: Batch  # G groups, group ids 0..G-1, staleness set
    trained: list[PromptKey]
    dropped: list[tuple[PromptKey, str]]  # (prompt, reason) dropped for good since the last take
    reissued: list[PromptKey]  # dropped as stale, drawn again
    metrics: dict[str, float]


@dataclass
class _Draws:
    """The producer's counters and the collection metrics since the last take."""

    count: int = 0  # draws so far over the run (seeds the sampling)
    metrics: dict[str, float] = field(default_factory=dict)
    dropped: list[tuple[PromptKey, str]] = field(default_factory=list)


class RolloutProducer:
    """The producer thread and its buffer (see the module docstring).

    ``collect(prompts, params, timer) -> (Batch, metrics)``: one generation round and its scores
    (the plain collector); ``draw()``: the next step's PromptBatch from the sampler;
    ``prompts_of(keys)``: a PromptBatch of given prompts (re-issues); ``sampling(draw)``: the
    sampling params of draw ``draw``; ``groups_per_step``: G (data.prompts_per_step);
    ``dynamic_sampling``: 0 (off), else algorithm.dynamic_sampling.max_rounds: groups without
    reward variance are dropped, except when that many draws in a row kept none (then the draw is
    kept whole, as the synchronous loop fills a step after its last round: such groups carry no
    policy gradient under group estimators, and the run goes on instead of drawing forever);
    ``timeout_s``: how long a step waits for groups (None: as long as the producer lives).
    """

    def __init__(self, collect: Callable[..., tuple[Batch, dict[str, float]]], stream: Any,
                 sampling: Callable[[int], SamplingParams], *, groups_per_step: int, max_staleness: int,
                 dynamic_sampling: int, timeout_s: float | None) -> None:  # fmt: skip
        self.collect, self.stream, self.sampling = collect, stream, sampling
        self.G, self.k = groups_per_step, max_staleness
        self.max_rounds, self.timeout_s = dynamic_sampling, timeout_s
        self._empty_draws = 0  # draws in a row dynamic sampling kept nothing of
        self._cond = threading.Condition()
        self._buffer: deque[Group] = deque()
        self._pending: list[PromptKey] = []  # drawn, not yet trained or dropped for good, in draw order
        self._reissue: deque[PromptKey] = deque()
        self._reissued_once: set[PromptKey] = set()
        self._draws = _Draws()
        self._busy: list[tuple[float, float]] = []  # generation and scoring spans (monotonic)
        self._last_take = time.monotonic()
        self._version = 0
        self._consumed = self._groups_total = 0  # groups trained, and to be trained, over the run
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._doing, self._since = "not started", time.monotonic()
        self._thread: threading.Thread | None = None

    # ---- run ------------------------------------------------------------------------------
    def start(self, version: int, steps_left: int) -> None:
        """Start drawing; the engines hold ``version``, ``steps_left`` steps remain to be fed."""
        with self._cond:
            self._version = version
            self._consumed, self._groups_total = version * self.G, (version + steps_left) * self.G
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop drawing. A draw in flight is left to the engines' shutdown, which fails its
        call: the run's end does not wait for a generation nobody will train on."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def pushed(self, version: int) -> None:
        """The engines now run ``version``: the producer may draw further ahead."""
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            while self._wait_for_room():
                self._produce_one()
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer, which raises it
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _wait_for_room(self) -> bool:
        """Block until a draw may start; False once stopped. Once every step is fed it waits on:
        a group dropped as stale later makes room for its prompt's re-issue."""
        with self._cond:
            while not self._stop.is_set():
                ahead = self._consumed + len(self._buffer)  # groups before a new draw's
                last_step = -(-(ahead + self.G) // self.G)  # the step that trains the draw's last group
                if ahead < self._groups_total and last_step - 1 - self._version <= self.k:
                    return True
                self._set_doing("waiting: every step fed" if ahead >= self._groups_total else "waiting: staleness bound")
                self._cond.wait()
            return False

    def _produce_one(self) -> None:
        prompts, keys = self._draw()
        with self._cond:
            started = self._version  # the oldest weights any of the draw's tokens can come from
        params = self.sampling(self._draws.count)
        timer = PhaseTimer(mark_progress=False)  # the watchdog follows the trainer, not this thread
        with self._cond:
            self._set_doing(f"generating and scoring {len(keys)} prompts")
        batch, metrics = self.collect(prompts, params, timer)
        with self._cond:
            self._busy.append((self._since, time.monotonic()))
        version = self._version_of(batch, started)
        groups = [Group(batch.select((batch.group_id == g).nonzero().flatten()), key, version[g],
                        key in self._reissued_once) for g, key in enumerate(keys)]  # fmt: skip
        groups, dropped = self._with_reward_variance(batch, groups)
        with self._cond:
            self._buffer.extend(groups)
            self._draws.metrics = add_counts(self._draws.metrics, metrics | timer.metrics())
            self._draws.dropped += dropped
            self._cond.notify_all()

    def _with_reward_variance(self, batch: Batch, groups: list[Group]) -> tuple[list[Group], list[tuple[PromptKey, str]]]:
        """Dynamic sampling: the groups kept and the prompts dropped (see the class docstring)."""
        if not self.max_rounds:
            return groups, []
        assert batch.scores is not None  # the collector scores every batch
        keep, _ = dynamic_sampling_filter(batch.scores, batch.group_id)  # [B] bool
        kept = set(batch.group_id[keep].tolist())
        self._empty_draws = 0 if kept else self._empty_draws + 1
        if self._empty_draws >= self.max_rounds:
            self._empty_draws = 0
            return groups, []
        return [g for i, g in enumerate(groups) if i in kept], [(g.key, "no_reward_variance") for i, g in enumerate(groups) if i not in kept]

    def _draw(self) -> tuple[PromptBatch, list[PromptKey]]:
        """G prompts: re-issued ones first, then the sampler's; recorded as pending."""
        with self._cond:
            self._draws.count += 1
            again = [self._reissue.popleft() for _ in range(min(self.G, len(self._reissue)))]
            fresh = self.stream.next_batch() if len(again) < self.G else None
            parts = ([self.stream.prompts_of(again)] if again else []) + ([fresh] if fresh is not None else [])
            keys = again + (list(zip(fresh.file_index, fresh.index)) if fresh is not None else [])
            self._pending += keys[len(again):]
        prompts = parts[0] if len(parts) == 1 else _concat_prompts(parts)
        n = self.G
        if len(prompts) > n:  # re-issues plus a whole fresh draw: the surplus goes back to the front
            with self._cond:
                self._reissue.extendleft(reversed(keys[n:]))
            prompts, keys = prompts.select(range(n)), keys[:n]
        return prompts, keys

    def _version_of(self, batch: Batch, started: int) -> list[int]:
        """Per group of ``batch``: the oldest weight version among its tokens (``started``, the
        version when the draw began, for engines that report no token versions)."""
        groups = int(batch.group_id.max()) + 1 if len(batch) else 0
        if batch.token_versions is None:
            return [started] * groups
        valid = batch.response_valid.bool()  # [B, R]
        big = torch.iinfo(torch.long).max
        per_sample = torch.where(valid, batch.token_versions, big).min(dim=1).values  # [B]
        per_sample = torch.where(per_sample == big, torch.full_like(per_sample, started), per_sample)  # no token
        return [int(per_sample[batch.group_id == g].min()) for g in range(groups)]

    def _set_doing(self, what: str) -> None:
        self._doing, self._since = what, time.monotonic()

    # ---- the trainer's side ---------------------------------------------------------------
    def take(self, step: int) -> Taken:
        """G groups for step ``step`` (policy version ``step - 1``), FIFO; stale ones dropped."""
        waited_from = time.monotonic()
        picked: list[Group] = []
        reissued: list[PromptKey] = []
        dropped: list[tuple[PromptKey, str]] = []
        with self._cond:
            while len(picked) < self.G:
                group = self._next_group(waited_from)
                stale = step - 1 - group.version
                if stale <= self.k:
                    picked.append(group)
                    self._consumed += 1
                elif group.reissued:
                    dropped.append((group.key, "stale_twice"))
                else:
                    reissued.append(group.key)
                    self._reissued_once.add(group.key)
                    self._reissue.append(group.key)
                    self._cond.notify_all()  # room for the re-issue: the producer may be waiting, every step fed
            dropped += self._draws.dropped
            for key in [g.key for g in picked] + [k for k, _ in dropped]:
                self._pending.remove(key)  # one occurrence: a later epoch may have drawn it again
                self._reissued_once.discard(key)  # (a later epoch may re-issue it once again)
            draws = self._draws
            self._draws = _Draws(count=draws.count)
            self._busy = [(a, b) for a, b in self._busy if b >= self._last_take]
            self._last_take = time.monotonic()
            buffered = len(self._buffer)
            self._cond.notify_all()
        batch = _renumbered([g.batch for g in picked])
        staleness = torch.tensor([step - 1 - g.version for g in picked for _ in range(len(g.batch))], dtype=torch.long)
        metrics = draws.metrics | {"async/buffer_groups": float(buffered),
                                   "async/dropped_stale": float(len(reissued) + sum(r == "stale_twice" for _, r in dropped)),
                                   "async/dropped_no_variance": float(sum(r == "no_reward_variance" for _, r in dropped))}  # fmt: skip
        return Taken(batch.replace(staleness=staleness), [g.key for g in picked], dropped, reissued, metrics)

    def _next_group(self, since: float) -> Group:
        """The oldest buffered group; waits (condition held) with the deadline."""
        while not self._buffer:
            if self._error is not None:  # a reward function's or an engine's error, as the step would raise it
                raise self._error
            if self._thread is None or not self._thread.is_alive():
                raise RolloutStalled(f"the rollout producer stopped ({self._doing}) with too few groups for the step")
            waited = time.monotonic() - since
            if self.timeout_s is not None and waited > self.timeout_s:
                raise RolloutStalled(f"no rollouts for {waited:.0f} s: the producer is {self._doing} since "
                                     f"{time.monotonic() - self._since:.0f} s (raise trainer.hang_timeout_s if the "
                                     "engines are just slow)")  # fmt: skip
            self._cond.wait(timeout=STOP_POLL_S)
            waiting = thread_wait(self._thread)  # a stop's grace: the producer's user code that does not return
            if waiting is not None:
                give_up_after_stop(f"the rollout producer ({waiting[0]})", waiting[1])
        return self._buffer.popleft()

    def generating_overlap(self, start: float, stop: float) -> float:
        """Seconds of [start, stop] (monotonic) during which the producer generated and scored
        (since the previous step's take: older spans are forgotten at each take)."""
        with self._cond:
            spans = list(self._busy)
            if self._doing.startswith("generating"):
                spans.append((self._since, stop))
        return sum(max(0.0, min(b, stop) - max(a, start)) for a, b in spans)

    # ---- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the sampler's state, the prompts pending and re-issued): one consistent snapshot."""
        with self._cond:  # re-issued prompts are pending too
            return self.stream.state_dict(), {"pending": [list(k) for k in self._pending], "draws": self._draws.count,
                                              "reissued_once": [list(k) for k in sorted(self._reissued_once)]}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Re-issue the prompts a checkpoint left pending, before any fresh draw."""
        with self._cond:
            self._pending = [(int(f), int(r)) for f, r in state.get("pending", [])]
            self._reissue = deque(self._pending)
            self._reissued_once = {(int(f), int(r)) for f, r in state.get("reissued_once", [])}
            self._draws.count = int(state.get("draws", 0))


def _renumbered(batches: list[Batch]) -> Batch:
    """The groups' rows in order, group ids 0..G-1 (unique per step)."""
    out = [b.replace(group_id=torch.full_like(b.group_id, i)) for i, b in enumerate(batches)]
    return Batch.concat(out)


def _concat_prompts(parts: list[PromptBatch]) -> PromptBatch:
    fields = {f.name: [x for p in parts for x in getattr(p, f.name)] for f in dataclasses.fields(PromptBatch)
              if isinstance(getattr(parts[0], f.name), list)}  # fmt: skip
    return PromptBatch(**fields, step=parts[-1].step)

