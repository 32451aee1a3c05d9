"""The sweep of a supervised driver's leftovers (megarl/tagged_processes.py) on stand-in processes:
SIGTERM first (a process's handler gets its chance), SIGKILL for what does not go; untagged
processes and other tags are left alone."""

import os
import subprocess
import sys
import time
from pathlib import Path

from megarl.tagged_processes import DRIVER_TAG_ENV, end_tagged, new_tag


def _start(tmp_path: Path, name: str, tag: str | None, on_term: str) -> tuple[subprocess.Popen, Path]:
    """A process carrying ``tag`` (None: none) whose SIGTERM handler runs ``on_term``; returned
    once its handler is up, with the file the handler may write."""
    ready, said = tmp_path / f"{name}.ready", tmp_path / f"{name}.term"
    code = ("import signal, sys, time\n"
            f"def on_term(signum, frame):\n    {on_term}\n"
            "signal.signal(signal.SIGTERM, on_term)\n"
            f"open({str(ready)!r}, 'w').close()\ntime.sleep(120)")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != DRIVER_TAG_ENV}
    if tag is not None:
        env[DRIVER_TAG_ENV] = tag
    proc = subprocess.Popen([sys.executable, "-c", code.replace("SAID", repr(str(said)))], env=env)
    for _ in range(600):
        if ready.exists():
            break
        time.sleep(0.05)
    return proc, said


def test_sigterm_first_then_sigkill_for_what_stays(tmp_path):
    tag = new_tag()
    polite, said = _start(tmp_path, "polite", tag, "open(SAID, 'w').write('flushed'); sys.exit(0)")
    stubborn, _ = _start(tmp_path, "stubborn", tag, "pass")  # ignores SIGTERM
    others = [_start(tmp_path, "untagged", None, "sys.exit(0)")[0], _start(tmp_path, "other-run", new_tag(), "sys.exit(0)")[0],
              _start(tmp_path, "prefixed", tag + "0", "sys.exit(0)")[0]]  # fmt: skip
    try:
        assert end_tagged(tag) == 2
        assert polite.wait(timeout=10) == 0 and said.read_text() == "flushed"  # its handler ran: SIGTERM came first
        assert stubborn.wait(timeout=10) == -9
        assert all(p.poll() is None for p in others)
    finally:
        for p in (polite, stubborn, *others):
            p.kill()
            p.wait()


def test_nothing_tagged_returns_at_once():
    assert end_tagged(new_tag()) == 0


def test_a_block_ends_what_it_started_and_a_spared_pid_is_left(tmp_path):
    from megarl.tagged_processes import ending_what_it_starts

    before = os.environ.get(DRIVER_TAG_ENV)
    with ending_what_it_starts():  # the tag is in this process's environment only while the block runs
        inside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    tag = new_tag()
    spared, _ = _start(tmp_path, "spared", tag, "sys.exit(0)")
    try:
        assert inside.wait(timeout=30) == -15 and os.environ.get(DRIVER_TAG_ENV) == before
        assert end_tagged(tag, spare={spared.pid}) == 0 and spared.poll() is None
        assert end_tagged(tag) == 1 and spared.wait(timeout=10) == 0
    finally:
        for p in (spared, inside):
            p.kill()
            p.wait()


def test_a_process_that_blocks_sigterm_gets_sigkill_without_the_grace(monkeypatch):
    # the reward pool's forkserver and Ray's processes block SIGTERM: the grace would only be waited out
    import threading

    from megarl import tagged_processes

    monkeypatch.setattr(tagged_processes, "TERM_GRACE_S", 600.0)
    tag = new_tag()
    code = "import signal, time\nsignal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\nprint('up', flush=True)\ntime.sleep(120)"
    blocked = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, DRIVER_TAG_ENV: tag}, stdout=subprocess.PIPE,
                               text=True)  # fmt: skip
    try:
        assert blocked.stdout.readline().strip() == "up"
        sweep = threading.Thread(target=end_tagged, args=(tag,))
        sweep.start()
        sweep.join(timeout=60)  # far below the 600 s grace
        assert not sweep.is_alive() and blocked.wait(timeout=10) == -9
    finally:
        blocked.kill()
        blocked.wait()


def test_the_sweep_returns_once_what_it_killed_has_exited():
    # A killed process's environment reads empty once its memory is gone, before its files are
    # closed: the sweep returned then, and a forkserver it had killed still accepted a connection
    # (the next in-process evaluate's pool read EOF from it). Many open files make that window long.
    # The sweeping process has many files open too: its pidfds lie above select()'s 1024.
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    files = max(100, min(hard - 100, 16000))
    code = ("import os, resource, signal, time\nsignal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({hard}, {hard}))\n"
            f"fd = os.open(os.devnull, os.O_RDONLY)\nfds = [os.dup(fd) for _ in range({files})]\n"
            "print('up', flush=True)\ntime.sleep(120)")  # fmt: skip
    tag = new_tag()
    child = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, DRIVER_TAG_ENV: tag}, stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(max(0, min(1100, soft - 200)))]
    try:
        assert child.stdout.readline().strip() == "up"
        assert end_tagged(tag) == 1
        assert os.waitpid(child.pid, os.WNOHANG)[0] == child.pid  # a zombie already: nothing of it is left running
        child.returncode = -9
    finally:
        for fd in filler:
            os.close(fd)
        if child.returncode is None:
            child.kill()
            child.wait()
