"""The bridge of Qwen3-MoE (HF ``model_type`` ``qwen3_moe``): Qwen3's attention (q/k RMSNorm, no
QKV bias) with a mixture-of-experts MLP in the layers ``mlp_only_layers`` and
``decoder_sparse_step`` say.

An MoE layer in HF: a router ``mlp.gate`` ([E, H]: softmax over the E experts, the top
``num_experts_per_tok``, renormalised to sum to 1 when ``norm_topk_prob``) and E SwiGLU experts
of width ``moe_intermediate_size``, saved one tensor per expert
(``mlp.experts.{e}.{gate,up,down}_proj.weight``; transformers 5 fuses them in memory but saves
and loads these names). No shared expert, no router bias. In Megatron: ``MoELayer`` with the
``TopKRouter`` (``mlp.router.weight``, replicated) and the experts as

- ``SequentialMLP`` under the local spec (CPU, and GPUs without transformer-engine):
  ``mlp.experts.local_experts.{j}.linear_fc1.weight`` (``[gate; up]``) and ``.linear_fc2.weight``;
- ``TEGroupedMLP`` under the te spec: ``mlp.experts.linear_fc1.weight{j}`` / ``linear_fc2.weight{j}``.

``j`` is the local expert: EP rank r holds global experts ``r * E/ep .. (r+1) * E/ep - 1``, read
from the layer itself (Megatron's ``local_expert_indices``) and checked against that rule, which
export relies on (megarl/models/layouts.py). Routing: Megatron's softmax score function with the
top-k taken before the softmax (``moe_router_pre_softmax=False``) is HF's ``norm_topk_prob=True``
(the softmax over the k chosen logits is their full-softmax probabilities renormalised); with the
softmax first (``True``) it is ``norm_topk_prob=False``. Dense layers are the Qwen3 dense MLP of
``intermediate_size``.

The token dispatcher is Megatron's ``alltoall``, on GPUs and on the CPU alike: ``allgather``
gathers every rank's tokens over the TP x EP group and so needs the same token count on each,
which RL's ragged, packed micro-batches do not have when an expert-parallel group spans
data-parallel replicas (Megatron's TransformerConfig does not allow it with
``variable_seq_lengths``, which the workers use); alltoall exchanges uneven splits. On the CPU it needs three shims, all in
megarl/parallel/cpu_compat.py; running it there also means the CPU tests cover the GPU's path.

Load balance comes from the role's ``moe`` section (:func:`load_balance_kwargs`), not from
the HF config: ``output_router_logits`` and ``router_aux_loss_coef`` describe HF's own training
loop (``load_balancing_loss_func`` pools every layer's router counts and probabilities into
one Switch loss, E * sum_i f_i P_i with f_i summing to k) and are not read. Megatron's
``aux_loss`` is the same Switch loss per MoE layer and micro-batch, with f_i summing to 1, and
adds one term per layer: on a model with one MoE layer HF's value is k x Megatron's; with L
layers HF's pools the layers (cross-layer products included) where Megatron sums L per-layer
values (tests/distributed/test_moe_balance.py checks both by hand). The DeepSeek-style expert
bias needs a sigmoid router; Qwen3-MoE's is a softmax, so it is refused.

Expert tensor parallelism (``parallel.etp`` > 1) splits each expert's fc1 (gate and up rows) and fc2
(columns) over the expert-tensor-parallel group; ``etp`` must divide ``moe_intermediate_size``.

Not handled yet, and refused by name: shared experts, top-1 with ``norm_topk_prob`` (Megatron refuses it: the router would get no gradient).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from megarl.models.bridge import register_bridge
from megarl.models.dense import _LAYER_NAME, Qwen3Bridge
from megarl.models.layer_specs import LayerSpec
from megarl.models.layouts import ParamRule, ShardInfo
from megarl.models.norm import RMSNorm

# A local expert's weight under the local spec (SequentialMLP) or the te spec (TEGroupedMLP):
# (fc 1 or 2, local expert j).
_SEQUENTIAL = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")
_GROUPED = re.compile(r"^mlp\.experts\.linear_fc([12])\.weight(\d+)$")


def moe_layers(hf_config: Any) -> list[bool]:
    """Per layer (0-based), whether it is an MoE layer: HF's rule (Qwen3MoeDecoderLayer)."""
    skip, step = set(getattr(hf_config, "mlp_only_layers", None) or []), hf_config.decoder_sparse_step
    experts = _num_experts(hf_config)
    return [i not in skip and experts > 0 and (i + 1) % step == 0 for i in range(hf_config.num_hidden_layers)]


def _num_experts(hf_config: Any) -> int:
    return int(getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", 0) or 0)


def _expert_suffixes(expert: int) -> tuple[str, str, str]:
    gate, up, down = (f"mlp.experts.{expert}.{t}.weight" for t in ("gate_proj", "up_proj", "down_proj"))
    return gate, up, down


def expert_names(layer: int, expert: int) -> tuple[str, str, str]:
    """HF (gate, up, down) of one expert of one layer, as transformers saves them."""
    gate, up, down = (f"model.layers.{layer}.{s}" for s in _expert_suffixes(expert))
    return gate, up, down


@register_bridge("qwen3_moe")
class Qwen3MoeBridge(Qwen3Bridge):
    # ---- config ------------------------------------------------------------------------
    def check_hf_config(self, hf_config: Any) -> None:
        """Refuse, by name, every HF setting this bridge does not implement (module docstring)."""
        self._check_decoder_config(hf_config)
        experts, top_k = _num_experts(hf_config), int(hf_config.num_experts_per_tok)
        if experts < 1:
            self._refuse(hf_config, "num_experts", experts, ">= 1 (a dense Qwen3 is model_type qwen3)")
        if not 1 <= top_k <= experts:
            self._refuse(hf_config, "num_experts_per_tok", top_k, f"1 to num_experts ({experts})")
        if top_k == 1 and hf_config.norm_topk_prob:
            self._refuse(hf_config, "norm_topk_prob", True, "false with num_experts_per_tok=1 (every weight would be 1 "
                         "and the router would get no gradient; Megatron refuses it)")  # fmt: skip
        for key in ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", "n_shared_experts"):
            if getattr(hf_config, key, None):
                self._refuse(hf_config, key, getattr(hf_config, key), "none (Qwen3-MoE has no shared expert)")
        if int(getattr(hf_config, "decoder_sparse_step", 1) or 0) < 1:
            self._refuse(hf_config, "decoder_sparse_step", hf_config.decoder_sparse_step, ">= 1")

    def check_parallel(self, hf_config: Any, parallel: Any) -> None:
        experts, ep, etp, f = _num_experts(hf_config), parallel.ep, parallel.etp, hf_config.moe_intermediate_size
        if f % etp:  # expert tensor parallelism splits each expert's gate/up rows and down columns
            ok = [d for d in range(1, f + 1) if f % d == 0]
            raise ValueError(f"parallel.etp ({etp}) must divide moe_intermediate_size ({f}); try {', '.join(map(str, ok))}")
        if experts % ep:
            ok = [d for d in range(1, experts + 1) if experts % d == 0]
            raise ValueError(f"parallel.ep ({ep}) must divide num_experts ({experts}); try {', '.join(map(str, ok))}")
        self._check_split(hf_config, parallel)

    def _config_kwargs(self, hf_config: Any, parallel: Any, dtype: torch.dtype, recompute: str,
                       spec: LayerSpec = "local", moe: Any = None) -> dict[str, Any]:  # fmt: skip
        kwargs = super()._config_kwargs(hf_config, parallel, dtype, recompute, spec, moe)
        kwargs.update(
            num_moe_experts=_num_experts(hf_config),
            moe_ffn_hidden_size=hf_config.moe_intermediate_size,
            moe_layer_freq=[int(m) for m in moe_layers(hf_config)],  # dense layers: ffn_hidden_size (intermediate_size)
            moe_router_topk=int(hf_config.num_experts_per_tok),
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not hf_config.norm_topk_prob,  # see the module docstring
            moe_token_dispatcher_type="alltoall",  # on CPU too: see the module docstring
            moe_permute_fusion=False,  # a transformer-engine kernel
            expert_model_parallel_size=parallel.ep,
            expert_tensor_parallel_size=parallel.etp,  # Megatron's default would be tp
            **load_balance_kwargs(moe, sigmoid_router=False),
        )
        return kwargs

    # ---- model ---------------------------------------------------------------------------
    def moe_layer_spec(self, spec: LayerSpec, num_experts: int):
        """One MoE decoder layer: SequentialMLP experts (local, with megarl's norms and attention
        as :meth:`layer_spec`) or TEGroupedMLP ones (te). The config's ``moe_grouped_gemm`` stays
        False: megatron-core 0.16-0.19 read it only in spec helpers (and the flex dispatcher), and
        the spec chosen here is what decides."""
        from megatron.core.models.gpt import gpt_layer_specs

        if spec == "te":
            return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
                num_experts=num_experts, moe_grouped_gemm=True, qk_layernorm=self.qk_norm
            )
        return self._localized(gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm", qk_layernorm=self.qk_norm
        ))  # fmt: skip

    def block_spec(self, transformer_config: Any, spec: LayerSpec = "local"):
        """This pipeline stage's layers, each dense or MoE as ``moe_layer_freq`` says (Megatron's
        offset and count of the stage's layers), and megarl's final RMSNorm."""
        from megatron.core.transformer.transformer_block import (
            TransformerBlockSubmodules,
            get_num_layers_to_build,
        )
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        first = get_transformer_layer_offset(transformer_config)
        pattern = transformer_config.moe_layer_freq[first : first + get_num_layers_to_build(transformer_config)]
        dense, moe = self.layer_spec(spec), self.moe_layer_spec(spec, transformer_config.num_moe_experts)
        return TransformerBlockSubmodules(layer_specs=[moe if m else dense for m in pattern], layer_norm=RMSNorm)

    # ---- names ---------------------------------------------------------------------------
    def _layer_shapes(self, hf_config: Any, layer: int) -> dict[str, tuple[int, ...]]:
        shapes = super()._layer_shapes(hf_config, layer)
        if not moe_layers(hf_config)[layer]:
            return shapes
        h, f, experts = hf_config.hidden_size, hf_config.moe_intermediate_size, _num_experts(hf_config)
        shapes = {k: s for k, s in shapes.items() if not k.startswith("mlp.")}  # the dense MLP's
        shapes["mlp.gate.weight"] = (experts, h)
        for e in range(experts):
            gate, up, down = _expert_suffixes(e)
            shapes.update({gate: (f, h), up: (f, h), down: (h, f)})
        return shapes

    def param_rule(self, hf_config: Any, model: Any, megatron_name: str) -> ParamRule:  # model: a megatron GPTModel
        m = _LAYER_NAME.match(megatron_name)
        if m is None:
            return super().param_rule(hf_config, model, megatron_name)
        module = model.decoder.layers[int(m.group(1))]
        layer, suffix = module.layer_number - 1, m.group(2)  # global, 0-based
        if suffix == "mlp.router.weight":
            return ParamRule(megatron_name, (f"model.layers.{layer}.mlp.gate.weight",), "replicated")
        found = _SEQUENTIAL.match(suffix) or _GROUPED.match(suffix)
        if found is None:
            return super().param_rule(hf_config, model, megatron_name)
        local, fc = (int(found.group(1)), found.group(2)) if found.re is _SEQUENTIAL else (int(found.group(2)), found.group(1))
        per_rank = tuple(_expert_hf(layer, e, fc) for e in experts_per_ep_rank(module.mlp, local))
        here = module.mlp.local_expert_indices[local] // module.mlp.num_local_experts  # this rank's place (checked)
        return ParamRule(megatron_name, per_rank[here], "fc1" if fc == "1" else "row", hf_per_ep_rank=per_rank)

    def check_rules(self, hf_config: Any, rules: list[ParamRule], info: ShardInfo) -> None:
        """Also: each expert rule's ``hf`` is this EP rank's entry, and over the EP group the
        stage's MoE layers hold every expert of theirs exactly once (none unmapped, none twice)."""
        super().check_rules(hf_config, rules, info)
        held: dict[int, list[str]] = {}  # layer -> the HF expert tensors its rules hold on every EP rank
        for rule in rules:
            if rule.hf_per_ep_rank is None:
                continue
            if len(rule.hf_per_ep_rank) != info.ep_size or rule.hf_per_ep_rank[info.ep_rank] != rule.hf:
                raise ValueError(f"expert parameter {rule.megatron} maps to {rule.hf} on EP rank {info.ep_rank} of "
                                 f"{info.ep_size}, but its names per EP rank are {rule.hf_per_ep_rank}")  # fmt: skip
            layer = int(rule.hf[0].split(".")[2])
            held.setdefault(layer, []).extend(rule.exported_names())
        experts = _num_experts(hf_config)
        for layer, names in held.items():
            expected = [n for e in range(experts) for n in expert_names(layer, e)]
            if sorted(names) != sorted(expected):
                twice = sorted({n for n in names if names.count(n) > 1})
                raise ValueError(f"layer {layer}'s expert parameters over the EP group do not map each HF expert "
                                 f"tensor once: unmapped {sorted(set(expected) - set(names))}, mapped twice {twice}, "
                                 f"unknown {sorted(set(names) - set(expected))}")  # fmt: skip


def load_balance_kwargs(moe: Any, *, sigmoid_router: bool) -> dict[str, Any]:
    """Megatron's load-balancing keys of a role's MoEConfig (None: its defaults): the Switch
    auxiliary loss per MoE layer and micro-batch (``aux_loss``: see the module docstring), the
    router z-loss, the expert bias (sigmoid routers only) and the capacity; dropless without one."""
    aux, z = (moe.aux_loss_coef, moe.z_loss_coef) if moe is not None else (0.0, 0.0)
    rate = moe.expert_bias_update_rate if moe is not None else 0.0
    if rate > 0 and not sigmoid_router:
        raise ValueError(f"actor.moe.expert_bias_update_rate ({rate}) needs a sigmoid router and this model's is a "
                         "softmax (Megatron refuses expert bias with it); set it to 0 (or use aux_loss_coef)")  # fmt: skip
    capacity = moe.capacity_factor if moe is not None else None
    return dict(
        moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
        moe_aux_loss_coeff=aux,
        moe_z_loss_coeff=z or None,  # None: no z-loss computed at all
        moe_router_enable_expert_bias=rate > 0,
        moe_router_bias_update_rate=rate or 1e-3,  # Megatron's default when off (it reads it only when on)
        moe_expert_capacity_factor=capacity,  # None: dropless
        moe_token_drop_policy=moe.token_drop_policy if moe is not None else "probs",
        moe_pad_expert_input_to_capacity=False,  # dropped slots are not padded: no compute on them
    )


def experts_per_ep_rank(moe_layer: Any, local: int) -> list[int]:
    """The global expert that local expert ``local`` of an MoE layer is on each EP rank, in EP
    rank order. Megatron places experts in contiguous blocks (BaseMoELayer, and the global index
    of SequentialMLP's / TEGroupedMLP's sharded state dict): ``ep_rank * experts_per_rank +
    local``. This rank's answer is checked against the layer's own ``local_expert_indices``."""
    per_rank = moe_layer.num_local_experts
    ep = moe_layer.config.num_moe_experts // per_rank
    placed = [r * per_rank + local for r in range(ep)]
    mine = moe_layer.local_expert_indices[local]
    if mine not in placed or mine % per_rank != local:
        raise ValueError(f"Megatron placed local expert {local} at global expert {mine}, not at one of {placed}: "
                         "this megatron-core lays experts out differently from what megarl's export assumes")  # fmt: skip
    return placed


def _expert_hf(layer: int, expert: int, fc: str) -> tuple[str, ...]:
    gate, up, down = expert_names(layer, expert)
    return (gate, up) if fc == "1" else (down,)
