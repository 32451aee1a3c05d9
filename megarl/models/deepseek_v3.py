"""The DeepSeek-V3 bridge (HF ``model_type: deepseek_v3``: DeepSeek-V3/R1, Kimi-K2 and their kin):
multi-latent attention, shared experts, grouped sigmoid routing with a correction bias, dense
first layers; MoE parallelism and expert names as the Qwen3-MoE bridge (megarl/models/qwen3_moe.py).

What maps where (Megatron local spec, per decoder layer ``i``; HF ``model.layers.{i}.``):

- ``self_attention.linear_q_down_proj`` = ``self_attn.q_a_proj``, ``q_layernorm`` = ``q_a_layernorm``,
  ``linear_q_up_proj`` = ``q_b_proj`` (``linear_q_proj`` = ``q_proj`` when ``q_lora_rank`` is None);
  ``linear_kv_down_proj`` = ``kv_a_proj_with_mqa``, ``kv_layernorm`` = ``kv_a_layernorm``,
  ``linear_kv_up_proj`` = ``kv_b_proj``, ``linear_proj`` = ``o_proj``. The rows are the same in
  both: per head ``[no-rope, rope]`` for q, ``[k no-rope, v]`` for kv_b, the latent then k_pe for
  kv_a. The rope dimensions need no permutation: with ``rope_interleave`` (DeepSeek's default)
  HF rotates the pairs (x0, x1), (x2, x3) ... of the rope part, and Megatron's MLA rope
  de-interleaves the same pairs (``multi_latent_attention`` in its rope apply) before a
  half-rotation: the same rotation (tests/distributed/test_deepseek_v3_bridge.py). The two down
  projections are replicated over TP (each rank its sequence slice, as transformer-engine's MLA
  spec has them), not column-parallel as in megatron-core's local MLA spec (0.16.1, 0.19.2): there the
  rope part of ``kv_a_proj_with_mqa`` (k_pe, shared by every head) gets the gradient of this TP
  rank's heads only (measured at TP 2, on both: 0.6% off HF's); replicated under sequence parallelism,
  k_pe is gathered over the sequence and its gradient reduce-scattered, summing every head's.
  So TP > 1 needs ``sequence_parallel`` (refused without).
- the first ``first_k_dense_replace`` layers: ``mlp.linear_fc1`` = cat(``mlp.gate_proj``,
  ``mlp.up_proj``), ``mlp.linear_fc2`` = ``mlp.down_proj`` (``intermediate_size`` wide);
- MoE layers: ``mlp.router.weight`` = ``mlp.gate.weight``; the router's ``expert_bias`` buffer
  (``moe_router_enable_expert_bias``, always on here: the bias takes part in every top-k) =
  ``mlp.gate.e_score_correction_bias``, fp32 in both; it is not a parameter and gets no
  gradient: the role's ``moe.expert_bias_update_rate`` moves it by load (0: frozen, as HF and
  inference keep it); experts as Qwen3-MoE's (``mlp.experts.{e}.{gate,up,down}_proj``);
  ``mlp.shared_experts.linear_fc1`` / ``linear_fc2`` = ``mlp.shared_experts.{gate,up}_proj`` /
  ``down_proj`` (``n_shared_experts * moe_intermediate_size`` wide, TP-split like a dense MLP).
- routing: sigmoid scores plus the bias choose ``topk_group`` of ``n_group`` groups (each by the
  sum of its two best biased scores) then the top ``num_experts_per_tok`` experts in them; the
  weights are the unbiased scores, normalised, times ``routed_scaling_factor``: Megatron's
  ``moe_router_num_groups`` / ``group_topk`` / ``topk_scaling_factor`` with the sigmoid score
  function. Megatron ranks groups by their top ``topk / group_topk`` scores and HF by their top
  2: configs where these differ are refused (DeepSeek-V3 and Kimi-K2: 8 / 4 = 2).

Multi-token-prediction layers (``num_nextn_predict_layers``; tensors ``model.layers.{L + j}.*``
after the ``L`` decoder layers) are not trained: :meth:`DeepseekV3Bridge.carried_names` names
them, the checkpoint checks accept them, and `megarl convert` carries them through a side file
bit for bit (megarl/models/carried_tensors.py).

Rope scaling: yarn (DeepSeek-V3's and Kimi-K2's own) maps onto MLA's yarn settings
(:func:`rope_kwargs`; megarl/models/rope.py says how HF's mscale keys become Megatron's, and
refuses the combinations Megatron cannot reproduce); other scaling types are refused.

What does not run, or is refused by name: ``rope_interleave`` false (would need the rope rows
permuted), ``norm_topk_prob`` false (Megatron always normalises sigmoid top-k weights),
``scoring_func`` other than sigmoid, ``topk_method`` other than noaux_tc, a
``num_key_value_heads`` other than the head count, the transformer-engine layer spec (its MLA
names are not mapped yet), expert tensor parallelism, quantized (FP8) checkpoints. On CPU with
megatron-core 0.16.1: MLA's rope fusion (a TE/Triton kernel; yarn only) is off, and MLA's
packed-sequence (THD) path is not tested; padded micro-batches are.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from megarl.models.bridge import register_bridge
from megarl.models.dense import DenseDecoderBridge
from megarl.models.layer_specs import LayerSpec
from megarl.models.layouts import ParamRule
from megarl.models.norm import RMSNorm
from megarl.models.qwen3_moe import Qwen3MoeBridge, load_balance_kwargs
from megarl.models.rope import MLA_ROPE_TYPES, RopeSettings, read_rope
from megarl.parallel.mcore_version import installed_version

# Megatron local suffix (MLA) -> (HF suffix, layout) inside one decoder layer.
_MLA_RULES: dict[str, tuple[str, str]] = {
    "self_attention.linear_q_proj.weight": ("self_attn.q_proj.weight", "column"),
    "self_attention.linear_q_down_proj.weight": ("self_attn.q_a_proj.weight", "replicated"),
    "self_attention.q_layernorm.weight": ("self_attn.q_a_layernorm.weight", "replicated"),
    "self_attention.linear_q_up_proj.weight": ("self_attn.q_b_proj.weight", "column"),
    "self_attention.linear_kv_down_proj.weight": ("self_attn.kv_a_proj_with_mqa.weight", "replicated"),
    "self_attention.kv_layernorm.weight": ("self_attn.kv_a_layernorm.weight", "replicated"),
    "self_attention.linear_kv_up_proj.weight": ("self_attn.kv_b_proj.weight", "column"),
    "mlp.router.expert_bias": ("mlp.gate.e_score_correction_bias", "replicated"),
}
_SHARED_RULES: dict[str, tuple[tuple[str, ...], str]] = {
    "mlp.shared_experts.linear_fc1.weight": (("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"), "fc1"),
    "mlp.shared_experts.linear_fc2.weight": (("mlp.shared_experts.down_proj.weight",), "row"),
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def dense_layers(hf_config: Any) -> int:
    return int(hf_config.first_k_dense_replace or 0)


def moe_layers(hf_config: Any) -> list[bool]:
    """Per layer (0-based), whether it is an MoE layer: HF's rule (DeepseekV3DecoderLayer)."""
    return [i >= dense_layers(hf_config) for i in range(hf_config.num_hidden_layers)]


def mtp_layers(hf_config: Any) -> int:
    return int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)


@register_bridge("deepseek_v3")
class DeepseekV3Bridge(Qwen3MoeBridge):
    qk_norm = False  # MLA's q/kv norms are mapped by _MLA_RULES, not the dense q/k norm rules
    rope_types = MLA_ROPE_TYPES  # Megatron's MLA has yarn (rope_kwargs)

    # ---- config ------------------------------------------------------------------------
    def check_hf_config(self, hf_config: Any) -> None:
        """Refuse, by name, every HF setting this bridge does not implement (module docstring)."""
        self._check_decoder_config(hf_config)
        heads, experts, top_k = hf_config.num_attention_heads, int(hf_config.n_routed_experts), int(hf_config.num_experts_per_tok)
        self._check_mla(hf_config, heads)
        if not 1 <= top_k <= experts:
            self._refuse(hf_config, "num_experts_per_tok", top_k, f"1 to n_routed_experts ({experts})")
        if not 0 <= dense_layers(hf_config) <= hf_config.num_hidden_layers:
            self._refuse(hf_config, "first_k_dense_replace", hf_config.first_k_dense_replace, "0 to num_hidden_layers")
        if not hf_config.norm_topk_prob:
            self._refuse(hf_config, "norm_topk_prob", False, "true (Megatron normalises sigmoid top-k weights always)")
        for key, ok in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if getattr(hf_config, key, ok) != ok:
                self._refuse(hf_config, key, getattr(hf_config, key), repr(ok))
        self._check_groups(hf_config, experts, top_k)

    def _check_mla(self, hf_config: Any, heads: int) -> None:
        if (hf_config.num_key_value_heads or heads) != heads:
            self._refuse(hf_config, "num_key_value_heads", hf_config.num_key_value_heads, f"num_attention_heads ({heads})")
        if not getattr(hf_config, "rope_interleave", True):
            self._refuse(hf_config, "rope_interleave", False, "true (DeepSeek's interleaved rope dimensions)")
        if hf_config.q_lora_rank is None and mla_norms_q_proj():
            self._refuse(hf_config, "q_lora_rank", None, f"set, on megatron-core {installed_version()} (its MLA puts a norm "
                         "before q_proj when q_lora_rank is null, HF none); or use megatron-core 0.16")  # fmt: skip
        for key in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank"):
            if int(getattr(hf_config, key) or 0) < 1:
                self._refuse(hf_config, key, getattr(hf_config, key), ">= 1")

    def _check_groups(self, hf_config: Any, experts: int, top_k: int) -> None:
        groups, kept = int(hf_config.n_group or 1), int(hf_config.topk_group or 1)
        if experts % groups or not 1 <= kept <= groups:
            self._refuse(hf_config, "n_group/topk_group", (groups, kept),
                         f"n_group dividing n_routed_experts ({experts}), 1 <= topk_group <= n_group")  # fmt: skip
        if groups > 1 and (top_k % kept or top_k // kept != 2 or experts // groups < 2):
            self._refuse(hf_config, "num_experts_per_tok/topk_group", (top_k, kept),
                         "a ratio of 2 with at least 2 experts per group (HF ranks groups by their 2 best scores, "
                         "Megatron by their num_experts_per_tok / topk_group best)")  # fmt: skip

    def _dims(self, hf_config: Any) -> tuple[int, int, int]:
        """(heads, groups, kv_channels): MLA has a k and v per head; Megatron's core attention
        sizes its output by kv_channels, which is therefore the v head size."""
        heads = hf_config.num_attention_heads
        return heads, heads, int(hf_config.v_head_dim)

    def check_parallel(self, hf_config: Any, parallel: Any) -> None:
        super().check_parallel(hf_config, parallel)
        if parallel.etp != 1:  # the Qwen3-MoE experts' split is checked against HF; this model's is not yet
            raise ValueError(f"parallel.etp ({parallel.etp}) is not supported for deepseek_v3 yet (each expert stays "
                             "whole on its rank); set it to 1")  # fmt: skip
        if parallel.tp > 1 and not parallel.uses_sequence_parallel:
            raise ValueError(f"parallel.sequence_parallel (false) with parallel.tp ({parallel.tp}) is not supported for "
                             "deepseek_v3 (MLA's shared rope key would miss the other TP ranks' gradients); "
                             "set parallel.sequence_parallel to true")  # fmt: skip

    def transformer_config(self, hf_config: Any, parallel: Any, dtype: torch.dtype, recompute: str = "none",
                           spec: LayerSpec = "local", moe: Any = None):  # fmt: skip
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        self.check_hf_config(hf_config)
        self.check_parallel(hf_config, parallel)
        if spec != "local":
            raise ValueError(f"model.layer_spec ({spec}) is not supported for deepseek_v3 yet (transformer-engine's "
                             "MLA names are not mapped); set model.layer_spec to local")  # fmt: skip
        return MLATransformerConfig(**self._config_kwargs(hf_config, parallel, dtype, recompute, spec, moe))

    def _config_kwargs(self, hf_config: Any, parallel: Any, dtype: torch.dtype, recompute: str,
                       spec: LayerSpec = "local", moe: Any = None) -> dict[str, Any]:  # fmt: skip
        kwargs = DenseDecoderBridge._config_kwargs(self, hf_config, parallel, dtype, recompute, spec, moe)
        groups, balance = int(hf_config.n_group or 1), load_balance_kwargs(moe, sigmoid_router=True)
        shared = int(hf_config.n_shared_experts or 0) * hf_config.moe_intermediate_size
        kwargs.update(
            multi_latent_attention=True, q_lora_rank=hf_config.q_lora_rank, kv_lora_rank=hf_config.kv_lora_rank,
            qk_head_dim=hf_config.qk_nope_head_dim, qk_pos_emb_head_dim=hf_config.qk_rope_head_dim,
            v_head_dim=hf_config.v_head_dim, qk_layernorm=True,  # MLA: the q_a / kv_a norms
            **rope_kwargs(read_rope(hf_config, self.rope_types)), rotary_percent=1.0,
            apply_rope_fusion=False,  # MLA's fused rope is yarn-only and a Triton kernel
            num_moe_experts=int(hf_config.n_routed_experts),
            moe_ffn_hidden_size=hf_config.moe_intermediate_size,
            moe_shared_expert_intermediate_size=shared or None,
            moe_layer_freq=[int(m) for m in moe_layers(hf_config)],
            moe_router_topk=int(hf_config.num_experts_per_tok),
            moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
            moe_router_num_groups=groups if groups > 1 else None,
            moe_router_group_topk=int(hf_config.topk_group) if groups > 1 else None,
            moe_router_topk_scaling_factor=float(hf_config.routed_scaling_factor),
            moe_router_dtype="fp32",  # HF routes in fp32 (its gate weight and bias stay fp32)
            moe_token_dispatcher_type="alltoall", moe_permute_fusion=False,
            expert_model_parallel_size=parallel.ep, expert_tensor_parallel_size=parallel.etp,
            **balance,
        )
        # The correction bias takes part in routing whether or not it is updated (rate 0: frozen).
        kwargs.update(moe_router_enable_expert_bias=True,
                      moe_router_bias_update_rate=balance["moe_router_bias_update_rate"] if balance["moe_router_enable_expert_bias"] else 0.0)  # fmt: skip
        return kwargs

    # ---- model ---------------------------------------------------------------------------
    def layer_spec(self, spec: LayerSpec = "local"):
        return self._mla_layer(None)

    def moe_layer_spec(self, spec: LayerSpec, num_experts: int):
        return self._mla_layer(num_experts)

    def _mla_layer(self, num_experts: int | None):
        """A decoder layer of Megatron's local spec with MLA, megarl's RMSNorm in every norm slot
        (q_a / kv_a norms included), SDPA core attention and replicated down projections."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        layer = self._localized(get_gpt_layer_local_spec(
            num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm", qk_layernorm=True,
            multi_latent_attention=True,
        ))  # fmt: skip
        from megatron.core.post_training.modelopt.layers import (
            Linear,  # replicated, marked sequence_parallel
        )

        attention = layer.submodules.self_attention.submodules
        attention.q_layernorm = attention.kv_layernorm = RMSNorm
        attention.linear_q_down_proj = attention.linear_kv_down_proj = Linear  # see the module docstring
        return layer

    def build_model(self, hf_config: Any, transformer_config: Any, *, pre_process: bool, post_process: bool,
                    value_head: bool = False, spec: LayerSpec = "local"):  # fmt: skip
        _mla_without_te()
        return super().build_model(hf_config, transformer_config, pre_process=pre_process, post_process=post_process,
                                   value_head=value_head, spec=spec)  # fmt: skip

    def mapped_buffers(self, gpt: Any) -> list[tuple[str, torch.Tensor]]:
        """Each MoE layer's router ``expert_bias`` (the HF correction bias; a buffer)."""
        return [(n, b) for n, b in gpt.named_buffers() if n.endswith(".mlp.router.expert_bias")]

    # ---- names ---------------------------------------------------------------------------
    def carried_names(self, hf_config: Any, names: set[str]) -> set[str]:
        """The MTP layers' tensors among ``names``: ``model.layers.{L..L+n-1}.*`` (module docstring)."""
        first, count = hf_config.num_hidden_layers, mtp_layers(hf_config)
        found = (_HF_LAYER.match(n) for n in names)
        return {m.string for m in found if m is not None and first <= int(m.group(1)) < first + count}

    def _layer_shapes(self, hf_config: Any, layer: int) -> dict[str, tuple[int, ...]]:
        c, h = hf_config, hf_config.hidden_size
        heads, qk = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
            "self_attn.kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.qk_rope_head_dim, h),
            "self_attn.kv_a_layernorm.weight": (c.kv_lora_rank,),
            "self_attn.kv_b_proj.weight": (heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
            "self_attn.o_proj.weight": (h, heads * c.v_head_dim),
        }  # fmt: skip
        if c.q_lora_rank is None:
            shapes["self_attn.q_proj.weight"] = (heads * qk, h)
        else:
            shapes |= {"self_attn.q_a_proj.weight": (c.q_lora_rank, h), "self_attn.q_a_layernorm.weight": (c.q_lora_rank,),
                       "self_attn.q_b_proj.weight": (heads * qk, c.q_lora_rank)}  # fmt: skip
        if not moe_layers(c)[layer]:
            f = c.intermediate_size
            return shapes | {"mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
        f, experts, shared = c.moe_intermediate_size, int(c.n_routed_experts), int(c.n_shared_experts or 0) * c.moe_intermediate_size
        shapes |= {"mlp.gate.weight": (experts, h), "mlp.gate.e_score_correction_bias": (experts,)}
        if shared:
            shapes |= {"mlp.shared_experts.gate_proj.weight": (shared, h), "mlp.shared_experts.up_proj.weight": (shared, h),
                       "mlp.shared_experts.down_proj.weight": (h, shared)}  # fmt: skip
        for e in range(experts):
            shapes |= {f"mlp.experts.{e}.gate_proj.weight": (f, h), f"mlp.experts.{e}.up_proj.weight": (f, h),
                       f"mlp.experts.{e}.down_proj.weight": (h, f)}  # fmt: skip
        return shapes

    def param_rule(self, hf_config: Any, model: Any, megatron_name: str) -> ParamRule:  # model: a megatron GPTModel
        m = _LAYER.match(megatron_name)
        if m is None or (m.group(2) not in _MLA_RULES and m.group(2) not in _SHARED_RULES):
            return super().param_rule(hf_config, model, megatron_name)  # norms, dense MLP, router, experts, o_proj
        layer, suffix = model.decoder.layers[int(m.group(1))].layer_number - 1, m.group(2)  # global, 0-based
        hf, layout = _SHARED_RULES[suffix] if suffix in _SHARED_RULES else ((_MLA_RULES[suffix][0],), _MLA_RULES[suffix][1])
        return ParamRule(megatron_name, tuple(f"model.layers.{layer}.{s}" for s in hf), layout)  # type: ignore[arg-type]


def rope_kwargs(rope: RopeSettings) -> dict[str, Any]:
    """MLATransformerConfig's rope settings: plain rope, or yarn with HF's values as read_rope maps
    them (the cos/sin factor and the softmax scale's mscale included: megarl/models/rope.py)."""
    if rope.rope_type == "default":
        return {"rope_type": "rope", "rotary_base": rope.theta}
    return {"rope_type": "yarn", "rotary_base": rope.theta, "rotary_scaling_factor": rope.factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
            "beta_fast": rope.beta_fast, "beta_slow": rope.beta_slow, "mscale": rope.mscale,
            "mscale_all_dim": rope.mscale_all_dim}  # fmt: skip


def mla_norms_q_proj() -> bool:
    """Whether the installed megatron-core's MLA builds ``q_proj`` as a fused norm + linear when
    ``q_lora_rank`` is None and ``qk_layernorm`` is on (0.19's ``mla_qk_norm_config``; 0.16 builds a
    plain linear): HF's DeepSeek-V3 has no norm there, and MLA needs ``qk_layernorm`` for the kv_a
    norm. Read from the version (no Megatron import: the planner asks too)."""
    mcore = installed_version()
    return mcore is not None and not mcore.startswith("0.16.")


def _mla_without_te() -> None:
    """Make megatron-core's MLA accept the replicated down projections without transformer-engine.

    - 0.16.1 checks ``isinstance(linear_proj, TELinear)`` whenever importing its transformer-engine
      extension worked, and without transformer-engine that extension still imports, with
      placeholders (MagicMock) for TE's classes: the check then raises TypeError. Tell the MLA
      module what the extension knows (TE is absent).
    - 0.19 imports the replicated ``Linear`` (modelopt's, a plain torch linear that needs no TE)
      only when TE is present and otherwise accepts no replicated down projection at all
      ("Unsupported linear_q_down_proj"), leaving the column-split one, whose shared rope key
      misses the other TP ranks' gradients (module docstring). Give it the class it imports with
      TE: the same layout as on a cluster, where TE is installed."""
    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer import multi_latent_attention

    if not te_extension.HAVE_TE:
        multi_latent_attention.HAVE_TE = False
    if getattr(multi_latent_attention, "Linear", Linear) is None:
        multi_latent_attention.Linear = Linear
