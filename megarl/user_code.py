"""The user's own code run in the driver (tools, interactions, data.custom_cls, a generate
function), reported as the user's: what it did to end the process and where it lives.

Python's ways for code to end its process (``sys.exit``, ``raise KeyboardInterrupt`` /
``SystemExit`` / ``GeneratorExit``) would otherwise pass through megarl as if they were megarl's
own ending: the function's exit code, or "stopped by SIGINT (Ctrl-C)" blaming the user's keyboard.
:func:`user_exit_error` turns such an exception into :class:`UserCodeError`, one `error:` line
with exit code 2 naming the function, its file, what it did and the fix. A KeyboardInterrupt that
a signal raised (the user's own Ctrl-C) is left alone: see :func:`raised_by_code`.

Left out: reward functions, which run in worker processes (megarl/rewards/worker.py reports
them the same way), and code that ends its process at the C level (os._exit): in the driver that
ends the run as the process's own exit, which only a separate process could survive.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import threading
import traceback
from typing import Any

EXITS = (SystemExit, KeyboardInterrupt, GeneratorExit)  # user code trying to end its process


class SignalInterrupt(KeyboardInterrupt):  # noqa: N818 - a KeyboardInterrupt, named as its kind is
    """The KeyboardInterrupt megarl's own signal and hang handlers raise (megarl/trainer/watchdog.py):
    the user's Ctrl-C or a stop request, never the code that happened to be running."""


class UserCodeError(RuntimeError):
    """The user's own code (a tool, an interaction, a dataset class, a generate function) tried to
    end the process or failed; the message names it, its file, what it did and the fix."""


def exit_description(exc: BaseException) -> str:
    """How code tried to end its process, for an error line: "called sys.exit(3)", "raised KeyboardInterrupt"."""
    if isinstance(exc, SystemExit):
        frames = traceback.extract_tb(exc.__traceback__)
        called = bool(frames) and "exit(" in (frames[-1].line or "")
        return f"called sys.exit({exc.code!r})" if called else f"raised SystemExit({exc.code!r})"
    return f"raised {type(exc).__name__}"


def raised_by_code(exc: BaseException) -> bool:
    """Whether ``exc`` came from the code (``raise``, ``sys.exit``) rather than a signal: never a
    SignalInterrupt (megarl's handlers); off the main thread always (signals reach the main thread
    only); on it, a plain KeyboardInterrupt counts as the code's only when its innermost frame is a
    ``raise`` statement (Python's own SIGINT handler raises it wherever the main thread was)."""
    if isinstance(exc, SignalInterrupt):
        return False
    if (
        not isinstance(exc, KeyboardInterrupt)
        or threading.current_thread() is not threading.main_thread()
    ):
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and re.search(r"\braise\b", frames[-1].line or "") is not None  # (one-liners too: `def f(): raise X`)


def source_file(obj: Any) -> str:
    """The file that defines ``obj`` (a function, method, class or instance), or "its file" when unknown."""
    target = obj if inspect.isroutine(obj) or inspect.isclass(obj) else type(obj)
    try:
        return inspect.getsourcefile(inspect.unwrap(target)) or "its file"
    except TypeError:
        return "its file"


def user_exit_error(what: str, exc: BaseException, fix: str) -> UserCodeError:
    """``exc`` (one of EXITS, raised by the code) as the one-line error: "<what> <did>; <fix>"."""
    return UserCodeError(f"{what} {exit_description(exc)}; {fix}")


def named_generate_function(fn: Any, name: str) -> Any:
    """``fn`` (the user's rollout.generate_function ``name``) called so that an exit or an exception
    of the user's own is one UserCodeError naming it and its file (megarl's own errors pass as they are)."""

    @functools.wraps(fn)  # logs and the run's phases name the user's function, not this wrapper
    def generate(*args: Any, **kwargs: Any) -> Any:
        what = f"rollout.generate_function {name} ({source_file(fn)})"
        try:
            return fn(*args, **kwargs)
        except EXITS as exc:
            if not raised_by_code(exc):  # the user's own Ctrl-C
                raise
            raise user_exit_error(
                what, exc, "a generate function must return a Batch or raise, never end the process"
            ) from exc
        except Exception as exc:
            # megarl's own (an engine's, a user error it names) passes as it is, and so does
            # anything raised inside a megarl call the function made (an engine actor's death, a
            # Ray or HTTP error, an out-of-memory there): not the function's fault
            if type(exc).__module__.startswith("megarl.") or _raised_in_megarl(exc):
                exc.add_note(f"(raised while {what} ran)")
                raise
            raise UserCodeError(
                f"{what} raised {type(exc).__name__}: {exc}; fix the function (the traceback is in "
                "the run's log)"
            ) from exc

    return generate


_MEGARL_DIR = os.path.dirname(os.path.abspath(__file__))


def _raised_in_megarl(exc: BaseException) -> bool:
    """Whether ``exc`` passed through megarl's own code below the user's function (the traceback's
    first frame is the wrapper, the next the user's)."""
    frames = list(traceback.walk_tb(exc.__traceback__))[2:]
    return any(os.path.abspath(frame.f_code.co_filename).startswith(_MEGARL_DIR + os.sep) for frame, _ in frames)
