"""`megarl config` lists every leaf key of the config with its default."""

import pytest

from megarl.config.documentation import describe
from megarl.config.loading import ConfigError


def test_every_leaf_key_is_listed():
    text = describe()
    for key in ("rollout.sampling.temperature = 1.0", "actor.optimizer.lr = 1e-06", "algorithm.kl.estimator = 'k3'",
                "trainer.resume = 'auto'", "model.path = None", "reward.custom: (optional section", "reward.custom.path = <required>"):
        assert key in text


def test_one_section_and_a_bad_one():
    assert describe("actor.optimizer").splitlines()[0].startswith("actor.optimizer.lr = ")
    with pytest.raises(ConfigError, match=r"^unknown key actor\.xyzzy; valid keys here: .*parallel, .*optimizer"):
        describe("actor.xyzzy")


def test_one_key_and_a_misspelt_one():
    assert describe("actor.optimizer.lr") == "actor.optimizer.lr = 1e-06  (float)  Peak learning rate."
    assert describe("rollout.n").startswith("rollout.n = ")
    with pytest.raises(ConfigError, match=r"^unknown key rollout\.sampling\.temprature; did you mean rollout\.sampling\.temperature\?"):
        describe("rollout.sampling.temprature")
    with pytest.raises(ConfigError, match=r"^unknown key actor\.lr; did you mean actor\.optimizer\.lr\?$"):
        describe("actor.lr")  # a key one section down, as overrides and YAML files say it
    with pytest.raises(ConfigError, match=r"^rollout\.n is a key, not a section; `megarl config rollout\.n` describes it$"):
        describe("rollout.n.x")


def test_a_config_file_is_not_a_key():
    with pytest.raises(ConfigError, match=r"^configs/tiny_grpo.yaml looks like a config file; .*`megarl plan configs/tiny_grpo.yaml`"):
        describe("configs/tiny_grpo.yaml")
