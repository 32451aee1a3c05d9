"""What the SGLang transports share: a policy rank's own engine clients and the order of calls
around a push, on every engine (what a real SGLang server needs; memory is resumed before the
push by the hand-over, megarl/memory/handover.py, not here)::

    pause_generation                  no request runs while weights change (mode: below)
    flush_cache                       retried while SGLang answers 400
    begin_weight_update               on servers that require it (SGLangEngine knows)
    bucket 1 .. bucket k              flush_cache=False each; the last one carries
                                      weight_version
    end_weight_update                 on servers that require it
    continue_generation
    check weight_version              /model_info must report the pushed version

The pause mode: a synchronous run pushes when nothing generates, and pauses with ``abort``
(what is in flight, nothing, would come back as "abort"). An asynchronous run with partial
rollouts pushes while requests run and pauses with ``retract`` (:func:`pause_mode`): SGLang
0.5.23's ``Scheduler.pause_generation`` puts every running request back in the waiting queue
and frees its KV cache (``retract_all`` -> ``release_req``); after ``continue_generation`` the
scheduler prefills each again from its prompt and response so far, under the new weights, and
the HTTP request goes on as one response. ``in_place`` would keep the old KV cache (mixing two
policies in one token's logits) and makes ``flush_cache`` refuse (the running batch is not
empty). The flush is still needed after a retract: the radix cache holds prefixes computed by
the old weights, which the recomputation would otherwise reuse. It succeeds with the retracted
requests queued: ``Scheduler.flush_cache`` asks ``is_fully_idle(ignore_waiting=_engine_paused)``,
and a retracted request holds no KV. Nothing runs between that flush and ``continue_generation``
(the scheduler schedules nothing while paused; ``TokenizerManager.generate_request`` holds new
requests back), so the buckets keep ``flush_cache=False``: a flush per bucket would find nothing
new to drop.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from megarl.rollout_sglang.engine import EngineEndpoint, SGLangEngine

EngineFactory = Callable[[EngineEndpoint], SGLangEngine]

ABORT, RETRACT = "abort", "retract"  # SGLang's /pause_generation modes megarl uses (module docstring)


def pause_mode(asynchronous: bool, partial_rollouts: bool) -> str:
    """How a push pauses the SGLang servers: ``retract`` when requests may be in flight and go on
    under the new weights (asynchronous with partial rollouts), else ``abort``."""
    return RETRACT if asynchronous and partial_rollouts else ABORT


def engine_client(endpoint: EngineEndpoint) -> SGLangEngine:
    """A policy rank's own client of one engine (it never releases or resumes memory)."""
    return SGLangEngine(endpoint.url, tp=endpoint.tp, max_running_requests=endpoint.max_running_requests)


def send_failed(what: str, engines: Sequence[SGLangEngine], exc: BaseException) -> RuntimeError:
    """The error of a send to ``engines`` that raised ``exc``: the engines named, the cause's
    first line (the push deadline's report and the driver's one-line error carry it)."""
    cause = (str(exc).strip().splitlines() or [""])[0][:160]
    urls = ", ".join(e.url for e in engines)
    return RuntimeError(f"sending {what} to engine(s) {urls} failed: {type(exc).__name__}: {cause}")


def pause_for_push(engines: Sequence[SGLangEngine], mode: str = ABORT) -> None:
    """Steps before the first bucket, on every engine (see the module docstring)."""
    for engine in engines:
        engine.pause_generation(mode)
        engine.flush_cache()
        engine.begin_weight_update()


def finish_push(engines: Sequence[SGLangEngine], version: int) -> None:
    """Steps after the last bucket, on every engine; raises WeightVersionMismatch."""
    for engine in engines:
        engine.end_weight_update()
        engine.continue_generation()
        engine.check_weight_version(version)


class RetractingDiskReload:
    """An SGLang server's disk reload while it generates (the disk transport of an asynchronous
    run with partial rollouts): paused with ``retract`` and flushed around the update. Without a
    pause, SGLang's ``update_weights_from_disk`` takes the tokenizer manager's writer lock and
    so waits for every request in flight to end; paused, it loads at once (the lock is skipped)."""

    def __init__(self, engine: SGLangEngine) -> None:
        self.engine = engine

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def load_weights_from_disk(self, directory: str | os.PathLike[str], version: int) -> None:
        self.engine.pause_generation(RETRACT)
        self.engine.flush_cache()
        self.engine.update_from_disk(str(directory), version)
        self.engine.continue_generation()
        self.engine.check_weight_version(version)
