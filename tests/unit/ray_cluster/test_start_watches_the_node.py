"""A group's start-up waits (megarl/ray_cluster/worker_group.py), and before them the wait for the
placement groups (megarl/ray_cluster/placement.py), look at the embedded raylet every few
seconds: a raylet killed right after Ray started leaves the placement groups and the ranks'
actors pending until a deadline, and the driver's core worker may not notice. No Ray starts
here: a real child process stands for the raylet, in a stand-in for Ray's node record (what
megarl/ray_cluster/session.py reads), and Ray's ``wait`` is a stand-in that finds nothing ready."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import types

import pytest

from megarl.ray_cluster import placement, session


@pytest.fixture
def raylet(monkeypatch, tmp_path):
    """A stand-in raylet (this process's child, as an embedded raylet is the driver's) recorded
    where Ray records it; ray.wait finds nothing ready and takes its timeout."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    node = types.SimpleNamespace(all_processes={"raylet": [types.SimpleNamespace(process=process)]},
                                 get_logs_dir_path=lambda: str(tmp_path))  # fmt: skip
    waits: list[float | None] = []

    def wait(refs, num_returns=1, timeout=None):
        assert timeout is not None, "a start-up wait with no deadline would never look at the raylet"
        waits.append(timeout)
        time.sleep(min(timeout, 0.05))
        return [], refs

    fake = types.SimpleNamespace(wait=wait, _private=types.SimpleNamespace(
        worker=types.SimpleNamespace(global_worker=types.SimpleNamespace(node=node)),
        ray_constants=types.SimpleNamespace(PROCESS_TYPE_RAYLET="raylet")))  # fmt: skip
    monkeypatch.setattr(session, "ray", fake)
    monkeypatch.setattr(session, "NODE_CHECK_S", 0.05)
    yield process, waits
    if process.poll() is None:
        process.kill()
        process.wait(timeout=60)


def test_a_raylet_dead_during_start_up_ends_the_wait_with_the_node_s_line(raylet, tmp_path):
    process, waits = raylet
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    with pytest.raises(ConnectionError) as err:
        session.wait_watching_the_node(["ref"], None, watch_node=True)  # no deadline: only the check ends it
    line = str(err.value)
    assert line.startswith(f"the Ray node under the run died while the ranks started: its raylet (pid {process.pid}) "
                           "was killed by SIGKILL; check this machine"), line  # fmt: skip
    assert f"{tmp_path}/raylet.out" in line and "\n" not in line
    assert waits == [0.05]


def test_a_live_raylet_lets_the_wait_run_to_its_deadline(raylet):
    process, waits = raylet
    assert session.wait_watching_the_node(["ref"], time.monotonic() + 0.3, watch_node=True) == []
    assert len(waits) >= 2 and all(w <= 0.05 for w in waits)  # looked at the raylet between slices
    assert process.poll() is None


def test_only_start_up_waits_look_at_the_raylet(raylet):
    """A wait not watching the node (a step's call) waits for its deadline in one, whatever the raylet."""
    process, waits = raylet
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert session.wait_watching_the_node(["ref"], time.monotonic() + 0.2, watch_node=False) == []
    assert len(waits) >= 1 and waits[0] > 0.05


def test_an_attached_driver_has_no_raylet_of_its_own_to_check(monkeypatch):
    """Attached to a cluster (--address), Ray's node record lists no raylet of this process."""
    node = types.SimpleNamespace(all_processes={}, get_logs_dir_path=lambda: "/nowhere")
    fake = types.SimpleNamespace(_private=types.SimpleNamespace(
        worker=types.SimpleNamespace(global_worker=types.SimpleNamespace(node=node)),
        ray_constants=types.SimpleNamespace(PROCESS_TYPE_RAYLET="raylet")))  # fmt: skip
    monkeypatch.setattr(session, "ray", fake)
    assert session.embedded_node_death() is None


class _Group:
    """A placement group Ray never places (its node is gone, or others hold the resources)."""

    bundle_specs = [{"CPU": 1.0}]

    def ready(self):
        return "never ready"


def _pools(nnodes: int = 2) -> list:
    return [types.SimpleNamespace(roles=("policy", "rollout"), shape=types.SimpleNamespace(procs_per_node=2),
                                  groups=[_Group() for _ in range(nnodes)])]  # fmt: skip


def test_the_placement_wait_ends_with_the_node_s_line_when_the_raylet_is_dead(raylet, tmp_path):
    """The demo's raylet killed just after Ray started: the wait for the placement groups (before
    any rank starts) ends with the node's line, not at its deadline (place_timeout_s)."""
    process, waits = raylet
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    with pytest.raises(ConnectionError) as err:
        placement._wait_ready(_pools(), timeout_s=3600)
    line = str(err.value)
    assert line.startswith(f"the Ray node under the run died while Ray placed the workers: its raylet (pid {process.pid}) "
                           "was killed by SIGKILL; check this machine"), line  # fmt: skip
    assert waits == [0.05]  # one slice: the raylet was looked at after it, not after the hour


def test_a_placement_not_made_by_its_deadline_under_a_live_raylet_is_still_refused(raylet, monkeypatch):
    process, waits = raylet
    monkeypatch.setattr(placement, "ray", types.SimpleNamespace(available_resources=lambda: {"CPU": 0.0}))
    with pytest.raises(placement.PlacementError, match=r"^placement: node-group 0 of policy\+rollout \(2 bundles of "
                                                       r"\{CPU: 1\}, STRICT_PACK\) was not placed within 0.3 s"):  # fmt: skip
        placement._wait_ready(_pools(), timeout_s=0.3)
    assert len(waits) >= 2 and all(w <= 0.05 for w in waits)  # looked at the raylet between slices
    assert process.poll() is None
