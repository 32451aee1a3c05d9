"""process_signals.forks_die_with_this_process: the parent-death signal reaches the children
forked inside its block (megatron-core's checkpoint writers, in a real save), and not a process
started after it with ``subprocess.Popen(preexec_fn=...)`` (an SGLang server meant to outlive the
driver)."""

import json
import subprocess
import sys

# PR_GET_PDEATHSIG (2) in a fork-context child inside the block, and in a Popen'd program with a
# preexec_fn after it (the parent-death signal survives exec, so that program reads its own).
SCRIPT = r"""
import ctypes, json, multiprocessing, subprocess, sys
from megarl.process_signals import forks_die_with_this_process

READ = "import ctypes; s = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(s)); print(s.value)"

def writer(out):
    s = ctypes.c_int()
    ctypes.CDLL(None).prctl(2, ctypes.byref(s))
    out.put(s.value)

def popen():
    return int(subprocess.run([sys.executable, "-c", READ], preexec_fn=lambda: None, capture_output=True, text=True, check=True).stdout)

fork = multiprocessing.get_context("fork")
before = popen()
with forks_die_with_this_process():
    out = fork.Queue()
    child = fork.Process(target=writer, args=(out,))
    child.start()
    in_block = out.get(timeout=60)
    child.join(60)
after = popen()
print(json.dumps({"popen_before": before, "writer": in_block, "popen_after": after}))
"""


def test_only_forks_inside_the_block_get_the_parent_death_signal():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"popen_before": 0, "writer": 9, "popen_after": 0}, done.stdout


# megatron-core's real torch_dist save, as megarl runs it (megarl/checkpoint/dist_save.py), on
# CPU: each process it forks records its parent-death signal (a hook registered after megarl's,
# so it runs after it in the child); then a Popen with a preexec_fn reads its own.
SAVE = r"""
import ctypes, json, os, subprocess, sys
import torch, torch.distributed as dist
from megatron.core.dist_checkpointing import ShardedTensor
from megarl.checkpoint.dist_save import save_dist_checkpoint
from megarl.parallel.cpu_compat import enable_cpu_compat
from megarl.process_signals import forks_die_with_this_process

READ = "import ctypes; s = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(s)); print(s.value)"
out_dir, port = sys.argv[1], sys.argv[2]
enable_cpu_compat()
with forks_die_with_this_process():  # megarl's hook registered first
    pass

def record():
    s = ctypes.c_int()
    ctypes.CDLL(None).prctl(2, ctypes.byref(s))
    with open(os.path.join(out_dir, f"fork-{os.getpid()}"), "w") as f:
        f.write(str(s.value))

os.register_at_fork(after_in_child=record)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=0, world_size=1)
os.makedirs(os.path.join(out_dir, "ckpt"))
save_dist_checkpoint({"w": ShardedTensor.from_rank_offsets("w", torch.arange(16.0))}, os.path.join(out_dir, "ckpt"))
dist.destroy_process_group()
writers = [int(open(os.path.join(out_dir, n)).read()) for n in os.listdir(out_dir) if n.startswith("fork-")]
after = int(subprocess.run([sys.executable, "-c", READ], preexec_fn=lambda: None, capture_output=True, text=True, check=True).stdout)
print(json.dumps({"writers": writers, "popen_after": after}))
"""


def test_megatron_s_checkpoint_writers_get_the_parent_death_signal_and_a_later_popen_does_not(tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = subprocess.run([sys.executable, "-c", SAVE, str(tmp_path), str(port)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["writers"] and set(result["writers"]) == {9}, result  # SIGKILL in each process the save forked
    assert result["popen_after"] == 0, result


# A driver (forks_pass_stops_on) with its stop handlers up forks a writer inside the block; a
# SIGALRM to the writer (and one more, as a timer repeats it) reaches the driver as its stop,
# and the writer goes on to its end (exit 0) instead of announcing or raising a stop of its own.
PASS_ON = r"""
import json, multiprocessing, os, signal, sys, time
from megarl.process_signals import forks_die_with_this_process, forks_pass_stops_on
from megarl.trainer.watchdog import RunControl

def writer(ready):
    ready.set()
    time.sleep(3)  # (the write)

forks_pass_stops_on()
fork = multiprocessing.get_context("fork")
control = RunControl()
with control.handlers():
    control.deferred = True
    with forks_die_with_this_process():
        ready = fork.Event()
        child = fork.Process(target=writer, args=(ready,))
        child.start()
        ready.wait(60)
        for _ in range(2):
            os.kill(child.pid, signal.SIGALRM)
            time.sleep(0.5)
        child.join(60)
print(json.dumps({"stop": control.signal, "writer": child.exitcode}))
"""


def test_a_stop_sent_to_a_driver_s_forked_writer_is_the_driver_s():
    import signal

    done = subprocess.run([sys.executable, "-c", PASS_ON], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"stop": signal.SIGALRM, "writer": 0}, done.stdout
    assert done.stderr.count("SIGALRM received: stopping after this step") == 1, done.stderr  # the driver's line alone
