"""The controller's typed view of the worker groups: one client per role, one method per call.

A client turns a typed call (``policy.compute_logprobs(batch, temperature) -> [B, R]``) into
a call on every rank of its group and collects the answers by the method's rule, declared
here once per method:

- ``_first``: the collective already made every rank's answer identical (metrics reduced over
  the group, a checksum): rank 0's is taken.
- ``_rows``: per-token results; each data-parallel replica's output rank returns the rows it
  computed (:class:`~megarl.data.batch.TokenRows`) and the client assembles ``[B, R]``.
- ``_each``: one answer per rank (layouts, generations of the engines in the ranks).

A call names the rank class's method itself (``group.call(PolicyRank.update, batch, t)``), so
the type check (mypy) sees a renamed or mistyped method, wrong arguments or a wrong result
type; the group sends the method's name and the rank runs its method of that name. The group
is anything with ``world_size``, ``call`` and ``call_each``: a Ray
:class:`~megarl.ray_cluster.worker_group.WorkerGroup`, or an :class:`InProcessGroup`
(world size 1, no Ray: a one-GPU box under torchrun, and unit tests); they are the only places
a method's name is looked up. The rank classes import Megatron only inside their methods, so
importing them here costs the controller no Megatron (tests/unit/actors/test_clients.py).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, TypeVarTuple, cast

import torch

from megarl.actors.conversion_rank import ConversionRank
from megarl.actors.critic_rank import CriticRank
from megarl.actors.policy_rank import PolicyRank
from megarl.actors.routing_split import policy_replica_rows
from megarl.actors.sft_rank import SFTRank
from megarl.actors.trained_rank import TrainedRank
from megarl.config.sections import MegaRLConfig
from megarl.data.batch import Batch, TokenRows
from megarl.engines.base import GenerationResult
from megarl.ray_cluster.worker_error import WorkerError

W = TypeVar("W")  # a rank class
W_co = TypeVar("W_co", covariant=True)  # a group of PolicyRank is a group of TrainedRank
T = TypeVar("T", bound=TrainedRank)
P = ParamSpec("P")
Ts = TypeVarTuple("Ts")
R = TypeVar("R")


class Group(Protocol[W_co]):
    """What a client needs of a worker group of ``W_co`` ranks (WorkerGroup and InProcessGroup
    have it): ``method`` is a function of the rank class, ``PolicyRank.update``."""

    world_size: int

    def call(self, method: Callable[Concatenate[W_co, P], R], /, *args: P.args, **kwargs: P.kwargs) -> list[R]: ...

    def call_each(self, method: Callable[[W_co, *Ts], R], args_per_rank: Sequence[tuple[*Ts]]) -> list[R]: ...

    def call_split(self, method: Callable[..., R], shared: tuple, each: Sequence[Any]) -> list[R]: ...


def _first(results: list[R]) -> R:
    return results[0]


def _rows(results: list[TokenRows | None], batch: Batch) -> dict[str, torch.Tensor]:
    return TokenRows.assemble(results, len(batch), batch.response_len)


@dataclass(frozen=True)
class RankLayout:
    """Where one rank of the policy group sits (the controller maps engines to ranks with it)."""

    rank: int
    dp_rank: int
    dp_size: int
    leader: bool  # TP rank 0 of the first pipeline stage: holds its replica's torch engine


class TrainedClient(Generic[T]):
    """What the policy and critic clients share: checkpoints, memory states, profiling."""

    def __init__(self, group: Group[T]) -> None:
        self.group = group

    def save(self, path: str) -> None:
        self.group.call(TrainedRank.save, path)

    def load(self, path: str) -> None:
        self.group.call(TrainedRank.load, path)

    # Memory: only the hand-over (megarl/memory/handover.py) calls offload / onload.
    def offload(self, states: Sequence[str]) -> int:
        """Move residency-table states of this group's processes (``policy/optimizer``,
        ``reference/weights``, ...: megarl/memory/residency.py) off the devices; bytes freed, all ranks."""
        return sum(self.group.call(TrainedRank.offload_states, list(states)))

    def onload(self, states: Sequence[str]) -> None:
        self.group.call(TrainedRank.onload_states, list(states))

    def device_bytes(self) -> list[dict[str, int]]:
        """Per rank: the bytes each table state keeps allocated on the device (0: off it)."""
        return self.group.call(TrainedRank.device_bytes)

    def host_bytes(self) -> list[dict[str, int]]:
        """Per rank: the bytes of each table state's host copy (kept from its last offload for the next)."""
        return self.group.call(TrainedRank.host_bytes)

    def start_profile(self) -> None:
        self.group.call(TrainedRank.start_profile)

    def stop_profile(self, folder: str) -> None:
        self.group.call(TrainedRank.stop_profile, folder)


class PolicyClient(TrainedClient[PolicyRank]):
    """The policy group (PolicyRank): policy, reference and the torch engines live there.
    ``push_timeout_s``: the deadline of one weight push (rollout.weight_sync.timeout_s), for a
    Ray WorkerGroup (``call_within``); None: no deadline (an InProcessGroup cannot interrupt its
    own call, and runs without Ray)."""

    def __init__(self, group: Group[PolicyRank], push_timeout_s: float | None = None, cfg: MegaRLConfig | None = None) -> None:
        super().__init__(group)
        self.push_timeout_s = push_timeout_s
        self.cfg = cfg  # with it, each rank is sent its replica's routing only (routing_split.py)
        self._layouts: list[RankLayout] | None = None

    def layouts(self) -> list[RankLayout]:
        if self._layouts is None:
            self._layouts = [RankLayout(**lay) for lay in self.group.call(PolicyRank.layout)]
        return self._layouts

    def _call_routed(self, method: Callable[..., R], batch: Batch, *args: Any, step: int | None = None) -> list[R]:
        """``method(batch, *args)`` on every rank; a batch with routing goes without it, and each
        rank gets its data-parallel replica's share as the last argument (routing_split.py)."""
        lays = self.layouts() if self.cfg is not None and batch.routed_experts is not None else []
        if not lays or lays[0].dp_size == 1:
            return self.group.call(method, batch, *args)
        rows = policy_replica_rows(self.cfg, batch, lays[0].dp_size, step)  # type: ignore[arg-type]
        shares = [batch.routing_share(r) for r in rows]
        bare = batch.replace(routed_experts=None, routing_weights=None)
        return self.group.call_split(method, (bare, *args), [shares[lay.dp_rank] for lay in lays])

    def compute_logprobs(self, batch: Batch, temperature: float) -> torch.Tensor:
        """``[B, R]`` log-probs of the responses under the current policy (0 past each length)."""
        return _rows(self._call_routed(PolicyRank.compute_logprobs, batch, temperature), batch)["logprobs"]

    def compute_logprobs_and_reference(self, batch: Batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, R]`` log-probs under the current policy and under the reference, in one pass."""
        rows = _rows(self._call_routed(PolicyRank.compute_logprobs_and_reference, batch, temperature), batch)
        return rows["logprobs"], rows["ref_logprobs"]

    def compute_ref_logprobs(self, batch: Batch, temperature: float) -> torch.Tensor:
        """``[B, R]`` log-probs under the frozen reference policy."""
        return _rows(self._call_routed(PolicyRank.compute_ref_logprobs, batch, temperature), batch)["logprobs"]

    def update(self, batch: Batch, temperature: float, step: int = 0) -> dict[str, float]:
        """One RL update on ``batch`` in step ``step``; metrics reduced over the group (public names)."""
        return _first(self._call_routed(PolicyRank.update, batch, temperature, step, step=step))

    def push_weights(self, version: int) -> dict[str, float]:
        """Send the current weights to the engines through the connected transport. A push that
        misses its deadline raises WeightPushTimeout naming the rank(s) it waited for."""
        if self.push_timeout_s is None:
            return _first(self.group.call(PolicyRank.push_weights, version))
        # A deadline means a Ray group (see the class): a WorkerGroup, which has call_within.
        from megarl.ray_cluster.worker_group import CallTimeout, WorkerGroup
        from megarl.weight_sync.progress import late_push

        ray_group = cast(WorkerGroup[PolicyRank], self.group)
        try:
            return _first(ray_group.call_within(self.push_timeout_s, PolicyRank.push_weights, version))
        except CallTimeout as late:
            raise late_push(version, self.push_timeout_s, self.group, late.waiting) from None

    def connect_engines(self, engines: Any) -> None:
        """(Re)connect every rank's transport to the engines (after start and each restart)."""
        self.group.call(PolicyRank.connect_engines, engines)

    def generate(self, requests: Sequence[Any]) -> list[list[GenerationResult] | None]:
        """``requests[r]`` to rank r's torch engine (None: nothing for that rank)."""
        return self.group.call_each(PolicyRank.generate, [(r,) for r in requests])

    def parameter_checksum(self) -> float:
        return _first(self.group.call(PolicyRank.parameter_checksum))


class CriticClient(TrainedClient[CriticRank]):
    """The critic group (CriticRank)."""

    def compute_values(self, batch: Batch) -> torch.Tensor:
        """``[B, R]`` values before the update (0 past each response's length)."""
        return _rows(self.group.call(CriticRank.compute_values, batch), batch)["values"]

    def update(self, batch: Batch, step: int = 0) -> dict[str, float]:
        return _first(self.group.call(CriticRank.update, batch, step))


class SFTClient(TrainedClient[SFTRank]):
    """The `megarl sft` group (megarl.actors.sft_rank.SFTRank)."""

    def dp_size(self) -> int:
        return int(_first(self.group.call(SFTRank.layout))["dp_size"])

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on ``batch``; metrics reduced over the group (sft/loss, actor/lr, ...)."""
        return _first(self.group.call(SFTRank.train_step, batch))

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """``[B, R]`` log-probs of the response tokens (0 past each length)."""
        return _rows(self.group.call(SFTRank.compute_logprobs, batch), batch)["logprobs"]

    def save_model(self, weights_dir: str) -> None:
        self.group.call(SFTRank.save_model, weights_dir)

    def verify_model(self, checkpoint_dir: str) -> int:
        """Load the written checkpoint back and compare bit for bit; parameters checked, all ranks."""
        return sum(self.group.call(SFTRank.verify_model, checkpoint_dir))

    def save_adapter(self, directory: str, base: str) -> None:
        """LoRA: the trained adapters as an HF PEFT adapter directory of the HF model ``base``."""
        self.group.call(SFTRank.save_adapter, directory, base)


class ConversionClient:
    """A conversion group of `megarl convert` (megarl.actors.conversion_rank: ExportRank or
    ImportRank)."""

    def __init__(self, group: Group[ConversionRank]) -> None:
        self.group = group

    def write(self, target: str) -> dict[str, float] | None:
        """The loaded weights in the other format under ``target``; rank 0's metrics, if any."""
        return _first(self.group.call(ConversionRank.write, target))

    def verify(self, written: str) -> int:
        """Load ``written`` back and compare bit for bit; the number of parameters checked."""
        return sum(self.group.call(ConversionRank.verify, written))

    def write_adapter(self, directory: str, base: str) -> None:
        """A LoRA checkpoint's adapters as an HF PEFT adapter directory of the HF model ``base``."""
        self.group.call(ConversionRank.write_adapter, directory, base)


class InProcessGroup(Generic[W]):
    """A worker group of one rank living in this process (no Ray).

    Sets torchrun's variables when they are missing (rank 0 of a world of 1 on a free local
    port), so the worker initialises torch.distributed as it would under torchrun, and removes
    them again at shutdown (what the process starts next, e.g. `megarl generate`'s SGLang server
    after an in-process export, does not inherit a rank). The group whose worker made the process
    group destroys it at shutdown (the first made is shut down last: closers run newest first),
    or torch warns at exit that it never was; a process group the caller made stays theirs.
    """

    world_size = 1

    def __init__(self, factory: Callable[..., W], *args: Any, **kwargs: Any) -> None:
        defaults = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}  # fmt: skip
        if os.environ.get("WORLD_SIZE", "1") != "1":
            raise RuntimeError(
                f"an in-process worker group runs one rank, but WORLD_SIZE is {os.environ['WORLD_SIZE']}; "
                "launch with one process (torchrun --nproc_per_node 1) or use Ray worker groups"
            )
        self._set_env = [key for key in defaults if key not in os.environ]
        for key in self._set_env:
            os.environ[key] = defaults[key]
        self._owns_process_group = not torch.distributed.is_initialized()
        try:
            self.worker: W | None = factory(*args, **kwargs)
        except BaseException as exc:
            self._destroy_process_group()
            if isinstance(exc, _STOPS):
                raise
            raise _rank_failure(factory, "__init__", exc) from exc

    def call(self, method: Callable[Concatenate[W, P], R], /, *args: P.args, **kwargs: P.kwargs) -> list[R]:
        return [self._run(method.__name__, *args, **kwargs)]

    def call_split(self, method: Callable[..., R], shared: tuple, each: Sequence[Any]) -> list[R]:
        (mine,) = each
        return [self._run(method.__name__, *shared, mine)]

    def call_each(self, method: Callable[[W, *Ts], R], args_per_rank: Sequence[tuple[*Ts]]) -> list[R]:
        if len(args_per_rank) != 1:
            raise ValueError(f"call_each('{method.__name__}'): {len(args_per_rank)} argument sets for 1 rank")
        (args,) = args_per_rank
        return [self._run(method.__name__, *args)]

    def _run(self, name: str, *args: Any, **kwargs: Any) -> Any:
        # By name, as a Ray group's actor calls it: an override in the worker's class runs.
        try:
            return getattr(self.worker, name)(*args, **kwargs)
        except _STOPS:
            raise
        except BaseException as exc:
            raise _rank_failure(type(self.worker), name, exc) from exc

    def shutdown(self) -> None:
        # In this process nothing ends with the rank: close it, or the model (Megatron DDP's
        # hooks) stays allocated for the life of the process.
        close = getattr(self.worker, "close", None)
        self.worker = None
        if close is not None:
            close()
        self._destroy_process_group()

    def _destroy_process_group(self) -> None:
        # No process group yet (the worker stopped before making it, e.g. a Ctrl-C while it
        # imported Megatron): nothing to tear down, and importing Megatron again after an
        # interrupted import would raise in place of the interruption.
        if self._owns_process_group and torch.distributed.is_initialized():
            from megarl.parallel.groups import destroy_parallel

            self._owns_process_group = False
            destroy_parallel()
        for key in self._set_env:
            os.environ.pop(key, None)
        self._set_env = []


# What stops this process rather than fails the rank (torch's checkpoint errors are BaseExceptions too).
_STOPS = (KeyboardInterrupt, SystemExit, GeneratorExit)


def _rank_failure(cls: Any, method: str, exc: BaseException) -> WorkerError:
    """What the rank in this process raised, told as a Ray group's rank's error is: one line
    naming the call and the rank's last words (its traceback: ``exc``, the error's cause, which
    --debug and a launch's driver.log show)."""
    lines = str(exc).strip().splitlines()
    said = lines[-1] if lines else "(no message)"
    summary = f"the rank in this process raised {type(exc).__name__} in {getattr(cls, '__qualname__', cls)}.{method}: {said}"
    return WorkerError(summary, "in-process", 0, summary, cause=exc)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
