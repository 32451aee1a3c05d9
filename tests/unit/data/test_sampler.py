"""The resumable sampler: mixing proportions, per-epoch shuffles, exact resume."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from megarl.data.datasets import DataError
from megarl.data.sampler import MixtureSampler


def _run(sampler: MixtureSampler, steps: int) -> list[list[tuple[int, int]]]:
    return [sampler.next_indices() for _ in range(steps)]


def test_weights_set_each_steps_composition_exactly():
    sampler = MixtureSampler([50, 20], [3.0, 1.0], batch_size=32, seed=0)
    for batch in _run(sampler, 10):
        counts = Counter(f for f, _ in batch)
        assert counts == {0: 24, 1: 8}


def test_uneven_weights_track_the_shares_over_time():
    sampler = MixtureSampler([7, 11, 5], [0.5, 0.3, 0.2], batch_size=10, seed=3)
    drawn = Counter(f for batch in _run(sampler, 100) for f, _ in batch)
    assert [drawn[i] for i in range(3)] == [500, 300, 200]


def test_each_file_epoch_is_a_seeded_permutation_that_changes_per_epoch():
    sampler = MixtureSampler([10], batch_size=5, seed=7)
    rows = [r for batch in _run(sampler, 6) for _, r in batch]  # 3 epochs of 10
    epochs = [rows[0:10], rows[10:20], rows[20:30]]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3  # a new order every epoch
    assert sampler.epoch == 3.0
    again = [r for batch in _run(MixtureSampler([10], batch_size=5, seed=7), 6) for _, r in batch]
    other = [r for batch in _run(MixtureSampler([10], batch_size=5, seed=8), 6) for _, r in batch]
    assert again == rows and other != rows


def test_no_shuffle_reads_in_order_and_straddles_epochs():
    sampler = MixtureSampler([5], batch_size=3, seed=0, shuffle=False)
    assert [[r for _, r in b] for b in _run(sampler, 3)] == [[0, 1, 2], [3, 4, 0], [1, 2, 3]]
    assert sampler.steps_per_epoch() == 2


@pytest.mark.parametrize("k", [1, 3, 4, 7])
def test_resume_matches_an_uninterrupted_run(k):
    # 13 + 6 rows, 5 prompts a step: epochs of both files end mid-step several times.
    def make() -> MixtureSampler:
        return MixtureSampler([13, 6], [2.0, 1.0], batch_size=5, seed=11)

    full = _run(make(), 12)
    first = make()
    _run(first, k)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.step == k
    assert _run(resumed, 12 - k) == full[k:]


def test_resume_refuses_different_data_or_seed():
    state = MixtureSampler([10, 4], batch_size=2, seed=1).state_dict()
    with pytest.raises(DataError, match=r"rows per train file \(after filtering\) = \[10, 4\], the config now gives \[10, 5\]"):
        MixtureSampler([10, 5], batch_size=2, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="data.seed = 1, the config now gives 2"):
        MixtureSampler([10, 4], batch_size=2, seed=2).load_state_dict(state)
    # prompts_per_step may change: the stream continues
    MixtureSampler([10, 4], batch_size=8, seed=1).load_state_dict(state)


@pytest.mark.parametrize(
    ("saved", "now"),
    [
        (dict(weights=[2.0, 1.0], seed=11), dict(weights=[4.0, 2.0], seed=11)),  # the same shares
        (dict(weights=[0.5, 0.25], seed=11), dict(weights=[2.0, 1.0], seed=11)),
        (dict(weights=[2.0, 1.0], seed=11, shuffle=False), dict(weights=[2.0, 1.0], seed=5, shuffle=False)),
    ],
)
def test_a_resume_with_settings_that_leave_the_stream_as_it_was_goes_on(saved, now):
    # (refused before: a seed without shuffle, or weights scaled, change nothing the sampler draws)
    full = _run(MixtureSampler([13, 6], batch_size=5, **saved), 8)
    first = MixtureSampler([13, 6], batch_size=5, **saved)
    _run(first, 3)
    resumed = MixtureSampler([13, 6], batch_size=5, **now)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert _run(resumed, 5) == full[3:]
    with pytest.raises(DataError, match=r"data.train_files weights = \[2.0, 1.0\], the config now gives \[3.0, 1.0\]"):
        MixtureSampler([13, 6], [3.0, 1.0], batch_size=5, seed=11).load_state_dict(
            MixtureSampler([13, 6], [2.0, 1.0], batch_size=5, seed=11).state_dict())
    with pytest.raises(DataError, match="data.seed = 11, the config now gives 5"):  # shuffled on either side
        MixtureSampler([13, 6], batch_size=5, seed=5, shuffle=False).load_state_dict(
            MixtureSampler([13, 6], batch_size=5, seed=11).state_dict())


def test_bad_weights_are_user_errors():
    with pytest.raises(DataError, match="weights must be > 0"):
        MixtureSampler([3, 3], [1.0, 0.0], batch_size=2, seed=0)
