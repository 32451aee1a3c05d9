"""Bridge registry, HF config -> TransformerConfig, refusals, vocab padding, HF tensor names."""

from __future__ import annotations

import pytest
import torch

from megarl.config.train_sections import ParallelConfig
from megarl.models.bridges import get_bridge
from megarl.models.tiny import build_tiny_model, tiny_hf_config


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bridge_cfg")
    return {
        "qwen2": build_tiny_model(root / "qwen2", "qwen2"),
        "qwen3": build_tiny_model(root / "qwen3", "qwen3", tie_word_embeddings=True),
        "llama": build_tiny_model(root / "llama", "llama", num_kv_heads=4),
    }


def test_registry_lists_supported_types_on_a_miss():
    assert all(get_bridge(t) is not None for t in ("llama", "qwen2", "qwen3"))
    with pytest.raises(ValueError, match="'mixtral' has no megarl bridge; supported: .*llama.*qwen2.*qwen3"):
        get_bridge("mixtral")
    assert type(get_bridge(tiny_hf_config("qwen3", vocab_size=259))).__name__ == "Qwen3Bridge"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_hf_tensor_shapes_match_the_checkpoint(tiny_dirs, arch):
    from safetensors import safe_open
    from transformers import AutoConfig

    path = tiny_dirs[arch]
    bridge = get_bridge(AutoConfig.from_pretrained(path))
    with safe_open(path / "model.safetensors", framework="pt") as f:
        actual = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert bridge.hf_tensor_shapes(AutoConfig.from_pretrained(path)) == actual


def test_transformer_config_reads_every_field():
    cfg = tiny_hf_config("qwen3", vocab_size=259, hidden_size=64, num_heads=4, num_kv_heads=2)
    cfg.head_dim = 32  # qwen3 allows head_dim != hidden / heads
    cfg.rms_norm_eps = 1e-5
    tc = get_bridge(cfg).transformer_config(cfg, ParallelConfig(tp=2), torch.bfloat16, recompute="full")
    assert (tc.kv_channels, tc.num_query_groups, tc.layernorm_epsilon) == (32, 2, 1e-5)
    assert tc.qk_layernorm and not tc.add_qkv_bias and tc.gated_linear_unit
    assert tc.bf16 and tc.params_dtype == torch.bfloat16 and tc.recompute_granularity == "full"
    assert tc.calculate_per_token_loss and tc.hidden_dropout == 0.0 and tc.attention_dropout == 0.0
    q2 = tiny_hf_config("qwen2", vocab_size=259)
    assert get_bridge(q2).transformer_config(q2, ParallelConfig(), torch.float32).add_qkv_bias


def _qwen2(**overrides):
    cfg = tiny_hf_config("qwen2", vocab_size=259)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


@pytest.mark.parametrize(
    "overrides, parallel, match",
    [
        ({"use_sliding_window": True}, {}, "use_sliding_window=True"),
        ({"attention_dropout": 0.1}, {}, "attention_dropout=0.1.*supported: 0.0"),
        ({"hidden_act": "gelu"}, {}, "hidden_act='gelu'"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, {}, "rope_type='dynamic'"),
        ({}, {"tp": 4}, r"parallel.tp \(4\) must divide num_key_value_heads \(2\); try 1, 2"),
        ({}, {"pp": 3}, r"parallel.pp \(3\) must divide num_hidden_layers \(2\)"),
        ({}, {"cp": 2}, r"parallel.cp \(2\) is not supported"),
    ],
)
def test_unsupported_settings_are_refused_by_name(overrides, parallel, match):
    cfg = _qwen2(**overrides)
    with pytest.raises(ValueError, match=match):
        get_bridge(cfg).transformer_config(cfg, ParallelConfig(**parallel), torch.float32)


def test_llama_attention_bias_refused():
    cfg = tiny_hf_config("llama", vocab_size=259)
    cfg.attention_bias = True
    with pytest.raises(ValueError, match="attention_bias=True"):
        get_bridge(cfg).transformer_config(cfg, ParallelConfig(), torch.float32)


def test_padded_vocab_size():
    b = get_bridge("qwen2")
    assert b.padded_vocab_size(tiny_hf_config("qwen2", vocab_size=259), 1) == 259
    assert b.padded_vocab_size(tiny_hf_config("qwen2", vocab_size=259), 2) == 260
    big = tiny_hf_config("qwen2", vocab_size=151646)
    assert b.padded_vocab_size(big, 1) == 151680  # multiple of 128
    assert b.padded_vocab_size(big, 8) == 152576  # multiple of 1024
    assert b.vocab_size(big) == 151646


def _rewrite(src, dst, drop=(), add=None, reshape=None):
    """Copy a tiny checkpoint with tensors dropped / added / reshaped."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if k not in drop}
    tensors.update(add or {})
    for name, shape in (reshape or {}).items():
        tensors[name] = torch.zeros(shape)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_checkpoint_check_names_the_offending_tensor(tiny_dirs, tmp_path):
    from transformers import AutoConfig

    src = tiny_dirs["qwen2"]
    cfg = AutoConfig.from_pretrained(src)
    bridge = get_bridge(cfg)
    bridge.check_hf_checkpoint(cfg, str(src))  # the original passes
    extra = _rewrite(src, tmp_path / "extra", add={"model.layers.0.mlp.extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"map to no Megatron parameter: \['model.layers.0.mlp.extra.weight'\]"):
        bridge.check_hf_checkpoint(cfg, str(extra))
    many = _rewrite(src, tmp_path / "many", add={f"model.layers.0.extra{i}.weight": torch.zeros(2) for i in range(10)})
    with pytest.raises(ValueError, match=r"map to no Megatron parameter: \['model.layers.0.extra0.weight', .*"
                                         r"'model.layers.0.extra7.weight'\] and 2 more; expected tensors missing: none$"):
        bridge.check_hf_checkpoint(cfg, str(many))  # a real model's hundreds: one readable line
    missing = _rewrite(src, tmp_path / "missing", drop={"model.layers.1.self_attn.k_proj.bias"})
    with pytest.raises(ValueError, match=r"missing: \['model.layers.1.self_attn.k_proj.bias'\]"):
        bridge.check_hf_checkpoint(cfg, str(missing))
    wrong = _rewrite(src, tmp_path / "shape", reshape={"model.norm.weight": (3,)})
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(3,\), the config implies \(64,\)"):
        bridge.check_hf_checkpoint(cfg, str(wrong))
    # a critic built from this policy checkpoint does not use lm_head: accepted
    no_head = _rewrite(src, tmp_path / "nohead", drop={"lm_head.weight"})
    bridge.check_hf_checkpoint(cfg, str(no_head), value_head=True)


def test_an_unresolved_recompute_auto_is_refused():
    cfg = _qwen2()
    with pytest.raises(ValueError, match="recompute=auto is resolved by the plan"):
        get_bridge(cfg).transformer_config(cfg, ParallelConfig(), torch.float32, "auto")


def test_check_hf_model_says_which_part_is_refused(tiny_dirs, tmp_path):
    """One check for launch's preflight and generate: a config refusal and a weights refusal
    are told apart (generate leaves the first to the engine), each as one line."""
    import json
    import shutil

    from megarl.models.bridges import ModelRefused, check_hf_model

    src = tiny_dirs["qwen2"]
    check_hf_model(str(src), (ParallelConfig(tp=2),))  # the original passes, in a layout it divides
    with pytest.raises(ModelRefused, match=r"^ValueError: .*tp \(8\) must divide") as refused:
        check_hf_model(str(src), (ParallelConfig(tp=8),))
    assert refused.value.part == "config"
    other = shutil.copytree(src, tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"model_type": "gpt2"}))
    with pytest.raises(ModelRefused, match=r"model_type 'gpt2' has no megarl bridge") as refused:
        check_hf_model(str(other))
    assert refused.value.part == "config"
    missing = _rewrite(src, tmp_path / "missing", drop={"model.norm.weight"})
    with pytest.raises(ModelRefused, match=r"^ValueError: HF checkpoint .* expected tensors missing: \['model.norm.weight'\]$") as refused:  # fmt: skip
        check_hf_model(str(missing))
    assert refused.value.part == "weights"
    check_hf_model(str(missing), weights=False)  # a model checkpoint's weights are checked elsewhere


def test_the_te_spec_asks_megatron_for_the_fused_rope(monkeypatch):
    """Megatron's unfused THD rope reads the packed offsets on the host in every layer; under the TE
    spec (offsets on the device) that is a sync per layer, so the TE spec asks for TE's fused rope.
    The local spec keeps the unfused apply (megarl/models/packed_rope.py relies on it)."""
    from megatron.core.models.common.embeddings import rope_utils

    cfg = tiny_hf_config("qwen2", vocab_size=259)
    bridge = get_bridge(cfg)
    assert bridge.transformer_config(cfg, ParallelConfig(), torch.float32).apply_rope_fusion is False
    assert bridge.transformer_config(cfg, ParallelConfig(), torch.float32, spec="local").apply_rope_fusion is False
    if rope_utils.fused_apply_rotary_pos_emb_thd is None:
        # Megatron refuses the fusion where TE's kernels do not import (no transformer-engine here),
        # which resolve_layer_spec already rules out for the TE spec: a stand-in plays them.
        with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
            bridge.transformer_config(cfg, ParallelConfig(), torch.float32, spec="te")
        monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", lambda *a, **k: None)
    assert bridge.transformer_config(cfg, ParallelConfig(), torch.float32, spec="te").apply_rope_fusion is True


def test_the_planner_knows_every_bridge_by_its_model_type():
    """The planner imports no torch, so it keeps its own list of bridged model types."""
    from megarl.models.bridge import BRIDGES
    from megarl.models.bridges import get_bridge
    from megarl.plan.planner import BRIDGED_MODEL_TYPES

    get_bridge("qwen2")  # the built-in bridges are registered
    assert sorted(BRIDGED_MODEL_TYPES) == sorted(BRIDGES)
