"""The torch engine as a Ray actor of its own (asynchronous training): placed on a node whose
CPUs the policy holds, generating, reloaded through the disk transport's writer path while a
generate is in flight, named when a call passes its deadline, gone after close()."""

from __future__ import annotations

import sys
import threading

import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(300)

import torch  # noqa: E402
from ray.exceptions import RayActorError  # noqa: E402

from megarl.config.loading import load_config  # noqa: E402
from megarl.engines.base import SamplingParams  # noqa: E402
from megarl.engines.engine_actor import EngineActorClient, start_standalone_engines  # noqa: E402
from megarl.models.hf_files import copy_side_files  # noqa: E402
from megarl.models.tiny import build_tiny_model  # noqa: E402
from megarl.ray_cluster.session import ray_session  # noqa: E402
from megarl.weight_sync.transport_base import check_versions  # noqa: E402
from megarl.weight_sync.transports import _writer_engines  # noqa: E402

# Ray workers cannot import this test module by name: ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

PROMPTS = [[3, 4, 5, 6, 7], [8, 9]]


@ray.remote(num_cpus=1)
class _CpuHolder:
    """Stands for the policy ranks: holds the node's only CPU."""

    def ping(self) -> int:
        return 1


@ray.remote(num_cpus=0)
def _writer_reload(endpoints, directory, version: int) -> int:
    """What policy rank 0 does with the endpoints connect_engines gave it (another Ray process)."""
    clients = _writer_engines(True, "abort")(endpoints)
    assert len(clients) == 1 and isinstance(clients[0], EngineActorClient)
    clients[0].load_weights_from_disk(directory, version)
    check_versions(clients, version)
    return clients[0].weight_version


def _pushed_version(model_dir, out, scale: float):
    """``out``: the model with its weights scaled, as the disk transport writes a version."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    model.save_pretrained(out)
    copy_side_files(model_dir, out)
    return out


def test_engine_actor_generates_reloads_from_disk_and_closes(tmp_path):
    model_dir = build_tiny_model(tmp_path / "model", seed=3)
    cfg = load_config(None, [f"model.path={model_dir}", "model.arch=qwen2.5-7b", "model.dtype=float32",
                             "rollout.engine=torch", "rollout.max_staleness=1", "rollout.max_running_requests=8",
                             "trainer.total_steps=1"])  # fmt: skip
    assert cfg.partial_rollouts and cfg.weight_transport == "disk"
    with ray_session(None, num_cpus=1):
        holder = _CpuHolder.remote()
        ray.get(holder.ping.remote(), timeout=120)  # the node's CPU is taken before the engine starts
        engines = start_standalone_engines(cfg, tmp_path / "logs")
        handle = engines.handle
        try:
            first = engines.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=4))
            assert [r.prompt_index for r in first] == [0, 1]
            assert all(r.token_versions == (0,) * len(r.response_ids) for r in first)

            # the disk transport's writer, in another Ray process, takes the actor's client as it is,
            # reloads and checks the version
            v3 = _pushed_version(model_dir, tmp_path / "v3", 1.1)
            assert ray.get(_writer_reload.remote(engines.endpoints, v3, 3), timeout=120) == 3
            assert engines.weight_version == 3 and engines.health().weight_version == 3
            clients = _writer_engines(True, "abort")(engines.endpoints)

            # a reload while a generate is in flight (a producer thread): both finish, each token's
            # version is the old or the new one, never going back
            out: dict = {}
            params = SamplingParams(temperature=1.0, max_new_tokens=64, n=2, seed=1)
            producer = threading.Thread(target=lambda: out.update(results=engines.generate(PROMPTS, params)))
            producer.start()
            clients[0].load_weights_from_disk(_pushed_version(model_dir, tmp_path / "v4", 0.9), 4)
            producer.join(timeout=120)
            assert not producer.is_alive() and len(out["results"]) == 4
            for r in out["results"]:
                assert set(r.token_versions) <= {3, 4} and list(r.token_versions) == sorted(r.token_versions)
            assert engines.weight_version == 4

            engines.generate_timeout_s = 0.01  # a deadline that passes names the actor, the call and its log
            with pytest.raises(TimeoutError, match=r"torch engine actor \(log: .*torch_engine.log\): generate"):
                engines.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=500, n=8, seed=2))
        finally:
            engines.close()
        with pytest.raises(RayActorError):
            ray.get(handle.weight_version.remote(), timeout=60)
        assert (tmp_path / "logs" / "torch_engine.log").is_file()
