"""User code imported for the pre-launch checks in a child process, never in the driver: the
reward module and reward.custom's function, the functions named by import path, tools,
interactions and a data.custom_cls class (megarl/plan/preflight.py starts it first, in parallel
with the other checks). The child dies with the driver, its prints go to a log file, and one that
hangs, ends the process or raises is one finding naming the field, what happened and the fix.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from megarl.plan.issues import Finding
from megarl.process_signals import pid_alive
from megarl.signal_kinds import FAULTS, signal_name

CHILD_TIMEOUT_S = 120.0
PROGRESS_EVERY_S = 5.0  # a slow import in the check: "importing reward.custom from FILE ... (N s)" this often
SLOW_IMPORT_S = 5.0  # a reward file that takes longer to import is named in a warning (each reward worker imports it)
log = logging.getLogger(__name__)

# The child process: the user's reward module and functions never load in the driver.
_CHILD_CODE = r"""
import json, os, signal, sys, time, traceback
spec = json.loads(sys.argv[1])
try:  # killed with the driver, whatever ends it (SIGKILL included: it cannot be handled there)
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
except (OSError, AttributeError):
    pass
if os.getppid() != spec["parent"]:  # the driver died before the line above
    os._exit(1)
# answers on a copy of stdout; the user's code prints (fds 1 and 2) to the log file
answers = os.fdopen(os.dup(1), "w")
log = os.open(spec["log"], os.O_WRONLY | os.O_APPEND)
os.dup2(log, 1)
os.dup2(log, 2)

def emit(check, error, seconds=None):  # seconds: how long a reward file's import took
    answers.write(json.dumps({"check": check, "error": error, "seconds": seconds}) + "\n")
    answers.flush()

def starting(check, what):
    answers.write(json.dumps({"starting": check, "what": what}) + "\n")
    answers.flush()

def ended(exc):  # user code that tried to end the process (sys.exit, Ctrl-C's exception)
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({exc.code!r}) at import"
    if isinstance(exc, KeyboardInterrupt):  # this child has a process group of its own: no Ctrl-C of the user's
        return "it raised KeyboardInterrupt at import (a SIGINT it sent to its own process or process group)"
    return f"{type(exc).__name__}: {exc}"

if spec.get("reward"):
    path, name = spec["reward"]
    starting("reward", f"importing reward.custom from {path}")
    try:
        # custom.py alone (standard library only), not the megarl.rewards package (sympy, ...).
        import importlib.util
        loader = importlib.util.spec_from_file_location("megarl_preflight_custom", spec["custom_module"])
        custom = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(custom)
        start = time.monotonic()
        custom.load_function(path, name)
        emit("reward", None, time.monotonic() - start)
    except BaseException as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == path]
        where = f" (line {frames[-1].lineno})" if frames else ""
        emit("reward", f"{ended(exc)}{where}")
for source, (path, name) in spec.get("reward_functions", {}).items():
    check = f"reward.functions[{source!r}]"
    starting(check, f"importing {check} from {path}")
    try:
        import importlib.util
        loader = importlib.util.spec_from_file_location("megarl_preflight_custom", spec["custom_module"])
        custom = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(custom)
        start = time.monotonic()
        custom.load_function(path, name, field=check)
        emit(check, None, time.monotonic() - start)
    except (FileNotFoundError, AttributeError) as exc:
        emit(check, str(exc).removeprefix(check + ": "))
    except BaseException as exc:
        emit(check, f"importing {path} failed: {ended(exc)}")
for field, name in spec.get("extensions", []):
    starting(field, f"importing {field} ({name})")
    try:
        from megarl.plan.extensions import import_problem
        emit(field, import_problem(field, name, lambda what, field=field: starting(field, what)))
    except BaseException as exc:
        emit(field, ended(exc))
# Last: building a dataset class can outlast the deadline (a warning, not a refusal), and the
# checks after it would then go unanswered.
if spec.get("dataset"):
    starting("data.custom_cls", f"importing data.custom_cls from {spec['dataset'][0]}")
    steps = []  # the class's hooks called so far (its __init__, __len__, __getitem__(i)): the last one ran
    def step(what):
        steps.append(what)
        starting("data.custom_cls", what)
    try:
        from megarl.data.custom_dataset import class_problem, first_rows_problem, step_hook
        problem = class_problem(*spec["dataset"])
        if problem is None and spec.get("dataset_build"):
            problem = first_rows_problem(*spec["dataset"], spec["dataset_build"], step)
        emit("data.custom_cls", problem)
    except BaseException as exc:
        if not steps:
            emit("data.custom_cls", f"importing {spec['dataset'][0]} failed: {ended(exc)}")
        else:  # sys.exit, KeyboardInterrupt: the user's code ending the process, never the user's Ctrl-C
            from megarl.user_code import exit_description
            how = exit_description(exc) if not isinstance(exc, Exception) else f"raised {type(exc).__name__}: {exc}"
            emit("data.custom_cls", f"data.custom_cls: {spec['dataset'][1]} ({spec['dataset'][0]}) {how} in its "
                 f"{step_hook(steps[-1])} while it was built or its first rows read; a dataset class must raise an "
                 "exception for data it cannot read, never end the process")
"""


CHECK_LOG_PREFIX = "megarl-import-check-"  # then the driver's pid: whose log it is


def remove_orphaned_logs() -> None:
    """Empty check logs of drivers that are gone: a driver killed with SIGKILL (or its machine
    reset) ran no cleanup. A log that holds output is kept: a finding may have named it."""
    for path in Path(tempfile.gettempdir()).glob(f"{CHECK_LOG_PREFIX}*.log"):
        pid = path.name.removeprefix(CHECK_LOG_PREFIX).split("-")[0]
        try:
            if pid.isdigit() and not pid_alive(int(pid)) and path.stat().st_size == 0:
                path.unlink()
        except OSError:  # another user's, or removed meanwhile
            continue



class ChildChecks:
    """reward.custom's import and the import-path functions ``(field, name)``, in one child process
    started at once; each answer awaited at most CHILD_TIMEOUT_S (user code can hang at import), with
    a log line every PROGRESS_EVERY_S while one is awaited. The child dies with the driver (Linux's
    parent-death signal), its prints go to a log file (a temporary one, kept and named in a finding
    when a check failed), and one that ends before answering is named with its exit code."""

    def __init__(self, custom: Any, extensions: list[tuple[str, str]], dataset: Any = None,
                 functions: dict[str, str] | None = None, dataset_build: dict[str, Any] | None = None):
        from megarl.rewards.registry import user_function

        users = {source: user_function(name) for source, name in (functions or {}).items()}
        self.spec: dict[str, Any] = {  # JSON for the child
            "reward": [os.path.abspath(custom.path), custom.name] if custom and Path(custom.path).is_file() else None,
            "custom_module": str(Path(__file__).resolve().parents[1] / "rewards" / "custom.py"),
            "extensions": extensions,
            "dataset": [os.path.abspath(dataset.path), dataset.name] if dataset is not None else None,
            "dataset_build": dataset_build,  # built and its first rows read (custom_dataset.first_rows_problem)
            # reward.functions' user functions whose file exists (a missing one: check_functions' finding)
            "reward_functions": {source: [os.path.abspath(user[0]), user[1]] for source, user in users.items()
                                 if user is not None and Path(user[0]).is_file()},
            "parent": os.getpid(),
        }
        self.custom = custom
        self.got: dict[str, str | None] = {}
        self.seconds: dict[str, float] = {}  # how long each reward file's import took in the child
        self._buffer = b""
        self._doing = ("", time.monotonic())  # what the child said it is importing, since when
        self._log: Path | None = None
        self._quoted = False  # a finding named the log: it is kept
        self.proc: subprocess.Popen | None = None
        if any(self.spec[k] for k in ("reward", "extensions", "dataset", "reward_functions")):
            remove_orphaned_logs()
            fd, log = tempfile.mkstemp(prefix=f"{CHECK_LOG_PREFIX}{os.getpid()}-", suffix=".log")
            self._log = Path(log)
            self.spec["log"] = log
            env = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
            try:
                # A process group of its own: user code that signals its group (os.killpg(os.getpgrp(), ...))
                # reaches this child alone, which reports it, not the command as if the user had pressed Ctrl-C.
                self.proc = subprocess.Popen([sys.executable, "-c", _CHILD_CODE, json.dumps(self.spec)], stdout=subprocess.PIPE,
                                             stderr=fd, stdin=subprocess.DEVNULL, env=env, process_group=0)
            finally:
                os.close(fd)

    def results(self, check: str) -> list[Finding]:
        """The child's finding for ``check`` (reward | an import-path field), waiting for it if needed."""
        if (check == "reward" and not self.spec["reward"]) or (check == "data.custom_cls" and not self.spec["dataset"]):
            return []
        if check not in self.got:
            self.got.update(self._read({check}))
        if check not in self.got and self._building_too_long(check):
            from megarl.data.custom_dataset import step_hook

            hook = step_hook(self._doing[0])
            doing = "building it" if hook == "__init__" else f"reading its first rows (its {hook})"
            return [Finding("data.custom_cls", f"{self.spec['dataset'][1]}: {doing} took over {CHILD_TIMEOUT_S:g} s, "
                            "not checked before launch; the run builds it", level="warning")]
        error = self.got[check] if check in self.got else self._no_answer()
        return [self._finding(check, error + self._output())] if error is not None else self._slow_import(check)

    def _slow_import(self, check: str) -> list[Finding]:
        """A warning for a reward file that imported fine but slowly (the user would wonder why
        the reward workers are slow to start)."""
        seconds = self.seconds.get(check, 0.0)
        if seconds <= SLOW_IMPORT_S:
            return []
        files = {f"reward.functions[{source!r}]": user[0] for source, user in self.spec["reward_functions"].items()}
        field, path = ("reward.custom", self.spec["reward"][0]) if check == "reward" else (check, files[check])
        return [Finding(field, f"importing {path} took {seconds:.1f} s; each reward worker imports it as it starts (not "
                        "counted in reward.timeout_s), and again when a worker is replaced after a timeout or a death: "
                        "move slow work out of the import if it need not be there", level="warning")]

    def _building_too_long(self, check: str) -> bool:
        """The dataset class imported but its build (all of data.train_files; a class may tokenize
        every row in __init__) is still running at the deadline: slow, not wrong."""
        running = self.proc is not None and self.proc.poll() is None
        from megarl.data.custom_dataset import step_hook

        return check == "data.custom_cls" and running and step_hook(self._doing[0]) is not None

    def _no_answer(self) -> str:
        """Why an answer never came: the child ended (its exit code) or did not answer in time."""
        doing = self._doing[0] or "starting"
        code = self.proc.poll() if self.proc is not None else None
        if code is None:
            return f"{doing} did not finish within {CHILD_TIMEOUT_S:g} s: check it for work done at import (network, locks, long loops)"
        how = f"killed by {signal_name(-code)}" if code < 0 else f"exit code {code}"
        from megarl.data.custom_dataset import step_hook

        hook = step_hook(doing)  # a dataset class's: the hook it had started (its __getitem__(0), ...)
        at = f"in its {hook}" if hook else "while it was built (in its __init__)" if doing.startswith("building ") else "at import"
        cause = ("os._exit" if code >= 0 else "a crash in C code" if -code in FAULTS else
                 "the kernel's out-of-memory killer or a kill -9" if -code == signal.SIGKILL else
                 "a signal it sent to its own process or process group (os.kill, os.killpg), or a kill from outside")  # fmt: skip
        return f"the check's process ended ({how}) while {doing}, before it answered: {cause} {at}"

    def _output(self) -> str:
        """The head of what the child printed, for a finding (the log is then kept)."""
        from megarl.rewards.scorer import quoted_output

        try:
            text = self._log.read_text(errors="replace")[:2000] if self._log is not None else ""
        except OSError:
            return ""
        if not text.strip():
            return ""
        self._quoted = True
        return f" (its output, in {self._log}: {quoted_output(text)})"

    def _read(self, wanted: set[str]) -> dict[str, str | None]:
        """Answers (one JSON line each) until every wanted one came, the child ended, or the deadline."""
        import select

        got: dict[str, str | None] = {}
        if self.proc is None:
            return got
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while wanted - set(got):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if not select.select([fd], [], [], min(left, PROGRESS_EVERY_S))[0]:
                self._say_waiting()
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                self.proc.wait()  # the child ended (or died) before answering everything: its exit code
                break
            *lines, self._buffer = (self._buffer + chunk).split(b"\n")
            for line in lines:
                answer = json.loads(line)
                if "starting" in answer:
                    self._doing = (answer["what"], time.monotonic())
                else:
                    got[answer["check"]] = answer["error"]
                    if answer.get("seconds") is not None:
                        self.seconds[answer["check"]] = answer["seconds"]
        return got

    def _say_waiting(self) -> None:
        """A slow import is no silent launch: a line every PROGRESS_EVERY_S, on a terminal or a pipe."""
        from megarl.progress import said_inside

        what, since = self._doing
        log.info("%s ... (%.0f s)", what or "starting the import check", time.monotonic() - since)
        said_inside()  # "checking the config and its files" around it waits for this line to go quiet

    def _finding(self, check: str, error: str) -> Finding:
        if check == "reward":
            custom = self.custom
            return Finding("reward.custom", f"loading {custom.name!r} from {custom.path} failed: {error}; fix the file "
                           "(or install what it imports) and check reward.custom.name")
        if check == "data.custom_cls" and error.startswith("data.custom_cls"):  # class_problem's line names its key
            field, _, rest = error.partition(": ")
            return Finding(field, rest)
        return Finding(check, error)  # an import-path function: the registry's message names it and the fix

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()
            self.proc.stdout.close()  # type: ignore[union-attr]
        if self._log is not None and not self._quoted:
            self._log.unlink(missing_ok=True)


def reward_file_problem(custom: Any) -> str | None:
    """reward.custom (a ``CustomReward`` or None) loaded in a child process, as a launch checks
    it: why it does not load, or does not answer within CHILD_TIMEOUT_S, as one line; or None.
    For the commands that score without a launch (`megarl evaluate`): a file that hangs at import
    would hang the reward workers with no word."""
    child = ChildChecks(custom, [])
    try:
        return next((f"{f.field}: {f.message}" for f in child.results("reward") if f.level == "error"), None)
    finally:
        child.stop()
