"""TrainerState round trip (weights_only) and exact RNG restore."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from megarl.checkpoint.trainer_state import (
    STATE_FILE,
    TrainerState,
    capture_rng,
    restore_rng,
    to_plain,
)
from megarl.data.batch import Batch


def _draws() -> tuple:
    return (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), torch.rand(3).tolist(),
            torch.randint(0, 1000, (4,)).tolist())


def _batch() -> Batch:
    return Batch(
        prompt_ids=torch.tensor([[0, 5, 6], [7, 8, 9]]),
        prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
        response_ids=torch.tensor([[1, 2], [3, 0]]),
        response_lengths=torch.tensor([2, 1]),
        response_mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
        group_id=torch.tensor([0, 0]),
        data_source=["gsm8k", "gsm8k"],
        ground_truth=["4", "4"],
        extra_info=[{"idx": 1}, {"idx": 1}],
        finish_reason=["stop", "length"],
        prompt_text=["a", "a"],
        scores=torch.tensor([1.0, 0.0]),
    )


def test_rng_restore_repeats_draws():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    state = capture_rng()
    first = _draws()
    _draws()
    restore_rng(state)
    assert _draws() == first


def test_round_trip_through_file(tmp_path):
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    carry = _batch()
    state = TrainerState(
        step=7,
        sampler={"epoch": 1, "offset": 12, "order": torch.randperm(10), "seed": 5},
        kl_controller={"coef": 0.05, "history": [0.1, 0.07]},
        dynamic_sampling_carry=carry,
        rng=capture_rng(),
    )
    expected = _draws()
    path = state.save(tmp_path)
    assert path.name == STATE_FILE
    torch.load(path, weights_only=True)  # plain data only: the safe loader reads it
    _draws()  # move every RNG on
    loaded = TrainerState.load(tmp_path)
    restore_rng(loaded.rng)
    assert _draws() == expected
    assert loaded.step == 7 and loaded.kl_controller == {"coef": 0.05, "history": [0.1, 0.07]}
    assert loaded.sampler["offset"] == 12 and torch.equal(loaded.sampler["order"], state.sampler["order"])
    got = loaded.dynamic_sampling_carry
    assert isinstance(got, Batch)
    assert torch.equal(got.response_mask, carry.response_mask) and got.finish_reason == ["stop", "length"]
    assert got.extra_info == [{"idx": 1}, {"idx": 1}] and got.old_logprobs is None
    assert torch.equal(got.scores, carry.scores)


def test_non_plain_values_are_refused_with_their_path(tmp_path):
    with pytest.raises(TypeError, match=r"sampler\['gen'\]: Generator cannot go into trainer_state.pt"):
        TrainerState(sampler={"gen": torch.Generator()}).save(tmp_path)
    with pytest.raises(TypeError, match="dict key"):
        to_plain({(1, 2): 3})


def test_missing_state_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=STATE_FILE):
        TrainerState.load(tmp_path)


def test_the_post_push_checks_baseline_round_trips_and_older_states_have_none(tmp_path):
    kept = {"first": [0.03, 0.045, 0.035, 0.05, 0.032], "baseline": 0.035}
    TrainerState(step=9, logprob_check=kept).save(tmp_path)
    assert TrainerState.load(tmp_path).logprob_check == kept
    # A trainer_state.pt written before the baseline was kept: the check measures it again.
    payload = torch.load(tmp_path / STATE_FILE, weights_only=True)
    del payload["logprob_check"]
    torch.save(payload, tmp_path / STATE_FILE)
    assert TrainerState.load(tmp_path).logprob_check == {}
