"""verl's sampling features in megarl's config: ignore_eos, validation sampling of its own; how
they reach the engines' SamplingParams (megarl/trainer/loop.py)."""

from __future__ import annotations

import pydantic
import pytest

from megarl.config.sections import MegaRLConfig
from megarl.trainer.loop import sampling_params


def _cfg(**rollout) -> MegaRLConfig:
    return MegaRLConfig(model={"arch": "qwen3-8b"}, rollout=rollout)


def test_ignore_eos_reaches_training_and_validation_params():
    assert not sampling_params(_cfg(), 1).ignore_eos  # the default is unchanged
    cfg = _cfg(sampling={"ignore_eos": True})
    assert sampling_params(cfg, 1).ignore_eos and sampling_params(cfg, 1, validation=True).ignore_eos


def test_ignore_eos_with_stop_token_ids_is_refused_naming_both():
    with pytest.raises(pydantic.ValidationError, match="stop_token_ids .* ignore_eos=true"):
        _cfg(sampling={"ignore_eos": True, "stop_token_ids": [7]})


def test_validation_sampling_keys_without_greedy_false_are_refused():
    with pytest.raises(pydantic.ValidationError, match=r"rollout.val.temperature=0.7 has no effect .* rollout.val.greedy=false"):
        _cfg(val={"temperature": 0.7})
    assert _cfg(val={"greedy": False, "temperature": 0.7}).rollout.val.temperature == 0.7
