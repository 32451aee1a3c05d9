"""The in-process transport: buckets straight into the torch engines living in the policy
ranks (``engine.load_weights``), no copy beyond the export."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from megarl.engines.base import RolloutEngine
from megarl.weight_sync.stream import WeightStream
from megarl.weight_sync.transport_base import check_versions


class InProcessTransport:
    """Buckets straight into the torch engines living in this process (``engine.load_weights``).

    Ranks without an engine connect an empty list and only take part in the export.
    """

    def __init__(self, stream: WeightStream, local_engines: Sequence[RolloutEngine] = ()) -> None:
        self.stream = stream
        self.local_engines = list(local_engines)
        self.engines: list[RolloutEngine] = []

    def connect(self, endpoints: Any = None) -> None:
        """The engines are this process's own (``endpoints`` is unused: nothing to reach)."""
        self.engines = list(self.local_engines)

    def push(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        for bucket in self.stream.buckets(version):
            for engine in self.engines:
                engine.load_weights(bucket)
            del bucket
        check_versions(self.engines, version)
        return self.stream.metrics(time.perf_counter() - start)

    def close(self) -> None:
        self.engines = []
