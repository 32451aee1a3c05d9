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


# An --in-process driver at a save: the reward pool up (forkserver, a worker, the resource
# tracker), megarl's results queue, and a writer forked from the main thread as megatron-core's
# save forks its writers (filesystem_async.write_preloaded_data_multiproc, fork context), caught
# while it runs. Without the parent-death signal such a writer would outlive a kill -9 of the driver
# and hold the pipes that tell the others the driver is gone: all of them would stay.
IN_PROCESS_DRIVER = """
import multiprocessing, time
from megarl.checkpoint import results_queue as rq
from megarl.config.sections import RewardConfig
from megarl.process_signals import forks_die_with_this_process
from megarl.rewards.scorer import RewardScorer

def write():
    time.sleep(300)

scorer = RewardScorer(RewardConfig(workers=1)).__enter__()
assert scorer.score(["gsm8k"], ["#### 7"], ["7"]) is not None
rq.install_results_queue()
with forks_die_with_this_process():  # as megarl/checkpoint/dist_save.py runs megatron's save
    writer = multiprocessing.get_context("fork").Process(target=write)
    writer.start()
print(writer.pid, flush=True)
time.sleep(300)
"""


def test_a_killed_in_process_driver_leaves_no_descendant(tmp_path):
    import psutil

    child = subprocess.Popen([sys.executable, "-c", IN_PROCESS_DRIVER], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    writer = int(child.stdout.readline())
    descendants = psutil.Process(child.pid).children(recursive=True)
    names = {p.pid: " ".join(p.cmdline())[:120] for p in descendants}
    assert writer in names and any("forkserver" in c for c in names.values()) and any("resource_tracker" in c for c in names.values()), names
    child.kill()
    child.wait(timeout=60)
    for _ in range(600):
        left = [pid for pid in names if not _gone(pid)]
        if not left:
            break
        time.sleep(0.1)
    else:
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"these outlived the killed driver: {[names[pid] for pid in left]}")


# A driver at a save, with its run's signal handling (a step in progress: a stop waits for its
# end), and a writer forked as megatron-core forks one. The writer carries the driver's command
# line (`pgrep -f` finds it too), so a stop may reach it alone. It says it runs before the test
# signals it: a signal that arrives while the child is being forked, before its after-fork setup,
# is lost.
DRIVER_WITH_WRITER = """
import multiprocessing, time
from megarl.process_signals import forks_die_with_this_process, forks_pass_stops_on
from megarl.trainer.watchdog import RunControl

def write(running):
    running.set()
    time.sleep(300)

control = RunControl()
with control.handlers():
    control.deferred = True
    forks_pass_stops_on()  # as megarl's CLI does in a supervised driver
    fork = multiprocessing.get_context("fork")
    running = fork.Event()
    with forks_die_with_this_process():  # as megarl/checkpoint/dist_save.py runs megatron's save
        writer = fork.Process(target=write, args=(running,))
        writer.start()
        assert running.wait(60)
    print(writer.pid, flush=True)
    deadline = time.monotonic() + 120
    while not control.stop_requested and time.monotonic() < deadline:
        time.sleep(0.05)
    print(control.signal, writer.is_alive(), flush=True)
    writer.kill()
"""


def test_a_sigterm_to_a_writer_forked_by_the_driver_stops_the_run():
    child = subprocess.Popen([sys.executable, "-c", DRIVER_WITH_WRITER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    writer = int(child.stdout.readline())
    os.kill(writer, signal.SIGTERM)
    out, err = child.communicate(timeout=120)
    assert out.split() == [str(int(signal.SIGTERM)), "True"], (out, err)  # the driver's stop; the writer finishes its part
    assert err.count("SIGTERM received: stopping after this step") == 1, err
