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
