"""rollout.engine=sglang in the trainer, what runs without a GPU: engines mapped to nodes and
local GPUs from real plans, the trainer's Engines over the fake SGLang servers (conftest.py),
and the memory hand-over (megarl/memory/handover.py) driven through the trainer's phase
objects: what the servers and the policy see, in order, and that no generation reads
released weights (the fake serves NaN log-probs then, as SGLang serves garbage)."""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import pytest
import torch

from megarl.config.loading import load_config
from megarl.data.prompt_batch import PromptBatch
from megarl.engines.base import SamplingParams
from megarl.memory.handover import CheckpointedModel, HandedOverEngines, Handover
from megarl.memory.residency import build_residency
from megarl.memory.sglang_memory import SGLangMemory
from megarl.plan.planner import make_plan
from megarl.rollout.single_turn import generate_batch
from megarl.rollout_sglang.controller import (
    PolicyConnection,
    SGLangEngines,
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
from megarl.trainer.phases import PolicyForward, WeightPush
from megarl.weight_sync.cuda_ipc import SGLangTensorTransport
from megarl.weight_sync.logprob_check import PostPushCheck
from megarl.weight_sync.stream import WeightStream

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
    assert all(s.gpu_ids == ("7", "6", "5", "4", "3", "2", "1", "0") for s in slots)
    assert [s.holders for s in slots] == [tuple(range(8 * k, 8 * k + 8)) for k in range(4)]


def test_colocated_7b_tp2_engines_on_rank_pairs():
    _, plan = plan_of("qwen2.5_7b_ppo.yaml")  # 1 node x 8, rollout tp 2
    slots = colocated_slots(plan, ray_infos(8, 8))
    assert [s.gpu_ids for s in slots] == [("0", "1"), ("2", "3"), ("4", "5"), ("6", "7")]
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
        ("node4", ("4", "5", "6", "7"), (0, 1, 2, 3)), ("node4", ("0", "1", "2", "3"), (4, 5, 6, 7))]  # fmt: skip


def test_disaggregated_7b_rollout_gpus_after_the_training_pool():
    _, plan = plan_of("qwen2.5_7b_ppo.yaml", "cluster.placement=disaggregated", "cluster.rollout_gpus=4",
                      "cluster.gpu_memory_gib=141")  # 4 training GPUs hold policy + critic on H200s
    assert plan.roles["policy"].gpus == (0, 1, 2, 3)
    bundles = ray_infos(4, 8, physical=lambda local: local + 4)  # the pool is GPUs 4..7 of node 0
    assert [s.gpu_ids for s in disaggregated_slots(plan, bundles)] == [("4", "5"), ("6", "7")]


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
    base = spec_from_config(cfg.model.path, cfg.rollout, cfg.cluster, seed=3, dtype=cfg.model.dtype)
    spec = slot_spec(base, slot, str(tmp_path / "e1.log"))
    assert build_launch_env(spec, base={})["CUDA_VISIBLE_DEVICES"] == "5,4"
    cmd = build_launch_command(spec, 30000)
    assert cmd[cmd.index("--host") + 1] == "10.0.0.0"
    assert cmd[cmd.index("--base-gpu-id") + 1] == "0"
    assert cmd[cmd.index("--tp-size") + 1] == "2"
    assert "--enable-memory-saver" in cmd  # colocated: release / resume around training


def test_uuid_gpu_ids_reach_the_server_as_they_are():
    """Ray reports GPU ids as UUIDs when CUDA_VISIBLE_DEVICES holds UUIDs; CUDA_VISIBLE_DEVICES
    takes them back as they are (an int() of one raised ValueError)."""
    cfg, plan = plan_of("qwen2.5_7b_ppo.yaml")
    uuids = [f"GPU-5f3{g}a7c1-0d1e-4b2f-9c3d-{g:012d}" for g in range(8)]
    slots = colocated_slots(plan, ray_infos(8, 8, physical=lambda local: uuids[local]))
    assert [s.gpu_ids for s in slots] == [tuple(uuids[2 * k : 2 * k + 2]) for k in range(4)]
    spec = slot_spec(spec_from_config(cfg.model.path, cfg.rollout, cfg.cluster), slots[1], None)
    assert spec.gpu_ids == (uuids[2], uuids[3])
    assert build_launch_env(spec, base={})["CUDA_VISIBLE_DEVICES"] == f"{uuids[2]},{uuids[3]}"
    cmd = build_launch_command(spec, 30000)
    assert cmd[cmd.index("--base-gpu-id") + 1] == "0"


def test_a_runs_engines_load_no_checkpoint_because_the_trainer_pushes_first(tmp_path):
    """The trainer pushes its weights before it generates, and the hand-over re-pushes after a
    restart: reading the HF checkpoint at every launch (4 x 145 GB at 72B) would be for nothing."""
    from types import SimpleNamespace

    from megarl.rollout_sglang.controller import prepare_sglang

    cfg, plan = plan_of("qwen2.5_7b_ppo.yaml")
    policy = SimpleNamespace(group=SimpleNamespace(node_infos=ray_infos(8, 8)))
    rollout = prepare_sglang(cfg, plan, policy, tmp_path, weights_cpu_backup=False)
    assert [s.load_format for s in rollout.specs] == ["dummy"] * 4
    cmd = build_launch_command(rollout.specs[0], 30000)
    assert cmd[cmd.index("--load-format") + 1] == "dummy"
    # `megarl generate` serves the model as it is: no push follows, the checkpoint is loaded.
    assert spec_from_config(cfg.model.path, cfg.rollout, cfg.cluster).load_format is None


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


class RecordingPolicy:
    """The policy client as the hand-over uses it, in one process: pushes go through the real
    SGLangTensorTransport over its own engine clients (a policy rank's view); every call records
    its states and what each server had released at that moment."""

    def __init__(self, weights: dict[str, torch.Tensor], fakes_of) -> None:
        self.weights, self.fakes_of = weights, fakes_of
        self.events: list[tuple[str, tuple, list[set[str]]]] = []
        self.connections: list[list[str]] = []
        stream = WeightStream(lambda: ((n, t.clone()) for n, t in self.weights.items()), 0.01)
        self.transport = SGLangTensorTransport(stream, bucket_class=None)

    def _note(self, method: str, *args) -> None:
        self.events.append((method, args, [set(f.released) for f in self.fakes_of()]))

    def connect_engines(self, endpoints) -> None:
        self._note("connect_engines")
        self.transport.connect(endpoints)
        self.connections.append([e.url for e in endpoints])

    def push_weights(self, version: int) -> dict[str, float]:
        self._note("push_weights", version)
        return self.transport.push(version)

    def offload(self, states) -> int:
        self._note("offload", *states)
        return 0

    def onload(self, states) -> None:
        self._note("onload", *states)

    def save(self, path: str) -> None:
        self._note("save", path)

    def compute_logprobs(self, batch, temperature: float) -> torch.Tensor:
        self._note("compute_logprobs")
        return batch.rollout_logprobs.clone()  # the trainer agrees with whatever the engine sampled...

    def moves(self) -> list[tuple]:
        """(method, states...) of every call but connections."""
        return [(m, *a) for m, a, _ in self.events if m != "connect_engines"]


# The 72B recipe's table: colocated SGLang, actor and reference offloaded, no critic.
GRPO = dict(reference=True, actor_offload=True, reference_offload=True)
POLICY_ALL = ("policy/grads", "policy/optimizer", "policy/weights")


def colocated_setup(fake_server, check: bool = False, **table_flags):
    """Servers launched through the hand-over, as the trainer starts them; the trainer's phase objects."""
    servers: list = []
    table = build_residency("colocated", "sglang", **(table_flags or GRPO))
    policy = RecordingPolicy({"w0": torch.randn(8, 8), "w1": torch.randn(4)}, lambda: [s.fake for s in servers])
    handover = Handover(table, {"policy": policy})
    connect = PolicyConnection(policy, [], [[0], [0]])

    def start() -> SGLangMemory:
        servers.extend([fake_server(weights_cpu_backup=table.weights_cpu_backup) for _ in range(2)])
        connect.engines = [SGLangEngine(s, flush_interval=0.01) for s in servers]
        return SGLangMemory(connect.engines, connect)

    handover.launch(start)
    connect()
    gen = HandedOverEngines(SGLangEngines(connect.engines), handover)
    probe = PostPushCheck(partial(generate_batch, gen), PolicyForward(policy, handover), prompt_batch([[1, 2], [3]]),
                          SamplingParams(max_new_tokens=2, seed=1), max_diff=0.05) if check else None  # fmt: skip
    push = WeightPush(policy, handover, probe)
    return servers, policy, handover, push, gen


def memory_bodies(fake) -> list[tuple[str, list[str]]]:
    return [(c.split("_")[0].strip("/"), sorted(b["tags"])) for c, b in fake.bodies if "memory_occupation" in c]


def generate(gen, prompts=([1, 2], [3, 4]), n=2):
    results = gen.generate([list(p) for p in prompts], SamplingParams(max_new_tokens=2, n=n, seed=3))
    assert all(math.isfinite(x) for r in results for x in r.logprobs)  # real weights served, not garbage
    return results


def test_launch_happens_with_the_trained_models_off_the_gpus(fake_server):
    servers, policy, handover, _, _ = colocated_setup(fake_server)
    # Everything trained leaves before a server exists (SGLang sizes its KV cache from the free
    # memory it sees), comes back once every server released all its memory.
    (off, off_args, off_seen), (on, on_args, on_seen) = [e for e in policy.events if e[0] != "connect_engines"]
    assert (off, on) == ("offload", "onload") and off_args == on_args == (*POLICY_ALL, "reference/weights")
    assert off_seen == [] and on_seen == [ALL_TAGS] * 2
    assert [memory_bodies(s.fake) for s in servers] == [[("release", sorted(ALL_TAGS))]] * 2
    assert handover.phase == "start" and handover.stale  # the initial weights were released: a push comes first


def test_colocated_step_moves_exactly_what_the_table_says(fake_server):
    servers, policy, handover, push, gen = colocated_setup(fake_server)
    del policy.events[:]
    push(version=0)
    generate(gen)
    for phase in ("policy_forward", "reference_forward", "policy_update"):  # what the step's phase objects enter
        handover.enter(phase)
    push(version=1)
    generate(gen)
    assert policy.moves() == [
        ("offload", "policy/grads", "policy/optimizer", "reference/weights"),  # start -> weight_push
        ("push_weights", 0),
        ("offload", "policy/weights"),  # -> generate
        ("onload", "policy/weights"),  # -> policy_forward
        ("offload", "policy/weights"), ("onload", "reference/weights"),  # -> reference_forward
        ("offload", "reference/weights"), ("onload", *POLICY_ALL),  # -> policy_update (grads come back zeroed)
        ("offload", "policy/grads", "policy/optimizer"),  # -> weight_push: the optimizer leaves before the push
        ("push_weights", 1),
        ("offload", "policy/weights"),  # -> generate
    ]  # fmt: skip
    for s in servers:
        assert memory_bodies(s.fake) == [
            ("release", sorted(ALL_TAGS)),            # after the launch
            ("resume", ["weights"]),                  # push 0 needs the weights' memory
            ("resume", ["cuda_graph", "kv_cache"]),   # generate
            ("release", ["cuda_graph", "kv_cache"]),  # policy_forward: the weights stay
            ("release", ["weights"]),                 # policy_update
            ("resume", ["weights"]),                  # push 1 refills them
            ("resume", ["cuda_graph", "kv_cache"]),   # generate
        ]  # fmt: skip
        calls = [c for c in s.fake.calls if c not in ("/model_info", "/health_generate")]
        release = calls.index("/release_memory_occupation", calls.index("/generate"))
        assert calls[release - 1] == "/flush_cache"  # released only once idle
        assert s.fake.weight_version == "1" and torch.equal(s.fake.weights["w0"], policy.weights["w0"])
    # The optimizer left before the push, with the engines' KV cache still released.
    seen = {(m, *a): r for m, a, r in policy.events}
    assert seen[("push_weights", 1)] == [{"kv_cache", "cuda_graph"}] * 2
    assert seen[("onload", *POLICY_ALL)] == [ALL_TAGS] * 2  # the policy trains with SGLang holding nothing
    assert handover.repushes == 0


def test_second_generations_read_real_weights_without_a_repush(fake_server):
    """ReMax's greedy baseline right after the step's generation, the post-push check, then
    validation and the next step: every generation after the first keeps the pushed weights."""
    servers, policy, handover, push, gen = colocated_setup(fake_server, check=True)
    push(version=0)  # + the check: generate, then the trainer's log-probs
    generate(gen)  # validation (eval_before_train)
    generate(gen)  # step 1
    generate(gen, n=1)  # remax baseline
    handover.enter("policy_forward")
    generate(gen)  # a second DAPO round would do this
    assert [m for m, *_ in policy.moves() if m in ("push_weights", "compute_logprobs")] == ["push_weights", "compute_logprobs"]
    assert handover.repushes == 0
    for s in servers:
        assert [b for b in memory_bodies(s.fake) if "weights" in b[1]] == [("release", sorted(ALL_TAGS)), ("resume", ["weights"])]


def test_post_push_check_generates_with_the_policy_off_and_scores_with_it_back(fake_server):
    servers, policy, handover, push, gen = colocated_setup(fake_server, check=True)
    del policy.events[:]
    metrics = push(version=0)
    assert metrics["weight_sync/logprob_diff"] == 0.0
    events = [(m, a, r) for m, a, r in policy.events if m != "connect_engines"]
    assert [(m, *a) for m, a, _ in events] == [
        ("offload", "policy/grads", "policy/optimizer", "reference/weights"), ("push_weights", 0),
        ("offload", "policy/weights"), ("onload", "policy/weights"), ("compute_logprobs",)]  # fmt: skip
    # generate with the KV cache resumed; score with it released again but the weights kept
    assert events[2][2] == [{"kv_cache", "cuda_graph"}] * 2
    assert events[4][2] == [{"kv_cache", "cuda_graph"}] * 2
    assert all(s.fake.weight_version == "0" for s in servers)


@pytest.mark.parametrize("cpu_backup", [False, True])
def test_generation_after_a_weights_release_repushes_unless_sglang_kept_a_copy(fake_server, cpu_backup):
    """A checkpoint releases the engines' weights (rule 3 of megarl/memory/residency.py): the next
    generation re-pushes the last version first, unless SGLang kept a CPU copy."""
    servers, policy, handover, push, gen = colocated_setup(fake_server, **GRPO, weights_cpu_backup=cpu_backup)
    push(version=4)
    generate(gen)
    CheckpointedModel(policy, handover).save("step_000004")  # the loop's save, in the checkpoint phase
    assert policy.moves()[-3:] == [("offload", "policy/weights"), ("onload", "policy/optimizer", "policy/weights"),
                                   ("save", "step_000004")]  # fmt: skip
    del policy.events[:]
    generate(gen)
    pushes = [a for m, a, _ in policy.events if m == "push_weights"]
    assert pushes == ([] if cpu_backup else [(4,)])
    assert handover.repushes == (0 if cpu_backup else 1)
    if not cpu_backup:  # through weight_push (the optimizer leaves first), then generate
        assert policy.moves() == [("offload", "policy/optimizer"), ("push_weights", 4), ("offload", "policy/weights")]
    after_generate = [("release", sorted(ALL_TAGS))]  # generate -> checkpoint
    for s in servers:
        if cpu_backup:
            assert memory_bodies(s.fake)[-2:] == after_generate + [("resume", sorted(ALL_TAGS))]
        else:  # weights for the push, then the rest for the generation
            assert memory_bodies(s.fake)[-3:] == after_generate + [("resume", ["weights"]), ("resume", ["cuda_graph", "kv_cache"])]
        assert s.fake.weight_version == "4"


def test_dead_engine_restarts_with_the_policy_off_and_gets_the_last_version(fake_server):
    servers, policy, handover, push, gen = colocated_setup(fake_server)
    push(version=0)
    generate(gen, n=1)
    handover.enter("policy_update")
    push(version=3)
    engines = handover.engines.engines
    old_url = engines[1].url
    servers[1].kill()
    del policy.events[:]
    results = generate(gen, prompts=([1, 2], [5, 6]), n=1)
    assert [r.prompt_index for r in results] == [0, 1]
    assert handover.restarts == 1 and handover.repushes == 1
    assert engines[1].url != old_url and policy.connections[-1] == [engines[0].url, engines[1].url]
    moves = [(m, *a) for m, a, _ in policy.events]
    assert moves == [
        ("offload", "policy/weights"),  # weight_push's resident trained states leave before the relaunch
        ("connect_engines",),  # the relaunched server is up
        ("onload", "policy/weights"),  # after it released what weight_push does not hold
        ("push_weights", 3),  # stale: the relaunched server has the initial weights
        ("offload", "policy/weights"),  # -> generate
    ]
    fresh = servers[1].fake  # the relaunched server
    assert policy.events[2][2] == [{"kv_cache", "cuda_graph"}] * 2  # the relaunched one released like the other, before the onload
    assert memory_bodies(fresh) == [("release", ["cuda_graph", "kv_cache"]), ("resume", ["cuda_graph", "kv_cache"])]
    assert fresh.weight_version == "3" and torch.equal(fresh.weights["w1"], policy.weights["w1"])
    assert servers[0].fake.weight_version == "3"


def test_no_generation_before_the_first_push(fake_server):
    """Engines start with random weights (--load-format dummy): a generation before the trainer's
    first push is refused, before any request reaches a server; after it, generation runs."""
    server = fake_server(load_format="dummy")
    engine = SGLangEngine(server, flush_interval=0.01)
    policy = RecordingPolicy({"w": torch.ones(3)}, lambda: [server.fake])
    handover = Handover(build_residency("disaggregated", "sglang"), {"policy": policy})
    connect = PolicyConnection(policy, [engine])
    handover.launch(lambda: SGLangMemory([engine], connect))
    connect()
    gen = HandedOverEngines(SGLangEngines([engine]), handover)
    with pytest.raises(RuntimeError, match=r"no pushed weights yet .*push first"):
        generate(gen, n=1)
    assert "/generate" not in server.fake.calls
    WeightPush(policy, handover)(version=0)
    generate(gen, n=1)
    assert server.fake.weight_version == "0" and handover.repushes == 0


def test_disaggregated_moves_no_engine_memory_but_honours_the_critic_offload(fake_server):
    server = fake_server()
    engine = SGLangEngine(server, flush_interval=0.01)
    policy = RecordingPolicy({"w": torch.ones(3)}, lambda: [server.fake])
    critic = RecordingPolicy({}, lambda: [server.fake])
    table = build_residency("disaggregated", "sglang", critic=True, critic_offload=True)
    handover = Handover(table, {"policy": policy, "critic": critic})
    connect = PolicyConnection(policy, [engine])
    handover.launch(lambda: SGLangMemory([engine], connect))
    connect()
    WeightPush(policy, handover)(version=2)
    gen = HandedOverEngines(SGLangEngines([engine]), handover)
    generate(gen, n=1)
    for phase in ("critic_forward", "critic_update", "policy_update"):
        handover.enter(phase)
    server.kill()
    WeightPush(policy, handover)(version=3)  # the restart brings nothing of the trained models off
    assert not [c for c in server.fake.calls if "memory" in c] and not [c for s in server.history for c in s.calls if "memory" in c]
    assert [m for m, *_ in policy.moves()] == ["push_weights", "push_weights"]  # the policy has no flag: it never moves
    assert critic.moves() == [
        ("offload", "critic/grads", "critic/optimizer", "critic/weights"),  # start -> weight_push
        ("onload", "critic/weights"), ("onload", "critic/grads", "critic/optimizer"),  # its forward, its update
        ("offload", "critic/grads", "critic/optimizer", "critic/weights"),  # policy_update
    ]  # fmt: skip
    assert server.fake.weight_version == "3" and handover.restarts == 1
