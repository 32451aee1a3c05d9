"""What runs in a reward worker process (megarl/rewards/scorer.py owns the pool): the
initializer that loads reward.custom / reward.model once, and the tasks that score samples.
A task returns, per sample, an outcome: ("ok", score, extras) or ("error", message,
traceback); the driver adds ("timeout", message).

User code runs here isolated from the driver: its stdout and stderr (Python's and C's, file
descriptors 1 and 2) go to the scorer's log file, and a function that tries to end the process
the Python way (``sys.exit``, ``raise KeyboardInterrupt`` / ``SystemExit`` / ``GeneratorExit``,
a BaseException subclass of its own) fails its task with :class:`UserExit`, which the driver reports at once (no sample is scored 0
for it: a function that exits is a bug to fix, not a score)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import traceback
from typing import Any, NoReturn

import megarl.rewards.code_sandbox as code_sandbox
import megarl.rewards.custom as custom_fn
import megarl.rewards.registry as registry
from megarl.process_signals import unblock_stop_signals
from megarl.user_code import exit_description

Outcome = tuple

_WORKER: dict[str, Any] = {}


class UserExit(Exception):
    """User code tried to end its process (sys.exit, KeyboardInterrupt, SystemExit, GeneratorExit, a
    BaseException of its own):
    ``what`` says how ("called sys.exit(3)"); ``position`` is the sample's place in its task;
    ``output`` the head of what the worker printed during the call; ``trace`` its traceback."""

    def __init__(self, what: str, position: int = 0, output: str = "", trace: str = ""):
        super().__init__(what, position, output, trace)
        self.what, self.position, self.output, self.trace = what, position, output, trace

    def __str__(self) -> str:
        return self.what


OUTPUT_HEAD_CHARS = 300  # what of a failing call's output the error line quotes
EXIT_NOTE = "megarl: the reward function "  # how the traceback of a function that ended its process starts in the log


def _redirect_output(path: str | None) -> None:
    """The worker's fds 1 and 2 (print, C extensions, warnings) appended to ``path``: a reward
    function that prints on every sample must not flood the terminal (issue: 100 MB in 2 steps)."""
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for target in (1, 2):
        os.dup2(fd, target)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):  # lines reach the file before an os._exit can drop them
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]


def _output_since(offset: int) -> str:
    """The head of what was appended to the worker's log since ``offset`` (other workers' lines
    may be interleaved: they share the file), up to the first traceback megarl wrote there: one
    another worker's exit put there is no output of this call, and would fill the error line."""
    log = _WORKER.get("spec", {}).get("log")
    if not log:
        return ""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(OSError), open(log, "rb") as f:
        f.seek(offset)
        head = f.read(OUTPUT_HEAD_CHARS + len(EXIT_NOTE)).decode(errors="replace")
        note = ("\n" + head).find("\n" + EXIT_NOTE)  # (a line's start: its newline kept)
        return head[: note if note >= 0 else OUTPUT_HEAD_CHARS][:OUTPUT_HEAD_CHARS]
    return ""


def _log_size() -> int:
    log = _WORKER.get("spec", {}).get("log")
    try:
        return os.path.getsize(log) if log else 0
    except OSError:
        return 0


def init_worker(spec: dict[str, Any], loaded: Any, load_s: Any) -> None:
    """Pool initializer: load the custom function / reward model / reward.functions' user files
    once, then count the worker in ``loaded`` (a shared int: the driver tells a death while loading
    from one after it) and keep the longest load so far in ``load_s`` (a shared double: the driver's
    bound on a worker's start). Here, not in a task: pebble starts a task's timeout (reward.timeout_s)
    when a worker takes it, so a slow import is never charged to a sample. Never raises (pebble
    would respawn a failing worker forever); a load error is re-raised by each task."""
    _WORKER.clear()
    _WORKER["spec"] = spec
    _redirect_output(spec.get("log"))
    _chain_sigterm()
    # Ctrl-C reaches the whole foreground process group: the driver decides when to stop, a
    # worker must not die mid-sample (the step in progress is finished or abandoned as a whole).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # So does a SIGTERM to the group (`timeout`, `kill -TERM -PGID`): the worker, started with it
    # blocked (scorer._new_pool), leaves the group, then takes the SIGTERM pebble stops it with.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    unblock_stop_signals()
    start = time.monotonic()
    _load(spec)
    with load_s.get_lock():
        load_s.value = max(load_s.value, time.monotonic() - start)
    with loaded.get_lock():
        loaded.value += 1


def _load(spec: dict[str, Any]) -> None:
    """What the worker's tasks call, loaded; a load error kept for them (see init_worker)."""
    for function in spec.get("functions", ()):
        with contextlib.suppress(Exception):  # kept by _user_function, raised by each task of it
            _user_function(function)
    try:
        if spec.get("custom"):
            _WORKER["custom"] = custom_fn.load_function(*spec["custom"])
        if spec.get("model"):
            from megarl.rewards.reward_model import load_reward_model

            load_reward_model(*spec["model"])
        if spec.get("preload_math"):
            import math_verify  # noqa: F401  (the first math task should not pay the sympy import)
    except Exception as exc:  # noqa: BLE001 - reported by every task of this worker
        _WORKER["load_error"] = exc
    except BaseException as exc:  # noqa: BLE001 - sys.exit at import: must not end a task as SystemExit
        _WORKER["load_error"] = _user_exit(exc, 0, 0, " while it was imported")


def _raise_kept(error: BaseException) -> NoReturn:
    """Raise a kept load error again with the traceback of its first raise: raised as it is, the
    one object gathered each raise's frames in its traceback, which grew with every task."""
    first = _WORKER.setdefault("first_tracebacks", {}).setdefault(id(error), error.__traceback__)  # (kept: ids stay)
    raise error.with_traceback(first)


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
        _raise_kept(_WORKER["load_error"])
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
    """The user function ``path.py:function`` of reward.functions, imported once per worker (by
    init_worker); its load error, kept, raised again at each call."""
    loaded, failed = _WORKER.setdefault("functions", {}), _WORKER.setdefault("function_errors", {})
    if spec in failed:
        _raise_kept(failed[spec])
    if spec not in loaded:
        path, name = registry.user_function(spec)  # type: ignore[misc]  # the scorer sends user functions only
        offset = _log_size()
        try:
            loaded[spec] = custom_fn.load_function(path, name, field=f"reward.functions ({spec})")
        except Exception as exc:
            failed[spec] = exc
            raise
        except BaseException as exc:  # sys.exit, KeyboardInterrupt, one of its own: it ends the process
            failed[spec] = _user_exit(exc, 0, offset, " while it was imported")
            raise failed[spec] from None
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
    for position, (name, sample) in enumerate(zip(scorers, samples, strict=True)):
        where = f"reward scorer {name}" if name is not None else "reward.custom function"
        offset = _log_size()
        try:
            value = _call(name, sample)
        except Exception as exc:  # noqa: BLE001 - a reward error scores 0 and is counted
            # The traceback from the function's own frame on (this loop's frame says nothing).
            assert exc.__traceback__ is not None  # a caught exception carries its traceback
            user_tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next))
            outcomes.append(("error", f"{type(exc).__name__}: {exc}", user_tb))
            continue
        except BaseException as exc:  # sys.exit, KeyboardInterrupt, one of its own: it ends the process
            raise _user_exit(exc, position, offset) from None  # the task fails: the driver stops the call
        outcomes.append(_scored(value, where))
    return outcomes


def _scored(value: Any, where: str) -> Outcome:
    """A function's return as an outcome; one that is no score is an error without a traceback:
    the message says what was returned, and the only frames would be megarl's own check."""
    try:
        return ("ok", *custom_fn.to_scored(value, where))
    except Exception as exc:  # noqa: BLE001 - e.g. None, a string, NaN: scored 0 and counted
        return ("error", f"{type(exc).__name__}: {exc}", "")


def _user_exit(exc: BaseException, position: int, offset: int, when: str = "") -> UserExit:
    assert exc.__traceback__ is not None  # a caught exception carries its traceback
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next))
    output = _output_since(offset)
    what = exit_description(exc) + when
    if _WORKER.get("spec", {}).get("log"):  # the traceback beside the output, in the log the error names
        print(f"{EXIT_NOTE}{what}, which stops the run:\n{trace}", file=sys.stderr, flush=True)
    return UserExit(what, position, output, trace)


def score_batched(columns: tuple[list, list, list, list]) -> list[Outcome]:
    """The batched custom function on the call's columns; a raise or a return of the wrong length
    fails every sample (as outcomes, not a raise: pebble would add its own and this module's
    frames to the traceback the run stops with)."""
    offset, n = _log_size(), len(columns[0])
    try:
        values = _custom()(*columns)
    except Exception as exc:  # noqa: BLE001 - every sample fails; the traceback from the function's frame on
        assert exc.__traceback__ is not None  # a caught exception carries its traceback
        user_tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next))
        return [("error", f"{type(exc).__name__}: {exc}", user_tb)] * n
    except BaseException as exc:  # sys.exit, KeyboardInterrupt, one of its own: it ends the process
        raise _user_exit(exc, 0, offset) from None
    if not isinstance(values, (list, tuple)) or len(values) != n:
        # megarl's own check: no traceback (its only frame would be this one), what came back instead
        got = f"a {type(values).__name__} of {len(values)}" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
        message = (f"ValueError: the batched reward.custom function returned {got} ({_head(values)}) for {n} samples; "
                   "return a list, one score per sample")
        return [("error", message, "")] * n
    return [_scored(v, "batched reward.custom function") for v in values]


def _head(value: Any, chars: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= chars else text[:chars] + "..."


def score_model(samples: list[tuple]) -> list[Outcome]:
    """reward.model on (raw prompt or None, prompt text, response) samples."""
    from megarl.rewards.reward_model import score_samples

    if "load_error" in _WORKER:
        _raise_kept(_WORKER["load_error"])
    path, device = _WORKER["spec"]["model"]
    chat_template, max_length = _WORKER["spec"].get("model_input", (False, None))
    return [("ok", s, {}) for s in score_samples(path, device, samples, chat_template, max_length)]
