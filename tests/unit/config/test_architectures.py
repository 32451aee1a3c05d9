"""Mixture-of-experts architecture numbers: the built-ins against the published counts, a
config.json's expert fields, and `megarl plan --list-archs`."""

import pytest

from megarl.cli import main
from megarl.config.architectures import BUILTIN_ARCHS, arch_from_hf_dict


# Qwen's model cards: 30.5B total / 3.3B activated, 235B total / 22B activated.
@pytest.mark.parametrize(("name", "total", "active"), [("qwen3-30b-a3b", 30.5, 3.3), ("qwen3-235b-a22b", 235.0, 22.0)])
def test_moe_builtins_match_published_total_and_active_counts(name, total, active):
    arch = BUILTIN_ARCHS[name]
    assert arch.num_params / 1e9 == pytest.approx(total, rel=0.02)
    assert arch.active_params / 1e9 == pytest.approx(active, rel=0.02)


def test_moe_layer_params_by_hand():
    a = BUILTIN_ARCHS["qwen3-30b-a3b"]
    attention = 2048 * (4096 + 2 * 512) + 4096 * 2048 + 2 * 128 + 2 * 2048  # qkv, o, q/k norms, two RMSNorms
    router, experts = 128 * 2048, 128 * 3 * 2048 * 768
    assert a.moe_layer_params == (attention + router, experts)
    assert a.num_params == 48 * (attention + router + experts) + 2 * 151936 * 2048 + 2048  # untied, final norm
    assert a.active_params == a.num_params - 48 * 120 * 3 * 2048 * 768  # 120 of 128 experts idle per token


def _moe_config(**extra) -> dict:
    return {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 100, "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, **extra}  # fmt: skip


def test_a_config_json_gives_the_experts_and_which_layers_are_dense():
    a = arch_from_hf_dict(_moe_config(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert (a.num_experts, a.experts_per_token, a.moe_ffn_hidden_size) == (8, 2, 32)
    # (i + 1) % 2 == 0 picks layers 1 and 3; layer 3 is listed dense: layer 1 alone is MoE
    assert [a.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    dense, experts = a.moe_layer_params
    assert a.layers_params(0, 4) == (3 * a.layer_params + dense, experts)
    assert a.layer_params == a.attention_params + 3 * 64 * 96  # a dense layer's MLP is intermediate_size wide
    assert arch_from_hf_dict(_moe_config()).num_moe_layers == 4  # Qwen3-MoE's defaults: every layer
    plain = arch_from_hf_dict({k: v for k, v in _moe_config().items() if not k.startswith(("num_experts", "moe_"))})
    assert (plain.num_experts, plain.num_moe_layers, plain.active_params) == (0, 0, plain.num_params)


def test_list_archs_shows_the_moe_builtins_with_active_params(capsys):
    assert main(["plan", "--list-archs"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    assert rows["qwen3-30b-a3b"][1:5] == ["qwen3_moe", "30.53B", "3.35B", "8/128"]
    assert rows["qwen3-235b-a22b"][1:5] == ["qwen3_moe", "235.09B", "22.19B", "8/128"]
    assert rows["qwen2.5-72b"][3:5] == ["-", "-"]  # a dense model has no active share or experts


# DeepSeek-V3's model card: 671B total (without the 14B MTP module), 37B activated; Kimi-K2's: 1T
# (1.04T) total, 32B activated. Counted here: 671.03B / 37.55B and 1.026T / 32.86B.
@pytest.mark.parametrize(("name", "total", "active", "rel"), [("deepseek-v3", 671.0, 37.0, 0.02),
                                                              ("kimi-k2", 1040.0, 32.0, 0.03)])  # fmt: skip
def test_deepseek_v3_family_matches_published_total_and_active_counts(name, total, active, rel):
    arch = BUILTIN_ARCHS[name]
    assert arch.num_params / 1e9 == pytest.approx(total, rel=rel)
    assert arch.active_params / 1e9 == pytest.approx(active, rel=rel)


def test_deepseek_v3_params_by_hand():
    """Multi-latent attention, 3 dense layers, 1 shared expert beside 256 routed, a correction bias."""
    a = BUILTIN_ARCHS["deepseek-v3"]
    h, heads = 7168, 128
    mla = (h * 1536 + 1536 + 1536 * heads * (128 + 64)  # q down, its norm, q up
           + h * (512 + 64) + 512 + 512 * heads * (128 + 128)  # kv down (latent + shared rope key), norm, kv up
           + heads * 128 * h)  # output
    assert a.attention_params == mla + 2 * h == 187_121_664
    expert = 3 * h * 2048
    assert a.moe_layer_params == (mla + 2 * h + 256 * (h + 1) + expert, 256 * expert)  # router + bias + shared expert
    dense_layer = mla + 2 * h + 3 * h * 18432
    assert a.num_params == 3 * dense_layer + 58 * sum(a.moe_layer_params) + 2 * 129280 * h + h == 671_026_419_200
    assert a.active_params == a.num_params - 58 * 248 * expert


def _deepseek_v3_config_json() -> dict:
    """deepseek-ai/DeepSeek-V3's config.json (the fields the planner reads)."""
    return {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
            "num_key_value_heads": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
            "vocab_size": 129280, "max_position_embeddings": 163840, "tie_word_embeddings": False,
            "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
            "moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "n_group": 8, "topk_group": 4,
            "routed_scaling_factor": 2.5, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "num_nextn_predict_layers": 1}  # fmt: skip


def test_a_deepseek_v3_config_json_gives_the_builtin_shape():
    a = arch_from_hf_dict(_deepseek_v3_config_json(), name="deepseek-v3")
    assert a == BUILTIN_ARCHS["deepseek-v3"]
    assert [a.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]
    every_other = arch_from_hf_dict(_deepseek_v3_config_json() | {"num_hidden_layers": 6, "moe_layer_freq": 2})
    assert [every_other.is_moe_layer(i) for i in range(6)] == [False, False, False, False, True, False]
    greedy = arch_from_hf_dict(_deepseek_v3_config_json() | {"topk_method": "greedy"})  # DeepSeek-V2: no bias
    assert not greedy.router_bias and greedy.moe_layer_params[0] == a.moe_layer_params[0] - 256


def test_list_archs_shows_deepseek_v3_and_kimi_k2(capsys):
    assert main(["plan", "--list-archs"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    assert rows["deepseek-v3"][1:5] == ["deepseek_v3", "671.03B", "37.55B", "8/256"]
    assert rows["kimi-k2"][1:5] == ["deepseek_v3", "1026.41B", "32.86B", "8/384"]
