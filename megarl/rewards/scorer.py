"""Parallel reward scoring in warm worker processes, with a true per-sample timeout.

``RewardScorer`` owns a pebble ``ProcessPool`` (forkserver or spawn context: the trainer
process runs threads, so plain fork is unsafe). Each task has its own timeout: a task that
runs past ``reward.timeout_s`` is stopped by killing its worker, which the pool replaces; a
worker that dies (``os._exit``, a segfault in user code) fails only its task. Such samples
score 0 and are counted (``reward/errors``, ``reward/timeouts``); the first few are logged
with the sample, the first timeout as soon as it happens.

A worker that dies while no task runs in the pool (the OOM killer between steps) breaks
pebble's whole pool, and every task it held is dropped: the scorer logs a warning, starts a new
pool and schedules the call's unscored samples on it. A second break before the new pool
finished a task (something kills every worker) raises RewardError, saying whether the new pool's
workers had finished loading (each counts itself in a shared int): if not, loading killed them;
if so, one died between samples, killed from outside or by a sample. pebble also breaks the pool
when a task kills its worker before pebble read the worker's acknowledgement of it (a race, seen
when the driver's threads hold the GIL): the new pool runs that sample again. And pebble never
fails a task it had not yet taken from its queue when the pool broke: waits look at the pool
itself every POOL_CHECK_S.

Failing fast: a function that timed out on ``reward.workers`` samples (one round of the pool)
without ever returning in this call is hanging on everything; its remaining samples are
marked as timeouts without running, so a step where every sample hangs ends within about
2 x ``timeout_s`` (a chunk's timeout, then one round of single samples). When errors +
timeouts reach ``reward.max_failed_fraction`` of a call's samples, ``score`` raises
RewardError with the function's first traceback: the run stops instead of training on zeros.

Workers import the user's files (reward.custom, reward.functions' ``file.py:function``) and load
reward.model in their initializer, before they take a task: pebble starts a task's timeout when a
worker takes it, so ``reward.timeout_s`` bounds the samples only, never a slow import, a
replacement worker's (after a timeout or a death) included. A worker that hangs or dies in its
initializer runs no task, so no task timeout covers it and pebble reports only a broken pool: the
scorer bounds that wait itself (WORKER_START_TIMEOUT_S, MODEL_LOAD_TIMEOUT_S, or LOAD_BOUND_FACTOR
times the longest load a worker measured, when more), then stops the workers and raises one
RewardError naming what was loading.

What runs where (the workers' side, initializer and tasks, is megarl/rewards/worker.py):
- built-in rule scorers (registry.py): cheap ones go in chunks of samples per task (the pool's
  per-task cost is larger than a gsm8k check); a chunk that times out or loses its worker is
  re-run one sample per task, so a hanging sample still gets exactly its own timeout.
- reward.custom: loaded in the workers, one sample per task (batched: one task per call, the
  timeout applies to the whole call).
- reward.model: one task per ``batch_size`` samples; the model is loaded once per worker.

User code that ends its worker: a function that calls ``sys.exit`` (or raises KeyboardInterrupt,
SystemExit, GeneratorExit, a BaseException subclass of its own) stops the call at once with a RewardError naming it (worker.UserExit); one
that kills its process (os._exit, a segfault) scores 0 and is named with the exit code, and
DEATHS_IN_A_ROW of them with no return in between stop the call (a worker respawned per sample
costs seconds each, and says nothing new). pebble reports no worker that exits with code 0 (a
worker it retires itself does), so a wait also looks for running tasks whose worker is gone.
The workers' stdout and stderr go to the scorer's ``log_path`` (logs/reward_workers.log in a run),
quoted in these errors, and so does what multiprocessing's helpers print (megarl/rewards/
pool_helpers.py: a resource tracker killed from outside is started again there, quietly). A long
call logs its progress every PROGRESS_EVERY_S.

Left out: rewards that need the GPU of the trainer, async scoring overlapped with generation.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pebble import ProcessExpired, ProcessPool

import megarl.rewards.registry as registry
import megarl.rewards.worker as worker
from megarl.config.sections import RewardConfig
from megarl.output_cap import enforce
from megarl.rewards.failures import (
    RewardError,
    check_failed_fraction,
    log_failures,
)
from megarl.rewards.pool_helpers import helpers_output_to, restart_dead_tracker
from megarl.rewards.pool_problems import HangWatch, break_problem, start_problem
from megarl.rewards.worker import Outcome, UserExit
from megarl.user_code import give_up_after_stop, waiting_on

log = logging.getLogger(__name__)

CHUNK_SIZE = 32  # samples per task for cheap scorers
# pebble starts a task's timeout when a worker takes it, after the worker's initializer: user
# code that hangs at import would never start one. The driver bounds that wait itself.
WORKER_START_TIMEOUT_S = 120.0  # reward.custom's import, math_verify's: as long as the pre-launch import check waits (what passes it starts)
MODEL_LOAD_TIMEOUT_S = 600.0  # reward.model: a large model read from a slow disk takes minutes
# A replacement worker's load may take this many times the longest one measured (a loaded machine
# is slower than the quiet start was) before its wait counts as a hang.
LOAD_BOUND_FACTOR = 3.0
TRAINING_STOPS = "the run stops rather than train on zero rewards"
# How often a wait looks at the pool itself: when it breaks, pebble fails the tasks it registered,
# but one scheduled a moment before (not yet taken by its scheduler thread) is never finished.
POOL_CHECK_S = 0.5
# Three: one death can be the OOM killer, and two can be the workers' two samples in flight dying
# of one outside cause together; three in a row with no return between them is the function itself
# (each costs a worker respawn, a second or more with reward.custom's imports).
DEATHS_IN_A_ROW = 3
PROGRESS_EVERY_S = 10.0  # a long scoring call: "reward: 512/1024 samples scored" this often
IMPORT_PROGRESS_EVERY_S = 5.0  # the workers' start: "reward workers: importing reward.custom from FILE ... (N s)"
LOG_QUOTE_CHARS = 300  # what of the workers' log an error line quotes
WORKER_DIED = "the worker process died"  # how a sample whose task ended its worker is said, here and by `megarl evaluate`
REWARD_WORKERS_LOG = "reward_workers.log"  # a run's, in <output_dir>/logs beside driver.log


def _absolute(name: str) -> str:
    """A reward.functions value with a user function's file made absolute; a scorer name as is."""
    user = registry.user_function(name)
    return f"{os.path.abspath(os.path.expanduser(user[0]))}:{user[1]}" if user is not None else name


@dataclass
class ScoreResult:
    """Scores of one batch, aligned with the inputs, plus extra per-sample metrics and counts."""

    scores: list[float]
    extra: dict[str, list[float]] = field(default_factory=dict)  # NaN where a sample had no value
    preds: list[str | None] = field(default_factory=list)  # the functions' "pred" answers, None where not given
    errors: int = 0
    timeouts: int = 0
    deaths: int = 0  # of the errors, samples whose task ended its worker (os._exit, a crash, a kill): WORKER_DIED

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """Means for logging: score, each extra key (NaN ignored), error and timeout counts."""
        out = {f"{prefix}score_mean": sum(self.scores) / max(len(self.scores), 1)}
        for key, values in self.extra.items():
            seen = [v for v in values if not math.isnan(v)]
            if seen:
                out[f"{prefix}{key}"] = sum(seen) / len(seen)
        out[f"{prefix}errors"] = float(self.errors)
        out[f"{prefix}timeouts"] = float(self.timeouts)
        return out


def _snapshot(d: dict) -> dict:
    """A copy of a dict pebble's threads change meanwhile (copying may meet a change: try again)."""
    while True:
        try:
            return dict(d)
        except RuntimeError:
            continue


def _sample_text(sample: tuple) -> str:
    return f"data_source={sample[0]!r} response={str(sample[1])[:80]!r}"


def quoted_output(text: str) -> str:
    """A head of printed output as one line of an error (empty text: nothing)."""
    text = text.strip()
    return repr(text[:LOG_QUOTE_CHARS] + ("..." if len(text) > LOG_QUOTE_CHARS else "")) if text else ""


class _CallProgress:
    """A long scoring call's progress: one log line every PROGRESS_EVERY_S (terminal and pipe
    alike), or, given ``report``, the samples scored since the last tick passed to it (a caller
    with a progress display of its own: `megarl evaluate`'s)."""

    def __init__(self, outcomes: list[Outcome], unscored: Outcome, report: Callable[[int], None] | None = None):
        self.outcomes, self.unscored, self.report = outcomes, unscored, report
        self.start = self.last = time.monotonic()
        self.reported = 0

    def tick(self) -> None:
        now = time.monotonic()
        if self.report is not None:
            scored = sum(o is not self.unscored for o in self.outcomes)
            if scored > self.reported:
                self.report(scored - self.reported)
                self.reported = scored
            return
        if now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        scored = sum(o is not self.unscored for o in self.outcomes)
        log.info("reward: %d/%d samples scored (%.0f s)", scored, len(self.outcomes), now - self.start)


# ----------------------------------------------------------------------------- trainer side


@dataclass
class _Job:
    indices: list[int]  # the samples this task scores
    future: Future
    split_on_failure: bool  # re-run one sample per task when the whole task times out / dies
    scorers: list[str | None] = field(default_factory=list)
    function: str = "reward.custom"  # what runs: a scorer name, reward.custom or reward.model
    call: tuple = ()  # (function, args): scheduled again on a new pool when the pool breaks
    pool: int = 0  # the pool it runs on (RewardScorer._pools when scheduled)


def remove_if_empty(log_path: Path) -> None:
    """Remove a workers' log no worker wrote to (it is no news); called by the log's owner only."""
    with contextlib.suppress(OSError):
        if log_path.stat().st_size == 0:
            log_path.unlink()


class RewardScorer:
    """Scores batches of responses in ``cfg.workers`` warm processes; use as a context manager.

    ``score(data_sources, solution_strs, ground_truths, extra_infos=None, prompts=None)``:
    lists of equal length, one entry per sample; ``prompts`` is needed by ``reward.model``.
    """

    def __init__(self, cfg: RewardConfig, *, start_method: str = "forkserver", stops: str = TRAINING_STOPS,
                 log_path: str | Path | None = None, owns_log: bool = True) -> None:  # fmt: skip
        """``owns_log`` False: ``log_path`` is shared with other pools (reward.combine), whose owner
        decides whether to remove it; this pool never does (the others may still write to it)."""
        if cfg.custom is not None and cfg.model is not None:
            raise ValueError(
                "reward.custom and reward.model are both set; set one of them (a custom function can call a model itself)"
            )
        registry.check_functions(cfg.functions)
        self.cfg = cfg
        self.stops = stops  # what failing on too many samples means, said in the RewardError
        # reward.functions with each user function's file made absolute (the workers' directory may differ)
        self._functions = {source: _absolute(name) for source, name in cfg.functions.items()}
        custom = (os.path.abspath(cfg.custom.path), cfg.custom.name) if cfg.custom else None
        model = (cfg.model.path, cfg.model.device or "cpu") if cfg.model else None
        # the workers' stdout and stderr: this file (None: this process's own, as for any library)
        self.log_path = Path(log_path).absolute() if log_path is not None else None
        self._log_made = owns_log and self.log_path is not None and not self.log_path.exists()  # removed at close when empty
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log_path.touch()
        self._max_mb = cfg.output_log_max_mb  # the log's cap (megarl/output_cap.py), kept after each call and wait
        users = sorted(n for n in self._functions.values() if registry.user_function(n)) if custom is None and model is None else []
        self._spec = {"custom": custom, "model": model, "preload_math": custom is None and model is None, "functions": users,
                      "format_score": cfg.format_score, "log": str(self.log_path) if self.log_path else None,
                      "model_input": (cfg.model.chat_template, cfg.model.max_length) if cfg.model else None}
        self._vanished: dict[Future, int] = {}  # running tasks whose worker exited with code 0 -> its pid
        self._missing: set[Future] = set()  # seen once without their worker (confirmed at the next look)
        self._progress: _CallProgress | None = None
        self._context = multiprocessing.get_context(start_method)
        self._loaded: Any = None  # the current pool's count of workers past their initializer
        self._load_s: Any = None  # the longest a worker's initializer took, seconds (kept across pools)
        if start_method == "forkserver":  # workers replaced after a timeout start in milliseconds
            self._context.set_forkserver_preload(["megarl.rewards.scorer", "math_verify"])
        self._pool = self._new_pool()
        self._pools = 0  # pools started after a break (see _restart)
        self._fresh = False  # a new pool that has not finished a task yet
        self._closed = False
        if custom is not None:
            self._check_custom(custom)
        if custom is None and model is None:
            for source, name in self._functions.items():
                if registry.user_function(name) is not None:
                    self._check_function(source, name)

    def _new_pool(self) -> ProcessPool:
        from megarl.process_signals import (
            hangup_blocked_in_children,
            stop_signals_blocked_in_children,
        )

        # Started now (pebble starts a pool at its first use; `active` does), with SIGTERM and
        # SIGHUP blocked: the forkserver, the workers and pebble's threads, which start
        # replacements, inherit the block (multiprocessing's resource tracker SIGHUP only: it
        # ignores SIGTERM itself), so a SIGTERM or a closed terminal's SIGHUP to the driver's process group
        # (`timeout`, `kill -TERM -PGID`, the shell) does not kill the samples being scored, as
        # Ctrl-C does not; each worker then leaves the group and takes SIGTERM again, which pebble
        # stops a timed-out one with (worker.init_worker).
        with helpers_output_to(self.log_path):
            with hangup_blocked_in_children():  # multiprocessing's resource tracker, started for the Value
                self._loaded = self._context.Value("i", 0)
                load_s, self._load_s = self._load_s, self._context.Value("d", 0.0)
                self._load_s.value = load_s.value if load_s is not None else 0.0
            if self._context.get_start_method() == "forkserver":
                from multiprocessing import forkserver

                with stop_signals_blocked_in_children():
                    forkserver.ensure_running()
        with stop_signals_blocked_in_children():
            pool = ProcessPool(max_workers=self.cfg.workers, initializer=worker.init_worker,
                               initargs=(self._spec, self._loaded, self._load_s), context=self._context)
            if not pool.active:  # (starts it)
                raise RewardError("the reward workers' pool did not start")
        return pool

    @property
    def _start_limit_s(self) -> float:
        # read at each wait, not fixed at construction: the module's setting when the wait starts
        base = MODEL_LOAD_TIMEOUT_S if self.cfg.model is not None else WORKER_START_TIMEOUT_S
        return max(base, LOAD_BOUND_FACTOR * self._load_s.value)

    def _check_custom(self, custom: tuple[str, str]) -> None:
        """The custom function loads in a worker within the start limit; RewardError otherwise
        (a user error: one line, wherever the scorer starts, training included)."""
        limit = self._start_limit_s
        future = self._pool.schedule(worker.check_custom, timeout=limit)
        try:
            self._result_within(future, limit)  # the whole wait: worker start, import, check
        except Exception as exc:
            self.close()  # workers stuck in the import are killed, not left behind
            if isinstance(exc, FutureTimeout):
                raise RewardError(start_problem(self.cfg, True, limit)) from exc
            if isinstance(exc, BrokenProcessPool):
                raise RewardError(break_problem(self.cfg, self._loaded.value, [], limit)) from exc
            if isinstance(exc, UserExit):
                raise RewardError(f"{self._custom_label()} {exc.what}{self._output_note(exc.output)}; a reward file must "
                                  "not end its process at import: remove that call") from None
            # worker.init_worker's load error (the user's own exception, kept), or the name is no function
            raise RewardError(
                f"reward.custom: loading {custom[1]!r} from {custom[0]} failed in a reward worker: {type(exc).__name__}: {exc}"
            ) from exc

    def _check_function(self, source: str, spec: str) -> None:
        """A reward.functions user function loads in a worker (its initializer imports every one):
        RewardError (one line) otherwise."""
        limit = self._start_limit_s
        future = self._pool.schedule(worker.check_function, args=(spec,), timeout=limit)
        try:
            self._result_within(future, limit)
        except Exception as exc:
            self.close()
            if isinstance(exc, FutureTimeout):
                raise RewardError(start_problem(self.cfg, True, limit)) from exc
            if isinstance(exc, BrokenProcessPool):  # a death at import: no traceback, the way to see why
                raise RewardError(break_problem(self.cfg, self._loaded.value, [], limit)) from exc
            why = f"it {exc}{self._output_note(exc.output)}" if isinstance(exc, UserExit) else f"{type(exc).__name__}: {exc}"
            raise RewardError(f"reward.functions[{source!r}] = {self.cfg.functions[source]!r} failed to load in a reward "
                              f"worker: {why}; fix the file or the function name") from exc

    def _result_within(self, future: Future, limit_s: float) -> Any:
        """``future.result(timeout=limit_s)``, or BrokenProcessPool as soon as the pool broke."""
        start = said = time.monotonic()
        pids: set[int] = set()
        while not wait([future], timeout=POOL_CHECK_S).done:
            if not self._pool.active:
                raise BrokenProcessPool("the pool broke before it took the task")
            pids |= self._worker_pids()
            if not self._loaded.value and len(pids) >= self.cfg.workers + DEATHS_IN_A_ROW:
                # workers replaced without a word and none loaded: each exited with code 0 while loading
                raise BrokenProcessPool(f"{len(pids)} workers started and exited with code 0 while loading")
            now = time.monotonic()
            if now - start >= limit_s:
                raise FutureTimeout()
            if now - said >= IMPORT_PROGRESS_EVERY_S:  # a slow import is no silent start
                said = now
                log.info("reward workers: %s ... (%.0f s)", self._loading(), now - start)
        error = future.exception()  # a task's SystemExit returned, not raised here (see _finished)
        if error is not None and not isinstance(error, Exception):
            raise UserExit(f"raised {type(error).__name__}")
        return future.result()

    def score(
        self,
        data_sources: Sequence[str],
        solution_strs: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[dict | None] | None = None,
        prompts: Sequence[str] | None = None,
        scorers: Sequence[str | None] | None = None,
        raw_prompts: Sequence[Any] | None = None,
        on_scored: Callable[[int], None] | None = None,
    ) -> ScoreResult:
        """Score every sample; errors and timeouts score 0 and are counted, never raised.
        ``scorers``: a built-in scorer's name per sample (reward.combine's rule components), None
        where the sample's own scorer is found as without it (reward.custom, reward.functions).
        ``raw_prompts``: the prompts as the data holds them, which reward.model re-renders in its own template.
        ``on_scored(n)``: told of each n samples scored as they are (instead of this call's own
        progress lines), for a caller that shows the progress itself."""
        restart_dead_tracker(self.log_path)  # (killed since the last call: see megarl/rewards/pool_helpers.py)
        n = len(solution_strs)
        infos = list(extra_infos) if extra_infos is not None else [None] * n
        lengths = {
            "data_sources": len(data_sources),
            "ground_truths": len(ground_truths),
            "extra_infos": len(infos),
        }
        if prompts is not None:
            lengths["prompts"] = len(prompts)
        bad = {k: v for k, v in lengths.items() if v != n}
        if bad:
            raise ValueError(
                f"RewardScorer.score: {bad} differ from len(solution_strs) = {n}; pass one entry per sample"
            )
        samples = [
            (data_sources[i], solution_strs[i], ground_truths[i], infos[i]) for i in range(n)
        ]
        if self.cfg.model is not None:
            jobs = self._model_jobs(samples, prompts, raw_prompts)
        elif self.cfg.custom is not None and self.cfg.custom.batched:
            jobs = self._batched_jobs(samples)
        else:
            jobs = self._sample_jobs(samples, scorers)
        outcomes = self._collect(jobs, samples, on_scored)
        enforce(self.log_path, self._max_mb, "reward functions")
        result = self._result(outcomes, samples)
        self._examine(samples, result, prompts)
        return result

    def _examine(self, samples: list[tuple], result: ScoreResult, prompts: Sequence[str] | None) -> None:
        """Log the first ``reward.num_examine`` scored samples of each data source (verl's
        num_examine): prompt, response, ground truth and score."""
        if not self.cfg.num_examine:
            return
        shown: dict[str, int] = {}
        for i, (source, solution, truth, _) in enumerate(samples):
            if shown.get(source, 0) >= self.cfg.num_examine:
                continue
            shown[source] = shown.get(source, 0) + 1
            prompt = f"[prompt] {prompts[i]}\n" if prompts is not None else ""
            log.info("reward: data_source=%r sample %d\n%s[response] %s\n[ground_truth] %r\n[score] %g", source, i,
                     prompt, solution, truth, result.scores[i])

    def _batched_jobs(self, samples: list[tuple]) -> list[_Job]:
        if not samples:
            return []
        columns = tuple([s[k] for s in samples] for k in range(4))
        return [self._job((worker.score_batched, (columns,)), list(range(len(samples))), False, self._custom_label())]

    def _sample_jobs(self, samples: list[tuple], scorers: Sequence[str | None] | None = None) -> list[_Job]:
        if self.cfg.custom is not None:
            names: list[str | None] = [None] * len(samples)
        else:  # resolving first: an unknown data_source is a config error, raised before any work
            names = [registry.resolve(s[0], self._functions) if scorers is None or scorers[i] is None else None
                     for i, s in enumerate(samples)]  # fmt: skip
        if scorers is not None:
            names = [given if given is not None else name for given, name in zip(scorers, names, strict=True)]
        cheap = [i for i, name in enumerate(names) if name in registry.CHEAP_SCORERS]
        chunk = max(1, min(CHUNK_SIZE, math.ceil(len(cheap) / (4 * self.cfg.workers))))
        groups = [cheap[k : k + chunk] for k in range(0, len(cheap), chunk)]
        groups += [[i] for i, name in enumerate(names) if name not in registry.CHEAP_SCORERS]
        return [self._schedule(g, [names[i] for i in g], samples) for g in groups]

    def _schedule(self, indices: list[int], names: list[str | None], samples: list[tuple]) -> _Job:
        label = f"reward scorer {names[0]}" if names[0] is not None else self._custom_label()
        return self._job((worker.score_samples, (names, [samples[i] for i in indices])), indices, len(indices) > 1, label, names)

    def _job(self, call: tuple, indices: list[int], split_on_failure: bool, function: str,
             scorers: list[str | None] | None = None) -> _Job:
        """``call`` = (function, args) scheduled on the pool, as a _Job of ``indices``."""
        return _Job(indices, self._submit(*call), split_on_failure, scorers or [], function, call, self._pools)

    def _model_jobs(self, samples: list[tuple], prompts: Sequence[str] | None, raw_prompts: Sequence[Any] | None = None) -> list[_Job]:
        if prompts is None:
            raise ValueError(
                "reward.model scores prompt + response: pass prompts=[...] to RewardScorer.score"
            )
        size = self.cfg.model.batch_size  # type: ignore[union-attr]
        raws = list(raw_prompts) if raw_prompts else [None] * len(samples)
        texts = [(raw, str(p), s[1]) for raw, p, s in zip(raws, prompts, samples, strict=True)]  # worker.score_model's samples
        jobs = []
        for k in range(0, len(texts), size):
            jobs.append(self._job((worker.score_model, (texts[k : k + size],)), list(range(k, min(k + size, len(texts)))), False,
                                  "reward.model"))
        return jobs

    def _loading(self) -> str:
        custom, model = self.cfg.custom, self.cfg.model
        return (f"importing reward.custom from {custom.path}" if custom else f"loading reward.model {model.path}" if model
                else "importing reward.functions' files")

    def _custom_label(self) -> str:
        custom = self.cfg.custom
        return f"reward.custom {custom.name!r} ({os.path.basename(custom.path)})" if custom else "reward.custom"

    def _collect(self, jobs: list[_Job], samples: list[tuple], on_scored: Callable[[int], None] | None = None) -> list[Outcome]:
        """Wait for the jobs as they finish; re-run failed chunks one sample per task; give up on
        a function that hangs on everything (see the module docstring)."""
        unscored: Outcome = ("error", "not scored", "")
        outcomes: list[Outcome] = [unscored] * len(samples)
        self._progress = _CallProgress(outcomes, unscored, on_scored)
        self._vanished.clear()  # an earlier call's, given up with their jobs
        self._missing.clear()
        pending = {job.future: job for job in jobs}
        watch = HangWatch(self.cfg.workers, self.cfg.timeout_s)
        # One restart per call before the new pool finishes a task: an earlier call's new pool
        # whose jobs were all given up (none finished) is no break of this call.
        self._fresh = False
        while pending:
            for future in self._wait_any(pending, samples):
                job = pending.pop(future, None)
                if job is None:  # given up by _give_up while this ``done`` set was handled: its outcome is set
                    continue
                try:
                    failure = self._finished(job, outcomes, watch, samples)
                except BrokenProcessPool as exc:
                    pending[future] = job
                    self._restart(pending, exc, samples)
                    break  # the rest of ``done``: kept in ``pending`` (finished before the break) or scheduled again
                if job.pool == self._pools:
                    self._fresh = False  # the current pool ran a task: a later break is a new one
                if failure is None:
                    continue
                if job.split_on_failure and not watch.hopeless(job.function):
                    for i, name in zip(job.indices, job.scorers, strict=True):
                        retry = self._schedule([i], [name], samples)
                        pending[retry.future] = retry
                    continue
                for i in job.indices:
                    outcomes[i] = failure
                if watch.hopeless(job.function):
                    self._give_up(job.function, pending, outcomes, watch)
        if on_scored is not None:
            self._progress.tick()  # the last samples' report
        return outcomes

    def _wait_any(self, pending: dict[Future, _Job], samples: list[tuple]) -> set[Future]:
        """The futures of ``pending`` that finished, once one did. Meanwhile a pool that broke is
        restarted (see POOL_CHECK_S), and a stall is a RewardError: no task running or ending for
        the start limit, every worker still in its initializer. After a stop request the wait
        lasts STOP_GRACE_S at most (megarl/user_code.py): a hanging function does not hold the stop."""
        who = ", ".join(sorted({job.function for job in pending.values()}))
        with waiting_on(who) as since:
            return self._wait_any_since(pending, samples, who, since)

    def _wait_any_since(self, pending: dict[Future, _Job], samples: list[tuple], who: str, since: float) -> set[Future]:
        quiet_since = said = time.monotonic()
        while True:
            enforce(self.log_path, self._max_mb, "reward functions")  # (a stat) a function may print gigabytes a call
            done, _ = wait(list(pending), timeout=POOL_CHECK_S, return_when=FIRST_COMPLETED)
            if self._progress is not None:
                self._progress.tick()
            if done:
                return done
            give_up_after_stop(who, since)
            restart_dead_tracker(self.log_path)
            self._look_for_vanished(pending)
            if self._vanished.keys() & pending.keys():
                return set(self._vanished.keys() & pending.keys())
            if not self._pool.active:
                self._restart(pending, BrokenProcessPool("the pool broke before it took every task"), samples)
                quiet_since = time.monotonic()
            elif any(f.running() for f in pending):
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= self._start_limit_s:
                raise self._stopped(start_problem(self.cfg, True, self._start_limit_s))
            elif time.monotonic() - max(quiet_since, said) >= IMPORT_PROGRESS_EVERY_S:  # replacement workers loading
                said = time.monotonic()
                log.info("reward workers: %s ... (%.0f s, not counted in reward.timeout_s)", self._loading(), said - quiet_since)

    def _worker_pids(self) -> set[int]:
        """The pool's live workers (pebble's internals; another pebble: none known)."""
        workers = getattr(getattr(getattr(self._pool, "_pool_manager", None), "worker_manager", None), "workers", None)
        return set(_snapshot(workers)) if isinstance(workers, dict) else set()

    def _look_for_vanished(self, pending: dict[Future, _Job]) -> None:
        """Running tasks of ``pending`` whose worker is gone and of which pebble said nothing, seen so at
        two looks POOL_CHECK_S apart: their worker exited with code 0 (pebble reports a worker's death
        only for other codes), into ``_vanished``. A task past its timeout is pebble's to stop."""
        manager = getattr(self._pool, "_pool_manager", None)  # pebble's internals; another pebble: the timeout covers it
        tasks = getattr(getattr(manager, "task_manager", None), "tasks", None)
        workers = getattr(getattr(manager, "worker_manager", None), "workers", None)
        if not isinstance(tasks, dict) or not isinstance(workers, dict):
            return
        now, missing, workers = time.time(), set(), set(_snapshot(workers))
        for task in _snapshot(tasks).values():
            future, pid = getattr(task, "future", None), getattr(task, "worker_id", 0)
            started, timeout = getattr(task, "timestamp", 0.0), getattr(task, "timeout", None) or math.inf
            if future in pending and pid and pid not in workers and not future.done() and now - started < timeout:
                missing.add(future)
        for future in missing & self._missing:
            self._vanished[future] = 0
        self._missing = missing - self._vanished.keys()

    def _finished(self, job: _Job, outcomes: list[Outcome], watch: HangWatch, samples: list[tuple]) -> Outcome | None:
        """Store a finished job's outcomes; returns the failure when the whole task failed."""
        if job.future in self._vanished:
            return self._died(job, self._vanished.pop(job.future), watch, samples)
        # exception(), not result(): a SystemExit or KeyboardInterrupt a task ended with is returned, not
        # raised in the driver (where it would pass for the user's Ctrl-C); the future is done: no wait
        error = job.future.exception()
        if isinstance(error, FutureTimeout):
            watch.timed_out(job.function, samples[job.indices[0]])
            return ("timeout", f"timed out after {self.cfg.timeout_s:g} s (reward.timeout_s)")
        if isinstance(error, BrokenProcessPool):  # the pool runs nothing any more (_collect restarts it)
            raise error
        if isinstance(error, ProcessExpired):
            return self._died(job, error.exitcode, watch, samples)
        if isinstance(error, UserExit) or (error is not None and not isinstance(error, Exception)):
            raise self._exited(job, error, samples)
        if error is not None:  # a batched / model call that raised
            watch.returned(job.function)
            return ("error", f"{type(error).__name__}: {error}", getattr(error, "traceback", "") or "")
        watch.returned(job.function)
        for i, outcome in zip(job.indices, job.future.result(), strict=True):
            outcomes[i] = outcome
        return None

    def _died(self, job: _Job, code: int, watch: HangWatch, samples: list[tuple]) -> Outcome:
        """A task killed its worker (os._exit, a crash in C): that sample's failure, or, the
        DEATHS_IN_A_ROW-th time in a row, a RewardError that stops the call."""
        sample = samples[job.indices[0]]
        died = f"{WORKER_DIED} (exit code {code}{', a segfault' if code == -11 else ''}) while scoring"
        if watch.died(job.function) >= DEATHS_IN_A_ROW:
            raise self._stopped_by_user_code(
                f"{job.function}: {died} {_sample_text(sample)}; {DEATHS_IN_A_ROW} samples in a row ended their worker "
                f"with no score returned between them{self._output_note(self._log_tail())}; a reward function must return a "
                "score (or raise), not end its process: look for os._exit, or a crash in C code (which ends a worker with a "
                "negative exit code: -11 for a segfault)")
        if watch.deaths[job.function] == 1:  # at once, not when the batch ends
            log.warning("reward: %s: %s %s (scored 0)", job.function, died, _sample_text(sample))
        return ("error", f"{died} it", "")

    def _exited(self, job: _Job, error: BaseException, samples: list[tuple]) -> RewardError:
        """A task whose user code tried to end its process the Python way (worker.UserExit)."""
        if isinstance(error, UserExit):
            what, position, output, trace = error.what, error.position, error.output, error.trace
        else:  # megarl's own code in the worker: said as is
            what, position, output, trace = f"raised {type(error).__name__}", 0, "", getattr(error, "traceback", "")
        if trace:  # (the workers wrote it to the log file too)
            log.debug("reward: %s %s:\n%s", job.function, what, trace.rstrip())
        sample = samples[job.indices[min(position, len(job.indices) - 1)]]
        return self._stopped_by_user_code(
            f"{job.function} {what} while scoring {_sample_text(sample)}{self._output_note(output)}; a reward function "
            "must return a score (return 0.0, or raise an exception, for a sample it cannot score), never end the process")

    def _stopped_by_user_code(self, message: str) -> RewardError:
        self.close()
        return RewardError(message)

    def _output_note(self, output: str) -> str:
        """Where the workers' output is (when they wrote any), and ``output``'s head."""
        try:
            written = self.log_path is not None and self.log_path.stat().st_size > 0
        except OSError:
            written = False
        if not written:
            return ""
        quoted = quoted_output(output)
        return f" (the workers' output: {self.log_path}" + (f", there: {quoted})" if quoted else ")")

    def _log_tail(self) -> str:
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, self.log_path.stat().st_size - LOG_QUOTE_CHARS))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _restart(self, pending: dict[Future, _Job], exc: BrokenProcessPool, samples: list[tuple]) -> None:
        """A new pool in place of the broken one, and every job the break dropped (all of ``pending``
        but those that finished before it) scheduled on it. A second break before the new pool
        finished a task is a RewardError saying what is known (break_problem)."""
        if self._fresh:
            unscored = sorted({i for job in pending.values() for i in job.indices})
            why = break_problem(self.cfg, self._loaded.value, [samples[i] for i in unscored], self._start_limit_s)
            raise self._stopped(why) from exc
        dropped = [f for f in pending if not f.done() or isinstance(f.exception(), BrokenProcessPool)]
        log.warning("reward: the reward workers' pool broke (a worker died while no sample ran on it: killed from "
                    "outside, by the OOM killer say, or dying as it started); starting a new pool for this call's "
                    "%d unscored samples", sum(len(pending[f].indices) for f in dropped))
        self._pool.stop()
        self._pool.join()
        self._pool = self._new_pool()
        self._pools += 1
        self._fresh = True
        for future in dropped:
            job = pending.pop(future)
            retry = replace(job, future=self._submit(*job.call), pool=self._pools)
            pending[retry.future] = retry

    def _give_up(self, function: str, pending: dict[Future, _Job], outcomes: list[Outcome], watch: HangWatch) -> None:
        skipped = [job for job in pending.values() if job.function == function]
        for job in skipped:
            job.future.cancel()  # a running one: pebble stops its worker
            del pending[job.future]
            for i in job.indices:
                outcomes[i] = ("timeout", f"not run: {function} timed out {watch.timeouts[function]} times and never returned")
        count = sum(len(job.indices) for job in skipped)
        if count:
            log.warning("reward: %s timed out %d times without ever returning; its other %d samples of this batch "
                        "are counted as timeouts without running", function, watch.timeouts[function], count)

    def _result(self, outcomes: list[Outcome], samples: list[tuple]) -> ScoreResult:
        n = len(outcomes)
        result = ScoreResult(scores=[0.0] * n, preds=[None] * n)
        failed = []
        for i, outcome in enumerate(outcomes):
            if outcome[0] != "ok":
                failed.append(i)
                continue
            result.scores[i] = outcome[1]
            for key, value in outcome[2].items():
                if key == "pred":
                    result.preds[i] = value
                else:
                    result.extra.setdefault(key, [math.nan] * n)[i] = value
        result.timeouts = sum(outcomes[i][0] == "timeout" for i in failed)
        result.errors = sum(outcomes[i][0] == "error" for i in failed)
        result.deaths = sum(outcomes[i][0] == "error" and str(outcomes[i][1]).startswith(WORKER_DIED) for i in failed)
        self._check_failed_fraction(outcomes, samples)  # first: its one line says it all, no warnings before it
        log_failures("reward", outcomes, [x[0] for x in samples], [x[1] for x in samples], [x[2] for x in samples])
        return result

    def _check_failed_fraction(self, outcomes: list[Outcome], samples: list[tuple]) -> None:
        first = next((o for o in outcomes if o[0] != "ok"), None)
        trace = first[2] if first is not None and first[0] == "error" and len(first) > 2 else ""
        what = self._custom_label() if self.cfg.custom else "reward.model" if self.cfg.model else "the reward scorers"

        def fix(kind: str) -> str:
            return ("raise reward.timeout_s or make the function return sooner" if kind == "timeout"
                    else "fix the function" + (" (its traceback follows)" if trace else ""))  # fmt: skip

        check_failed_fraction(what, outcomes, [x[0] for x in samples], limit=self.cfg.max_failed_fraction,
                              stops=self.stops, fix=fix, trace=trace)  # fmt: skip

    def _submit(self, fn: Any, args: tuple) -> Future:
        try:
            return self._pool.schedule(fn, args=args, timeout=self.cfg.timeout_s)
        except RuntimeError as exc:  # pebble's "Unexpected error within the Pool": a worker died outside a task
            if self._closed:
                raise RuntimeError("RewardScorer.score called after close()") from exc
            broken: Future = Future()  # a task of the broken pool: _collect restarts the pool and schedules it again
            broken.set_exception(BrokenProcessPool(str(exc)))
            return broken

    def _stopped(self, why: str) -> RewardError:
        """The pool cannot score any more: stop its workers (none is left behind) and say why."""
        self.close()
        return RewardError(f"reward workers stopped taking samples: {why}; {self.stops}")

    def close(self) -> None:
        """Stop the workers (running tasks are abandoned)."""
        self._closed = True
        restart_dead_tracker(self.log_path)  # stopping the pool releases its semaphores: a dead tracker would be relaunched noisily
        self._pool.stop()
        self._pool.join()
        if self._log_made and self.log_path is not None:
            remove_if_empty(self.log_path)

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
