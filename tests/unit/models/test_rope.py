"""RoPE settings from HF configs (transformers 4 and 5 styles) and llama3 frequency scaling."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megarl.models.rope import RopeSettings, default_inv_freq, llama3_inv_freq, read_rope

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 256}


def test_llama3_inv_freq_equals_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=512)
    cfg.rope_parameters = {**LLAMA3, "rope_theta": 10000.0}
    hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = llama3_inv_freq(16, read_rope(cfg))
    assert torch.equal(ours, hf_inv.to(torch.float32))
    default = default_inv_freq(16, 10000.0)
    # with these constants the three bands all occur: kept, interpolated, divided by factor
    assert (ours == default).sum() == 3 and (ours == default / 8).sum() == 4


def test_transformers4_style_config():
    cfg = SimpleNamespace(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    assert read_rope(cfg) == RopeSettings(theta=500000.0, rope_type="linear", factor=2.0)
    assert read_rope(SimpleNamespace(rope_theta=1e6, rope_scaling=None)).rope_type == "default"


@pytest.mark.parametrize(
    "rope, match",
    [
        ({"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}, "rope_type='yarn'.*supported: default, linear, llama3"),
        ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"rope_type": "default", "rope_theta": 1e4, "mrope_section": [1, 2]}, "mrope_section"),
        ({"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}, "lacks low_freq_factor"),
    ],
)
def test_unsupported_rope_is_refused_by_name(rope, match):
    with pytest.raises(ValueError, match=match):
        read_rope(SimpleNamespace(rope_parameters=rope))


DSV3_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # DeepSeek-V3's config.json  # fmt: skip


@pytest.mark.parametrize(
    "yarn",
    [
        DSV3_YARN,
        {**DSV3_YARN, "factor": 32.0, "beta_fast": 1.0},  # Kimi-K2's
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},  # neither mscale
        {**DSV3_YARN, "mscale": 0.7, "mscale_all_dim": None},  # HF ignores mscale alone
        {**DSV3_YARN, "mscale": 1.0, "mscale_all_dim": 0.8},
    ],
)
def test_yarn_maps_onto_megatron_as_hf_scales(yarn):
    """For multi-latent attention (``supported`` with yarn): Megatron's cos/sin factor and softmax
    scale from the mapped settings equal transformers' DeepSeek-V3 ones."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor,
        _yarn_get_mscale,
    )
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=64, max_position_embeddings=163840)
    cfg.rope_parameters = {**yarn, "rope_theta": 10000.0}
    ours = read_rope(cfg, ("default", "yarn"))
    _, hf_cos_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    assert _yarn_get_concentration_factor(ours.factor, ours.mscale, ours.mscale_all_dim) == pytest.approx(hf_cos_factor, rel=1e-12)
    softmax = _yarn_get_mscale(ours.factor, ours.mscale_all_dim) ** 2 / cfg.qk_head_dim**0.5
    assert softmax == pytest.approx(yarn_apply_mscale(cfg.rope_parameters, cfg.qk_head_dim**-0.5), rel=1e-12)
    assert (ours.original_max_position_embeddings, ours.beta_fast) == (yarn["original_max_position_embeddings"], yarn.get("beta_fast") or 32)


@pytest.mark.parametrize(
    "yarn, match",
    [
        ({**DSV3_YARN, "mscale": None}, r"mscale=None, mscale_all_dim=1\.0\) scales cos/sin by 1\.36889, which Megatron's yarn cannot \(1\)"),
        ({**DSV3_YARN, "attention_factor": 1.5}, r"attention_factor=1\.5.*which Megatron's yarn cannot"),
        ({**DSV3_YARN, "truncate": False}, "truncate=False"),
        ({"rope_type": "yarn", "factor": 4.0}, "lacks original_max_position_embeddings"),
    ],
)
def test_yarn_megatron_cannot_reproduce_is_refused_by_name(yarn, match):
    with pytest.raises(ValueError, match=match):
        read_rope(SimpleNamespace(rope_parameters={**yarn, "rope_theta": 1e4}), ("default", "yarn"))
