"""The LLM judge's own SGLang server (reward.judge.engine: sglang).

The server is a child process of the controller, on its node, launched by the rollout's launcher
(megarl/rollout_sglang/server.py) with the judge's own arguments: its model, reward.judge's
mem_fraction, context_length and max_running_requests, rollout.server_python as the interpreter,
its log in the run's log folder, the run's build deadline to become healthy. It dies with the
thread that launched it (``die_with_parent``), so a killed controller leaves no server behind, and
the run's closers stop it otherwise.

A judge call is one round of concurrent ``/generate`` requests (SGLangEngine: up to
max_running_requests in flight); the deadline, retries and the counting of failures are the
Judge's (megarl/rollout/judge.py), whatever the engine. :meth:`JudgeServer.abort` ends the
requests of a call past its deadline, so the next call does not queue behind them.

Left out: GPUs (the planner refuses cluster.device cuda for it: megarl/plan/reward_checks.py),
several servers, restarting a server that died (its calls count as errors).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from megarl.config.reward_sections import RewardJudgeConfig
from megarl.engines.base import GenerationResult, SamplingParams
from megarl.progress import still_waiting
from megarl.rollout_sglang.engine import SGLangEngine
from megarl.rollout_sglang.server import ServerSpec, SGLangServer
from megarl.rollout_sglang.server_sizes import CPU_MAX_TOTAL_TOKENS

log = logging.getLogger(__name__)

JUDGE_SERVER_LOG = "judge_sglang.log"  # in the run's log folder
# A request's own HTTP deadline past the call's: the Judge's deadline fires first and aborts it.
_HTTP_GRACE_S = 60.0


def judge_server_spec(cfg: RewardJudgeConfig, context: int, log_path: str | Path, python: str | None) -> ServerSpec:
    """How the judge's server runs (on CPU: its KV cache holds at least one full context)."""
    return ServerSpec(
        model_path=str(cfg.model), mem_fraction=cfg.server_mem_fraction("cpu"), max_running_requests=cfg.max_running_requests,
        device="cpu", memory_saver=False, python=python or sys.executable, log_path=str(log_path),
        max_total_tokens=max(CPU_MAX_TOTAL_TOKENS, context), extra_args=("--context-length", str(context)),
        die_with_parent=True,
    )  # fmt: skip


class JudgeServer:
    """The judge's server behind the ``Engines`` protocol; ``close`` stops it."""

    def __init__(self, server: SGLangServer, cfg: RewardJudgeConfig) -> None:
        self.server = server
        self.engine = SGLangEngine(server, max_running_requests=cfg.max_running_requests, timeout=cfg.timeout_s + _HTTP_GRACE_S)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[GenerationResult]:
        return self.engine.generate(prompts, params)

    def abort(self) -> None:
        """End the requests in flight (they answer as aborted); the server takes new ones."""
        try:
            self.engine.pause_generation("abort")
            self.engine.continue_generation()
        except Exception as exc:  # noqa: BLE001 - a server that cannot abort fails the next call, counted there
            log.warning("aborting the judge's late requests on %s failed: %s", self.engine.url, exc)

    def close(self) -> None:
        # The server process is what must not outlive the run: stop it even when the client's close fails.
        try:
            self.engine.close()
        finally:
            self.server.shutdown()


def start_judge_server(cfg: RewardJudgeConfig, context: int, log_path: str | Path, python: str | None,
                       start_timeout_s: float) -> JudgeServer:  # fmt: skip
    """Launch the judge's server and wait until it answers (ServerLaunchError with its log's tail
    otherwise, the process killed)."""
    server = SGLangServer(judge_server_spec(cfg, context, log_path, python))
    with still_waiting(f"reward.judge: starting its SGLang server (log {log_path})"):
        server.start(timeout=start_timeout_s)
    log.info("reward.judge: SGLang server %s up (log %s)", server.url, log_path)
    return JudgeServer(server, cfg)
