"""The residency table against the bytes the real workers keep on their device, phase by phase.

Two gloo processes, each holding a real PolicyRank (policy, reference, torch engine) and a real
CriticRank on the demo's tiny model (fp32, DP=2, distributed optimizer), with every offload
flag on. The controller's code runs in both processes (SPMD) through the real clients, the
real hand-over and the trainer's real phase objects, for two RL steps. After every phase each
rank reports what every state keeps allocated (``device_bytes``: storages not resized to 0)
and the test compares it with the planner's bytes for the states the table says are resident
(within 5 %; a state the table says is off must measure exactly 0).

Then one process trains the same in-process run (build_trainer, validation, checkpoints, the
post-push check) with and without every offload flag: the moves must not change a metric.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from spawn import run_distributed

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = ["algorithm.estimator=gae", "algorithm.lam=0.95", "actor.offload=true", "critic.offload=true",
             "reference.offload=true", "cluster.gpus_per_node=2", "data.prompts_per_step=4", "rollout.n=2",
             "actor.mini_batch_size=8", "actor.micro_batch_size=4", "critic.mini_batch_size=8",
             "critic.micro_batch_size=4", "critic.optimizer.lr=1e-3", "trainer.total_steps=2"]  # fmt: skip
TEMPERATURE = 1.0


class SpmdGroup:
    """A worker group seen from one process of an SPMD run: every process runs the controller's
    code, calls the method on its own rank, and gathers every rank's answer (what a Ray
    WorkerGroup returns to its one controller)."""

    def __init__(self, worker) -> None:
        import torch.distributed as dist

        self.worker, self.dist = worker, dist
        self.world_size = dist.get_world_size()

    def _gather(self, answer):
        out = [None] * self.world_size
        self.dist.all_gather_object(out, answer)
        return out

    def call(self, method, *args, **kwargs):  # by name, as the real groups: the rank's override
        return self._gather(getattr(self.worker, method.__name__)(*args, **kwargs))

    def call_each(self, method, args_per_rank):
        return self._gather(getattr(self.worker, method.__name__)(*args_per_rank[self.dist.get_rank()]))


def _walk(rank: int, world: int, model_dir: str) -> dict:
    from megarl.actors.clients import CriticClient, PolicyClient
    from megarl.actors.critic_rank import CriticRank
    from megarl.actors.policy_rank import PolicyRank
    from megarl.config.loading import load_config
    from megarl.data.prompt_batch import PromptBatch
    from megarl.engines.base import SamplingParams
    from megarl.memory.handover import CheckpointedModel, HandedOverEngines, Handover
    from megarl.memory.residency import residency_of
    from megarl.plan.planner import make_plan
    from megarl.rollout.collect import WorkerEngines
    from megarl.rollout.single_turn import generate_batch
    from megarl.trainer.phases import (
        Advantages,
        CriticPhase,
        OldLogprobs,
        PolicyForward,
        PolicyUpdate,
        ReferenceLogprobs,
        WeightPush,
    )
    from megarl.weight_sync.logprob_check import PostPushCheck

    cfg = load_config(ROOT / "configs" / "tiny_grpo.yaml", [f"model.path={model_dir}", *OVERRIDES])
    plan = make_plan(cfg)
    policy, critic = PolicyClient(SpmdGroup(PolicyRank(cfg, 4))), CriticClient(SpmdGroup(CriticRank(cfg, 4)))
    policy.connect_engines(None)
    handover = Handover(residency_of(cfg), {"policy": policy, "critic": critic})
    measured: list[tuple[str, dict[str, int]]] = []

    def record() -> None:
        mine = policy.device_bytes()[rank] | critic.device_bytes()[rank]
        measured.append((handover.phase, mine))

    engines = HandedOverEngines(WorkerEngines(policy), handover)
    forward = PolicyForward(policy, handover)
    prompts = PromptBatch(prompt_ids=[[1, 2, 3], [4, 5, 6], [7, 8, 9], [2, 3, 4]], prompt_text=[""] * 4, data_source=["t"] * 4,
                          ground_truth=[""] * 4, extra_info=[{}] * 4, index=list(range(4)), file_index=[0] * 4)  # fmt: skip
    params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=4, n=2, seed=7)
    check = PostPushCheck(lambda p, s: generate_batch(engines, p, s), forward, prompts, params, max_diff=1e-5)
    push, advantages = WeightPush(policy, handover), Advantages(cfg)
    critic_phase, update = CriticPhase(critic, handover), PolicyUpdate(policy, TEMPERATURE, 0, handover)
    record()  # start
    out: dict = {"checks": []}
    for step in (1, 2):
        batch = generate_batch(engines, prompts, params)
        record()
        batch = OldLogprobs(forward, TEMPERATURE)(batch)
        record()
        batch = ReferenceLogprobs(policy, TEMPERATURE, handover)(batch)
        record()
        batch = critic_phase(batch.replace(scores=torch.rand(len(batch), generator=torch.Generator().manual_seed(step))))
        record()
        batch, _ = advantages(batch, None)
        critic_phase.update(batch, step)
        record()
        # The policy's weights went to host memory and back: its log-probs must not move.
        out.setdefault("same_after_round_trip", []).append(bool(torch.equal(forward.compute_logprobs(batch, TEMPERATURE), batch.old_logprobs)))
        metrics = update.update(batch, step)
        record()
        push(step)
        record()
        out["checks"].append(check(step))  # engine vs trainer after the push, <= 1e-5 (fp32): generate, policy_forward
        record()
        out.setdefault("loss", []).append(metrics["actor/loss"])
        CheckpointedModel(policy, handover).parameter_checksum()
        record()
    out["measured"] = measured
    out["predicted"] = plan.memory.residency
    out["host"] = policy.host_bytes()[rank] | critic.host_bytes()[rank]  # after two steps: every state has moved
    out["host_predicted"] = {owner: b / world for owner, b in plan.memory.host.offloaded.items()}  # (one node)
    return out


@pytest.fixture(scope="module")
def walks(tmp_path_factory) -> list[dict]:
    from megarl.commands.demo import prepare_demo

    model, _ = prepare_demo(tmp_path_factory.mktemp("residency") / "demo")
    return run_distributed(_walk, 2, str(model), timeout_s=600)


STEP = ["generate", "policy_forward", "reference_forward", "critic_forward", "critic_update", "policy_update",
        "weight_push", "policy_forward", "checkpoint"]  # what _walk records after each call, per step


def test_every_phase_keeps_what_the_table_predicts_within_5_percent(walks):
    for rank, walk in enumerate(walks):
        assert [phase for phase, _ in walk["measured"]] == ["start", *STEP, *STEP]
        for i, (phase, got) in enumerate(walk["measured"]):
            predicted = walk["predicted"][phase]
            assert set(predicted) - set(got) <= {"engine/kv_cache"}  # it exists only inside generate calls
            for state, nbytes in got.items():
                expect = predicted.get(state, 0.0)
                where = f"rank {rank}, {phase} (#{i}), {state}: measured {nbytes}, predicted {expect:.0f}"
                if expect == 0:
                    assert nbytes == 0, where
                else:
                    assert abs(nbytes - expect) <= 0.05 * expect, where


def test_the_host_copies_are_what_the_plan_counts_within_5_percent(walks):
    # each state that left the device keeps a host buffer of its size for the next offload;
    # gradients are freed, not copied (the plan's host memory per node, megarl/plan/gpu_memory.py)
    for rank, walk in enumerate(walks):
        host = walk["host"]
        assert [s for s, n in host.items() if s.endswith("/grads")] and not [n for s, n in host.items() if s.endswith("/grads") and n]
        for owner, expect in walk["host_predicted"].items():
            got = sum(n for state, n in host.items() if state.startswith(f"{owner}/"))
            assert abs(got - expect) <= 0.05 * expect, f"rank {rank}, {owner}: host copies {got} bytes, planned {expect:.0f}"
        assert set(walk["host_predicted"]) == {"policy", "critic", "reference"}


def test_moves_keep_the_models_intact(walks):
    for walk in walks:
        assert walk["same_after_round_trip"] == [True, True]
        assert all(c["weight_sync/logprob_diff"] <= 1e-5 for c in walk["checks"])  # the push after the moves
        assert all(loss == loss for loss in walk["loss"])  # finite: grads came back zeroed, not garbage


# ---- a whole run: the offload flags change where bytes are, never what is computed -------------

RUN = ["trainer.total_steps=2", "trainer.eval_before_train=true", "trainer.eval_freq=2", "trainer.save_freq=1",
       "trainer.loggers=[jsonl]", "cluster.gpus_per_node=1", "data.prompts_per_step=4", "rollout.n=2",
       "actor.mini_batch_size=4", "actor.micro_batch_size=2", "actor.ppo_epochs=2", "algorithm.estimator=gae",
       "algorithm.kl.use_in_reward=true", "critic.mini_batch_size=8", "critic.micro_batch_size=4", "reward.workers=1"]  # fmt: skip
OFFLOAD = ["actor.offload=true", "critic.offload=true", "reference.offload=true"]


def _train_twice(rank: int, world: int, root: str) -> list[list[dict]]:
    """The same in-process run (build_trainer, fit: validation, checkpoints, the post-push
    check) without and with every offload flag; each run's metrics.jsonl."""
    import json

    from megarl.commands.demo import prepare_demo
    from megarl.config.loading import load_config
    from megarl.plan.planner import make_plan
    from megarl.trainer.build import build_trainer, shutdown

    model, data = prepare_demo(Path(root) / "demo")
    runs = []
    for name, flags in (("kept", []), ("offloaded", OFFLOAD)):
        out = Path(root) / name
        paths = [f"model.path={model}", f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'val.parquet'}]",
                 f"trainer.output_dir={out}"]  # fmt: skip
        cfg = load_config(ROOT / "configs" / "tiny_grpo.yaml", [*paths, *RUN, *flags])
        trainer = build_trainer(cfg, make_plan(cfg, check_files=True), in_process=True)
        try:
            trainer.fit()
        finally:
            shutdown(trainer)
        runs.append([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()])
    return runs


def test_a_run_with_every_offload_flag_computes_exactly_what_one_without_does(tmp_path):
    kept, offloaded = run_distributed(_train_twice, 1, str(tmp_path), timeout_s=600, daemon=False)[0]
    assert [r["step"] for r in kept] == [0, 1, 2] == [r["step"] for r in offloaded]  # validation at 0, two steps
    for a, b in zip(kept, offloaded):
        values = {k: v for k, v in a.items() if not k.startswith("time/") and k not in ("weight_sync/seconds", "weight_sync/gbps")}
        assert values == {k: b[k] for k in values}, a["step"]
    assert offloaded[-1]["actor/param_checksum"] == kept[-1]["actor/param_checksum"]  # saved from the checkpoint phase
