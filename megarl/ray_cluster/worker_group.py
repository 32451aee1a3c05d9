"""Run N copies of a plain Python worker class as Ray actors, wired like torchrun would.

The workers (policy, critic, ...) are plain classes that also run under torchrun without
Ray. A WorkerGroup wraps such a class in one generic actor per rank which, before it builds
the worker, sets the environment torchrun would have set:

- RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK: rank r sits on bundle r of the
  role's placement; LOCAL_RANK counts the ranks of the group that really landed on the same
  node (in rank order), NODE_RANK numbers those nodes in order of their first rank.
- MASTER_ADDR, MASTER_PORT: rank 0's node IP and a port that rank 0 found free.
- OMP_NUM_THREADS / MKL_NUM_THREADS: 1 for CPU workers unless `omp_threads` says otherwise
  (Ray's own default is the actor's CPU count; several gloo ranks on a few cores thrash).
  GPU workers keep Ray's value unless `omp_threads` is given.
- CUDA_VISIBLE_DEVICES: Ray gives each GPU actor only its own device(s). When every rank
  holds exactly one GPU (or a fraction of one, colocated), the group rewrites it to the
  GPUs of all the group's ranks on that node, in LOCAL_RANK order, so that, as under
  torchrun, `torch.cuda.set_device(LOCAL_RANK)` selects the rank's own GPU and peers are
  visible (CUDA IPC, NCCL P2P). With several GPUs per rank, Ray's per-actor value is kept
  and the worker's devices are 0..k-1. This happens before the worker class is built; the
  host actor never imports torch, so CUDA is not initialised earlier.

Every rank's stdout and stderr (file descriptors 1 and 2, so C++ output too) go to
`<log_dir>/<role>_rank<r>.log`. A rank that raises, or whose process dies, is reported as
a WorkerError whose first line (``summary``) names the role, the rank, the method and the
cause quoted from that log (the last exception line it holds), followed by the log's last
lines. Each rank registers faulthandler on SIGUSR1: `dump_stacks()` makes every rank write
the Python stacks of all its threads to its log (a rank on another node is signalled by a
zero-CPU Ray task pinned to that node), which the hang watchdog uses; `pending_calls()`
says which ranks have not answered the calls in flight.

A call names the worker class's method itself (``group.call(PolicyRank.update, batch, t)``),
so the type check sees its name, arguments and result; the actor gets the method's name and
runs its worker's method of that name (an override included).

This module imports neither torch nor megatron: the driver imports it. Left out: actor
restarts (a dead rank fails the group; the trainer resumes from a checkpoint), concurrent
calls into one rank (each actor runs one call at a time, in submission order).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, TypeVarTuple

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError, UnserializableException

from megarl.config.sections import BUILD_TIMEOUT_S
from megarl.progress import still_waiting
from megarl.rank_logs import START_LINE, without_warnings
from megarl.ray_cluster.placement import PlacedRole, RolePlacement, place_roles
from megarl.ray_cluster.rank_env import RANK_LOG_ENV
from megarl.ray_cluster.ray_failures import node_view, ray_failure
from megarl.ray_cluster.session import wait_watching_the_node
from megarl.ray_cluster.worker_error import WorkerError
from megarl.terminal import worker_logging

LOG_TAIL_LINES = 40
STACK_SIGNAL = signal.SIGUSR1  # faulthandler in every rank: write all threads' stacks to the log
STACK_MARK = b"most recent call first"
# The line of a log that says what went wrong: a Python exception, or the C runtime's last word.
# A prefix such as "[rank1]: " (torch's) is allowed before the exception's name.
_CAUSE_RE = re.compile(r"(^|: )[\w.]*(Error|Exception|Exit|Interrupt)\b|^(Killed|Segmentation fault|Fatal Python error|terminate called)\b")

log = logging.getLogger(__name__)

W = TypeVar("W")  # the worker class
P = ParamSpec("P")  # a worker method's parameters after self
Ts = TypeVarTuple("Ts")  # the same for call_each, whose per-rank arguments are tuples
R = TypeVar("R")  # what the method returns on one rank


class CallTimeout(WorkerError):
    """A call did not finish on every rank within its deadline; ``waiting`` lists the ranks that
    had not answered."""

    def __init__(self, message: str, role: str, waiting: list[int]):
        super().__init__(message, role, waiting[0])
        self.waiting = waiting


@dataclass(frozen=True)
class GroupOptions:
    """How a WorkerGroup starts its actors (kept apart from the worker's own init kwargs).

    log_dir: one log file per rank goes here (None: a fresh temp dir). On several nodes, use a
      shared filesystem or the driver cannot quote a dead rank's log.
    env: extra environment variables for every rank (set before the worker is built).
    omp_threads: OMP/MKL threads per rank; None = 1 on CPU, Ray's default on GPU.
    init_timeout_s: how long starting the actors and building the workers may take before the
      group gives up (0: no deadline); a run's comes from cluster.build_timeout_s.
    init_timeout_key: the config key that set init_timeout_s, named with the fix when it passes.
    place_timeout_s: how long to wait for the placement group when the group creates it.
    """

    log_dir: str | Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    omp_threads: int | None = None
    init_timeout_s: float = BUILD_TIMEOUT_S
    init_timeout_key: str = ""
    place_timeout_s: float = 120.0

    @classmethod
    def of_run(cls, cluster: Any, log_dir: str | Path, env: dict[str, str] | None = None) -> GroupOptions:
        """A run's group (launch, sft): its log folder, and the start-up deadline of
        ``cluster.build_timeout_s`` (a megarl.config.sections.ClusterConfig), named when it passes."""
        return cls(log_dir=log_dir, env=dict(env or {}), init_timeout_s=cluster.build_timeout_s,
                   init_timeout_key="cluster.build_timeout_s")  # fmt: skip


def output_to_log(log_path: str) -> None:
    """This actor process's stdout and stderr (Python's and any C library's) appended to
    ``log_path``: what a Ray actor of megarl does first."""
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    worker_logging()  # megarl's loggers at the driver's --log-level


class _WorkerHost:
    """The generic Ray actor: sends its output to a log file, then hosts one worker object."""

    def __init__(self, log_path: str):
        output_to_log(log_path)
        # `WorkerGroup.dump_stacks()`: written from the signal handler itself, so a rank stuck in C
        # code (a collective, a CUDA call) still shows where it is.
        faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
        self._worker: Any = None

    def node_info(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": ctx.get_node_id(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
        }

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def construct(self, cls: type, packed: tuple[tuple, dict], env: dict[str, str]) -> None:
        args, kwargs = packed
        os.environ.update(env)
        print(START_LINE.format(rank=env.get("RANK"), pid=os.getpid(), name=cls.__qualname__), flush=True)
        self._worker = self._guarded(cls, args, kwargs)

    def run(self, method: str, packed: tuple[tuple, dict]) -> Any:
        args, kwargs = packed
        return self._guarded(getattr(self._worker, method), args, kwargs)

    def run_split(self, method: str, shared: tuple, mine: Any) -> Any:
        return self._guarded(getattr(self._worker, method), (*shared, mine), {})

    def _guarded(self, fn: Any, args: tuple, kwargs: dict) -> Any:
        try:
            return fn(*args, **kwargs)
        except BaseException:
            # The traceback goes to this rank's log, which the driver quotes on failure.
            traceback.print_exc()
            sys.stderr.flush()
            raise


_HostActor = ray.remote(max_restarts=0, max_task_retries=0)(_WorkerHost)


@ray.remote(num_cpus=0)
def _signal_pid(pid: int, signum: int) -> bool:
    """Runs on the rank's node (pinned there): the actor itself may be busy with a call."""
    try:
        os.kill(pid, signum)
        return True
    except ProcessLookupError:
        return False


@dataclass
class PendingCall(Generic[R]):
    """Object refs of one call into some ranks (``method``: its name); `get()` waits and
    translates failures."""

    group: WorkerGroup[Any]
    method: str
    ranks: list[int]
    refs: list[ray.ObjectRef]

    def get(self, timeout_s: float | None = None) -> list[R]:
        """Results in rank order; raises WorkerError for the first rank that fails."""
        return self.group._gather(self.refs, self.ranks, self.method, timeout_s)


class WorkerGroup(Generic[W]):
    """N Ray actors, each building `cls(*init_args, **init_kwargs)` with torchrun's environment.

    placement: a RolePlacement (the group creates and later removes its own placement
    groups) or a PlacedRole from place_roles() (shared / colocated pools; the caller
    releases them). Options go in `group_options=GroupOptions(...)`, so they never collide
    with the worker's own keyword arguments.
    """

    def __init__(
        self,
        cls: type[W],
        placement: RolePlacement | PlacedRole,
        *init_args: Any,
        group_options: GroupOptions | None = None,
        **init_kwargs: Any,
    ):
        self.cls = cls
        self.options = group_options or GroupOptions()
        self.role = placement.role
        log_dir = self.options.log_dir or tempfile.mkdtemp(prefix=f"megarl-{self.role}-logs-")
        self.log_dir = Path(log_dir).resolve()
        # First, before anything is placed: an unwritable place is one clear OSError, not a rank
        # dying in its constructor.
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if isinstance(placement, RolePlacement):
            placed = place_roles([placement], timeout_s=self.options.place_timeout_s)[placement.role]
            placed.owns_pool = True
        else:
            placed = placement
        self.placed = placed
        self.world_size = placed.placement.world_size
        self.log_paths = [self.log_dir / f"{self.role}_rank{r}.log" for r in range(self.world_size)]
        self._waits: dict[int, tuple[str, list[int]]] = {}  # calls in flight -> ranks not answered yet
        self._waits_lock = threading.Lock()
        # Where this group's output starts in each log (a log dir may be reused by a restart).
        self._log_starts = [p.stat().st_size if p.exists() else 0 for p in self.log_paths]
        self._actors: list[Any] = []
        self._closed = False
        self.node_infos: list[dict[str, Any]] = []
        try:
            self._start(init_args, init_kwargs)
        except BaseException:
            self.shutdown()
            raise

    # ---- start-up -------------------------------------------------------------------

    def _start(self, init_args: tuple, init_kwargs: dict) -> None:
        started = time.monotonic()
        log.info("%s: starting %d rank(s) (logs: %s)", self.role, self.world_size, self.options.log_dir or self.log_dir)
        self._actors = [
            _HostActor.options(**self.placed.scheduling(r)).remote(str(self.log_paths[r]))
            for r in range(self.world_size)
        ]
        ranks = list(range(self.world_size))
        timeout = self.options.init_timeout_s or None  # 0: no deadline (each of the three waits)
        try:
            self.node_infos = self._gather([a.node_info.remote() for a in self._actors], ranks, "<start>", timeout, watch_node=True)
            port = self._gather([self._actors[0].free_port.remote()], [0], "<free_port>", timeout, watch_node=True)[0]
            envs = self.rank_envs(self.node_infos, self.node_infos[0]["ip"], port)
            log.info("%s: %d rank(s) up; building %s in each (loads the model) ...", self.role, self.world_size, self.cls.__qualname__)
            packed = ray.put((init_args, init_kwargs))  # a top-level ref: Ray resolves it per actor
            refs = [a.construct.remote(self.cls, packed, envs[r]) for r, a in enumerate(self._actors)]
            with still_waiting(f"{self.role}: building {self.cls.__qualname__} in {self.world_size} rank(s)"):
                self._gather(refs, ranks, "__init__", timeout, watch_node=True)
        except CallTimeout as err:
            raise build_timeout_error(err, self.options) from None
        log.info("%s: %d rank(s) ready in %.0f s", self.role, self.world_size, time.monotonic() - started)

    def rank_envs(self, infos: Sequence[dict[str, Any]], master_addr: str, master_port: int) -> list[dict[str, str]]:
        """The torchrun-like environment of every rank, from where the ranks landed."""
        node_order: list[str] = []
        local_ranks: list[int] = []
        members: dict[str, list[int]] = {}
        for rank, info in enumerate(infos):
            node = info["node_id"]
            if node not in members:
                members[node] = []
                node_order.append(node)
            local_ranks.append(len(members[node]))
            members[node].append(rank)
        gpus = self.placed.placement.gpus_per_proc
        one_gpu_each = gpus > 0 and all(len(i["gpu_ids"]) == 1 for i in infos)
        envs = []
        for rank, info in enumerate(infos):
            node = info["node_id"]
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(local_ranks[rank]),
                "LOCAL_WORLD_SIZE": str(len(members[node])),
                "NODE_RANK": str(node_order.index(node)),
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                "MEGARL_ROLE": self.role,
                RANK_LOG_ENV: str(self.log_paths[rank]),  # megarl/weight_sync/progress.py writes beside it
            }
            threads = self.options.omp_threads or (1 if gpus == 0 else None)
            if threads is not None:
                env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
            if one_gpu_each:
                node_gpus = list(dict.fromkeys(infos[r]["gpu_ids"][0] for r in members[node]))
                env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus)
            env.update(self.options.env)
            envs.append(env)
        return envs

    # ---- calls ----------------------------------------------------------------------

    def call(self, method: Callable[Concatenate[W, P], R], /, *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Call `method(*args, **kwargs)` on every rank (``method``: the worker class's function);
        results in rank order."""
        return self.call_async(method, *args, **kwargs).get()

    def call_within(self, timeout_s: float | None, method: Callable[Concatenate[W, P], R], /, *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """As :meth:`call`, but raise :class:`CallTimeout` when a rank has not answered within
        ``timeout_s`` seconds (None: wait as long as it takes). The ranks go on running."""
        return self.call_async(method, *args, **kwargs).get(timeout_s)

    def call_each(self, method: Callable[[W, *Ts], R], args_per_rank: Sequence[tuple[*Ts]]) -> list[R]:
        """Rank r gets `args_per_rank[r]`: a tuple of positional arguments, which the type check
        matches against the method (unchecked, a list passes positional arguments too, a dict
        keywords, anything else one positional argument)."""
        return self.call_each_async(method, args_per_rank).get()

    def call_async(self, method: Callable[Concatenate[W, P], R], /, *args: P.args, **kwargs: P.kwargs) -> PendingCall[R]:
        name = self._check_open(method)
        packed = ray.put((args, kwargs))  # serialised once, shared by all ranks
        refs = [a.run.remote(name, packed) for a in self._actors]
        return PendingCall(self, name, list(range(self.world_size)), refs)

    def call_split(self, method: Callable[..., R], shared: tuple, each: Sequence[Any]) -> list[R]:
        """Rank r runs ``method(*shared, each[r])``: ``shared`` is stored once for all ranks and each
        distinct object of ``each`` once for the ranks it goes to (a data-parallel replica's share)."""
        name = self._check_open(method)
        if len(each) != self.world_size:
            raise ValueError(f"{self.role}.call_split('{name}'): {len(each)} parts for {self.world_size} ranks")
        packed, stored = ray.put(shared), dict[int, Any]()
        for x in each:
            stored.setdefault(id(x), ray.put(x))
        refs = [a.run_split.remote(name, packed, stored[id(x)]) for a, x in zip(self._actors, each, strict=True)]
        return PendingCall(self, name, list(range(self.world_size)), refs).get()

    def call_each_async(self, method: Callable[[W, *Ts], R], args_per_rank: Sequence[tuple[*Ts]]) -> PendingCall[R]:
        name = self._check_open(method)
        if len(args_per_rank) != self.world_size:
            raise ValueError(
                f"{self.role}.call_each('{name}'): got {len(args_per_rank)} argument sets for "
                f"{self.world_size} ranks; pass exactly one per rank"
            )
        refs = [a.run.remote(name, _as_packed(x)) for a, x in zip(self._actors, args_per_rank, strict=True)]
        return PendingCall(self, name, list(range(self.world_size)), refs)

    def _check_open(self, method: Callable[..., Any]) -> str:
        """The name the rank's actor is sent: Ray carries a name, not the function."""
        name = method.__name__
        if self._closed:
            raise RuntimeError(f"{self.role} worker group is shut down; cannot call '{name}'")
        if not callable(getattr(self.cls, name, None)):
            raise AttributeError(f"{self.role}: {self.cls.__qualname__} has no method '{name}'")
        return name

    def _gather(self, refs: list[Any], ranks: list[int], method: str, timeout_s: float | None,
                watch_node: bool = False) -> list[Any]:  # fmt: skip
        """Wait for all refs; the first failure (in completion order) raises WorkerError.
        ``watch_node``: the embedded raylet is checked every few seconds meanwhile (start-up)."""
        pending = dict(zip(refs, range(len(refs)), strict=True))
        results: list[Any] = [None] * len(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        key = id(pending)
        try:
            while pending:
                self._note_wait(key, method, sorted(ranks[i] for i in pending.values()))
                ready = wait_watching_the_node(list(pending), deadline, watch_node)
                if not ready:
                    waiting = sorted(ranks[i] for i in pending.values())
                    raise CallTimeout(
                        f"{self.role}: {self._what(method)} did not finish within {timeout_s:g} s on "
                        f"rank(s) {waiting}; logs: {self.log_dir}", self.role, waiting)
                for ref in ready:
                    index = pending.pop(ref)
                    try:
                        results[index] = ray.get(ref)
                    # (UnserializableException: what a rank raised could not be unpickled here;
                    # its message is the rank's stack trace, whose last line names the error)
                    except (RayTaskError, RayActorError, GetTimeoutError, UnserializableException) as exc:
                        raise self._failure(ranks[index], method, exc) from exc
        finally:
            with self._waits_lock:
                self._waits.pop(key, None)
        return results

    def _note_wait(self, key: int, method: str, ranks: list[int]) -> None:
        with self._waits_lock:
            self._waits[key] = (self._what(method), ranks)

    def pending_calls(self) -> list[tuple[str, list[int]]]:
        """The calls being waited for now: (what, ranks that have not answered yet)."""
        with self._waits_lock:
            return list(self._waits.values())

    def dump_stacks(self) -> dict[int, bool]:
        """Make every rank write all its threads' Python stacks to its log; rank -> whether it
        did (within a few seconds). Local ranks get the signal directly, remote ones through a
        zero-CPU task pinned to their node (the actor itself may be stuck in a call)."""
        here = socket.gethostname()
        sizes = [self._log_size(r) for r in range(len(self.node_infos))]
        for info in self.node_infos:
            try:
                if info.get("hostname") == here:
                    os.kill(info["pid"], STACK_SIGNAL)
                else:
                    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                    pinned = NodeAffinitySchedulingStrategy(info["node_id"], soft=False)
                    ray.get(_signal_pid.options(scheduling_strategy=pinned).remote(info["pid"], STACK_SIGNAL), timeout=10)
            except Exception:  # noqa: BLE001 - a dead rank or node: reported as "did not write"
                continue
        deadline = time.monotonic() + 3.0
        written: dict[int, bool] = {}
        while time.monotonic() < deadline and len([w for w in written.values() if w]) < len(sizes):
            written = {r: self._stack_written(r, sizes[r]) for r in range(len(sizes))}
            time.sleep(0.1)
        return {r: written.get(r, False) for r in range(len(sizes))}

    def _log_size(self, rank: int) -> int:
        try:
            return self.log_paths[rank].stat().st_size
        except OSError:
            return 0

    def _stack_written(self, rank: int, since: int) -> bool:
        try:
            with open(self.log_paths[rank], "rb") as f:
                f.seek(since)
                return STACK_MARK in f.read()
        except OSError:
            return False

    def _what(self, method: str) -> str:
        name = self.cls.__qualname__
        return {"<start>": "starting the actor", "<free_port>": "picking MASTER_PORT"}.get(method, f"{name}.{method}")

    def _failure(self, rank: int, method: str, exc: BaseException) -> WorkerError:
        tail = self.log_tail(rank) if rank < len(self.log_paths) else ""
        where = self.node_infos[rank] if rank < len(self.node_infos) else {}
        if isinstance(exc, RayActorError):
            time.sleep(0.2)  # let the dying process's last writes reach the log
            tail = self.log_tail(rank)
            # Ray's own failure (its node died, the memory monitor) first: the log then holds at
            # most the symptom ("Socket closed"), not the cause.
            node = ray_failure(exc, where.get("node_id"), where.get("ip"), node_view(where.get("node_id")))
            cause = node or _cause(tail) or _cause(str(exc)) or "no error in its log: killed by a signal (the OOM killer?)"
            how = f"died during {self._what(method)}: {cause}"
        else:
            err = getattr(exc, "cause", None) or exc
            lines = str(err).strip().splitlines()
            said = lines[-1] if lines else f"(no message) {_raised_at(str(exc))}".rstrip()
            if isinstance(err, UnserializableException):  # its last line is "module.Class: message"
                how = f"raised in {self._what(method)} (an exception Ray could not unpickle): {said}"
            else:
                how = f"raised {type(err).__name__} in {self._what(method)}: {said}"
            if node := ray_failure(err):  # a call whose result Ray could not keep (a full object store)
                how = f"failed in {self._what(method)}: {node}"
        host = f" on {where.get('hostname')} ({where.get('ip')}), pid {where.get('pid')}" if where else ""
        summary = f"{self.role} rank {rank}{host} {how} (log: {self.log_paths[rank]})"
        message = f"{summary}\n--- last lines of {self.log_paths[rank]} ---\n{tail}"
        return WorkerError(message, self.role, rank, summary,
                           None if isinstance(exc, RayActorError) else getattr(exc, "cause", None) or exc)

    def log_tail(self, rank: int, lines: int = LOG_TAIL_LINES) -> str:
        """The last `lines` lines this group's rank wrote to its log (read on the driver's
        filesystem), less the library warnings (megarl/rank_logs.py): torch's, a dozen lines
        of them, would push out what the rank did last."""
        path = self.log_paths[rank]
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(self._log_starts[rank], f.tell() - 64 * 1024))
                text = f.read().decode("utf-8", errors="replace")
        except OSError as exc:
            info = self.node_infos[rank] if rank < len(self.node_infos) else {}
            if not info or info.get("hostname") == socket.gethostname():
                return f"(no log: {exc.strerror}: {path})"
            return f"(log not readable here: {exc.strerror}; it is on {info.get('hostname')}, or use a shared log_dir)"
        return "\n".join(without_warnings(text.splitlines())[-lines:])

    # ---- shutdown -------------------------------------------------------------------

    def shutdown(self) -> None:
        """Kill every actor; remove the placement groups if this group created them."""
        if self._closed:
            return
        self._closed = True
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass
        self._actors = []
        if self.placed.owns_pool:
            self.placed.pool.remove()

    def __enter__(self) -> WorkerGroup[W]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def build_timeout_error(err: CallTimeout, options: GroupOptions) -> CallTimeout:
    """``err`` (the ranks' build passed its deadline) with the config key that sets the deadline,
    its value and the fix, where the group was given the key."""
    key = options.init_timeout_key
    if not key:
        return err
    return CallTimeout(f"{err}; raise {key} ({options.init_timeout_s:g}) if the ranks are only slow to start or build their models "
                       "(a large checkpoint on a slow filesystem), or set it to 0 for no deadline", err.role, err.waiting)


def _raised_at(traceback_text: str) -> str:
    """'at <file>:<line> in <function>' of a traceback's last frame ('' without one): where an
    exception without a message (a bare assert) was raised. Ray's error text holds the rank's traceback."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', traceback_text)
    if not frames:
        return ""
    file, line, function = frames[-1]
    return f"at {file}:{line} in {function}"


def _cause(text: str) -> str | None:
    """The last line of ``text`` that names an error (what a dead rank's log says happened)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if _CAUSE_RE.search(line):
            return line[:300]
    return None


def _as_packed(x: Any) -> tuple[tuple, dict]:
    if isinstance(x, dict):
        return (), x
    if isinstance(x, (tuple, list)):
        return tuple(x), {}
    return (x,), {}
