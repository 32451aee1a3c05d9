"""process_signals.forks_die_with_this_process: the parent-death signal reaches the children
forked inside its block (megatron-core's checkpoint writers), and not a process started later
with ``subprocess.Popen(preexec_fn=...)`` (an SGLang server meant to outlive the driver)."""

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
