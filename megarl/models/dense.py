"""Bridges of the dense decoder families: Llama, Qwen2, Qwen3.

The three share one layout (pre-norm RMSNorm, GQA attention with RoPE, SwiGLU MLP) and the HF
names ``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj`` ...; they
differ in: QKV bias (Qwen2 always; Llama/Qwen3 never: ``attention_bias=True`` is refused),
per-head q/k RMSNorm (Qwen3 -> Megatron ``q_layernorm``/``k_layernorm``), and config defaults.
Tied embeddings are supported at any PP (Megatron keeps a copy of the embedding on the last
stage; it is loaded from ``embed_tokens`` and not exported twice).

Vocabulary padding: to a multiple of ``tp`` for small vocabularies (< 32768 tokens), of
``128 * tp`` otherwise (the usual Megatron divisor, good GEMM shapes). Padded rows are zero
and padded logit columns must be excluded (columns >= ``vocab_size(hf_config)``).

Every HF config value that changes the math is read by name; anything this bridge does not
implement (sliding windows, other rope types, dropout, biases on o_proj/MLP, quantization)
raises ValueError naming the key, the value and what is supported.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import torch
import torch.nn.functional as F

from megarl.models.bridge import HF_CONFIG_ATTR, ModelBridge, register_bridge
from megarl.models.layer_specs import LayerSpec, local_suffix
from megarl.models.layouts import VALUE_HEAD_HF_NAME, ParamRule
from megarl.models.norm import RMSNorm, current_device
from megarl.models.placement import check_placement
from megarl.models.rope import SUPPORTED_ROPE_TYPES, llama3_inv_freq, read_rope

LARGE_VOCAB = 32768
LARGE_VOCAB_DIVISOR = 128

# Megatron local suffix -> (HF suffixes, layout) inside one decoder layer.
_LAYER_RULES: dict[str, tuple[tuple[str, ...], str]] = {
    "input_layernorm.weight": (("input_layernorm.weight",), "replicated"),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "qkv"),
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), "qkv"),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), "replicated"),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), "replicated"),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "row"),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "replicated"),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "fc1"),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "row"),
}
_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


class DenseDecoderBridge(ModelBridge):
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_types: tuple[str, ...] = SUPPORTED_ROPE_TYPES  # the HF rope types this bridge implements

    # ---- config ------------------------------------------------------------------------
    def check_hf_config(self, hf_config: Any) -> None:
        """Refuse, by name, every HF setting this bridge does not implement."""
        self._check_decoder_config(hf_config)
        if getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None):
            self._refuse(hf_config, "num_experts", getattr(hf_config, "num_experts", None), "dense models only")

    def _refuse(self, hf_config: Any, key: str, value: Any, supported: str) -> None:
        raise ValueError(
            f"{hf_config.model_type} config {key}={value!r} is not supported by megarl's "
            f"{type(self).__name__}; supported: {supported}"
        )

    def _check_decoder_config(self, hf_config: Any) -> None:
        """The attention, norms, rope and MLP activation every decoder of this family shares."""
        def refuse(key: str, value: Any, supported: str) -> None:
            self._refuse(hf_config, key, value, supported)

        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            refuse("hidden_act", act, "'silu'")
        if float(getattr(hf_config, "attention_dropout", 0.0) or 0.0) != 0.0:
            refuse("attention_dropout", hf_config.attention_dropout, "0.0")
        if getattr(hf_config, "use_sliding_window", False):
            refuse("use_sliding_window", True, "False (full attention)")
        layer_types = getattr(hf_config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            refuse("layer_types", sorted(set(layer_types)), "'full_attention' on every layer")
        for key in ("attention_bias", "mlp_bias"):
            if getattr(hf_config, key, False) and not (key == "attention_bias" and self.qkv_bias):
                refuse(key, True, "False")
        if getattr(hf_config, "pretraining_tp", 1) not in (None, 1):
            refuse("pretraining_tp", hf_config.pretraining_tp, "1")
        if getattr(hf_config, "quantization_config", None):
            refuse("quantization_config", "set", "none (unquantized weights)")
        read_rope(hf_config, self.rope_types)  # raises on unsupported rope settings

    def _dims(self, hf_config: Any) -> tuple[int, int, int]:
        heads = hf_config.num_attention_heads
        groups = getattr(hf_config, "num_key_value_heads", None) or heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        return heads, groups, head_dim

    def check_parallel(self, hf_config: Any, parallel: Any) -> None:
        for key in ("ep", "etp"):
            if getattr(parallel, key, 1) != 1:
                raise ValueError(f"parallel.{key} ({getattr(parallel, key)}) splits the experts of a mixture-of-experts "
                                 f"model and {hf_config.model_type} is dense; set it to 1")  # fmt: skip
        self._check_split(hf_config, parallel)

    def _check_split(self, hf_config: Any, parallel: Any) -> None:
        """The attention heads over tp, the layers over pp; vpp and cp are not supported yet."""
        heads, groups, _ = self._dims(hf_config)
        tp, pp = parallel.tp, parallel.pp
        for key in ("vpp", "cp"):
            if getattr(parallel, key, 1) != 1:
                raise ValueError(f"parallel.{key} ({getattr(parallel, key)}) is not supported yet; set it to 1")
        ok_tp = [d for d in range(1, groups + 1) if groups % d == 0 and heads % d == 0]  # both must split evenly
        for what, n in (("num_attention_heads", heads), ("num_key_value_heads", groups)):
            if n % tp:
                raise ValueError(f"parallel.tp ({tp}) must divide {what} ({n}); try {', '.join(map(str, ok_tp))}")
        layers = hf_config.num_hidden_layers
        if layers % pp:
            ok = [d for d in range(1, layers + 1) if layers % d == 0]
            raise ValueError(f"parallel.pp ({pp}) must divide num_hidden_layers ({layers}); try {', '.join(map(str, ok))}")

    def transformer_config(self, hf_config: Any, parallel: Any, dtype: torch.dtype, recompute: str = "none",
                           spec: LayerSpec = "local", moe: Any = None):  # fmt: skip
        """Megatron's TransformerConfig of ``hf_config``, for layers of ``spec`` (the resolved
        ``model.layer_spec``: the TE spec asks for TE's fused rope)."""
        from megatron.core.transformer.transformer_config import TransformerConfig

        self.check_hf_config(hf_config)
        self.check_parallel(hf_config, parallel)
        return TransformerConfig(**self._config_kwargs(hf_config, parallel, dtype, recompute, spec, moe))

    def _config_kwargs(self, hf_config: Any, parallel: Any, dtype: torch.dtype, recompute: str,
                       spec: LayerSpec = "local", moe: Any = None) -> dict[str, Any]:  # fmt: skip
        """TransformerConfig's arguments for ``hf_config`` (checked) in ``parallel``'s layout and ``spec``'s layers."""
        heads, groups, head_dim = self._dims(hf_config)
        cpu = not torch.cuda.is_available()
        kwargs: dict[str, Any] = dict(
            num_layers=hf_config.num_hidden_layers,
            hidden_size=hf_config.hidden_size,
            ffn_hidden_size=hf_config.intermediate_size,
            num_attention_heads=heads,
            num_query_groups=groups,
            kv_channels=head_dim,
            normalization="RMSNorm",
            layernorm_epsilon=float(hf_config.rms_norm_eps),
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=self.qkv_bias,
            qk_layernorm=self.qk_norm,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            attention_softmax_in_fp32=True,
            tensor_model_parallel_size=parallel.tp,
            pipeline_model_parallel_size=parallel.pp,
            sequence_parallel=parallel.uses_sequence_parallel,  # on when tp > 1 unless turned off
            params_dtype=dtype,
            pipeline_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            use_cpu_initialization=cpu,
            # variable_seq_lengths stays False (0.16 ties it to MoE dispatcher checks): every
            # micro-batch of one pipeline call has the same padded length.
            calculate_per_token_loss=True,
            # Kernels that need apex / transformer-engine stay off; jit-fused ones only on GPU.
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            # TE's fused rope takes THD with the offsets on the device; Megatron's unfused THD apply
            # reads them on the host in every layer (a sync each time under TE, which needs them
            # on the device). The local spec keeps it off: packed_rope.py relies on that apply.
            apply_rope_fusion=spec == "te",
            gradient_accumulation_fusion=False,
            bias_activation_fusion=not cpu,
            bias_dropout_fusion=not cpu,
        )
        kwargs.update(_recompute_kwargs(recompute))
        return kwargs

    def padded_vocab_size(self, hf_config: Any, tp: int) -> int:
        vocab = self.vocab_size(hf_config)
        multiple = tp * (LARGE_VOCAB_DIVISOR if vocab >= LARGE_VOCAB else 1)
        return -(-vocab // multiple) * multiple

    # ---- model ---------------------------------------------------------------------------
    def layer_spec(self, spec: LayerSpec = "local"):
        """One decoder layer. ``local``: Megatron's local spec with SDPA core attention and
        megarl's RMSNorm (params_dtype, current device) in every norm slot, q/k norms included.
        ``te``: Megatron's transformer-engine spec (the input and pre-MLP norms fused into
        ``linear_qkv`` / ``linear_fc1``, TE's attention; ``megarl.models.layer_specs``)."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        if spec == "te":
            from megatron.core.models.gpt.gpt_layer_specs import (
                get_gpt_layer_with_transformer_engine_spec,
            )

            return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=self.qk_norm)

        return self._localized(get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=self.qk_norm))

    def _localized(self, local_layer: Any) -> Any:
        """A copy of a layer of Megatron's local spec with megarl's RMSNorm in every norm slot and
        SDPA core attention (see :meth:`layer_spec`)."""
        from megarl.models.attention import SdpaAttention

        layer = copy.deepcopy(local_layer)
        layer.submodules.input_layernorm = RMSNorm
        layer.submodules.pre_mlp_layernorm = RMSNorm
        attention = layer.submodules.self_attention.submodules
        attention.core_attention = SdpaAttention
        if self.qk_norm:
            attention.q_layernorm = RMSNorm
            attention.k_layernorm = RMSNorm
        return layer

    def block_spec(self, transformer_config: Any, spec: LayerSpec = "local"):
        """This pipeline stage's decoder block: its layers and the final norm. Given a layer spec
        alone, Megatron picks the final norm from what is installed (TE's, apex's or torch's);
        naming it here keeps it megarl's RMSNorm everywhere (under both specs)."""
        from megatron.core.transformer.transformer_block import (
            TransformerBlockSubmodules,
            get_num_layers_to_build,
        )

        layers = get_num_layers_to_build(transformer_config)
        return TransformerBlockSubmodules(layer_specs=[self.layer_spec(spec)] * layers, layer_norm=RMSNorm)

    def build_model(self, hf_config: Any, transformer_config: Any, *, pre_process: bool, post_process: bool,
                    value_head: bool = False, spec: LayerSpec = "local"):  # fmt: skip
        """This rank's GPTModel stage (random init; call :meth:`load_hf_weights` next), its
        layers of ``spec`` (``megarl.models.layer_specs.resolve_layer_spec``)."""
        from megatron.core.models.gpt import GPTModel

        rope = read_rope(hf_config, self.rope_types)
        tied = bool(getattr(hf_config, "tie_word_embeddings", False)) and not value_head
        model = GPTModel(
            config=transformer_config,
            transformer_layer_spec=self.block_spec(transformer_config, spec),
            vocab_size=self.padded_vocab_size(hf_config, transformer_config.tensor_model_parallel_size),
            max_sequence_length=hf_config.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=True,
            share_embeddings_and_output_weights=tied,
            position_embedding_type="rope",
            rotary_base=rope.theta,
            seq_len_interpolation_factor=rope.factor if rope.rope_type == "linear" else None,
        )
        if rope.rope_type == "llama3":
            # Megatron's llama3 scaling hard-codes its constants; use the config's own.
            inv = llama3_inv_freq(transformer_config.kv_channels, rope)
            model.rotary_pos_emb.inv_freq = inv.to(model.rotary_pos_emb.inv_freq.device)
        if spec == "local":  # (TE's attention reads the padded offsets this sets: see packed_rope)
            from megarl.models.packed_rope import rotate_packed_sequences_at_once

            rotate_packed_sequences_at_once(model)
        if value_head and post_process:
            from megarl.models.value_head import (
                ValueHead,  # megatron-core: imported only with a model
            )

            model.output_layer = ValueHead(transformer_config)
        setattr(model, HF_CONFIG_ATTR, hf_config)
        check_placement(model, transformer_config.params_dtype, current_device())
        return model

    # ---- names ---------------------------------------------------------------------------
    def _layer_suffixes(self) -> list[str]:
        skip = set()
        if not self.qkv_bias:
            skip.add("self_attention.linear_qkv.bias")
        if not self.qk_norm:
            skip |= {"self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"}
        return [s for s in _LAYER_RULES if s not in skip]

    def hf_tensor_shapes(self, hf_config: Any) -> dict[str, tuple[int, ...]]:
        h, v = hf_config.hidden_size, self.vocab_size(hf_config)
        shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
        if not getattr(hf_config, "tie_word_embeddings", False):
            shapes["lm_head.weight"] = (v, h)
        for i in range(hf_config.num_hidden_layers):
            shapes.update({f"model.layers.{i}.{k}": s for k, s in self._layer_shapes(hf_config, i).items()})
        return shapes

    def _layer_shapes(self, hf_config: Any, layer: int) -> dict[str, tuple[int, ...]]:
        """HF suffix -> shape of every tensor of decoder layer ``layer`` (0-based)."""
        heads, groups, d = self._dims(hf_config)
        h, f = hf_config.hidden_size, hf_config.intermediate_size
        per_layer = {
            "input_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (heads * d, h),
            "self_attn.k_proj.weight": (groups * d, h),
            "self_attn.v_proj.weight": (groups * d, h),
            "self_attn.q_proj.bias": (heads * d,),
            "self_attn.k_proj.bias": (groups * d,),
            "self_attn.v_proj.bias": (groups * d,),
            "self_attn.q_norm.weight": (d,),
            "self_attn.k_norm.weight": (d,),
            "self_attn.o_proj.weight": (h, heads * d),
            "post_attention_layernorm.weight": (h,),
            "mlp.gate_proj.weight": (f, h),
            "mlp.up_proj.weight": (f, h),
            "mlp.down_proj.weight": (h, f),
        }
        used = {hf for s in self._layer_suffixes() for hf in _LAYER_RULES[s][0]}
        return {k: s for k, s in per_layer.items() if k in used}

    def param_rule(self, hf_config: Any, model: Any, megatron_name: str) -> ParamRule:  # model: a megatron GPTModel (untyped)
        if megatron_name == "embedding.word_embeddings.weight":
            return ParamRule(megatron_name, ("model.embed_tokens.weight",), "vocab")
        if megatron_name == "decoder.final_layernorm.weight":
            return ParamRule(megatron_name, ("model.norm.weight",), "replicated")
        if megatron_name == "output_layer.weight":
            if getattr(model.output_layer, "is_value_head", False):
                return ParamRule(megatron_name, (VALUE_HEAD_HF_NAME,), "replicated")
            if model.share_embeddings_and_output_weights:  # last stage's copy (PP > 1)
                return ParamRule(megatron_name, ("model.embed_tokens.weight",), "vocab", export=False)
            return ParamRule(megatron_name, ("lm_head.weight",), "vocab")
        m = _LAYER_NAME.match(megatron_name)
        suffix = local_suffix(m.group(2)) if m else None  # TE's fused-norm names are the local norms' weights
        if m is None or suffix not in self._layer_suffixes():
            raise KeyError(megatron_name)
        layer = model.decoder.layers[int(m.group(1))].layer_number - 1  # global, 0-based
        hf, layout = _LAYER_RULES[suffix]
        return ParamRule(megatron_name, tuple(f"model.layers.{layer}.{s}" for s in hf), layout)  # type: ignore[arg-type]


def _recompute_kwargs(recompute: str) -> dict[str, Any]:
    if recompute == "none":
        return {}
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if recompute == "selective":
        return {"recompute_granularity": "selective"}
    if recompute == "auto":
        raise ValueError("recompute=auto is resolved by the plan (megarl launch / sft run it); a model built "
                         "without one needs none, selective or full")
    raise ValueError(f"recompute={recompute!r} is not one of none, selective, full")


@register_bridge("llama")
class LlamaBridge(DenseDecoderBridge):
    pass


@register_bridge("qwen2")
class Qwen2Bridge(DenseDecoderBridge):
    qkv_bias = True


@register_bridge("qwen3")
class Qwen3Bridge(DenseDecoderBridge):
    qk_norm = True
