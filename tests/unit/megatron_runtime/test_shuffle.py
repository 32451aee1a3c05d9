"""actor.shuffle (verl's actor_rollout_ref.actor.shuffle): the step's samples are permuted before
mini-batches are cut, each epoch its own permutation, seeded by the run's seed and the step alone
(a resumed run shuffles as the uninterrupted one; every rank cuts the same mini-batches); off,
the mini-batches are today's consecutive chunks."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megarl.config.sections import MegaRLConfig
from megarl.data.batch import Batch
from megarl.engines.seeds import shuffle_seed, step_seed
from megarl.megatron_runtime.micro_batches import mini_batches

ROWS, MINI, EPOCHS = 16, 4, 2


def _batch() -> Batch:
    return Batch(prompt_ids=torch.ones(ROWS, 2, dtype=torch.long), prompt_mask=torch.ones(ROWS, 2, dtype=torch.long),
                 response_ids=torch.ones(ROWS, 3, dtype=torch.long), response_lengths=torch.full((ROWS,), 3),
                 response_mask=torch.ones(ROWS, 3), group_id=torch.arange(ROWS) // 4,
                 scores=torch.arange(ROWS, dtype=torch.float))  # fmt: skip


def _rows(minis) -> list[list[int]]:
    """Each mini-batch's rows (by their scores, which number them)."""
    return [m.scores.long().tolist() for m in minis]


def test_unshuffled_mini_batches_are_the_consecutive_chunks_as_before():
    batch = _batch()
    assert _rows(mini_batches(batch, MINI, EPOCHS)) == _rows(batch.split(MINI)) * EPOCHS


def test_shuffled_mini_batches_permute_each_epoch_and_repeat_for_the_same_seed():
    seed = shuffle_seed(1, 5)
    got = _rows(mini_batches(_batch(), MINI, EPOCHS, seed))
    per_epoch = ROWS // MINI
    first, second = got[:per_epoch], got[per_epoch:]
    assert sorted(sum(first, [])) == sorted(sum(second, [])) == list(range(ROWS))  # every sample once per epoch
    assert first != _rows(_batch().split(MINI))  # the composition changed
    assert first != second  # each epoch its own permutation
    assert got == _rows(mini_batches(_batch(), MINI, EPOCHS, seed))  # same seed + step: the same cut (every rank)
    assert got != _rows(mini_batches(_batch(), MINI, EPOCHS, shuffle_seed(1, 6)))  # another step shuffles otherwise


def test_the_seed_is_a_function_of_run_seed_and_step_alone():
    assert shuffle_seed(1, 3) == shuffle_seed(1, 3)  # no state: a resumed run at step 3 gets this seed too
    assert len({shuffle_seed(1, 3), shuffle_seed(2, 3), shuffle_seed(1, 4), step_seed(1, 3)}) == 4


class _Recorder:
    """PolicyWorker.update / TrainableModel._step stand-ins that record what they were given."""

    def __init__(self) -> None:
        self.seeds: list[int | None] = []

    def update(self, batch, loss_fn, **kw) -> dict[str, float]:
        self.seeds.append(kw["shuffle_seed"])
        return {}


def _rank_seeds(shuffle: bool, steps: list[int]) -> list[int | None]:
    """The shuffle seeds PolicyRank.update passes down in ``steps``, from a fresh rank (a resumed run's)."""
    from megarl.actors.policy_rank import PolicyRank

    cfg = MegaRLConfig(model={"arch": "qwen3-8b"}, actor={"shuffle": shuffle, "ppo_epochs": 2, "mini_batch_size": 4})
    rank = SimpleNamespace(cfg=cfg, policy=_Recorder(), loss_fn=None)
    for step in steps:
        PolicyRank.update(rank, _batch(), 1.0, step)  # type: ignore[arg-type]
    return rank.policy.seeds


def test_the_policy_rank_seeds_its_update_by_step_and_a_resume_repeats_it():
    assert _rank_seeds(False, [1, 2]) == [None, None]  # off: today's order
    uninterrupted = _rank_seeds(True, [1, 2, 3])
    assert uninterrupted == [shuffle_seed(1, s) for s in (1, 2, 3)]
    assert _rank_seeds(True, [3]) == uninterrupted[2:]  # resumed at step 3


def test_the_update_loop_takes_its_mini_batches_shuffled():
    """TrainableModel.train cuts the mini-batches that mini_batches() gives for the seed."""
    from megarl.megatron_runtime.training import TrainableModel

    trainer = object.__new__(TrainableModel)
    seen: list[Batch] = []
    cfg = MegaRLConfig(model={"arch": "qwen3-8b"}).actor
    model = SimpleNamespace(info=SimpleNamespace(device=torch.device("cpu"), is_last_stage=False),
                            module=SimpleNamespace(ddp_config=SimpleNamespace(overlap_param_gather=False)),
                            reduce_metrics=lambda metrics, replicated: None)  # fmt: skip
    trainer.__dict__.update(closed=False, cfg=cfg, model=model, balance=None, role="actor",
                            schedule=SimpleNamespace(current_lr=0.0))  # fmt: skip
    trainer._step = lambda mini, head, metrics, stage_output: (seen.append(mini), (0.0, True, 0.0))[1]  # type: ignore[method-assign]
    seed = shuffle_seed(1, 2)
    trainer.train(_batch(), lambda *a: None, mini_batch_size=MINI, ppo_epochs=EPOCHS, shuffle_seed=seed)
    assert _rows(seen) == _rows(mini_batches(_batch(), MINI, EPOCHS, seed)) != _rows(_batch().split(MINI)) * EPOCHS
