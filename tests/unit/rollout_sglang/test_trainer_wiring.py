"""rollout.engine=sglang in the trainer, what runs without a GPU: engines mapped to nodes and
local GPUs from real plans, the trainer's Engines over the fake SGLang servers (conftest.py),
and the order of the colocated memory hand-over and of restarts as the servers record it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megarl.config.loading import load_config
from megarl.config.planner import make_plan
from megarl.data.prompt_batch import PromptBatch
from megarl.rollout.collect import HandedOverEngines, generate_batch
from megarl.rollout.engine import SamplingParams
from megarl.rollout.weight_sync import HFWeightStream
from megarl.rollout_sglang.controller import (
    SGLangEngines,
    SGLangHandover,
    engine_descriptors,
    rollout_placement,
)
from megarl.rollout_sglang.engine import SGLangEngine
from megarl.rollout_sglang.hosts import (
    colocated_slots,
    disaggregated_slots,
    engine_slots,
    slot_spec,
)
from megarl.rollout_sglang.server import build_launch_command, build_launch_env, spec_from_config
from megarl.rollout_sglang.transports import SGLangTensorSync
from megarl.trainer.phases import WeightPush

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
ALL_TAGS = {"kv_cache", "weights", "cuda_graph"}


def plan_of(name: str, *overrides: str):
    cfg = load_config(CONFIGS / name, list(overrides))
    return cfg, make_plan(cfg)


def ray_infos(world: int, gpus_per_node: int, physical=lambda local: local) -> list[dict]:
    """What WorkerGroup.node_infos / bundle probes report: rank r on node r // gpus_per_node."""
    return [{"ip": f"10.0.0.{r // gpus_per_node}", "node_id": f"node{r // gpus_per_node}",
             "gpu_ids": [str(physical(r % gpus_per_node))]} for r in range(world)]  # fmt: skip


# ---- engines -> nodes and local GPUs ----------------------------------------------------------


def test_colocated_72b_one_engine_per_node_on_the_ranks_own_gpus():
    _, plan = plan_of("qwen72b_grpo.yaml")  # 4 nodes x 8, rollout tp 8
    # Ray hands out physical GPUs in any order; the engine must use what the ranks really hold.
    infos = ray_infos(32, 8, physical=lambda local: 7 - local)
    slots = colocated_slots(plan, infos)
    assert [s.node_id for s in slots] == ["node0", "node1", "node2", "node3"]
    assert [s.ip for s in slots] == [f"10.0.0.{k}" for k in range(4)]
    assert all(s.gpu_ids == (7, 6, 5, 4, 3, 2, 1, 0) for s in slots)
    assert [s.holders for s in slots] == [tuple(range(8 * k, 8 * k + 8)) for k in range(4)]


def test_colocated_7b_tp2_engines_on_rank_pairs():
    _, plan = plan_of("qwen2.5_7b_ppo.yaml")  # 1 node x 8, rollout tp 2
    slots = colocated_slots(plan, ray_infos(8, 8))
    assert [s.gpu_ids for s in slots] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [s.holders for s in slots] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert {s.node_id for s in slots} == {"node0"}


def test_disaggregated_engines_on_the_rollout_pool_bundles():
    _, plan = plan_of("qwen72b_grpo.yaml", "cluster.nnodes=5", "cluster.placement=disaggregated",
                      "cluster.rollout_gpus=8", "rollout.tp=4")  # fmt: skip
    assert plan.roles["rollout"].gpus == tuple(range(32, 40))
    placement = rollout_placement(plan)  # one STRICT_PACK group per engine, tp one-GPU bundles
    assert (placement.nnodes, placement.procs_per_node, placement.gpus_per_proc) == (2, 4, 1.0)
    # Bundle probes: the 8 bundles landed on node 4, physical GPUs 0..7 (listed out of order).
    bundles = [{"ip": "10.0.0.4", "node_id": "node4", "gpu_ids": [str(g)]} for g in (4, 5, 6, 7, 0, 1, 2, 3)]
    slots = disaggregated_slots(plan, bundles)
    assert [(s.node_id, s.gpu_ids, s.holders) for s in slots] == [
        ("node4", (4, 5, 6, 7), (0, 1, 2, 3)), ("node4", (0, 1, 2, 3), (4, 5, 6, 7))]  # fmt: skip


def test_disaggregated_7b_rollout_gpus_after_the_training_pool():
    _, plan = plan_of("qwen2.5_7b_ppo.yaml", "cluster.placement=disaggregated", "cluster.rollout_gpus=4",
                      "cluster.gpu_memory_gib=141")  # 4 training GPUs hold policy + critic on H200s
    assert plan.roles["policy"].gpus == (0, 1, 2, 3)
    bundles = ray_infos(4, 8, physical=lambda local: local + 4)  # the pool is GPUs 4..7 of node 0
    assert [s.gpu_ids for s in disaggregated_slots(plan, bundles)] == [(4, 5), (6, 7)]


def test_engine_straddling_nodes_is_refused():
    _, plan = plan_of("qwen2.5_7b_ppo.yaml")
    infos = ray_infos(8, 8)
    infos[3] = {"ip": "10.0.0.1", "node_id": "node1", "gpu_ids": ["0"]}  # rank 3 landed elsewhere
    with pytest.raises(ValueError, match=r"engine 1 \(global GPUs \[2, 3\]\) would span 2 nodes"):
        colocated_slots(plan, infos)
    with pytest.raises(ValueError, match="must divide the 6 GPUs"):
        engine_slots(range(6), 4, {g: g for g in range(6)}, ray_infos(6, 8))


def test_slot_spec_pins_gpus_and_listens_on_the_node_address(tmp_path):
    cfg, plan = plan_of("qwen2.5_7b_ppo.yaml")
    slot = colocated_slots(plan, ray_infos(8, 8, physical=lambda local: 7 - local))[1]
    base = spec_from_config(cfg.model.path, cfg.rollout, cfg.cluster.placement, seed=3, dtype=cfg.model.dtype)
    spec = slot_spec(base, slot, str(tmp_path / "e1.log"))
    assert build_launch_env(spec, base={})["CUDA_VISIBLE_DEVICES"] == "5,4"
    cmd = build_launch_command(spec, 30000)
    assert cmd[cmd.index("--host") + 1] == "10.0.0.0"
    assert cmd[cmd.index("--base-gpu-id") + 1] == "0"
    assert cmd[cmd.index("--tp-size") + 1] == "2"
    assert "--enable-memory-saver" in cmd  # colocated: release / resume around training


# ---- the trainer's Engines over fake servers --------------------------------------------------


def prompt_batch(prompts: list[list[int]]) -> PromptBatch:
    k = len(prompts)
    return PromptBatch(prompt_ids=prompts, data_source=["t"] * k, ground_truth=[""] * k,
                       extra_info=[{}] * k, prompt_text=[""] * k, index=list(range(k)), file_index=[0] * k)  # fmt: skip


def test_sglang_engines_make_the_same_batch_as_one_engine(fake_server):
    servers = [fake_server(), fake_server()]
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    params = SamplingParams(max_new_tokens=3, n=2, seed=5)
    split = generate_batch(SGLangEngines([SGLangEngine(s) for s in servers]), prompt_batch(prompts), params)
    single = generate_batch(SGLangEngines([SGLangEngine(fake_server())]), prompt_batch(prompts), params)
    assert torch.equal(split.response_ids, single.response_ids)
    assert torch.equal(split.rollout_logprobs, single.rollout_logprobs)
    assert split.group_id.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    # Contiguous slices: the first engine got prompts 0-1, the second 2-3 (n copies per request;
    # an engine's requests run concurrently, so they arrive in any order).
    for server, mine in zip(servers, (prompts[:2], prompts[2:])):
        bodies = [b for c, b in server.fake.bodies if c == "/generate"]
        assert sorted(b["input_ids"][0] for b in bodies) == sorted(mine)
        assert all(len(b["input_ids"]) == 2 for b in bodies)


# ---- the hand-over: what the servers see, in order ----------------------------------------------


class InProcessPolicy:
    """The policy WorkerGroup as the hand-over calls it (``call(method, ...)``), in one process:
    pushes go through the real SGLangTensorSync over its own engine clients (a policy rank's
    view), offload/onload record what the servers had released at that moment."""

    def __init__(self, weights: dict[str, torch.Tensor], fakes_of) -> None:
        self.weights, self.fakes_of = weights, fakes_of
        self.events: list[tuple[str, list[set[str]]]] = []
        self.connections: list[list[str]] = []
        self.sync: SGLangTensorSync | None = None

    def call(self, method: str, *args):
        self.events.append((method, [set(f.released) for f in self.fakes_of()]))
        if method == "connect_sglang":
            descriptors, transport, _ = args
            assert transport == "tensor"
            stream = HFWeightStream(lambda _: ([(n, t.clone())] for n, t in self.weights.items()), 0.01)
            self.sync = SGLangTensorSync(stream, bucket_class=None)
            self.sync.connect([SGLangEngine(d["url"], tp=d["tp"]) for d in descriptors])
            self.connections.append([d["url"] for d in descriptors])
        elif method == "push_weights":
            return [self.sync.push(args[0])]
        elif method == "compare_probe_logprobs":
            return [{"weight_sync/logprob_diff": 0.0}]
        return [None]

    def methods(self) -> list[str]:
        return [m for m, _ in self.events]


def colocated_setup(fake_server, check=False):
    servers = [fake_server(), fake_server()]
    engines = [SGLangEngine(s, flush_interval=0.01) for s in servers]
    weights = {"w0": torch.randn(8, 8), "w1": torch.randn(4)}
    policy = InProcessPolicy(weights, lambda: [s.fake for s in servers])

    def reconnect():
        policy.call("connect_sglang", engine_descriptors(engines), "tensor", [[0], [1]])

    reconnect()
    for e in engines:  # what start_sglang does once the servers are up
        e.release_memory()
    handover = SGLangHandover(engines, policy, reconnect, colocated=True, offload=[policy])
    push = WeightPush(policy, 1.0, check, handover)
    gen = HandedOverEngines(SGLangEngines(engines), handover)
    return servers, engines, policy, push, gen


def memory_bodies(fake) -> list[tuple[str, list[str]]]:
    return [(c.split("_")[0].strip("/"), sorted(b["tags"])) for c, b in fake.bodies if "memory_occupation" in c]


def test_colocated_step_releases_after_generation_and_resumes_on_push(fake_server):
    servers, engines, policy, push, gen = colocated_setup(fake_server)
    push(version=0)
    gen.generate([[1, 2], [3, 4]], SamplingParams(max_new_tokens=2, n=2))
    push(version=1)
    for s in servers:
        f = s.fake
        assert memory_bodies(f) == [
            ("release", sorted(ALL_TAGS)),            # at start, so the policy has the GPU
            ("resume", ["weights"]),                  # push 0 needs the weights' memory
            ("resume", ["cuda_graph", "kv_cache"]),   # before generating
            ("release", sorted(ALL_TAGS)),            # right after generating
            ("resume", ["weights"]),                  # push 1
        ]  # fmt: skip
        calls = [c for c in f.calls if c not in ("/model_info", "/health_generate")]
        gen_at = calls.index("/generate")
        assert calls[gen_at - 1] == "/resume_memory_occupation" and calls[gen_at + 1] == "/release_memory_occupation"
        assert f.weight_version == "1" and f.released == {"kv_cache", "cuda_graph"}
        assert torch.equal(f.weights["w0"], policy.weights["w0"])
    # The policy leaves before SGLang takes its KV cache and returns after SGLang released it all.
    events = [(m, r) for m, r in policy.events if m != "connect_sglang"]
    assert [m for m, _ in events] == ["push_weights", "offload_states", "onload_states", "push_weights"]
    pushes = [rs for m, rs in events if m == "push_weights"]
    assert pushes == [[{"kv_cache", "cuda_graph"}] * 2] * 2  # the weights' memory is back before a push
    offload = next(rs for m, rs in events if m == "offload_states")
    onload = next(rs for m, rs in events if m == "onload_states")
    assert offload == [{"kv_cache", "cuda_graph"}] * 2 and onload == [ALL_TAGS] * 2


def test_log_prob_check_scores_on_runnable_engines_with_the_policy_offloaded(fake_server):
    servers, engines, policy, push, gen = colocated_setup(fake_server, check=True)
    push(version=0)
    events = [(m, r) for m, r in policy.events if m != "connect_sglang"]
    names = [m for m, _ in events]
    assert names == ["push_weights", "probe_trainer_logprobs", "offload_states", "compare_probe_logprobs", "onload_states"]
    # The trainer's side runs before SGLang takes its KV cache; the engines score with the
    # KV cache back and the policy off the GPU; afterwards SGLang holds nothing again.
    assert events[1][1] == [{"kv_cache", "cuda_graph"}] * 2
    assert events[3][1] == [set()] * 2
    assert events[4][1] == [{"kv_cache", "cuda_graph"}] * 2  # the pushed weights stay resident
    gen.generate([[1, 2]], SamplingParams(max_new_tokens=2, n=1))
    assert all(s.fake.released == ALL_TAGS for s in servers)


def test_dead_engine_is_restarted_reconnected_and_brought_to_the_last_version(fake_server):
    servers, engines, policy, push, gen = colocated_setup(fake_server)
    push(version=0)
    gen.generate([[1, 2]], SamplingParams(max_new_tokens=2, n=1))
    push(version=3)
    old_url = engines[1].url
    servers[1].kill()
    results = gen.generate([[1, 2], [5, 6]], SamplingParams(max_new_tokens=2, n=1))
    assert [r.prompt_index for r in results] == [0, 1]
    assert gen.handover.restarts == 1
    assert engines[1].url != old_url and policy.connections[-1] == [engines[0].url, engines[1].url]
    fresh = servers[1].fake  # the relaunched server: initial weights until the re-push
    assert fresh.weight_version == "3" and torch.equal(fresh.weights["w1"], policy.weights["w1"])
    assert "/generate" in fresh.calls and fresh.released == ALL_TAGS  # generated, then released
    assert servers[0].fake.weight_version == "3"


def test_disaggregated_handover_leaves_memory_alone(fake_server):
    server = fake_server()
    engine = SGLangEngine(server, flush_interval=0.01)
    policy = InProcessPolicy({"w": torch.ones(3)}, lambda: [server.fake])
    policy.call("connect_sglang", engine_descriptors([engine]), "tensor", [[0]])
    handover = SGLangHandover([engine], policy, lambda: None, colocated=False)
    WeightPush(policy, 1.0, False, handover)(version=2)
    HandedOverEngines(SGLangEngines([engine]), handover).generate([[1]], SamplingParams(max_new_tokens=1))
    assert not [c for c in server.fake.calls if "memory" in c]
    assert "offload_states" not in policy.methods() and server.fake.weight_version == "2"
