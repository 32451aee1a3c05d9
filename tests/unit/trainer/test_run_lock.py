"""One run per output directory: a second launch while the first runs is refused, naming the
first; the lock goes with the process however it ends, and not to the processes it forks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from megarl.trainer.run_lock import (
    LOCK_FILE,
    OutputDirInUse,
    output_dir_lock,
)

# Holds the lock, forks a child that outlives it (as a reward pool's worker could), and waits.
HOLD = """import os, sys, time
from megarl.trainer.run_lock import output_dir_lock
with output_dir_lock(sys.argv[1]):
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
    print('held', flush=True)
    time.sleep(60)
"""


def test_a_second_process_is_refused_until_the_first_is_gone(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputDirInUse, match=rf"^sft.output_dir {out} is in use by pid {holder.pid} on .* \(since "
                                                 r".*\); wait for that run to end or stop it .*, or give another sft.output_dir$"):  # fmt: skip
            with output_dir_lock(out, "sft.output_dir"):
                pass
        with pytest.raises(OutputDirInUse, match=rf"^trainer.output_dir {out} is in use by pid {holder.pid} "):
            with output_dir_lock(out):
                pass
        holder.kill()  # SIGKILL: the kernel releases the lock; the forked child, still alive, holds none
        holder.wait()
        with output_dir_lock(out):
            pass
        assert (out / LOCK_FILE).read_text().startswith("pid ")  # (read after: a close in the holder drops its lock)
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # the forked child too
        holder.wait()


def test_a_second_hold_in_the_same_process_is_refused(tmp_path):
    """A POSIX lock does not stop its own process, and a second open + close would drop it."""
    with output_dir_lock(tmp_path):
        with pytest.raises(OutputDirInUse, match="is in use by this process"):
            with output_dir_lock(tmp_path / "." ):
                pass
    with output_dir_lock(tmp_path):  # released
        pass


def test_a_filesystem_without_locks_runs_unlocked_with_a_warning(tmp_path, monkeypatch, caplog):
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    with output_dir_lock(tmp_path):
        pass
    assert "the filesystem has no file locks (No locks available); nothing stops a second run there" in caplog.text


HOLD_OUTPUT = """import sys, time
from megarl.trainer.run_lock import output_lock
with output_lock(sys.argv[1], "--scored"):
    print('held', flush=True)
    time.sleep(60)
"""


def test_a_commands_output_is_held_by_a_lock_file_beside_it_that_goes_with_the_command(tmp_path, monkeypatch):
    """generate, convert and evaluate: a second writer of one --out is refused naming the first's
    pid (and the output absolute, however it was given); the lock file is removed at the end, and
    so are the folders made only for it."""
    from megarl.trainer.run_lock import output_lock

    out = tmp_path / "new" / "deeper" / "scored.parquet"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_OUTPUT, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.chdir(tmp_path / "new")
        with pytest.raises(OutputDirInUse, match=rf"^--scored {out} is in use by pid {holder.pid} on .*; wait for that "
                                                 r"command to end or stop it .*, or give another --scored$"):  # fmt: skip
            with output_lock("deeper/scored.parquet", "--scored"):
                pass
        monkeypatch.chdir(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    with output_lock(out):
        assert [p.name for p in out.parent.iterdir()] == [".scored.parquet.megarl.lock"]
        with pytest.raises(OutputDirInUse, match="is in use by this process"):
            with output_lock(out.parent / ".." / "deeper" / "scored.parquet"):
                pass
    assert list(out.parent.iterdir()) == []  # the lock file goes (the killed holder's too, taken over)
    with output_lock(tmp_path / "made" / "for" / "it.json"):
        assert (tmp_path / "made" / "for").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new"]  # folders made only for the lock are removed


def test_a_run_refused_inside_the_lock_leaves_no_folder_it_made(tmp_path):
    new, kept = tmp_path / "a" / "run", tmp_path / "kept"
    kept.mkdir()
    for folder in (new, kept):
        with pytest.raises(ValueError), output_dir_lock(folder):
            raise ValueError("refused before anything was written")
    assert not (tmp_path / "a").exists()  # both folders it made are gone
    assert (kept / LOCK_FILE).is_file()  # a folder that was there is left as a held one is


# A supervised driver: checks OUT free, holds it, says which process holds the record lock (the
# kernel's /proc/locks) and whether an unsupervised process is refused meanwhile, and ends; refused
# (its error on stderr, no end reported) when its supervisor holds nothing for it.
SUPERVISED_DRIVER = """import os, subprocess, sys
from megarl import driver_supervisor
driver_supervisor.take_report_pipe()
from megarl.trainer.run_lock import check_output_free, output_lock
out = sys.argv[1]
check_output_free(out)
with output_lock(out):
    st = os.stat(os.path.join(os.path.dirname(out), '.' + os.path.basename(out) + '.megarl.lock'))
    key = f'{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}'
    owners = [line.split()[4] for line in open('/proc/locks') if line.split()[5] == key]
    other = subprocess.run([sys.executable, '-c', 'import sys; from megarl.trainer.run_lock import check_output_free; '
                            'check_output_free(sys.argv[1])', out], capture_output=True, text=True)
    print('owners', owners, 'supervisor', os.getppid(), 'other', other.returncode, other.stderr.strip().splitlines()[-1])
driver_supervisor.report(end=0)
"""


def test_a_supervisors_hold_is_its_drivers_and_no_one_elses(tmp_path, capfd):
    """The command's process takes its driver's output lock before the driver starts (a second
    command refused at once, not after the driver's imports) and tells its driver which file it
    holds: the driver checks and holds the output under that hold; any other process is refused,
    naming the supervisor; a driver not told so is refused as any other process."""
    from megarl.driver_supervisor import SUPERVISOR_HOLDS_ENV, supervise
    from megarl.trainer.run_lock import output_lock

    out = tmp_path / "gen.parquet"
    driver = [sys.executable, "-c", SUPERVISED_DRIVER, str(out)]
    with output_lock(out) as claim:
        assert supervise(driver, ray=False, env_extra={SUPERVISOR_HOLDS_ENV: claim}) == 0
        said = capfd.readouterr().out.strip()
        assert supervise(driver, ray=False) == 2  # a hold this process does not pass on is not the driver's
        refused = capfd.readouterr().err
    assert said.startswith(f"owners ['{os.getpid()}'] supervisor {os.getpid()} other 1 "), said  # the lock stayed this process's
    assert re.search(rf" other 1 megarl.trainer.run_lock.OutputDirInUse: --out {re.escape(str(out))} is in use by pid {os.getpid()} on "
                     r"\S+ \(since ", said)  # fmt: skip
    assert f"OutputDirInUse: --out {out} is in use by pid {os.getpid()} on " in refused, refused
    assert list(tmp_path.iterdir()) == []  # the lock file went with the supervisor's hold


def test_a_run_folder_made_for_the_lock_goes_at_the_end_when_nothing_else_came_into_it(tmp_path):
    with output_dir_lock(tmp_path / "made" / "run"):
        pass
    with output_dir_lock(tmp_path / "used" / "run"):
        (tmp_path / "used" / "run" / "metrics.jsonl").touch()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["used"]
    assert sorted(p.name for p in (tmp_path / "used" / "run").iterdir()) == [LOCK_FILE, "metrics.jsonl"]
    (tmp_path / "afile").touch()
    with pytest.raises(OutputDirInUse, match=rf"^trainer.output_dir {tmp_path / 'afile'} is a file; give a folder "):
        with output_dir_lock(tmp_path / "afile"):
            pass
