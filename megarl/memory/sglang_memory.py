"""The engine side of the memory hand-over for SGLang (megarl/memory/handover.py
``EngineMemory``, the only caller of its release / resume / restart): the residency table's
``engine/weights | kv_cache | cuda_graph`` are SGLang's memory tags, released and resumed on
every engine at once (the policy ranks' own engine clients never release or resume); health
checks, and restarts that reconnect the policy's transports."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence

from megarl.rollout_sglang.engine import CUDA_GRAPH, KV_CACHE, WEIGHTS, SGLangEngine

log = logging.getLogger(__name__)

# The residency table's engine states (megarl/memory/residency.py) are SGLang's memory tags.
TAG_OF_STATE = {"engine/weights": WEIGHTS, "engine/kv_cache": KV_CACHE, "engine/cuda_graph": CUDA_GRAPH}


class SGLangMemory:
    """The engine side of the memory hand-over (``EngineMemory``).

    ``reconnect`` re-runs the policy's connection after a restart (URLs and groups change).
    """

    def __init__(self, engines: Sequence[SGLangEngine], reconnect: Callable[[], None], restart_timeout: float = 900.0) -> None:
        self.engines, self.reconnect, self.restart_timeout = list(engines), reconnect, restart_timeout

    def release(self, states: Collection[str], engines: Sequence[SGLangEngine] | None = None) -> None:
        """Release the tags of ``states`` on ``engines`` (None: all); each engine flushes first
        and refuses while it has requests in flight (SGLangEngine.release_memory)."""
        tags = [TAG_OF_STATE[s] for s in states]
        for engine in self.engines if engines is None else engines:
            engine.release_memory(tags)

    def resume(self, states: Collection[str]) -> None:
        tags = [TAG_OF_STATE[s] for s in states]
        for engine in self.engines:
            engine.resume_memory(tags)

    def dead(self) -> list[SGLangEngine]:
        """The engines whose health check fails (each logged with its server's last lines)."""
        dead = []
        for engine in self.engines:
            health = engine.health()
            if not health.alive:
                dead.append(engine)
                tail = engine.server.log_tail() if engine.server is not None else ""
                log.warning("SGLang engine %s is not healthy (%s); restarting it. Last log lines:\n%s",
                            engine.url, health.detail, tail)  # fmt: skip
        return dead

    def restart(self, engines: Sequence[SGLangEngine]) -> None:
        """Relaunch ``engines`` (they come up holding all their memory, with the initial
        weights) and reconnect the policy's transports."""
        for engine in engines:
            engine.restart(self.restart_timeout)
        self.reconnect()


