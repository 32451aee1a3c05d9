"""The LLM judge's own SGLang servers (reward.judge.engine: sglang).

Where they run:
- cluster.device cpu (and ``megarl evaluate``): one server, a child process of the controller on
  its node, launched by the rollout's launcher (megarl/rollout_sglang/server.py). It dies with the
  thread that launched it (``die_with_parent``), so a killed controller leaves no server behind,
  and the run's closers stop it otherwise. Log judge_sglang.log.
- cluster.device cuda: ``reward.judge.gpus / tp`` servers on the devices the plan gives the judge
  (megarl/plan/judge_plan.py), started as a disaggregated rollout pool's engines are
  (megarl/rollout_sglang/hosts.py): one placement group per server (``tp`` one-GPU bundles on one
  node), probed for each bundle's node and physical GPU, then an SGLangHost actor on that node
  launches the server with those GPUs as CUDA_VISIBLE_DEVICES. Logs judge_sglang<k>.log. What
  each server is given (:func:`judge_server_specs`: tp, mem fraction, context length, devices) is
  plain data, tested without a GPU; :func:`start_judge_servers`, the Ray and CUDA side behind it,
  runs only on a GPU cluster (tests/gpu/test_judge_gpu.py).

Each server gets the judge's own arguments: its model, reward.judge's mem_fraction, context_length
and max_running_requests, rollout.server_python as the interpreter, the run's build deadline to
become healthy. A judge call is one round of concurrent ``/generate`` requests, its samples split
in contiguous slices over the servers (megarl/rollout_sglang/engine.py generate_across; each
SGLangEngine keeps up to max_running_requests in flight); the deadline, retries and the counting of
failures are the Judge's (megarl/rollout/judge.py), whatever the engine. :meth:`JudgeServers.abort`
ends the requests of a call past its deadline on every server, so the next call does not queue
behind them.

Left out: restarting a server that died (its calls count as errors), servers spanning nodes.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megarl.config.reward_sections import RewardJudgeConfig
from megarl.engines.base import GenerationResult, SamplingParams
from megarl.progress import still_waiting
from megarl.rollout_sglang.engine import SGLangEngine, generate_across
from megarl.rollout_sglang.hosts import EngineSlot, pool_slots, slot_spec
from megarl.rollout_sglang.server import ServerSpec, SGLangServer
from megarl.rollout_sglang.server_sizes import CPU_MAX_TOTAL_TOKENS

log = logging.getLogger(__name__)

JUDGE_SERVER_LOG = "judge_sglang.log"  # in the run's log folder (cpu: the one server)
JUDGE_SERVERS_LOG = "judge_sglang{index}.log"  # in the run's log folder (cuda: one per server)
JUDGE_ROLE = "judge"  # its placement groups' role name (megarl-judge-node<k>)
# A request's own HTTP deadline past the call's: the Judge's deadline fires first and aborts it.
_HTTP_GRACE_S = 60.0


def judge_server_spec(cfg: RewardJudgeConfig, context: int, log_path: str | Path | None, python: str | None,
                      device: str = "cpu") -> ServerSpec:  # fmt: skip
    """How a judge server runs on ``device`` (cluster.device). On cpu: a child of the controller,
    its KV cache at least one full context. On cuda: reward.judge.tp ranks, its KV cache sized from
    mem_fraction by SGLang; its GPUs and address come with its slot (:func:`judge_server_specs`)."""
    cpu = device == "cpu"
    # On cuda the judge holds its devices for the whole run and never releases them: no memory saver.
    return ServerSpec(
        model_path=str(cfg.model), tp=1 if cpu else cfg.tp, mem_fraction=cfg.server_mem_fraction(device),
        max_running_requests=cfg.max_running_requests, device="cpu" if cpu else "cuda", memory_saver=False,
        python=python or sys.executable, log_path=None if log_path is None else str(log_path),
        max_total_tokens=max(CPU_MAX_TOTAL_TOKENS, context) if cpu else None,
        extra_args=("--context-length", str(context)), die_with_parent=cpu,
    )  # fmt: skip


def judge_server_specs(cfg: RewardJudgeConfig, gpus: Sequence[int], bundle_infos: Sequence[dict[str, Any]], context: int,
                       log_dir: str | Path, python: str | None) -> tuple[list[EngineSlot], list[ServerSpec]]:  # fmt: skip
    """Where each judge server runs on cuda and how: server k on the plan's ``gpus[k * tp : (k + 1)
    * tp]``, held by bundles ``k * tp ...`` of the judge's placement (``bundle_infos``, rank order:
    node, address, physical GPU ids), listening on its node's address, its log judge_sglang<k>.log."""
    slots = pool_slots(gpus, cfg.tp, bundle_infos, "cuda", key="reward.judge.tp")
    base = judge_server_spec(cfg, context, None, python, "cuda")
    return slots, [slot_spec(base, s, str(Path(log_dir) / JUDGE_SERVERS_LOG.format(index=s.index))) for s in slots]


class JudgeServers:
    """The judge's servers behind the ``Engines`` protocol, a call's samples split over them;
    ``close`` stops them (``stop``: whatever started them)."""

    def __init__(self, engines: Sequence[SGLangEngine], stop: Callable[[], None]) -> None:
        self.engines, self._stop = list(engines), stop

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[GenerationResult]:
        if len(self.engines) == 1:  # no thread pool: a late call's thread must not be joined at exit
            return self.engines[0].generate(prompts, params)
        return generate_across(self.engines, prompts, params)

    def abort(self) -> None:
        """End the requests in flight on every server (they answer as aborted); the servers take new ones."""
        for engine in self.engines:
            try:
                engine.pause_generation("abort")
                engine.continue_generation()
            except Exception as exc:  # noqa: BLE001 - a server that cannot abort fails the next call, counted there
                log.warning("aborting the judge's late requests on %s failed: %s", engine.url, exc)

    def close(self) -> None:
        # The server processes are what must not outlive the run: stop them even when a client's close fails.
        try:
            for engine in self.engines:
                engine.close()
        finally:
            self._stop()


def _client(cfg: RewardJudgeConfig, server: Any, tp: int = 1) -> SGLangEngine:
    return SGLangEngine(server, tp=tp, max_running_requests=cfg.max_running_requests, timeout=cfg.timeout_s + _HTTP_GRACE_S)


def start_judge_server(cfg: RewardJudgeConfig, context: int, log_path: str | Path, python: str | None,
                       start_timeout_s: float) -> JudgeServers:  # fmt: skip
    """Launch the judge's server on cpu, a child of this process, and wait until it answers
    (ServerLaunchError with its log's tail otherwise, the process killed)."""
    server = SGLangServer(judge_server_spec(cfg, context, log_path, python))
    with still_waiting(f"reward.judge: starting its SGLang server (log {log_path})"):
        server.start(timeout=start_timeout_s)
    log.info("reward.judge: SGLang server %s up (log %s)", server.url, log_path)
    return JudgeServers([_client(cfg, server)], server.shutdown)


def start_judge_servers(cfg: RewardJudgeConfig, gpus: Sequence[int], context: int, log_dir: str | Path,
                        python: str | None, start_timeout_s: float) -> JudgeServers:  # fmt: skip
    """The judge's servers on its ``gpus`` (the plan's), through Ray: placement groups of their own,
    then a host actor per server on its node (needs a Ray cluster with those GPUs: the GPU-only
    seam). Whatever was started is stopped and released when a step of it fails."""
    from megarl.ray_cluster.placement import place_roles, release
    from megarl.rollout_sglang.hosts import (
        HostHandle,
        pool_placement,
        probe_bundles,
        start_servers,
        stop_servers,
    )

    placed = place_roles([pool_placement(JUDGE_ROLE, len(gpus), cfg.tp, "cuda")], timeout_s=start_timeout_s)
    hosts: list[Any] = []

    def stop() -> None:
        try:
            stop_servers(hosts)
        finally:
            release(placed)

    try:
        slots, specs = judge_server_specs(cfg, gpus, probe_bundles(placed[JUDGE_ROLE]), context, log_dir, python)
        with still_waiting(f"reward.judge: starting {len(specs)} SGLang server(s) on GPUs of its own (logs in {log_dir})"):
            urls = start_servers(slots, specs, start_timeout_s, hosts)
    except BaseException:
        stop()
        raise
    engines = [_client(cfg, HostHandle(h, u, s), s.tp) for h, u, s in zip(hosts, urls, specs, strict=True)]
    log.info("reward.judge: SGLang servers up: %s", ", ".join(f"{e.url} (GPUs {s.gpu_ids} on {s.host})"
                                                              for e, s in zip(engines, specs, strict=True)))  # fmt: skip
    return JudgeServers(engines, stop)
