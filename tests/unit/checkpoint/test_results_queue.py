"""megatron-core's save collects write results on a queue from a spawn-context manager process;
megarl's (megarl/checkpoint/results_queue.py) dies with the process that started it, and so does
multiprocessing's resource tracker then: a `kill -9` of a driver that saved leaves no process."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import multiprocessing.resource_tracker as rt, sys, time
from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
from megarl.checkpoint import results_queue as rq
rq.install_results_queue()
fa._results_queue.put("written")  # the queue megatron's save uses, served by megarl's manager
assert fa._results_queue.get(timeout=60) == "written"
print(rq._manager._process.pid, rt._resource_tracker._pid, flush=True)
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"  # dead, not reaped
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_a_killed_saver_leaves_no_manager_and_no_resource_tracker():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in child.stdout.readline().split()]
    assert len(pids) == 2 and child.pid not in pids and not any(_gone(p) for p in pids), pids
    child.kill()  # SIGKILL: no exit handler runs
    child.wait(timeout=60)
    for _ in range(600):
        if all(_gone(p) for p in pids):
            break
        time.sleep(0.1)
    else:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"processes {pids} (manager, resource tracker) outlived the killed saver")
