"""Start or attach to Ray for one run, and write Ray's timeline on request.

`ray_session()` starts an embedded local Ray (no dashboard) when no address is given, or
attaches to a running cluster ("auto" or host:port); on exit it shuts down only what it
started (an already initialised Ray, e.g. a test fixture's, is reused and left running).
`save_timeline()` writes Ray's task/actor timeline (Chrome trace JSON, open it in
chrome://tracing or Perfetto) for profiling a run. Left out: starting multi-node clusters
(launch/ holds the Slurm / head-worker bootstrap), runtime environments beyond env vars.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import ray

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RaySession:
    """What the session is connected to."""

    address: str  # the GCS address of the cluster
    started_here: bool  # True: embedded Ray that this session shuts down
    resources: dict[str, float] = field(default_factory=dict)  # cluster totals at start


@contextmanager
def ray_session(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    log_to_driver: bool = True,
    namespace: str = "megarl",
    env_vars: Mapping[str, str] | None = None,
) -> Iterator[RaySession]:
    """Ray for the duration of the `with` block.

    address None starts a local Ray with num_cpus / num_gpus (None: what the machine has);
    "auto" or "host:port" attaches to a cluster (num_cpus / num_gpus must then be None: the
    cluster's nodes declare their resources). env_vars reach every worker process.
    """
    if address is not None and (num_cpus is not None or num_gpus is not None):
        raise ValueError(
            f"ray_session: num_cpus/num_gpus only apply to a local Ray; with address={address!r} "
            "the cluster's nodes declare their resources (start them with `ray start --num-cpus ...`)"
        )
    if ray.is_initialized():
        log.info("ray_session: reusing the Ray instance already initialised in this process")
        yield _describe(started_here=False)
        return
    runtime_env = {"env_vars": dict(env_vars)} if env_vars else None
    kwargs = dict(log_to_driver=log_to_driver, namespace=namespace, runtime_env=runtime_env)
    if address is None:
        # "local" always starts a new instance; plain ray.init() would join a cluster found
        # through RAY_ADDRESS or a `ray start` on this machine (someone else's, on a shared box).
        ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, **kwargs)
    else:
        try:
            ray.init(address=address, **kwargs)
        except ConnectionError as exc:
            raise ConnectionError(
                f"cluster.ray_address={address!r}: no Ray cluster answered ({exc}). Start one with "
                "`ray start --head` (or the launch/ scripts), or unset cluster.ray_address to run "
                "an embedded local Ray"
            ) from exc
    try:
        yield _describe(started_here=True)
    finally:
        ray.shutdown()


def _describe(started_here: bool) -> RaySession:
    ctx = ray.get_runtime_context()
    address = getattr(ctx, "gcs_address", "") or ""
    return RaySession(address=address, started_here=started_here, resources=dict(ray.cluster_resources()))


def save_timeline(path: str | Path) -> Path:
    """Write Ray's timeline of tasks and actor calls so far (Chrome trace JSON) to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ray.timeline(filename=str(path))
    return path
