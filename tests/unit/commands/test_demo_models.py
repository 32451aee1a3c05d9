"""Each demo config's built-in architecture (what `megarl plan` reads before the model exists) is
the shape of the model `megarl demo` builds for it; a root holding another demo's model is refused;
a demo variant that runs for long says so before it starts."""

from __future__ import annotations

import dataclasses

import pytest

from megarl.commands.demo import DEMO_MODELS, long_demo_note, prepare_demo
from megarl.config.architectures import BUILTIN_ARCHS, arch_from_hf_dir
from megarl.config.loading import load_config


@pytest.mark.parametrize("config", ["configs/tiny_grpo.yaml", "configs/tiny_moe_grpo.yaml", "configs/tiny_dsv3_grpo.yaml",
                                    "configs/tiny_tool_agent.yaml"])
def test_a_demo_arch_is_the_model_the_demo_builds(config, tmp_path):
    arch = load_config(config).model.arch
    assert arch in DEMO_MODELS
    model, _ = prepare_demo(tmp_path, arch=arch)
    built = arch_from_hf_dir(model)
    assert dataclasses.replace(built, name=arch) == BUILTIN_ARCHS[arch]


def test_a_root_with_another_demos_model_is_refused(tmp_path):
    prepare_demo(tmp_path)  # the dense demo's model
    with pytest.raises(ValueError, match=r"holds a qwen2 model, and this config's model.arch \(tiny-moe-demo\) is a "
                                         r"qwen3_moe one; give this demo its own --root \(e.g. --root outputs/moe-demo\)"):
        prepare_demo(tmp_path, arch="tiny-moe-demo")


def test_a_long_demo_variant_says_how_long_and_how_to_shorten_it():
    """`megarl demo rollout.engine=sglang` started 500 steps of about 4 s with no word."""
    note = long_demo_note(load_config("configs/tiny_grpo.yaml", ["rollout.engine=sglang"]))
    assert note is not None and note.startswith("megarl demo: 500 steps (trainer.total_steps) of about 4 s each")
    assert "about 33 minutes" in note and "add trainer.total_steps=4" in note
    assert long_demo_note(load_config("configs/tiny_grpo.yaml", ["rollout.engine=sglang", "trainer.total_steps=4"])) is None
    assert long_demo_note(load_config("configs/tiny_grpo.yaml")) is None  # the torch engine's 500 steps: minutes
