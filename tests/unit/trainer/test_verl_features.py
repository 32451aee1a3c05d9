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


def test_a_top_k_of_0_is_refused_at_config_time_in_training_as_in_validation():
    """rollout.sampling.top_k=0 passed the config and the plan and failed at the first generation,
    after Ray started (the engines' SamplingParams refuse it); rollout.val.top_k=0 was refused here."""
    from megarl.config.loading import ConfigError, load_config

    base = ["model.arch=qwen3-8b", "trainer.total_steps=1"]
    with pytest.raises(ConfigError) as info:
        load_config(None, [*base, "rollout.sampling.top_k=0"])
    problems = [line for line in str(info.value).splitlines() if line.startswith("  - ")]
    assert problems == ["  - rollout.sampling.top_k: 0 samples nothing; use -1 (the whole vocabulary) or >= 1 (got 0)"]
    with pytest.raises(ConfigError, match=r"rollout.val.top_k: 0 samples nothing; use -1"):
        load_config(None, [*base, "rollout.val.greedy=false", "rollout.val.top_k=0"])
    for top_k in (-1, 1, 40):  # -1: the whole vocabulary
        assert sampling_params(_cfg(sampling={"top_k": top_k}), 1).top_k == top_k
