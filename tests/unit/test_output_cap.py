"""The cap on a log other processes append to (megarl/output_cap.py): cut from outside while they
write, it ends at the cap and one marker line, whatever they appended as it was cut."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from megarl.output_cap import MB, enforce, marker

pytestmark = pytest.mark.timeout(120)

# 16 MB in 4 KB lines, appended without pause (as a reward worker's fds 1 and 2 are: O_APPEND)
WRITER = """
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)
for _ in range(4096):
    os.write(fd, b"w" * 4095 + b"\\n")
"""


@pytest.mark.parametrize("trial", range(4))  # the cut meets their writes at a different point each time
def test_a_log_cut_while_two_processes_append_ends_at_the_cap_and_the_marker(tmp_path, trial):
    """The first cut comes while both writers append: what they appended between the marker and the
    driver's look at the file used to count as kept, at that cut and every later one."""
    log = tmp_path / f"reward_workers_{trial}.log"  # (a path of its own: the cap's state is per path)
    log.touch()
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(log)]) for _ in range(2)]
    try:
        deadline = time.monotonic() + 60
        while log.stat().st_size <= MB and time.monotonic() < deadline:
            pass  # (no sleep: the cut should find them writing)
        enforce(log, 1, "reward functions")  # the first cut, mid-write
    finally:
        assert [w.wait(timeout=60) for w in writers] == [0, 0]
    enforce(log, 1, "reward functions")  # the look after the call
    written = log.read_bytes()
    line = marker("reward functions", 1).encode()
    assert len(written) == MB + len(line), len(written)
    assert written[MB:] == line and set(written[:MB]) == set(b"w\n")
