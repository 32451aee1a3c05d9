"""WorkerGroup, placement and ray_session on a real local Ray (one session for the module).

The worker classes here are small but real: the rendezvous worker joins a 2-process gloo
group using only the environment WorkerGroup set, so the test fails if RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT are wrong.
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(180)  # a hung rendezvous must not hang CI

from megarl.checkpoint.manager import CheckpointManager  # noqa: E402
from megarl.cli import user_error_line  # noqa: E402
from megarl.ray_cluster.placement import PlacementError, RolePlacement, place_roles, release  # noqa: E402
from megarl.ray_cluster.session import ray_session, save_timeline  # noqa: E402
from megarl.ray_cluster.worker_group import GroupOptions, WorkerError, WorkerGroup  # noqa: E402

# Ray workers cannot import this test module by name: ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
            "MASTER_PORT", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


class RendezvousWorker:
    """Joins a gloo process group from the env vars, like under torchrun."""

    def __init__(self, scale: float, *, tag: str):
        import torch.distributed as dist

        self.scale, self.tag = scale, tag
        dist.init_process_group("gloo", init_method="env://")
        self.rank = dist.get_rank()

    def env(self) -> dict[str, str | None]:
        return {k: os.environ.get(k) for k in ENV_KEYS}

    def all_reduce(self, value: float) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([value * self.scale])
        dist.all_reduce(t)
        return float(t.item())

    def echo(self, *args: object, **kwargs: object) -> tuple:
        return (self.rank, self.tag, args, kwargs)

    def save_shard(self, directory: str) -> None:
        with open(os.path.join(directory, f"shard_{self.rank}.bin"), "wb") as f:
            f.write(bytes([self.rank]) * (self.rank + 1))

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


class FragileWorker:
    """Raises in __init__ on `fail_rank`; can exit hard or raise on request."""

    def __init__(self, fail_rank: int | None = None):
        self.rank = int(os.environ["RANK"])
        print(f"fragile rank {self.rank} starting", flush=True)
        if self.rank == fail_rank:
            raise ValueError(f"bad setting on rank {self.rank}")

    def env(self) -> dict[str, str | None]:
        return {k: os.environ.get(k) for k in ENV_KEYS}

    def die(self, rank: int) -> str:
        if self.rank == rank:
            print(f"rank {self.rank} about to exit hard", flush=True)
            os._exit(7)
        return "alive"

    def boom(self) -> None:
        raise KeyError("missing-key-xyz")

    def broken_invariant(self) -> None:
        raise AssertionError()  # what a failed bare `assert` raises (pytest would add a message to one here)

    def unpicklable(self) -> None:
        raise _TwoArgError("http://engine:1", "unreachable")


class _TwoArgError(RuntimeError):
    """An exception pickle cannot rebuild (its __init__ wants more than the message)."""

    def __init__(self, url: str, detail: str):
        super().__init__(f"{url}: {detail}")


@pytest.fixture(scope="module")
def session():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # 2 pretend GPUs: Ray schedules them as resources, so GPU placement logic runs on CPU.
    with ray_session(num_cpus=4, num_gpus=2, log_to_driver=False) as s:
        yield s


def test_session_and_rendezvous(session, tmp_path):
    assert session.started_here and session.resources["CPU"] == 4
    opts = GroupOptions(log_dir=tmp_path)
    with WorkerGroup(RendezvousWorker, RolePlacement("policy", 1, 2, 0, 0.5), 3.0,
                     group_options=opts, tag="t") as group:
        envs = group.call(RendezvousWorker.env)
        assert [e["RANK"] for e in envs] == ["0", "1"]
        assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
        assert all(e["WORLD_SIZE"] == "2" and e["LOCAL_WORLD_SIZE"] == "2" for e in envs)
        assert all(e["OMP_NUM_THREADS"] == "1" and e["NODE_RANK"] == "0" for e in envs)
        assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] != ""
        # gloo all_reduce across the two actors: (1 + 2) * scale on both ranks
        assert group.call_each(RendezvousWorker.all_reduce, [(1.0,), {"value": 2.0}]) == [9.0, 9.0]
        assert group.call(RendezvousWorker.echo, 5, k="v") == [(0, "t", (5,), {"k": "v"}), (1, "t", (5,), {"k": "v"})]
        assert group.call_each(RendezvousWorker.echo, ["a", ("b", "c")]) == [(0, "t", ("a",), {}), (1, "t", ("b", "c"), {})]
        # shared arguments stored once, then each rank's own part last (a replica's routing share)
        assert group.call_split(RendezvousWorker.echo, (1, "x"), ["r0", "r1"]) == [(0, "t", (1, "x", "r0"), {}),
                                                                                   (1, "t", (1, "x", "r1"), {})]  # fmt: skip
        with pytest.raises(ValueError, match="1 parts for 2 ranks"):
            group.call_split(RendezvousWorker.echo, (), ["only"])
        pending = group.call_async(RendezvousWorker.echo, 7)
        assert [r[0] for r in pending.get()] == [0, 1]
        with pytest.raises(ValueError, match="got 1 argument sets for 2 ranks"):
            group.call_each(RendezvousWorker.echo, [()])
        with pytest.raises(AttributeError, match="RendezvousWorker has no method 'die'"):  # another class's
            group.call(FragileWorker.die, 0)
        # A checkpoint written by the workers from their own processes, committed by the driver.
        manager = CheckpointManager(tmp_path / "run")
        with manager.saving(3) as ckpt_dir:
            (ckpt_dir / "policy").mkdir()
            group.call(RendezvousWorker.save_shard, str(ckpt_dir / "policy"))
        ckpt = manager.resolve_resume("auto")
        assert ckpt.step == 3 and (ckpt.component("policy") / "shard_1.bin").read_bytes() == b"\x01\x01"
        group.call(RendezvousWorker.close)
        assert (tmp_path / "policy_rank1.log").exists()
    with pytest.raises(RuntimeError, match="shut down"):
        group.call(RendezvousWorker.env)
    trace = save_timeline(tmp_path / "timeline.json")
    assert len(json.loads(trace.read_text())) > 0


def test_session_reuse_and_bad_arguments(session):
    with ray_session() as inner:  # already initialised: reused, left running
        assert not inner.started_here
    assert ray.is_initialized()
    with pytest.raises(ValueError, match="num_cpus/num_gpus only apply to a local Ray"):
        with ray_session("auto", num_cpus=2):
            pass


def test_raise_in_init_names_rank_and_log(session, tmp_path):
    with pytest.raises(WorkerError) as info:
        WorkerGroup(FragileWorker, RolePlacement("critic", 1, 2, 0, 0.5), fail_rank=1,
                    group_options=GroupOptions(log_dir=tmp_path))
    msg = str(info.value)
    assert info.value.rank == 1 and info.value.role == "critic"
    assert "critic rank 1" in msg and "FragileWorker.__init__" in msg
    assert "ValueError" in msg and "bad setting on rank 1" in msg
    assert "fragile rank 1 starting" in msg and "Traceback" in msg  # the log tail
    assert "fragile rank 0 starting" not in msg  # rank 1's log, not rank 0's


def test_dead_and_raising_worker(session, tmp_path):
    (tmp_path / "policy_rank1.log").write_text("old run: not this group\n")
    with WorkerGroup(FragileWorker, RolePlacement("policy", 1, 2, 0, 0.5),
                     group_options=GroupOptions(log_dir=tmp_path)) as group:
        with pytest.raises(WorkerError, match=r"policy rank [01] .*raised KeyError in FragileWorker.boom") as info:
            group.call(FragileWorker.boom)
        assert "missing-key-xyz" in str(info.value)
        assert user_error_line(info.value).startswith("policy rank")  # one line: it may come from the user's inputs
        with pytest.raises(WorkerError) as info:
            group.call(FragileWorker.broken_invariant)
        assert isinstance(info.value.cause, AssertionError) and user_error_line(info.value) is None  # a bug
        assert re.search(r"raised AssertionError in FragileWorker.broken_invariant: \(no message\) at \S+"
                         r"test_worker_group.py:\d+ in broken_invariant \(log: ", info.value.summary), info.value.summary
        # Ray could not unpickle it on the driver: a traceback of Ray's UnserializableException
        with pytest.raises(WorkerError) as info:
            group.call(FragileWorker.unpicklable)
        assert re.search(r"policy rank [01] .*raised in FragileWorker.unpicklable \(an exception Ray could not unpickle\): "
                         r"\S*_TwoArgError: http://engine:1: unreachable \(log: ", info.value.summary), info.value.summary
        with pytest.raises(WorkerError) as info:
            group.call(FragileWorker.die, 1)
        msg = str(info.value)
        assert info.value.rank == 1 and "policy rank 1" in msg and "died during FragileWorker.die" in msg
        assert "rank 1 about to exit hard" in msg and "old run" not in msg
        assert "died (" not in info.value.summary  # its node is alive and its raylet answers: no node's death


def test_colocated_roles_share_gpus(session, tmp_path):
    shape = dict(nnodes=1, procs_per_node=2, gpus_per_proc=1, cpus_per_proc=0.25)
    placed = place_roles([RolePlacement("policy", **shape), RolePlacement("rollout", **shape)],
                         colocate=[("policy", "rollout")], timeout_s=30)
    assert placed["policy"].pool is placed["rollout"].pool and placed["policy"].num_gpus == 0.5
    opts = GroupOptions(log_dir=tmp_path)
    try:
        with WorkerGroup(FragileWorker, placed["policy"], group_options=opts) as policy, \
             WorkerGroup(FragileWorker, placed["rollout"], group_options=opts) as rollout:
            for group in (policy, rollout):
                envs = group.call(FragileWorker.env)
                for rank, env in enumerate(envs):
                    own = group.node_infos[rank]["gpu_ids"]
                    assert len(own) == 1
                    visible = env["CUDA_VISIBLE_DEVICES"].split(",")
                    assert sorted(visible) == ["0", "1"]
                    assert visible[int(env["LOCAL_RANK"])] == own[0]  # set_device(LOCAL_RANK) is its GPU
                    assert env["OMP_NUM_THREADS"] is not None
            # rank r of both roles shares one GPU
            assert [i["gpu_ids"] for i in policy.node_infos] == [i["gpu_ids"] for i in rollout.node_infos]
    finally:
        release(placed)


def test_placement_errors(session):
    with pytest.raises(PlacementError, match="8 CPUs requested for policy, cluster has 4"):
        place_roles([RolePlacement("policy", 1, 8, 0, 1)])
    with pytest.raises(PlacementError, match="32 GPUs requested for policy, cluster has 2"):
        place_roles([RolePlacement("policy", 4, 8, 1, 0.1)])
    with pytest.raises(PlacementError, match=r"5 CPUs requested in all \(policy 4, critic 1\), cluster has 4"):
        place_roles([RolePlacement("policy", 1, 2, 0, 2), RolePlacement("critic", 1, 1, 0, 1)])
    with pytest.raises(PlacementError, match="colocated roles must have the same shape"):
        place_roles([RolePlacement("policy", 1, 2, 1, 0.1), RolePlacement("rollout", 1, 1, 1, 0.1)],
                    colocate=[("policy", "rollout")])
    # Possible in principle, but another placement group holds the CPUs: fails after the timeout.
    # (Placing `held` also proves the earlier tests' groups gave their bundles back.)
    held = place_roles([RolePlacement("other", 1, 1, 0, 3.5)], timeout_s=30)
    try:
        with pytest.raises(PlacementError, match=r"node-group 0 of critic .*not placed within 1 s"):
            place_roles([RolePlacement("critic", 1, 2, 0, 1)], timeout_s=1)
    finally:
        release(held)
