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


def test_the_policy_ranks_share_the_servers_nccl_cumem_value_where_one_nccl_group_joins_them(monkeypatch):
    """SGLang's servers run with NCCL_CUMEM_ENABLE=0 unless it is set; with the distributed
    transport the policy ranks get the same explicit value (or the user's, on both sides); other
    runs keep NCCL's default in every group."""
    from megarl.config.loading import load_config
    from megarl.ray_cluster.rank_env import NCCL_CUMEM_ENV
    from megarl.rollout_sglang.server import ServerSpec
    from megarl.trainer.build import _shared_nccl_env

    tiny = Path(__file__).resolve().parents[3] / "configs" / "tiny_grpo.yaml"
    infos = [{"node_id": "n0", "ip": "10.0.0.1", "gpu_ids": [str(g)]} for g in range(2)]
    distributed = load_config(tiny, ["rollout.engine=sglang", "cluster.placement=disaggregated", "cluster.gpus_per_node=3",
                                     "cluster.rollout_gpus=1"])  # fmt: skip
    assert distributed.weight_transport == "distributed"
    monkeypatch.delenv(NCCL_CUMEM_ENV, raising=False)
    envs = rank_envs(infos, options=GroupOptions(env=_shared_nccl_env(distributed)))
    assert [e[NCCL_CUMEM_ENV] for e in envs] == ["0", "0"] == [ServerSpec(model_path="m").nccl_cumem_enable] * 2
    monkeypatch.setenv(NCCL_CUMEM_ENV, "1")  # the user's, exported where megarl launch runs
    envs = rank_envs(infos, options=GroupOptions(env=_shared_nccl_env(distributed)))
    assert [e[NCCL_CUMEM_ENV] for e in envs] == ["1", "1"] == [ServerSpec(model_path="m").nccl_cumem_enable] * 2
    monkeypatch.delenv(NCCL_CUMEM_ENV)
    torch_engine = load_config(tiny, [])
    assert _shared_nccl_env(torch_engine) == {}
    assert all(NCCL_CUMEM_ENV not in e for e in rank_envs(infos, options=GroupOptions(env=_shared_nccl_env(torch_engine))))
