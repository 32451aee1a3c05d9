"""The commands whose driver starts Ray (launch, demo, sft, convert, generate) run that driver as
a child of the command's process, watched from outside (megarl/driver_supervisor.py says why:
Ray's core worker ends a driver whose raylet died at the C level, without a word, and user code
in the driver may call ``os._exit``). One wrapper does it for all of them: the command's process
checks the arguments and the config first (a mistake: its one line from here, no child started),
then runs the same command line again as its supervised driver, which finds itself supervised and
does the work.

What the supervisor's line says is kept when the driver dies without a word is each command's:
launch and demo report the command that resumes them; sft, convert and generate say it here
(``prepare`` returns it), from what the driver would have written by then.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from megarl.driver_supervisor import SUPERVISOR_HOLDS_ENV, USER_CODE

Hold = AbstractContextManager[str | None]  # an output lock held, yielding its claim for the driver (megarl/trainer/run_lock.py)


@dataclass(frozen=True)
class Supervision:
    """What the supervisor says of a command's driver that dies without a word."""

    kept: str | None = None  # what is left, and what to run (None: the driver reports the command that resumes)
    ray: bool = True  # whether the driver starts Ray (not under --in-process): the line names the Ray node then
    # the user code the driver runs, a likely cause of its os._exit (None: it runs none, as convert)
    user_code: str | None = USER_CODE
    # the output lock the driver takes (megarl/trainer/run_lock.py), taken first by the command's process and
    # kept until the driver and its leftovers have ended: a second command is refused at once, not after the
    # driver's imports (None: the driver locks nothing)
    holds: Callable[[], Hold] | None = None


def driver_user_code(cfg: Any, *, dataset: bool = True) -> str | None:
    """The user's code a config has the driver run, named by its keys for the supervisor's line (None:
    none; reward functions run in worker processes). ``dataset``: whether the command builds
    data.custom_cls (generate reads --data instead)."""
    agent = cfg.rollout.agent
    hooks = [f"rollout.generate_function {cfg.rollout.generate_function}" if cfg.rollout.generate_function != "default" else "",
             f"the tools of rollout.agent.tools_file {agent.tools_file}" if agent.tools_file else "",
             f"the interactions of rollout.agent.interactions_file {agent.interactions_file}" if agent.interactions_file else "",
             f"data.custom_cls {cfg.data.custom_cls.name}" if dataset and cfg.data.custom_cls is not None else ""]
    return ", ".join(hook for hook in hooks if hook) or None


Handler = Callable[[argparse.Namespace], int]
Prepare = Callable[[argparse.Namespace], Supervision]


def supervised_command(run: Handler, prepare: Prepare, holds: Callable[[argparse.Namespace], Hold] | None = None) -> Handler:
    """The handler of a command whose driver starts Ray: ``run(args)`` in the supervised driver.
    ``prepare(args)``, in the command's process before the driver starts, makes the checks of the
    arguments and config (raising the user's error: its line from here, no child started) and
    says what the supervisor's line would say of a silent death of the driver. ``holds(args)``:
    the output lock the driver takes, known from the arguments alone, taken before ``prepare``
    (whose checks may take seconds: a second command is refused at once) and kept as
    Supervision.holds is."""

    def handler(args: argparse.Namespace) -> int:
        from megarl.driver_supervisor import supervised

        if supervised():
            return run(args)
        with holds(args) if holds is not None else contextlib.nullcontext() as early:
            watch = prepare(args)
            if watch.ray:
                _check_ray_installed()
            with watch.holds() if watch.holds is not None else contextlib.nullcontext() as claim:
                return _supervise(args, watch, [c for c in (early, claim) if c])

    return handler


def _supervise(args: argparse.Namespace, watch: Supervision, claims: list[str]) -> int:
    from megarl.driver_supervisor import supervise

    return supervise([sys.executable, "-m", "megarl.cli", *args.argv], ray=watch.ray, kept=watch.kept,
                     user_code=watch.user_code, env_extra={SUPERVISOR_HOLDS_ENV: ",".join(claims)} if claims else None)  # fmt: skip


def starts_ray(args: argparse.Namespace) -> bool:
    """Whether a command's driver starts Ray by its flags: unless --in-process."""
    return not getattr(args, "in_process", False)


def _check_ray_installed() -> None:
    """A missing Ray refused here, not by a driver that would start only to say so (megarl/cli.py
    turns the error into its one line, with --in-process as the way without Ray)."""
    import importlib.util

    try:
        missing = importlib.util.find_spec("ray") is None
    except ValueError:  # a ray module without a spec: there, whatever it is
        missing = False
    if missing:
        raise ModuleNotFoundError("No module named 'ray'", name="ray")
