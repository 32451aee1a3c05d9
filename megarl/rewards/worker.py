"""What runs in a reward worker process (megarl/rewards/scorer.py owns the pool): the
initializer that loads reward.custom / reward.model once, and the tasks that score samples.
A task returns, per sample, an outcome: ("ok", score, extras) or ("error", message,
traceback); the driver adds ("timeout", message)."""

from __future__ import annotations

import contextlib
import os
import signal
import traceback
from typing import Any

import megarl.rewards.code_sandbox as code_sandbox
import megarl.rewards.custom as custom_fn
import megarl.rewards.registry as registry
from megarl.process_signals import unblock_stop_signals

Outcome = tuple

_WORKER: dict[str, Any] = {}


def init_worker(spec: dict[str, Any], loaded: Any) -> None:
    """Pool initializer: load the custom function / reward model once, then count the worker in
    ``loaded`` (a shared int: the driver tells a death while loading from one after it). Never
    raises (pebble would respawn a failing worker forever); a load error is re-raised by each task."""
    _WORKER.clear()
    _WORKER["spec"] = spec
    _chain_sigterm()
    # Ctrl-C reaches the whole foreground process group: the driver decides when to stop, a
    # worker must not die mid-sample (the step in progress is finished or abandoned as a whole).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # So does a SIGTERM to the group (`timeout`, `kill -TERM -PGID`): the worker, started with it
    # blocked (scorer._new_pool), leaves the group, then takes the SIGTERM pebble stops it with.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    unblock_stop_signals()
    try:
        if spec.get("custom"):
            _WORKER["custom"] = custom_fn.load_function(*spec["custom"])
        if spec.get("model"):
            from megarl.rewards.reward_model import load_reward_model

            load_reward_model(*spec["model"])
        if spec.get("preload_math"):
            import math_verify  # noqa: F401  (the first math task should not pay the sympy import)
    except BaseException as exc:  # noqa: BLE001 - reported by every task of this worker
        _WORKER["load_error"] = exc
    with loaded.get_lock():
        loaded.value += 1


def _chain_sigterm() -> None:
    # pebble stops a timed-out task's worker with SIGTERM and os._exit, skipping ``finally``:
    # kill that task's sandboxed programs and delete their directories first.
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: Any) -> None:
        code_sandbox.stop_active_runs()
        if callable(previous):
            previous(signum, frame)
        else:
            os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)


def _custom() -> Any:
    if "load_error" in _WORKER:
        raise _WORKER["load_error"]
    return _WORKER["custom"]


def check_custom() -> str:
    """Run in a worker at start: the custom function loads (raises otherwise)."""
    fn = _custom()
    return getattr(fn, "__qualname__", repr(fn))


def check_function(spec: str) -> str:
    """Run in a worker at start: the user function of a reward.functions entry loads (raises otherwise)."""
    fn = _user_function(spec)
    return getattr(fn, "__qualname__", repr(fn))


def _user_function(spec: str) -> Any:
    """The user function ``path.py:function`` of reward.functions, imported once per worker."""
    loaded = _WORKER.setdefault("functions", {})
    if spec not in loaded:
        path, name = registry.user_function(spec)  # type: ignore[misc]  # the scorer sends user functions only
        loaded[spec] = custom_fn.load_function(path, name, field=f"reward.functions ({spec})")
    return loaded[spec]


def _call(name: str | None, sample: tuple) -> Any:
    if name is None:
        return _custom()(*sample)
    if registry.user_function(name) is not None:
        return _user_function(name)(*sample)  # verl's arguments, the ground truth as read
    source, solution, truth, extra = sample
    return registry.score(name, source, solution, truth, extra, format_score=_WORKER.get("spec", {}).get("format_score", 0.0))


def score_samples(scorers: list[str | None], samples: list[tuple]) -> list[Outcome]:
    """Score each (data_source, solution, ground_truth, extra_info); None scorer = the custom one."""
    outcomes: list[Outcome] = []
    for name, sample in zip(scorers, samples, strict=True):
        where = f"reward scorer {name}" if name is not None else "reward.custom function"
        try:
            value = _call(name, sample)
        except Exception as exc:  # noqa: BLE001 - a reward error scores 0 and is counted
            # The traceback from the function's own frame on (this loop's frame says nothing).
            assert exc.__traceback__ is not None  # a caught exception carries its traceback
            user_tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next))
            outcomes.append(("error", f"{type(exc).__name__}: {exc}", user_tb))
            continue
        outcomes.append(_scored(value, where))
    return outcomes


def _scored(value: Any, where: str) -> Outcome:
    """A function's return as an outcome; one that is no score is an error without a traceback:
    the message says what was returned, and the only frames would be megarl's own check."""
    try:
        return ("ok", *custom_fn.to_scored(value, where))
    except Exception as exc:  # noqa: BLE001 - e.g. None, a string, NaN: scored 0 and counted
        return ("error", f"{type(exc).__name__}: {exc}", "")


def score_batched(columns: tuple[list, list, list, list]) -> list[Outcome]:
    values = _custom()(*columns)
    if not isinstance(values, (list, tuple)) or len(values) != len(columns[0]):
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise ValueError(
            f"batched reward.custom function returned {got} for {len(columns[0])} samples; return a list, one per sample"
        )
    return [_scored(v, "batched reward.custom function") for v in values]


def score_model(samples: list[tuple]) -> list[Outcome]:
    """reward.model on (raw prompt or None, prompt text, response) samples."""
    from megarl.rewards.reward_model import score_samples

    if "load_error" in _WORKER:
        raise _WORKER["load_error"]
    path, device = _WORKER["spec"]["model"]
    chat_template, max_length = _WORKER["spec"].get("model_input", (False, None))
    return [("ok", s, {}) for s in score_samples(path, device, samples, chat_template, max_length)]
