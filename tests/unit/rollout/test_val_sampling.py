"""rollout.val's own sampling (verl's actor_rollout_ref.rollout.val_kwargs) on the torch engine:
greedy by default (n identical copies), sampled at rollout.val.temperature when greedy is off."""

from __future__ import annotations

from megarl.config.sections import MegaRLConfig
from megarl.trainer.loop import sampling_params

PROMPTS = [[3, 4, 5], [6, 7]]


def _val_params(**val):
    cfg = MegaRLConfig(model={"arch": "qwen3-8b"}, rollout={"sampling": {"max_new_tokens": 8}, "val": val})
    return sampling_params(cfg, 2, validation=True)


def _responses(engine, params) -> list[tuple[int, ...]]:
    return [tuple(r.response_ids) for r in engine.generate(PROMPTS, params)]


def test_default_validation_is_greedy_as_before(task_engine):
    params = _val_params(n=3)
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 1.0, -1)
    got = _responses(task_engine, params)
    assert len(set(got[:3])) == 1 and len(set(got[3:])) == 1  # n copies of the greedy answer


def test_validation_samples_at_its_own_temperature_and_n(task_engine):
    params = _val_params(greedy=False, temperature=3.0, top_p=0.95, top_k=10, n=4)
    assert (params.temperature, params.top_p, params.top_k, params.n) == (3.0, 0.95, 10, 4)
    got = _responses(task_engine, params)
    assert len(got) == 8 and len(set(got[:4])) > 1 and len(set(got[4:])) > 1
    assert got == _responses(task_engine, params)  # seeded: the same step validates the same


def test_unset_keys_follow_training_sampling():
    params = _val_params(greedy=False)
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, -1)
