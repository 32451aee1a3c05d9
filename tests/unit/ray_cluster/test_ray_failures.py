"""Ray's own failures named in one line with the node and what to check (a dead node or raylet, the
memory monitor, a full object store), told apart from a process's own crash. Fed Ray's real
exception objects and recorded texts; the cluster's view of a node is Ray's ``nodes()`` answer
(a stand-in module here: no Ray cluster starts) and a real TCP probe of the raylet's port."""

from __future__ import annotations

import sys
import time
import types

import pytest
from ray.core.generated.common_pb2 import ActorDiedErrorContext
from ray.exceptions import ActorDiedError, ObjectStoreFullError, OutOfMemoryError

from megarl.ray_cluster.ray_failures import NodeView, node_view, ray_failure

NODE = "5f3c0a9e1b2d4c6e8f00112233445566778899aabbccddeeff001122"


def died(message: str, ip: str = "10.0.0.7") -> ActorDiedError:
    """What a call into an actor raises when Ray tells its death, as Ray builds it."""
    return ActorDiedError(ActorDiedErrorContext(error_message=message, node_ip_address=ip, class_name="PolicyRank",
                                                actor_id=b"\x01" * 16, pid=42))  # fmt: skip


def test_a_node_that_died_is_named_with_what_to_check():
    line = ray_failure(died(f"The actor died because its node has died. Node Id: {NODE}"))
    assert line is not None and line.startswith("its node 10.0.0.7 (id 5f3c0a9e1b2d) died (Ray reports it dead)")
    assert "dmesg" in line and "`ray status`" in line and "ray logs raylet.out --ip 10.0.0.7" in line and "\n" not in line
    # A task's version of it (recorded text of ray.exceptions.NodeDiedError), with the IP in Ray's words
    text = ("ray.exceptions.NodeDiedError: Task failed because the node it was running on is dead or unavailable. "
            f"Node IP: 10.0.0.9, node ID: {NODE}. This can happen if the node was preempted")  # fmt: skip
    assert (ray_failure(text) or "").startswith("its node 10.0.0.9 (id 5f3c0a9e1b2d) died")


def test_a_killed_raylet_is_told_by_the_clusters_view_where_ray_says_only_socket_closed():
    """The issue's case: "died during PolicyRank.__init__ ... Socket closed", no word of the node."""
    exc = died("Worker exits unexpectedly. Socket closed")
    assert ray_failure(exc) is None  # the text alone: nothing of the node (a process's crash looks the same)
    assert ray_failure(exc, NODE, "10.0.0.7", NodeView(NODE, "10.0.0.7", True, None)) is None  # node fine: a crash
    silent = ray_failure(exc, NODE, "10.0.0.7", NodeView(NODE, "10.0.0.7", True, "Connection refused"))
    assert silent is not None and silent.startswith("its node 10.0.0.7 (id 5f3c0a9e1b2d) died (its raylet does not answer (Connection refused))")
    dead = ray_failure(exc, NODE, "10.0.0.7", NodeView(NODE, "10.0.0.7", False, None))
    assert dead is not None and "died (Ray marked it dead)" in dead


def test_the_memory_monitor_and_a_full_object_store():
    text = ("ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.\n"
            f"Memory on the node (IP: 10.0.0.3, ID: {NODE}) was 30.12GB used / 31.35GB limit (0.960779), which exceeds "
            "the memory usage threshold of 0.95.")  # fmt: skip
    for exc in (text, OutOfMemoryError(text.split(": ", 1)[1])):
        line = ray_failure(exc)
        assert line is not None and line.startswith("Ray's memory monitor killed it: node 10.0.0.3 (id 5f3c0a9e1b2d) ran low")
        assert "(30.12 of 31.35 GB used)" in line and "RAY_memory_usage_threshold" in line
    full = ray_failure(ObjectStoreFullError("Failed to put object ffff in object store because it is full. Object size is 100 bytes."))
    assert full is not None and full.startswith("the Ray object store of node ? is full") and "`ray memory`" in full


def test_a_processs_own_errors_are_not_rays():
    cuda_oom = type("OutOfMemoryError", (RuntimeError,), {"__module__": "torch"})("CUDA out of memory. Tried to allocate 2 GiB")
    assert ray_failure(cuda_oom) is None  # torch's, on the GPU: the rank's log tells it
    assert ray_failure(RuntimeError("the disk is full because it is full")) is None
    assert ray_failure(died("Worker exits unexpectedly by a signal. SIGSEGV")) is None


def test_the_clusters_view_of_a_node(monkeypatch, refused_port):
    port = refused_port  # a port nothing listens at: a raylet that is gone
    nodes = [{"NodeID": NODE, "Alive": True, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": port}]
    fake = types.SimpleNamespace(is_initialized=lambda: True, nodes=lambda: nodes)
    monkeypatch.setitem(sys.modules, "ray", fake)
    view = node_view(NODE)
    assert view is not None and view.alive is True and view.ip == "127.0.0.1" and view.raylet_silent is not None
    assert node_view("another") is None and node_view(None) is None
    monkeypatch.setattr(fake, "nodes", lambda: (_ for _ in ()).throw(ConnectionError("GCS gone")))
    assert node_view(NODE) is None  # no view: the text alone decides
    monkeypatch.setattr(fake, "is_initialized", lambda: False)
    assert node_view(NODE) is None


def test_the_cli_tells_rays_failure_in_the_driver_in_one_line(capsys):
    from megarl.cli import EXIT_USER, report

    code = report(ObjectStoreFullError("Failed to put object ffff in object store because it is full."))
    err = capsys.readouterr().err
    assert code == EXIT_USER and err.startswith("error: a Ray call of the driver failed: the Ray object store") and err.count("\n") == 1


def test_a_node_of_an_embedded_ray_points_at_its_raylet_log_not_ray_status(monkeypatch, tmp_path):
    """Ray embedded in the run (its raylet this process's child): once its node is dead there is no
    cluster left for `ray status` to ask; the line names the raylet log megarl prints."""
    node = types.SimpleNamespace(all_processes={"raylet": [object()]}, get_logs_dir_path=lambda: str(tmp_path))
    fake = types.SimpleNamespace(is_initialized=lambda: True, _private=types.SimpleNamespace(
        worker=types.SimpleNamespace(global_worker=types.SimpleNamespace(node=node)),
        ray_constants=types.SimpleNamespace(PROCESS_TYPE_RAYLET="raylet")))  # fmt: skip
    monkeypatch.setitem(sys.modules, "ray", fake)
    line = ray_failure(died(f"The actor died because its node has died. Node Id: {NODE}"))
    assert line is not None and line.startswith("its node 10.0.0.7 (id 5f3c0a9e1b2d) died (Ray reports it dead)")
    assert "ray status" not in line and "ray logs" not in line and f"{tmp_path}/raylet.out" in line
    node.all_processes = {}  # attached to a cluster: its raylets are not this process's
    assert "`ray status`" in (ray_failure(died(f"The actor died because its node has died. Node Id: {NODE}")) or "")


def test_an_embedded_raylet_dead_as_ray_starts_is_refused_as_the_node_s_death(tmp_path):
    """The raylet killed right after Ray started: the driver says so before it imports user code
    (whose later death it would otherwise seem to be). A real child process stands for the raylet."""
    import signal
    import subprocess

    from megarl.ray_cluster.session import raylet_end_problem

    raylet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        assert raylet_end_problem(raylet, str(tmp_path)) is None  # running: nothing to say
    finally:
        raylet.send_signal(signal.SIGKILL)
        raylet.wait(timeout=60)
    line = raylet_end_problem(raylet, str(tmp_path)) or ""
    assert line.startswith(f"the Ray node under the run died as Ray started: its raylet (pid {raylet.pid}) was killed by SIGKILL")
    assert f"{tmp_path}/raylet.out" in line and "dmesg" in line and "\n" not in line


def test_a_raylet_killed_by_a_real_time_signal_is_named_as_kill_l_names_it(tmp_path):
    """Python's signal.Signals has no name for SIGRTMIN+2 (it raised ValueError); read both ways:
    from the reaped process and, unreaped, from waitid."""
    import signal
    import subprocess

    from megarl.ray_cluster.session import _how_it_ended, raylet_end_problem

    raylet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    raylet.send_signal(signal.SIGRTMIN + 2)
    for _ in range(600):  # dead, not reaped
        if open(f"/proc/{raylet.pid}/stat").read().rpartition(")")[2].split()[0] == "Z":
            break
        time.sleep(0.1)
    assert _how_it_ended(raylet.pid) == "was killed by SIGRTMIN+2"
    raylet.wait(timeout=60)
    assert f"its raylet (pid {raylet.pid}) was killed by SIGRTMIN+2;" in (raylet_end_problem(raylet, str(tmp_path)) or "")


@pytest.mark.parametrize("gcs", [True, False], ids=["gcs-names-the-session", "nothing-names-it"])
def test_a_raylet_dead_as_ray_init_waits_names_this_run_s_session_not_session_latest(tmp_path, gcs):
    """The raylet killed while ray.init waits for it (a zombie child: its exit code read without
    reaping it, no command line left): the line names the session folder from a live Ray process's command line (the GCS's
    --session-dir), else this run's folder under /tmp/ray, never session_latest (another run's on
    a shared machine). Real child processes stand for the raylet (named so) and the GCS."""
    import subprocess
    import time
    from pathlib import Path

    from megarl.ray_cluster.session import _dead_raylet, _descendants

    before = _descendants()
    raylet = subprocess.Popen([sys.executable, "-c", "import ctypes, os; ctypes.CDLL(None).prctl(15, b'raylet'); os._exit(0)"])
    session = tmp_path / "session_2026-11-29_20-33-14_1"
    others = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", f"--session-dir={session}"])] if gcs else []
    try:
        for _ in range(600):  # exited, not reaped: a zombie, as a killed raylet is until Ray's shutdown
            if Path(f"/proc/{raylet.pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z":
                break
            time.sleep(0.05)
        line = _dead_raylet(before) or ""
    finally:
        for other in others:
            other.kill()
            other.wait(timeout=60)
        raylet.wait(timeout=60)
    assert line.startswith(f"the Ray node under the run died as Ray started: its raylet (pid {raylet.pid}) exited with code 0"), line
    assert "session_latest/logs by default" not in line
    if gcs:
        assert f"{session}/logs/raylet.out and raylet.err" in line, line
    else:
        assert "this run's session folder under /tmp/ray" in line and "not session_latest when other Ray runs" in line, line
