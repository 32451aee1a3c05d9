"""What a worker group tells each rank through its environment (WorkerGroup.rank_envs), from
where Ray placed the ranks: no Ray cluster needed, the node infos are given."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("ray")

from megarl.ray_cluster.placement import RolePlacement  # noqa: E402
from megarl.ray_cluster.worker_group import GroupOptions, WorkerGroup  # noqa: E402


def rank_envs(infos: list[dict], gpus_per_proc: float = 1.0, options: GroupOptions | None = None) -> list[dict[str, str]]:
    """WorkerGroup.rank_envs of a group whose ranks landed as ``infos`` say."""
    group = SimpleNamespace(
        placed=SimpleNamespace(placement=RolePlacement("policy", 1, len(infos), gpus_per_proc=gpus_per_proc)),
        world_size=len(infos), role="policy", options=options or GroupOptions(),
        log_paths=[Path(f"/logs/policy_rank{r}.log") for r in range(len(infos))],
    )  # fmt: skip
    return WorkerGroup.rank_envs(group, infos, "10.0.0.1", 29500)  # type: ignore[arg-type]


def test_uuid_gpu_ids_become_the_nodes_cuda_visible_devices():
    """Ray reports GPU ids as UUIDs when the node's CUDA_VISIBLE_DEVICES holds UUIDs."""
    uuids = ["GPU-5f3e9a7c-0d1e-4b2f-9c3d-000000000000", "GPU-7a21c0de-1111-4b2f-9c3d-000000000001"]
    infos = [{"node_id": "n0", "ip": "10.0.0.1", "gpu_ids": [u]} for u in uuids]
    envs = rank_envs(infos)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == [",".join(uuids)] * 2
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]


def test_every_rank_gets_the_runs_one_nccl_cumem_value(monkeypatch):
    """SGLang's servers run with NCCL_CUMEM_ENABLE=0 unless it is set; the policy ranks get the
    same explicit value, or the user's on both sides (the server spec reads it the same way)."""
    from megarl.ray_cluster.rank_env import NCCL_CUMEM_ENV, nccl_cumem_enable

    infos = [{"node_id": "n0", "ip": "10.0.0.1", "gpu_ids": [str(g)]} for g in range(2)]
    monkeypatch.delenv(NCCL_CUMEM_ENV, raising=False)
    assert [e["NCCL_CUMEM_ENABLE"] for e in rank_envs(infos)] == ["0", "0"]
    assert nccl_cumem_enable() == "0"
    monkeypatch.setenv(NCCL_CUMEM_ENV, "1")  # the user's, exported where megarl launch runs
    assert [e["NCCL_CUMEM_ENABLE"] for e in rank_envs(infos)] == ["1", "1"]
    assert nccl_cumem_enable() == "1"
