"""The Qwen3-MoE bridge without processes: HF config -> TransformerConfig, refusals by name, the
HF tensor names, and the expert rules of both expert layouts (SequentialMLP on CPU, TEGroupedMLP
under transformer-engine, which cannot be built here: its names are mapped on a synthetic state
dict made from the HF file) with the checks that refuse an expert mapped twice or not at all.
The parity with HF and the export over EP run in tests/distributed/test_moe_bridge.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megarl.config.train_sections import ParallelConfig
from megarl.models import qwen3_moe
from megarl.models.bridges import get_bridge
from megarl.models.layouts import ShardInfo, export_parts, read_shard
from megarl.models.safetensors_reader import SafetensorsReader
from megarl.models.tiny import build_tiny_model, tiny_hf_config

SHAPE = dict(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=96, num_experts=4,
             experts_per_token=2, moe_ffn_hidden_size=32, mlp_only_layers=[1])  # fmt: skip


def _cfg(**overrides):
    cfg = tiny_hf_config("qwen3_moe", vocab_size=259, **SHAPE)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "m", "qwen3_moe", **SHAPE)


def test_hf_tensor_shapes_match_the_checkpoint_transformers_writes(moe_dir):
    from safetensors import safe_open
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(moe_dir)
    with safe_open(moe_dir / "model.safetensors", framework="pt") as f:
        actual = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert get_bridge(hf_config).hf_tensor_shapes(hf_config) == actual
    assert actual["model.layers.0.mlp.experts.3.gate_proj.weight"] == (32, 64)  # one tensor per expert on disk
    assert actual["model.layers.1.mlp.gate_proj.weight"] == (96, 64)  # layer 1: mlp_only_layers, dense
    assert actual["model.layers.2.mlp.gate.weight"] == (4, 64)  # the router


@pytest.mark.parametrize("norm_topk_prob, step, only, pattern", [
    (True, 1, [1], [1, 0, 1, 1]),
    (False, 2, [], [0, 1, 0, 1]),  # HF: MoE where (i + 1) % decoder_sparse_step == 0
    (True, 2, [3], [0, 1, 0, 0]),
])  # fmt: skip
def test_transformer_config_reads_the_router_and_the_layer_pattern(norm_topk_prob, step, only, pattern):
    cfg = _cfg(norm_topk_prob=norm_topk_prob, decoder_sparse_step=step, mlp_only_layers=only)
    tc = get_bridge(cfg).transformer_config(cfg, ParallelConfig(tp=2, ep=2), torch.float32)
    assert (tc.num_moe_experts, tc.moe_router_topk, tc.moe_ffn_hidden_size, tc.ffn_hidden_size) == (4, 2, 32, 96)
    assert tc.moe_layer_freq == pattern
    # renormalised top-k = the softmax over the chosen logits (top-k first); else softmax first
    assert tc.moe_router_score_function == "softmax" and tc.moe_router_pre_softmax is (not norm_topk_prob)
    assert tc.moe_router_load_balancing_type == "none" and tc.moe_aux_loss_coeff == 0.0
    assert tc.moe_token_dispatcher_type == "alltoall" and not tc.moe_permute_fusion
    assert (tc.expert_model_parallel_size, tc.expert_tensor_parallel_size) == (2, 1)  # etp 1, not Megatron's default tp
    assert tc.qk_layernorm and not tc.add_qkv_bias and tc.sequence_parallel


@pytest.mark.parametrize("overrides, parallel, match", [
    ({"num_experts_per_tok": 1}, {}, r"norm_topk_prob=True.*num_experts_per_tok=1"),
    ({"num_experts_per_tok": 5}, {}, r"num_experts_per_tok=5.*1 to num_experts \(4\)"),
    ({"shared_expert_intermediate_size": 64}, {}, r"shared_expert_intermediate_size=64.*no shared expert"),
    ({"hidden_act": "gelu"}, {}, r"hidden_act='gelu'"),
    ({}, {"ep": 3}, r"parallel.ep \(3\) must divide num_experts \(4\); try 1, 2, 4"),
    ({}, {"etp": 3}, r"parallel.etp \(3\) must divide moe_intermediate_size \(32\); try 1, 2, 4, 8, 16, 32"),
    ({}, {"vpp": 2}, r"parallel.vpp \(2\) is not supported yet"),
    ({}, {"tp": 4}, r"parallel.tp \(4\) must divide num_key_value_heads \(2\)"),
])  # fmt: skip
def test_what_the_bridge_does_not_handle_is_refused_by_name(overrides, parallel, match):
    cfg = _cfg(**overrides)
    with pytest.raises(ValueError, match=match):
        get_bridge(cfg).transformer_config(cfg, ParallelConfig(**parallel), torch.float32)


def test_the_moe_section_sets_megatrons_load_balance_and_drops():
    from megarl.config.train_sections import MoEConfig

    cfg = _cfg(output_router_logits=True)  # HF's own training flag: accepted, not read
    moe = MoEConfig(aux_loss_coef=0.01, z_loss_coef=0.001, capacity_factor=1.5, token_drop_policy="position")
    tc = get_bridge(cfg).transformer_config(cfg, ParallelConfig(), torch.float32, moe=moe)
    assert (tc.moe_router_load_balancing_type, tc.moe_aux_loss_coeff, tc.moe_z_loss_coeff) == ("aux_loss", 0.01, 0.001)
    assert (tc.moe_expert_capacity_factor, tc.moe_token_drop_policy) == (1.5, "position")
    assert not tc.moe_pad_expert_input_to_capacity and not tc.moe_router_enable_expert_bias
    default = get_bridge(cfg).transformer_config(cfg, ParallelConfig(), torch.float32, moe=MoEConfig())
    assert (default.moe_router_load_balancing_type, default.moe_aux_loss_coeff) == ("none", 0.0)
    assert default.moe_z_loss_coeff is None and default.moe_expert_capacity_factor is None  # dropless


@pytest.mark.parametrize("moe, parallel, match", [
    ({"expert_bias_update_rate": 0.001}, {}, r"actor.moe.expert_bias_update_rate \(0.001\) needs a sigmoid router.*set it to 0"),
])  # fmt: skip
def test_load_balance_settings_megatron_or_megarl_cannot_run_are_refused_by_name(moe, parallel, match):
    from megarl.config.train_sections import MoEConfig

    cfg = _cfg()
    with pytest.raises(ValueError, match=match):
        get_bridge(cfg).transformer_config(cfg, ParallelConfig(**parallel), torch.float32, moe=MoEConfig(**moe))


def test_norm_topk_prob_false_is_taken_at_top1():
    cfg = _cfg(num_experts_per_tok=1, norm_topk_prob=False)
    assert get_bridge(cfg).transformer_config(cfg, ParallelConfig(), torch.float32).moe_router_pre_softmax


def test_a_dense_model_refuses_expert_parallelism_by_field():
    cfg = tiny_hf_config("qwen3", vocab_size=259)
    for field in ("ep", "etp"):
        with pytest.raises(ValueError, match=rf"parallel.{field} \(2\) splits the experts .* qwen3 is dense; set it to 1"):
            get_bridge(cfg).check_parallel(cfg, ParallelConfig(**{field: 2}))


# ---- expert rules ------------------------------------------------------------------------------


def _model(ep_rank: int, ep_size: int = 2, experts: int = 4):
    """A GPTModel's attributes the rules read: decoder layer 0 is global layer 2 (a later PP stage),
    an MoE layer holding experts ep_rank * E/ep ... as Megatron's BaseMoELayer lays them out."""
    per_rank = experts // ep_size
    mlp = SimpleNamespace(num_local_experts=per_rank, config=SimpleNamespace(num_moe_experts=experts),
                          local_expert_indices=[ep_rank * per_rank + j for j in range(per_rank)])  # fmt: skip
    return SimpleNamespace(decoder=SimpleNamespace(layers=[SimpleNamespace(layer_number=3, mlp=mlp)]))


def _info(ep_rank: int, ep_size: int = 2) -> ShardInfo:
    return ShardInfo(tp_rank=0, tp_size=2, num_heads=4, num_groups=2, head_dim=16, vocab_size=259, padded_vocab_size=260,
                     ep_rank=ep_rank, ep_size=ep_size)  # fmt: skip


def _expert_names(local: int, spec: str) -> list[str]:
    if spec == "te":  # TEGroupedMLP
        return [f"decoder.layers.0.mlp.experts.linear_fc{fc}.weight{local}" for fc in (1, 2)]
    return [f"decoder.layers.0.mlp.experts.local_experts.{local}.linear_fc{fc}.weight" for fc in (1, 2)]


def _rules(ep_rank: int, spec: str = "local", ep_size: int = 2):
    bridge, cfg, model = get_bridge("qwen3_moe"), _cfg(), _model(ep_rank, ep_size)
    names = [n for j in range(4 // ep_size) for n in _expert_names(j, spec)] + ["decoder.layers.0.mlp.router.weight"]
    return [bridge.param_rule(cfg, model, n) for n in names]


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_both_expert_layouts_map_local_experts_to_global_ones(ep_rank):
    local, te = _rules(ep_rank), _rules(ep_rank, "te")
    assert [(r.hf, r.layout, r.hf_per_ep_rank) for r in local] == [(r.hf, r.layout, r.hf_per_ep_rank) for r in te]
    fc1, fc2 = local[0], local[1]  # local expert 0 of EP rank ep_rank = global expert 2 * ep_rank
    e = 2 * ep_rank
    assert fc1.hf == (f"model.layers.2.mlp.experts.{e}.gate_proj.weight", f"model.layers.2.mlp.experts.{e}.up_proj.weight")
    assert fc1.layout == "fc1" and fc2.layout == "row" and fc2.hf == (f"model.layers.2.mlp.experts.{e}.down_proj.weight",)
    assert [names[0] for names in fc2.hf_per_ep_rank] == [f"model.layers.2.mlp.experts.{x}.down_proj.weight" for x in (0, 2)]
    assert local[-1].hf == ("model.layers.2.mlp.gate.weight",) and local[-1].layout == "replicated" and not local[-1].expert
    get_bridge("qwen3_moe").check_rules(_cfg(), local, _info(ep_rank))  # every expert once over the EP group


def test_the_rules_check_refuses_an_expert_mapped_twice_or_not_at_all():
    bridge, rules = get_bridge("qwen3_moe"), _rules(0)
    twice = [rules[0], rules[1], rules[0], rules[1]]  # local expert 1 mapped as expert 0 again
    with pytest.raises(ValueError, match="mapped twice"):
        bridge.check_rules(_cfg(), twice, _info(0))
    # local expert 0's fc2 lost: global experts 0 (EP rank 0) and 2 (EP rank 1) lose their down_proj
    with pytest.raises(ValueError, match=r"unmapped \['model.layers.2.mlp.experts.0.down_proj.weight', "
                                         r"'model.layers.2.mlp.experts.2.down_proj.weight'\]"):
        bridge.check_rules(_cfg(), rules[:1] + rules[2:], _info(0))
    with pytest.raises(ValueError, match="on EP rank 1 of 2"):  # the rules of EP rank 0 on EP rank 1
        bridge.check_rules(_cfg(), rules, _info(1))


def test_a_placement_other_than_megatrons_contiguous_blocks_is_refused():
    model = _model(1)
    model.decoder.layers[0].mlp.local_expert_indices = [1, 3]  # interleaved: not what export assumes
    with pytest.raises(ValueError, match="Megatron placed local expert 0 at global expert 1"):
        get_bridge("qwen3_moe").param_rule(_cfg(), model, _expert_names(0, "local")[0])


@pytest.mark.parametrize("spec", ["local", "te"])
def test_expert_weights_through_both_layouts_on_a_synthetic_state_dict(moe_dir, spec):
    """EP rank 1 of 2, TP 2 (experts whole at etp 1): each Megatron expert tensor, made here from
    the HF file the way Megatron lays it out (fc1 = [gate; up] of global expert 2 + j, fc2 = its
    down), is what import reads for its name and what export's local piece of it gives back."""
    from safetensors.torch import load_file

    hf, reader, info = load_file(str(moe_dir / "model.safetensors")), SafetensorsReader(str(moe_dir)), _info(1)
    model = _model(1)
    state = {}
    for j in range(2):
        gate, up, down = qwen3_moe.expert_names(2, 2 + j)
        fc1, fc2 = _expert_names(j, spec)
        state[fc1], state[fc2] = torch.cat([hf[gate], hf[up]]), hf[down]  # [2f, h], [h, f]
    for name, tensor in state.items():
        rule = get_bridge("qwen3_moe").param_rule(_cfg(), model, name)
        assert torch.equal(read_shard(rule, reader, info), tensor), name
        for part in export_parts(rule, tensor, info):
            assert part.ep_names is not None and part.ep_names[1] == part.name, name  # this rank's entry
            assert torch.equal(part.shard, hf[part.name]), part.name


def test_training_refuses_expert_slices_that_megatrons_gradient_reduction_would_mix():
    from megarl.megatron_runtime.training import check_expert_gradients

    cfg = _cfg()
    for parallel in ({"etp": 2, "tp": 2}, {"etp": 2, "ep": 2}, {}):  # etp = tp, or experts reduced over their own group
        check_expert_gradients(get_bridge(cfg).transformer_config(cfg, ParallelConfig(**parallel), torch.float32))
    mixed = get_bridge(cfg).transformer_config(cfg, ParallelConfig(etp=2), torch.float32)  # converts, cannot train
    with pytest.raises(ValueError, match=r"parallel.etp \(2\) with parallel.ep 1 must equal parallel.tp \(1\) to train"):
        check_expert_gradients(mixed)
