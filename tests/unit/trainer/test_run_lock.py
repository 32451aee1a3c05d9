"""One run per output directory: a second launch while the first runs is refused, naming the
first; the lock goes with the process however it ends, and not to the processes it forks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from megarl.trainer.run_lock import LOCK_FILE, OutputDirInUse, output_dir_lock

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
                                                 r".*\); wait for that run to end or stop it, or give another sft.output_dir$"):  # fmt: skip
            with output_dir_lock(out, "sft.output_dir"):
                pass
        holder.kill()  # SIGKILL: the kernel releases the lock; the forked child, still alive, holds none
        holder.wait()
        with output_dir_lock(out):
            assert (out / LOCK_FILE).read_text().startswith("pid ")
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # the forked child too
        holder.wait()
