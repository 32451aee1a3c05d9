"""The tiny DeepSeek-V3 (``model_type: deepseek_v3``) of megarl/models/tiny.py: its config and what a
random init leaves too easy to get right by accident.

The defaults exercise every place a DeepSeek-V3 conversion can go wrong: multi-latent attention
with a low-rank query (``q_lora_rank``; None: one ``q_proj``) and a split rope / no-rope head,
one dense first layer (``first_k_dense_replace``), then MoE layers of 4 routed experts (top-2)
beside one shared expert, sigmoid routing over 2 groups of which 1 is kept, a routed-scaling
factor of 2.5. After transformers' init (router weights of std 0.02, a zero correction bias)
:func:`spread_routing` gives every router larger weights and a non-zero
``e_score_correction_bias``: a bias of zeros would not show whether a bridge maps it, and nearly
equal scores would make the parity tests depend on rounding (a near-tie flips an expert).

Multi-token-prediction layers (``num_nextn_predict_layers``): transformers 5 builds none of them
(DeepseekV3ForCausalLM has no MTP module) and drops their tensors on load, so
:func:`append_mtp_layers` writes random ones into the saved file under DeepSeek's names
(``model.layers.{num_hidden_layers + i}.*``): what megarl's conversion must carry untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# DeepseekV3Config values of the tiny model; `deepseek_v3_config(..., **overrides)` changes any.
TINY_DEEPSEEK_V3: dict[str, Any] = dict(
    q_lora_rank=32,
    kv_lora_rank=16,  # + qk_rope_head_dim: 24, even (split over TP 2 by the local spec)
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=32,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    num_nextn_predict_layers=0,
    rope_interleave=True,
)


def deepseek_v3_config(common: dict[str, Any], **overrides: Any):
    """A ``DeepseekV3Config`` of the shared tiny fields (``common``: vocab, hidden size, layers,
    heads ...; tiny.py's) and :data:`TINY_DEEPSEEK_V3` updated with ``overrides``."""
    from transformers import DeepseekV3Config

    unknown = sorted(set(overrides) - set(TINY_DEEPSEEK_V3))
    if unknown:
        raise ValueError(f"tiny deepseek_v3 model: unknown setting(s) {unknown}; known: {sorted(TINY_DEEPSEEK_V3)}")
    values = {**TINY_DEEPSEEK_V3, **overrides}
    common = {**common, "num_key_value_heads": common["num_attention_heads"]}  # MLA: every head its own k/v
    return DeepseekV3Config(**common, **values, attention_bias=False)


def spread_routing(model: Any, seed: int) -> None:
    """Router weights of std 0.3 and a correction bias of std 0.1 in every MoE layer (module docstring)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is None:  # a dense layer
                continue
            gate.weight.copy_(torch.randn(gate.weight.shape, generator=gen) * 0.3)
            gate.e_score_correction_bias.copy_(torch.randn(gate.e_score_correction_bias.shape, generator=gen) * 0.1)


def mtp_tensor_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """The tensors of DeepSeek's MTP layers, by name: each a full MoE decoder layer plus its own
    embedding, the two input norms, the projection of their concatenation and a head (with its norm)."""
    h, v, f = hf_config.hidden_size, hf_config.vocab_size, hf_config.moe_intermediate_size
    heads, experts = hf_config.num_attention_heads, hf_config.n_routed_experts
    qk, vd = hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim, hf_config.v_head_dim
    layer = {
        "embed_tokens.weight": (v, h), "enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
        "shared_head.norm.weight": (h,), "shared_head.head.weight": (v, h),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.kv_a_proj_with_mqa.weight": (hf_config.kv_lora_rank + hf_config.qk_rope_head_dim, h),
        "self_attn.kv_a_layernorm.weight": (hf_config.kv_lora_rank,),
        "self_attn.kv_b_proj.weight": (heads * (hf_config.qk_nope_head_dim + vd), hf_config.kv_lora_rank),
        "self_attn.o_proj.weight": (h, heads * vd),
        "mlp.gate.weight": (experts, h), "mlp.gate.e_score_correction_bias": (experts,),
        "mlp.shared_experts.gate_proj.weight": (f * hf_config.n_shared_experts, h),
        "mlp.shared_experts.up_proj.weight": (f * hf_config.n_shared_experts, h),
        "mlp.shared_experts.down_proj.weight": (h, f * hf_config.n_shared_experts),
    }  # fmt: skip
    if hf_config.q_lora_rank is None:
        layer["self_attn.q_proj.weight"] = (heads * qk, h)
    else:
        layer |= {"self_attn.q_a_proj.weight": (hf_config.q_lora_rank, h),
                  "self_attn.q_a_layernorm.weight": (hf_config.q_lora_rank,),
                  "self_attn.q_b_proj.weight": (heads * qk, hf_config.q_lora_rank)}  # fmt: skip
    for e in range(experts):
        layer |= {f"mlp.experts.{e}.gate_proj.weight": (f, h), f"mlp.experts.{e}.up_proj.weight": (f, h),
                  f"mlp.experts.{e}.down_proj.weight": (h, f)}  # fmt: skip
    first = hf_config.num_hidden_layers
    count = int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)
    return {f"model.layers.{first + i}.{k}": s for i in range(count) for k, s in layer.items()}


def append_mtp_layers(out: Path, hf_config: Any, seed: int) -> None:
    """Add random MTP tensors (:func:`mtp_tensor_shapes`) to ``out``'s single model.safetensors,
    in the dtype of its other tensors."""
    import torch
    from safetensors.torch import load_file, save_file

    shapes = mtp_tensor_shapes(hf_config)
    if not shapes:
        return
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    dtype = tensors["model.embed_tokens.weight"].dtype
    gen = torch.Generator().manual_seed(seed + 2000)
    tensors |= {name: (torch.randn(shape, generator=gen) * 0.02).to(dtype) for name, shape in shapes.items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
