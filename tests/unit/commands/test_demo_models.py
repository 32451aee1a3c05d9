"""Each demo config's built-in architecture (what `megarl plan` reads before the model exists) is
the shape of the model `megarl demo` builds for it; a root holding another demo's model is refused."""

from __future__ import annotations

import dataclasses

import pytest

from megarl.commands.demo import DEMO_MODELS, prepare_demo
from megarl.config.architectures import BUILTIN_ARCHS, arch_from_hf_dir
from megarl.config.loading import load_config


@pytest.mark.parametrize("config", ["configs/tiny_grpo.yaml", "configs/tiny_moe_grpo.yaml"])
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
