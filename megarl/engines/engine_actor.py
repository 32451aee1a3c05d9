"""The torch engine as a Ray actor of its own, for asynchronous training (docs/async.md).

Synchronous runs keep the torch engine inside the policy's replica leaders, where a Ray actor
runs one call at a time: generation could never overlap training. Here one
:class:`TorchEngine` lives on CPU in a threaded actor (``max_concurrency`` > 1), so a weight
reload runs while a ``generate`` is in flight (the engine's gate decides where it lands:
megarl/engines/weight_gate.py). Three views of it:

- the actor (:class:`_EngineHost`): asks Ray for no CPU, so it is placed even when the policy
  ranks hold every CPU of the node (it still shares them; its torch threads are few);
- the controller's :class:`StandaloneEngines` (the ``Engines`` protocol): ``generate`` from a
  producer thread while the main thread pushes, ``close()`` kills the actor;
- the policy's :class:`EngineActorClient` (``StandaloneEngines.endpoints``): what the disk
  transport's writer calls to reload each pushed version (``load_weights_from_disk``) and to
  check it (``weight_version``).

Every wait has a deadline; one that passes names the actor, the call and its log. Left out:
several engine actors, engines on GPUs, restarting a dead actor.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from megarl.config.sections import MegaRLConfig
from megarl.engines.base import EngineHealth, GenerationResult, SamplingParams
from megarl.progress import still_waiting
from megarl.ray_cluster.worker_group import output_to_log

ACTOR_LOG = "torch_engine.log"  # in the run's log folder


class _EngineHost:
    """The actor's body: one TorchEngine on CPU, its output in a log file."""

    def __init__(self, model_path: str, dtype: str | None, max_running_requests: int, partial: bool,
                 log_path: str, threads: int) -> None:  # fmt: skip
        output_to_log(log_path)
        import torch

        from megarl.engines.torch_engine import TorchEngine

        torch.set_num_threads(threads)  # it shares the node's cores with the policy ranks
        self.engine = TorchEngine(model_path, device="cpu", dtype=dtype, max_running_requests=max_running_requests,
                                  partial=partial)  # fmt: skip

    def generate(self, prompts: list[list[int]], params: SamplingParams, first_sample_index: int) -> list[GenerationResult]:
        return self.engine.generate(prompts, params, first_sample_index=first_sample_index)

    def load_weights_from_disk(self, directory: str, version: int) -> None:
        self.engine.load_weights_from_disk(directory, version)

    def weight_version(self) -> int:
        return self.engine.weight_version

    def health(self) -> EngineHealth:
        return self.engine.health()


_EngineActor = ray.remote(_EngineHost)
# Threads: a generate, a reload and a version or health probe at once. No CPU asked: see the module docstring.
_ACTOR_OPTIONS = {"num_cpus": 0, "num_gpus": 0, "max_concurrency": 4, "max_restarts": 0, "max_task_retries": 0}


def _deadline(seconds: float) -> float | None:
    return seconds if seconds > 0 else None  # 0 in the config: no deadline


def _answer(ref: Any, what: str, timeout_s: float, name: str) -> Any:
    """``ray.get(ref)`` within ``timeout_s`` (0: none); a passed deadline or a dead actor is one
    clear error naming the actor, the call and the wait."""
    try:
        return ray.get(ref, timeout=_deadline(timeout_s))
    except GetTimeoutError:
        raise TimeoutError(f"{name}: {what} did not answer within {timeout_s:.0f} s") from None
    except RayActorError as exc:
        from megarl.ray_cluster.ray_failures import ray_failure

        cause = ray_failure(exc) or (str(exc).strip().splitlines() or [""])[0][:200]  # its node's death, else Ray's line
        raise RuntimeError(f"{name} died during {what}: {cause}") from exc


class EngineActorClient:
    """The engine actor as the disk transport's writer sees it (picklable: it travels to the policy
    ranks in ``connect_engines``): reload a version, report the version."""

    def __init__(self, handle: Any, name: str, timeout_s: float) -> None:
        self.handle, self.name, self.timeout_s = handle, name, timeout_s

    def load_weights_from_disk(self, directory: str | Path, version: int) -> None:
        ref = self.handle.load_weights_from_disk.remote(str(directory), version)
        _answer(ref, f"load_weights_from_disk({directory}, version {version})", self.timeout_s, self.name)

    @property
    def weight_version(self) -> int:
        return int(_answer(self.handle.weight_version.remote(), "weight_version", self.timeout_s, self.name))


class StandaloneEngines:
    """The run's torch engine actor behind the controller's ``Engines`` protocol.

    ``generate`` may run in a producer thread while another thread pushes weights; each call
    waits at most ``generate_timeout_s`` (0: no deadline), each reload or probe ``call_timeout_s``.
    """

    def __init__(self, handle: Any, name: str, *, generate_timeout_s: float, call_timeout_s: float) -> None:
        self.handle, self.name = handle, name
        self.generate_timeout_s, self.call_timeout_s = generate_timeout_s, call_timeout_s

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[GenerationResult]:
        """Results grouped ``[p0s0 .. p0s(n-1), p1s0 ...]``; one engine, so sample indices start at 0."""
        ref = self.handle.generate.remote([list(map(int, p)) for p in prompts], params, 0)
        return list(_answer(ref, f"generate ({len(prompts)} prompts x n={params.n})", self.generate_timeout_s, self.name))

    @property
    def endpoints(self) -> list[EngineActorClient]:
        """What ``policy.connect_engines`` takes: the disk transport's writer reloads the engine through it."""
        return [EngineActorClient(self.handle, self.name, self.call_timeout_s)]

    @property
    def weight_version(self) -> int:
        return int(_answer(self.handle.weight_version.remote(), "weight_version", self.call_timeout_s, self.name))

    def health(self) -> EngineHealth:
        return _answer(self.handle.health.remote(), "health", self.call_timeout_s, self.name)

    def close(self) -> None:
        """Kill the actor and wait until Ray reports it dead (a generate in flight fails in its
        caller); closing twice is harmless."""
        if self.handle is not None:
            ray.kill(self.handle, no_restart=True)
            _wait_dead(self.handle, _CLOSE_WAIT_S)
            self.handle = None


_CLOSE_WAIT_S = 60.0


def _wait_dead(handle: Any, timeout_s: float) -> None:
    """``ray.kill`` only asks for the kill: a call sent just after it may still be answered. Probe
    until the actor's death reaches its callers, so nothing runs in it once ``close`` returns."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(handle.weight_version.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except (RayActorError, GetTimeoutError):
            return
        time.sleep(0.2)


def start_standalone_engines(cfg: MegaRLConfig, log_dir: str | Path, *, threads: int = 1) -> StandaloneEngines:
    """Start the run's torch engine actor (Ray must be up) and wait until its model is loaded.

    ``cfg``: the run's config (model path and dtype, rollout.max_running_requests,
    rollout.partial; deadlines: cluster.build_timeout_s to start, trainer.hang_timeout_s per
    generate, rollout.weight_sync.timeout_s per reload). ``threads``: the engine's torch threads.
    """
    if cfg.rollout.engine != "torch":
        raise ValueError(f"start_standalone_engines starts the torch engine, and rollout.engine is {cfg.rollout.engine!r}")
    log_path = Path(log_dir) / ACTOR_LOG
    rollout = cfg.rollout
    reload_s = rollout.weight_sync.timeout_s
    if not cfg.partial_rollouts and reload_s:  # a reload waits for the generate call in flight to end
        reload_s = max(reload_s, cfg.trainer.hang_timeout_s) if cfg.trainer.hang_timeout_s else 0.0
    return start_engine_actor(str(cfg.model.path), cfg.model.dtype, log_path, "the torch engine actor",
                              max_running_requests=rollout.max_running_requests, partial=cfg.partial_rollouts,
                              start_timeout_s=cfg.cluster.build_timeout_s, generate_timeout_s=cfg.trainer.hang_timeout_s,
                              call_timeout_s=reload_s, threads=threads)  # fmt: skip


def start_engine_actor(model_path: str, dtype: str | None, log_path: Path, what: str, *, max_running_requests: int,
                       partial: bool, start_timeout_s: float, generate_timeout_s: float, call_timeout_s: float,
                       threads: int = 1) -> StandaloneEngines:  # fmt: skip
    """A torch engine actor on CPU for ``model_path`` (Ray must be up), once its model is loaded:
    the run's own (start_standalone_engines) or another model's (the LLM judge). ``what`` names it
    in errors, with its log."""
    name = f"{what} (log: {log_path})"
    handle: Any = _EngineActor.options(**_ACTOR_OPTIONS).remote(
        model_path, dtype, max_running_requests, partial, str(log_path), threads
    )
    engines = StandaloneEngines(handle, name, generate_timeout_s=generate_timeout_s, call_timeout_s=call_timeout_s)
    try:
        with still_waiting(f"starting {name}: loading the model"):
            _answer(handle.health.remote(), "starting (loading the model)", start_timeout_s, name)
    except BaseException:
        engines.close()
        raise
    return engines
