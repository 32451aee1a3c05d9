"""reward.model.placement: disaggregated: the reward model's role (two Ray actors on CPU, a placement group of their own) scores a
step's samples as the reward workers do, alone and as reward.combine's ``model`` component; an
actor that dies costs its samples (counted errors) and is started again; a call past its deadline
counts timeouts and stops the run once they reach reward.max_failed_fraction."""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(300)

from megarl.config.sections import RewardConfig, RewardModelConfig  # noqa: E402
from megarl.rewards.scorer import RewardError, RewardScorer  # noqa: E402
from megarl.rollout.reward_combine import CombinedScorer  # noqa: E402
from megarl.rollout.reward_model_role import RewardModelRole  # noqa: E402

# A step's samples as the demo makes them: reverse_digits prompts (as the data holds them and as the
# policy's engine saw them), responses of different lengths so that a batch is padded.
RAW = ["Reverse 123.", [{"role": "user", "content": "Reverse 4567."}], "Reverse 89.", "Reverse 1000.", "Reverse 42.",
       [{"role": "user", "content": "Reverse 31."}], "Reverse 777."]  # fmt: skip
PROMPTS = [f"<|im_start|>user\n{r if isinstance(r, str) else r[0]['content']}<|im_end|>\n<|im_start|>assistant\n" for r in RAW]
RESPONSES = ["321", "7654 and then some more words", "98", "0001", "24 24 24", "13", "777"]
TRUTHS = ["321", "7654", "98", "0001", "24", "13", "777"]


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    from megarl.models.tiny import build_tiny_reward_model

    return str(build_tiny_reward_model(tmp_path_factory.mktemp("tiny_rm")))


def _reward(path: str, **model) -> RewardConfig:
    return RewardConfig(model=RewardModelConfig(path=path, batch_size=3, **model), timeout_s=60.0, workers=1)


def _score(scorer, **kwargs):
    n = len(RESPONSES)
    return scorer.score(["reverse_digits"] * n, RESPONSES, TRUTHS, prompts=PROMPTS, raw_prompts=RAW, **kwargs)


def test_the_role_scores_as_the_reward_workers_and_restarts_a_dead_actor(ray_local, reward_model_dir, tmp_path):
    with RewardScorer(_reward(reward_model_dir)) as workers:
        expected = _score(workers).scores
    assert len(set(expected)) == len(expected)  # a random model still tells the samples apart
    from megarl.ray_cluster.placement import RolePlacement, place_roles, release

    cfg = _reward(reward_model_dir, placement="disaggregated", gpus=2)
    placed = place_roles([RolePlacement("reward_model", 1, 2, gpus_per_proc=0.0, cpus_per_proc=1.0)])  # a pool of its own
    try:
        with RewardModelRole(cfg, "cpu", tmp_path, placed=placed["reward_model"]) as role:
            alone = _score(role)
            assert (alone.errors, alone.timeouts) == (0, 0)
            assert alone.scores == pytest.approx(expected, abs=1e-5)
            combined_cfg = cfg.model_copy(update={"combine": {"reverse_digits": {"reverse_digits": 1.0, "model": 0.5}}})
            combined = CombinedScorer(combined_cfg, model=role)  # closes the role with it, as the trainer's does
            result = _score(combined)
            assert result.extra["model"] == pytest.approx(expected, abs=1e-5)
            rule = result.extra["reverse_digits"]
            assert rule[0] == 1.0 and result.scores == pytest.approx([r + 0.5 * s for r, s in zip(rule, expected, strict=True)], abs=1e-5)
            # Actor 0 holds batches 0 and 2 (samples 0-2 and 6): they fail, counted; the others are scored.
            ray.kill(role._actors[0], no_restart=True)
            hurt = _score(role)
            assert (hurt.errors, hurt.timeouts) == (4, 0)
            assert hurt.scores == pytest.approx([0, 0, 0, *expected[3:6], 0], abs=1e-5)
            assert _score(role).scores == pytest.approx(expected, abs=1e-5)  # a new actor 0, loaded again
            combined.close()
            assert role._actors == [None, None]
    finally:
        release(placed)


def test_a_call_past_its_deadline_counts_timeouts_and_stops_the_run(ray_local, reward_model_dir, tmp_path):
    cfg = _reward(reward_model_dir, placement="disaggregated").model_copy(update={"timeout_s": 1e-3})
    with RewardModelRole(cfg, "cpu", tmp_path) as role, pytest.raises(RewardError) as info:
        _score(role)
    assert "reward.model failed on 7 of 7 samples (0 errors, 7 timeouts)" in str(info.value)
    assert "raise reward.timeout_s or lower reward.model.batch_size" in str(info.value)


def test_a_colocated_role_shares_the_policy_bundles_and_moves_with_the_handover(ray_local, reward_model_dir, tmp_path):
    """reward.model.placement colocated: one actor on each policy bundle, the model loaded on the
    host; the memory hand-over brings it to the device for phase reward (a scorer call through
    HandedOverScorer) and back at the next phase; it scores as the reward workers do, and an actor
    that died while the model was away comes back on the device where the others are."""
    from megarl.memory.handover import HandedOverScorer, Handover
    from megarl.memory.residency import POLICY_FORWARD, REWARD, build_residency
    from megarl.ray_cluster.placement import RolePlacement, place_roles, release

    with RewardScorer(_reward(reward_model_dir)) as workers:
        expected = _score(workers).scores
    shape = {"nnodes": 1, "procs_per_node": 2, "gpus_per_proc": 0.0, "cpus_per_proc": 1.0}
    placed = place_roles([RolePlacement("policy", **shape), RolePlacement("reward_model", **shape)],
                         [("policy", "critic", "reward_model")])  # fmt: skip
    try:
        assert placed["reward_model"].pool is placed["policy"].pool  # the same bundles: actor i beside policy rank i
        cfg = _reward(reward_model_dir, placement="colocated")
        with RewardModelRole(cfg, "cpu", tmp_path, placed=placed["reward_model"]) as role:
            where = lambda: ray.get([a.where.remote() for a in role._actors])  # noqa: E731
            assert where() == [(False, "cpu")] * 2  # loaded on the host
            handover = Handover(build_residency("colocated", "torch", reward_model=True), {"reward_model": role})
            scored = _score(HandedOverScorer(role, handover))
            assert handover.phase == REWARD and where() == [(True, "cpu")] * 2
            assert scored.scores == pytest.approx(expected, abs=1e-5) and (scored.errors, scored.timeouts) == (0, 0)
            handover.enter(POLICY_FORWARD)
            assert where() == [(False, "cpu")] * 2
            ray.kill(role._actors[1], no_restart=True)
            assert _died(role._actors[1])
            handover.enter(REWARD)  # actor 1 is dropped, not waited for
            assert role._actors[1] is None
            again = _score(HandedOverScorer(role, handover))  # actor 1 started again, loaded on the device
            assert again.scores == pytest.approx(expected, abs=1e-5) and where() == [(True, "cpu")] * 2
    finally:
        release(placed)


def _died(actor, deadline_s: float = 120.0) -> bool:
    """Whether the killed actor is gone within the deadline: ray.kill returns before it is, and a
    call sent just after the kill may still be answered, so ask until a call fails."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            ray.get(actor.ready.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.2)
    return False

