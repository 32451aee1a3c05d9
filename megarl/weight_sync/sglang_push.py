"""What the SGLang transports share: a policy rank's own engine clients and the order of calls
around a push, on every engine (what a real SGLang server needs; memory is resumed before the
push by the hand-over, megarl/memory/handover.py, not here)::

    pause_generation                  no request runs while weights change
    flush_cache                       retried while SGLang answers 400
    begin_weight_update               on servers that require it (SGLangEngine knows)
    bucket 1 .. bucket k              flush_cache=False each; the last one carries
                                      weight_version
    end_weight_update                 on servers that require it
    continue_generation
    check weight_version              /model_info must report the pushed version
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from megarl.rollout_sglang.engine import EngineEndpoint, SGLangEngine

EngineFactory = Callable[[EngineEndpoint], SGLangEngine]


def engine_client(endpoint: EngineEndpoint) -> SGLangEngine:
    """A policy rank's own client of one engine (it never releases or resumes memory)."""
    return SGLangEngine(endpoint.url, tp=endpoint.tp, max_running_requests=endpoint.max_running_requests)


def send_failed(what: str, engines: Sequence[SGLangEngine], exc: BaseException) -> RuntimeError:
    """The error of a send to ``engines`` that raised ``exc``: the engines named, the cause's
    first line (the push deadline's report and the driver's one-line error carry it)."""
    cause = (str(exc).strip().splitlines() or [""])[0][:160]
    urls = ", ".join(e.url for e in engines)
    return RuntimeError(f"sending {what} to engine(s) {urls} failed: {type(exc).__name__}: {cause}")


def pause_for_push(engines: Sequence[SGLangEngine]) -> None:
    """Steps before the first bucket, on every engine (see the module docstring)."""
    for engine in engines:
        engine.pause_generation()
        engine.flush_cache()
        engine.begin_weight_update()


def finish_push(engines: Sequence[SGLangEngine], version: int) -> None:
    """Steps after the last bucket, on every engine; raises WeightVersionMismatch."""
    for engine in engines:
        engine.end_weight_update()
        engine.continue_generation()
        engine.check_weight_version(version)
