"""A raylet's death report (Ray's ~20 lines of its log, printed by the driver's error listener,
once per agent) goes to the command's log file, not the terminal; the listener's other messages
print as Ray prints them. Driven through Ray's own printer, without starting Ray."""

from __future__ import annotations

import logging

import ray._private.worker as ray_worker

from megarl.ray_cluster.raylet_report import raylet_reports_to_log
from megarl.terminal import for_the_terminal

# The shape ray/_private/process_watcher.py publishes (abridged) and listen_error_messages prints.
REPORT = {"lines": ["Raylet is terminated. Termination is unexpected. Possible reasons include: (1) SIGKILL by the "
                    "user or system OOM killer, ... Last 20 lines of the Raylet logs:\n"
                    "    [state-dump] \tNodeManager.deadline_timer.debug_state_dump - 1 total (1 active)\n"
                    "    [state-dump] DebugString() time ms: 7\n"],
          "pid": "raylet", "is_err": False}  # fmt: skip
OTHER = {"lines": ["A worker died or was killed while executing a task by an unexpected system error."],
         "pid": "raylet", "is_err": False}  # fmt: skip


def test_the_listener_looks_the_printer_up_when_it_prints():
    # What the routing rests on: a Ray whose listener bound the printer otherwise would print the report again.
    listener = ray_worker.listen_error_messages
    assert listener.__globals__ is vars(ray_worker) and "print_to_stdstream" in listener.__code__.co_names


def test_a_raylet_death_report_goes_to_the_log_file_only(capsys, caplog):
    original = ray_worker.print_to_stdstream
    with caplog.at_level(logging.WARNING, logger="megarl.ray_cluster.raylet_report"), raylet_reports_to_log():
        ray_worker.print_to_stdstream(REPORT, ignore_prefix=False)
        ray_worker.print_to_stdstream(OTHER, ignore_prefix=False)
    assert ray_worker.print_to_stdstream is original  # Ray's printer again after the session
    out = capsys.readouterr().out
    assert "state-dump" not in out and "Raylet is terminated" not in out
    assert "A worker died or was killed" in out  # any other message: as Ray prints it
    [record] = [r for r in caplog.records if r.name == "megarl.ray_cluster.raylet_report"]
    assert record.levelno == logging.WARNING and "[state-dump] DebugString() time ms: 7" in record.getMessage()
    assert not for_the_terminal(record)  # the driver's log file has it; the terminal's handler skips it
    ray_worker.print_to_stdstream(REPORT, ignore_prefix=False)  # outside the session: Ray's printing
    assert "Raylet is terminated" in capsys.readouterr().out
