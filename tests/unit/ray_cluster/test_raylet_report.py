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
# The GCS's report of the same death (gcs_node_manager; Ray 2.60's words), for a driver still there when it comes.
MARKED_DEAD = {"lines": ["The node with node id: 7a8628e4ce6d and address: 192.0.2.2 and node name: 192.0.2.2 has been "
                         "marked dead because the detector has missed too many heartbeats from it. This can happen when a "
                         "\t(1) raylet crashes unexpectedly (OOM, etc.) \n\t(2) raylet has lagging heartbeats due to slow "
                         "network or busy workload."], "pid": "raylet", "is_err": False}  # fmt: skip
# The raylet's report of a rank killed on a live node (Ray 2.x's words, abridged).
WORKER_DIED = {"lines": ["A worker died or was killed while executing a task by an unexpected system error. To troubleshoot "
                         "the problem, check the logs for the dead worker. Lease ID: 00000000a89d Worker ID: 21f278bd Node ID: "
                         "34a68784 Worker IP address: 192.0.2.2 Worker port: 43263 Worker PID: 14472 Worker exit type: "
                         "SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error code 2."],
               "pid": "raylet", "is_err": False}  # fmt: skip
OTHER = {"lines": ["Warning: The following resource request cannot be scheduled right now: {'CPU': 8.0}. This is likely "
                   "due to all cluster resources being claimed by actors."], "pid": "raylet", "is_err": False}  # fmt: skip


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
    assert "cannot be scheduled right now" in out  # any other message: as Ray prints it
    [record] = [r for r in caplog.records if r.name == "megarl.ray_cluster.raylet_report"]
    assert record.levelno == logging.WARNING and "[state-dump] DebugString() time ms: 7" in record.getMessage()
    assert not for_the_terminal(record)  # the driver's log file has it; the terminal's handler skips it
    ray_worker.print_to_stdstream(REPORT, ignore_prefix=False)  # outside the session: Ray's printing
    assert "Raylet is terminated" in capsys.readouterr().out


def test_the_gcs_s_word_that_the_node_is_dead_goes_to_the_log_file_only(capsys, caplog):
    with caplog.at_level(logging.WARNING, logger="megarl.ray_cluster.raylet_report"), raylet_reports_to_log():
        ray_worker.print_to_stdstream(MARKED_DEAD, ignore_prefix=False)
    assert "marked dead" not in capsys.readouterr().out
    [record] = [r for r in caplog.records if r.name == "megarl.ray_cluster.raylet_report"]
    assert "has been marked dead because" in record.getMessage() and not for_the_terminal(record)


def test_the_raylet_s_word_on_a_killed_rank_goes_to_the_log_file_only(capsys, caplog, tmp_path):
    """A rank killed -9 (demo, sft, convert, generate): megarl's own line names its death; Ray's
    long line about it goes to the log file (convert's: the file beside its ranks' logs)."""
    with caplog.at_level(logging.WARNING, logger="megarl.ray_cluster.raylet_report"), raylet_reports_to_log():
        ray_worker.print_to_stdstream(WORKER_DIED, ignore_prefix=False)
    assert "A worker died" not in capsys.readouterr().out
    [record] = [r for r in caplog.records if r.name == "megarl.ray_cluster.raylet_report"]
    assert "Worker PID: 14472" in record.getMessage() and not for_the_terminal(record)
    beside = tmp_path / "ray_reports.log"
    with raylet_reports_to_log(beside):
        ray_worker.print_to_stdstream(WORKER_DIED, ignore_prefix=False)
    assert "A worker died" not in capsys.readouterr().out and "Worker PID: 14472" in beside.read_text()


def test_a_command_without_a_log_file_gets_the_report_in_the_file_it_names(capsys, tmp_path):
    """convert and generate's export have no driver.log: the report goes beside their ranks' logs,
    written only when one comes (an empty file would keep a folder that says nothing)."""
    quiet, told = tmp_path / "quiet.log", tmp_path / "ray_reports.log"
    with raylet_reports_to_log(quiet):
        ray_worker.print_to_stdstream(OTHER, ignore_prefix=False)
    assert not quiet.exists()
    with raylet_reports_to_log(told):
        ray_worker.print_to_stdstream(REPORT, ignore_prefix=False)
        ray_worker.print_to_stdstream(MARKED_DEAD, ignore_prefix=False)
    out = capsys.readouterr().out
    assert "Raylet is terminated" not in out and "marked dead" not in out
    text = told.read_text()
    assert "[state-dump] DebugString() time ms: 7" in text and "has been marked dead because" in text
