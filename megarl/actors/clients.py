"""The controller's typed view of the worker groups: one client per role, one method per call.

A client turns a typed call (``policy.compute_logprobs(batch, temperature) -> [B, R]``) into
a call on every rank of its group and collects the answers by the method's rule, declared
here once per method:

- ``_first``: the collective already made every rank's answer identical (metrics reduced over
  the group, a checksum): rank 0's is taken.
- ``_rows``: per-token results; each data-parallel replica's output rank returns the rows it
  computed (:class:`~megarl.data.batch.TokenRows`) and the client assembles ``[B, R]``.
- ``_each``: one answer per rank (layouts, generations of the engines in the ranks).

The group is anything with ``world_size``, ``call`` and ``call_each``: a Ray
:class:`~megarl.ray_cluster.worker_group.WorkerGroup`, or an :class:`InProcessGroup`
(world size 1, no Ray: a one-GPU box under torchrun, and unit tests). This is the only module
that names worker methods as strings.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from megarl.data.batch import Batch, TokenRows
from megarl.engines.base import GenerationResult
from megarl.ray_cluster.worker_error import WorkerError


class Group(Protocol):
    """What a client needs of a worker group (WorkerGroup and InProcessGroup have it)."""

    world_size: int

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]: ...

    def call_each(self, method: str, args_per_rank: Sequence[Any]) -> list[Any]: ...


def _first(results: list[Any]) -> Any:
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


class TrainedClient:
    """What the policy and critic clients share: checkpoints, memory states, profiling."""

    def __init__(self, group: Group) -> None:
        self.group = group

    def save(self, path: str) -> None:
        self.group.call("save", path)

    def load(self, path: str) -> None:
        self.group.call("load", path)

    # Memory: only the hand-over (megarl/memory/handover.py) calls offload / onload.
    def offload(self, states: Sequence[str]) -> int:
        """Move residency-table states of this group's processes (``policy/optimizer``,
        ``reference/weights``, ...: megarl/memory/residency.py) off the devices; bytes freed, all ranks."""
        return sum(self.group.call("offload_states", list(states)))

    def onload(self, states: Sequence[str]) -> None:
        self.group.call("onload_states", list(states))

    def device_bytes(self) -> list[dict[str, int]]:
        """Per rank: the bytes each table state keeps allocated on the device (0: off it)."""
        return self.group.call("device_bytes")

    def host_bytes(self) -> list[dict[str, int]]:
        """Per rank: the bytes of each table state's host copy (kept from its last offload for the next)."""
        return self.group.call("host_bytes")

    def start_profile(self) -> None:
        self.group.call("start_profile")

    def stop_profile(self, folder: str) -> None:
        self.group.call("stop_profile", folder)


class PolicyClient(TrainedClient):
    """The policy group (PolicyRank): policy, reference and the torch engines live there.
    ``push_timeout_s``: the deadline of one weight push (rollout.weight_sync.timeout_s), for a
    Ray WorkerGroup (``call_within``); None: no deadline (an InProcessGroup cannot interrupt its
    own call, and runs without Ray)."""

    def __init__(self, group: Group, push_timeout_s: float | None = None) -> None:
        super().__init__(group)
        self.push_timeout_s = push_timeout_s

    def layouts(self) -> list[RankLayout]:
        return [RankLayout(**lay) for lay in self.group.call("layout")]

    def compute_logprobs(self, batch: Batch, temperature: float) -> torch.Tensor:
        """``[B, R]`` log-probs of the responses under the current policy (0 past each length)."""
        return _rows(self.group.call("compute_logprobs", batch, temperature), batch)["logprobs"]

    def compute_ref_logprobs(self, batch: Batch, temperature: float) -> torch.Tensor:
        """``[B, R]`` log-probs under the frozen reference policy."""
        return _rows(self.group.call("compute_ref_logprobs", batch, temperature), batch)["logprobs"]

    def update(self, batch: Batch, temperature: float) -> dict[str, float]:
        """One RL update on ``batch``; metrics reduced over the group (public names)."""
        return _first(self.group.call("update", batch, temperature))

    def push_weights(self, version: int) -> dict[str, float]:
        """Send the current weights to the engines through the connected transport. A push that
        misses its deadline raises WeightPushTimeout naming the rank(s) it waited for."""
        if self.push_timeout_s is None:
            return _first(self.group.call("push_weights", version))
        from megarl.ray_cluster.worker_group import (
            CallTimeout,  # a deadline means a Ray group
        )
        from megarl.weight_sync.progress import late_push

        try:
            return _first(self.group.call_within(self.push_timeout_s, "push_weights", version))  # type: ignore[attr-defined]
        except CallTimeout as late:
            raise late_push(version, self.push_timeout_s, self.group, late.waiting) from None

    def connect_engines(self, engines: Any) -> None:
        """(Re)connect every rank's transport to the engines (after start and each restart)."""
        self.group.call("connect_engines", engines)

    def generate(self, requests: Sequence[Any]) -> list[list[GenerationResult] | None]:
        """``requests[r]`` to rank r's torch engine (None: nothing for that rank)."""
        return self.group.call_each("generate", [(r,) for r in requests])

    def parameter_checksum(self) -> float:
        return _first(self.group.call("parameter_checksum"))


class CriticClient(TrainedClient):
    """The critic group (CriticRank)."""

    def compute_values(self, batch: Batch) -> torch.Tensor:
        """``[B, R]`` values before the update (0 past each response's length)."""
        return _rows(self.group.call("compute_values", batch), batch)["values"]

    def update(self, batch: Batch) -> dict[str, float]:
        return _first(self.group.call("update", batch))


class SFTClient(TrainedClient):
    """The `megarl sft` group (megarl.actors.sft_rank.SFTRank)."""

    def dp_size(self) -> int:
        return int(_first(self.group.call("layout"))["dp_size"])

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on ``batch``; metrics reduced over the group (sft/loss, actor/lr, ...)."""
        return _first(self.group.call("train_step", batch))

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """``[B, R]`` log-probs of the response tokens (0 past each length)."""
        return _rows(self.group.call("compute_logprobs", batch), batch)["logprobs"]

    def save_model(self, weights_dir: str) -> None:
        self.group.call("save_model", weights_dir)

    def verify_model(self, checkpoint_dir: str) -> int:
        """Load the written checkpoint back and compare bit for bit; parameters checked, all ranks."""
        return sum(self.group.call("verify_model", checkpoint_dir))


class ConversionClient:
    """A conversion group of `megarl convert` (megarl.actors.conversion_rank: ExportRank or
    ImportRank)."""

    def __init__(self, group: Group) -> None:
        self.group = group

    def write(self, target: str) -> dict[str, float] | None:
        """The loaded weights in the other format under ``target``; rank 0's metrics, if any."""
        return _first(self.group.call("write", target))

    def verify(self, written: str) -> int:
        """Load ``written`` back and compare bit for bit; the number of parameters checked."""
        return sum(self.group.call("verify", written))


class InProcessGroup:
    """A worker group of one rank living in this process (no Ray).

    Sets torchrun's variables when they are missing (rank 0 of a world of 1 on a free local
    port), so the worker initialises torch.distributed as it would under torchrun, and removes
    them again at shutdown (what the process starts next, e.g. `megarl generate`'s SGLang server
    after an in-process export, does not inherit a rank). The group whose worker made the process
    group destroys it at shutdown (the first made is shut down last: closers run newest first),
    or torch warns at exit that it never was; a process group the caller made stays theirs.
    """

    world_size = 1

    def __init__(self, factory: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
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
            self.worker = factory(*args, **kwargs)
        except BaseException as exc:
            self._destroy_process_group()
            if isinstance(exc, _STOPS):
                raise
            raise _rank_failure(factory, "__init__", exc) from exc

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [self._run(method, *args, **kwargs)]

    def call_each(self, method: str, args_per_rank: Sequence[Any]) -> list[Any]:
        if len(args_per_rank) != 1:
            raise ValueError(f"call_each('{method}'): {len(args_per_rank)} argument sets for 1 rank")
        (args,) = args_per_rank
        return [self._run(method, *args)]

    def _run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self.worker, method)(*args, **kwargs)
        except _STOPS:
            raise
        except BaseException as exc:
            raise _rank_failure(type(self.worker), method, exc) from exc

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
