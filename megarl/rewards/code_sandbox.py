"""Code rewards: run the response's last ```python block against stdin/stdout test cases.

Test format (``extra_info``; documented in docs/rewards.md)::

    {"tests": [{"input": "1 2\\n", "output": "3\\n"}, ...],
     "mode": "pass_rate" | "all",          # default pass_rate: passed / total; all: 1 or 0
     "time_limit_s": 2.0,                   # wall-clock limit per test (CPU limit = ceil + 1)
     "memory_limit_mb": 512}                # address-space limit of the program

``ground_truth`` may carry the tests instead, as JSON: the list above, or
``{"inputs": [...], "outputs": [...]}``. Outputs compare line by line with trailing
whitespace and trailing blank lines ignored.

Each test runs the program in a fresh child process:
- always: a new temporary working directory (deleted afterwards), a minimal environment (no
  inherited variables, so no secrets; only the MEGARL_DRIVER_TAG of a supervised run (or of
  `megarl evaluate`'s scoring), by which its end finds what a program left running: megarl/tagged_processes.py), ``python -I -S`` (no site-packages, no PYTHON* vars),
  rlimits set in the child (address space, CPU seconds, output file size, no core dumps,
  processes for non-root users), stdout to a size-limited file, its own process group killed
  with SIGKILL at the wall-clock limit, and death with its parent (PR_SET_PDEATHSIG).
- with bubblewrap (``bwrap``) present and working: a read-only view of the system and the
  Python install only, tmpfs /tmp, the scratch directory as the only writable place, and new
  network / PID / IPC namespaces (no network at all). This is an isolation boundary.
- without bubblewrap: additionally a Python audit hook refuses writes outside the scratch
  directory, sockets, subprocesses, fork/exec and ctypes. That stops accidents and naive
  programs, and it is NOT a security boundary (native code, interpreter bugs and anything the
  hook does not see get through). Do not run untrusted code on a shared machine that way.

Left out: languages other than Python, function-call (LeetCode-style) tests, special judges.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.tagged_processes import DRIVER_TAG_ENV

DEFAULT_TIME_LIMIT_S = 2.0
DEFAULT_MEMORY_LIMIT_MB = 512
OUTPUT_LIMIT_BYTES = 16 << 20
SANDBOX_DIR = "/sandbox"  # where the scratch directory appears inside bubblewrap

_ACTIVE: dict[str, int | None] = {}  # scratch dir -> process group of the run using it

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)

# Runs in the child: limits, parent-death signal, optional audit guard, then the program.
_LAUNCHER = r"""
import json, os, resource, sys
cfg = json.loads(sys.argv[1])
try:
    import ctypes
    ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: die with the reward worker
except Exception:
    pass
for name in [m for m in sys.modules if m == "ctypes" or m.startswith("ctypes.")]:
    del sys.modules[name]
mem = cfg["memory_bytes"]
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["fsize"], cfg["fsize"]))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if cfg["nproc"] is not None:
    resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc"], cfg["nproc"]))
if cfg["guard"]:
    root = os.path.realpath(os.getcwd())
    WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    DENY = {"socket.__new__", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn",
            "os.spawn", "os.fork", "os.forkpty", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym",
            "os.kill", "os.killpg", "signal.pthread_kill"}
    PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link",
                   "os.chmod", "os.chown", "os.truncate", "os.utime", "shutil.rmtree",
                   "shutil.copyfile", "shutil.move", "os.chdir"}
    def inside(path):
        if isinstance(path, int):
            return True
        path = os.path.realpath(os.fsdecode(path))
        return path == root or path.startswith(root + os.sep)
    def guard(event, args):
        if event in DENY:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and len(args) >= 3:
            path, mode, flags = args[0], args[1] or "", args[2] or 0
            writing = any(c in str(mode) for c in "wax+") or bool(flags & WRITE_FLAGS)
            if writing and path is not None and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the working directory")
        elif event in PATH_EVENTS:
            for arg in args[:2]:
                if isinstance(arg, (str, bytes, os.PathLike)) and not inside(arg):
                    raise PermissionError(f"sandbox: {event} on {arg!r} is outside the working directory")
    sys.addaudithook(guard)
import runpy
sys.argv = ["solution.py"]
runpy.run_path("solution.py", run_name="__main__")
"""


@dataclass(frozen=True)
class RunResult:
    """What one sandboxed run of a program did."""

    stdout: str
    stderr: str
    returncode: int | None  # None when killed at the wall-clock limit
    timed_out: bool
    seconds: float


def extract_program(solution_str: str) -> str | None:
    """The last ```python (or ```py / ```python3) block, else the last untagged block, else None."""
    blocks = _FENCE.findall(solution_str)
    tagged = [body for tag, body in blocks if tag.lower() in ("python", "py", "python3")]
    untagged = [body for tag, body in blocks if not tag]
    chosen = tagged or untagged
    return chosen[-1] if chosen else None


@functools.lru_cache(maxsize=1)
def bwrap_available() -> bool:
    """Whether bubblewrap is installed and can create its namespaces here (probed once)."""
    exe = shutil.which("bwrap")
    if exe is None:
        return False
    probe = [exe, "--ro-bind", "/", "/", "--unshare-all", "--die-with-parent", "true"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=10, env={}).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _bwrap_prefix(scratch: Path) -> list[str]:
    args = ["bwrap", "--die-with-parent", "--new-session", "--unshare-all"]
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for path in ("/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives"):
        args += ["--ro-bind-try", path, path]
    python_root = os.path.realpath(sys.base_prefix)
    if not python_root.startswith("/usr"):
        args += ["--ro-bind", python_root, python_root]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    args += ["--bind", str(scratch), SANDBOX_DIR, "--chdir", SANDBOX_DIR]
    return args


def _nproc_limit() -> int | None:
    # RLIMIT_NPROC counts every process and thread of the user system-wide and root ignores
    # it: leave room for what the user already runs, so the program can start a handful.
    if os.geteuid() == 0:
        return None
    uid = os.getuid()
    running = sum(
        _tasks(p) for p in Path("/proc").iterdir() if p.name.isdigit() and _owner(p) == uid
    )
    return running + 8


def _owner(proc_dir: Path) -> int | None:
    try:
        return proc_dir.stat().st_uid
    except OSError:
        return None


def _tasks(proc_dir: Path) -> int:
    try:
        return len(os.listdir(proc_dir / "task"))  # threads count against RLIMIT_NPROC too
    except OSError:
        return 0


def _python() -> str:
    """The base interpreter (not a venv shim): the program sees the standard library only."""
    exe = os.path.realpath(sys.executable)
    return exe if os.path.exists(exe) else sys.executable


def run_program(
    source: str,
    stdin: str = "",
    *,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB,
    use_bwrap: bool | None = None,
) -> RunResult:
    """Run Python ``source`` with ``stdin`` in the sandbox (bwrap when ``use_bwrap`` or auto-detected)."""
    if use_bwrap is None:
        use_bwrap = bwrap_available()
    elif use_bwrap and not bwrap_available():
        raise RuntimeError(
            "use_bwrap=True but bubblewrap (bwrap) is not installed or cannot create namespaces"
        )
    scratch = Path(tempfile.mkdtemp(prefix="megarl-sandbox-"))
    _ACTIVE[str(scratch)] = None
    try:
        (scratch / "solution.py").write_text(source)
        limits = {
            "memory_bytes": int(memory_limit_mb) << 20,
            "cpu_s": int(math.ceil(time_limit_s)) + 1,
            "fsize": OUTPUT_LIMIT_BYTES,
            "nproc": _nproc_limit(),
            "guard": not use_bwrap,
        }
        argv = [_python(), "-I", "-S", "-c", _LAUNCHER, json.dumps(limits)]
        if use_bwrap:
            argv = _bwrap_prefix(scratch) + argv
        home = SANDBOX_DIR if use_bwrap else str(scratch)
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": home,
            "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8",
        }
        if os.environ.get(DRIVER_TAG_ENV):  # a supervised run's (or evaluate's) tag: its sweep ends what the program left (a sleep)
            env[DRIVER_TAG_ENV] = os.environ[DRIVER_TAG_ENV]
        return _execute(argv, stdin, scratch, env, time_limit_s)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        _ACTIVE.pop(str(scratch), None)


def _execute(
    argv: list[str], stdin: str, scratch: Path, env: dict[str, str], time_limit_s: float
) -> RunResult:
    # stdout/stderr go to files (RLIMIT_FSIZE bounds them), not pipes the worker must drain.
    out_path, err_path = scratch / ".stdout", scratch / ".stderr"
    start = time.monotonic()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=err,
            cwd=scratch,
            env=env,
            start_new_session=True,
        )
        _ACTIVE[str(scratch)] = proc.pid
        timed_out = False
        try:
            proc.communicate(stdin.encode(), timeout=time_limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        except BrokenPipeError:  # the program exited without reading its input
            pass
        finally:
            _kill_group(proc)
    seconds = time.monotonic() - start
    read = lambda p: p.read_bytes()[:OUTPUT_LIMIT_BYTES].decode("utf-8", "replace")  # noqa: E731
    return RunResult(
        read(out_path), read(err_path), None if timed_out else proc.returncode, timed_out, seconds
    )


def stop_active_runs() -> None:
    """Kill running sandboxed programs and delete their directories; for a worker's SIGTERM
    handler (a timed-out reward task's worker is terminated without unwinding ``finally``)."""
    for scratch, pid in list(_ACTIVE.items()):
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        shutil.rmtree(scratch, ignore_errors=True)
    _ACTIVE.clear()


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _same_output(actual: str, expected: str) -> bool:
    def lines(text: str) -> list[str]:
        rows = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while rows and not rows[-1]:
            rows.pop()
        return rows

    return lines(actual) == lines(expected)


def parse_tests(ground_truth: Any, extra_info: dict | None) -> list[dict[str, str]]:
    """The test cases from ``extra_info["tests"]`` or a JSON ``ground_truth`` (see module docstring)."""
    source: Any = (extra_info or {}).get("tests")
    if source is None and isinstance(ground_truth, str) and ground_truth.strip()[:1] in "[{":
        source = json.loads(ground_truth)
    elif source is None:
        source = ground_truth
    source = _plain(source)  # parquet via pandas gives numpy arrays where JSON gives lists
    if isinstance(source, dict) and "inputs" in source and "outputs" in source:
        source = [
            {"input": i, "output": o}
            for i, o in zip(source["inputs"], source["outputs"], strict=True)
        ]
    if (
        not isinstance(source, list)
        or not source
        or not all(isinstance(t, dict) and "output" in t for t in source)
    ):
        raise ValueError(
            'code reward needs test cases: extra_info["tests"] = [{"input": stdin, "output": expected stdout}, ...] '
            f'(or that list / {{"inputs": [...], "outputs": [...]}} as JSON in ground_truth); got {str(source)[:200]!r}'
        )
    return source


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def compute_score(
    data_source, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """Fraction of tests passed (mode pass_rate) or 1/0 for all passed (mode all); no program -> 0."""
    info = extra_info or {}
    tests = parse_tests(ground_truth, info)
    mode = info.get("mode", "pass_rate")
    if mode not in ("pass_rate", "all"):
        raise ValueError(f'extra_info["mode"] {mode!r} is not one of pass_rate, all')
    program = extract_program(solution_str)
    if program is None:
        return 0.0
    passed = 0
    for test in tests:
        result = run_program(
            program,
            str(test.get("input", "")),
            time_limit_s=float(info.get("time_limit_s", DEFAULT_TIME_LIMIT_S)),
            memory_limit_mb=int(info.get("memory_limit_mb", DEFAULT_MEMORY_LIMIT_MB)),
        )
        ok = result.returncode == 0 and _same_output(result.stdout, str(test["output"]))
        passed += ok
        if not ok and mode == "all":
            return 0.0
    return passed / len(tests)
