"""Worker failures and hangs on a real local Ray: a dead rank's error quotes the cause from its
log; every rank writes its Python stacks on request; the hang watchdog names the phase and the
ranks that did not answer, and stops the run (one Ray session for the module)."""

from __future__ import annotations

import os
import sys
import time

import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(300)

from megarl.progress import PhaseTimer  # noqa: E402
from megarl.ray_cluster.placement import RolePlacement  # noqa: E402
from megarl.ray_cluster.session import ray_session  # noqa: E402
from megarl.ray_cluster.worker_group import GroupOptions, WorkerError, WorkerGroup  # noqa: E402
from megarl.trainer.watchdog import RunControl, Watchdog  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class NappingWorker:
    def __init__(self) -> None:
        self.rank = int(os.environ["RANK"])

    def nap(self, seconds: float, ranks: tuple[int, ...] = (0, 1)) -> int:
        if self.rank in ranks:
            time.sleep(seconds)
        return self.rank

    def fail_hard(self, rank: int) -> int:
        if self.rank == rank:
            print(f"rank {self.rank}: RuntimeError: CUDA out of memory (pretend) while allocating 2 GiB", flush=True)
            os._exit(9)
        return self.rank


@pytest.fixture(scope="module")
def session():
    with ray_session(num_cpus=3, log_to_driver=False) as s:
        yield s


def group(tmp_path) -> WorkerGroup:
    return WorkerGroup(NappingWorker, RolePlacement("policy", 1, 2), group_options=GroupOptions(log_dir=tmp_path))


def test_a_dead_rank_is_one_line_quoting_its_log(session, tmp_path):
    with group(tmp_path) as g, pytest.raises(WorkerError) as info:
        g.call(NappingWorker.fail_hard, 1)
    summary = info.value.summary
    assert "\n" not in summary and summary.startswith("policy rank ")
    assert "died during NappingWorker.fail_hard: rank 1: RuntimeError: CUDA out of memory (pretend)" in summary
    assert f"(log: {tmp_path}" in summary
    assert "not readable here" not in str(info.value)  # one machine: the log is here


def test_an_unwritable_log_dir_fails_before_any_rank_starts(session, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError) as info:
        WorkerGroup(NappingWorker, RolePlacement("policy", 1, 2), group_options=GroupOptions(log_dir=tmp_path / "file" / "logs"))
    assert info.value.filename is not None  # reported by the CLI as one line naming the path


def test_every_rank_writes_its_stacks_and_pending_calls_name_the_silent_ranks(session, tmp_path):
    import threading

    with group(tmp_path) as g:
        results: list = []
        pending = g.call_async(NappingWorker.nap, 8.0, (1,))
        waiter = threading.Thread(target=lambda: results.append(pending.get()), daemon=True)  # as the trainer waits
        waiter.start()
        deadline = time.monotonic() + 60
        while g.pending_calls() != [("NappingWorker.nap", [1])] and time.monotonic() < deadline:
            time.sleep(0.1)  # rank 0 answers at once, rank 1 naps
        assert g.pending_calls() == [("NappingWorker.nap", [1])]
        # On a loaded machine rank 1 may not have started the call yet: dump again until it naps.
        while True:
            assert g.dump_stacks() == {0: True, 1: True}
            rank1 = (tmp_path / "policy_rank1.log").read_text()
            if "in nap" in rank1 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert "most recent call first" in rank1 and "in nap" in rank1  # where it is stuck
        waiter.join(timeout=60)
        assert results == [[0, 1]] and g.pending_calls() == []


def test_the_watchdog_stops_a_hung_phase_naming_the_ranks(session, tmp_path):
    control = RunControl()
    with group(tmp_path) as g, control.handlers():
        timer = PhaseTimer()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt), Watchdog(control, 2.0, {"policy": g}, tmp_path):
            with timer.phase("policy_update"):
                g.call(NappingWorker.nap, 60.0)
        assert time.monotonic() - start < 30
    message = control.hang
    assert message is not None and "no progress for" in message and "in phase 'policy_update'" in message
    assert "policy rank(s) [0, 1] did not answer NappingWorker.nap" in message
    assert "every rank wrote its Python stacks" in message and "raise trainer.hang_timeout_s" in message
    assert "most recent call first" in (tmp_path / "driver_stacks.log").read_text()
    for rank in (0, 1):
        assert "in nap" in (tmp_path / f"policy_rank{rank}.log").read_text()
