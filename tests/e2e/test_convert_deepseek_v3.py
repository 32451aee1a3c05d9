"""A tiny DeepSeek-V3 with one multi-token-prediction layer through both conversion directions in
this process (one rank: the TP2 x EP2 export is tests/distributed/test_deepseek_v3_bridge.py's):
HF -> Megatron -> HF gives every tensor back bit for bit, the correction biases through the
routers' expert_bias and the MTP layer (which no Megatron parameter holds) through the side file."""

from __future__ import annotations

import torch


def _tensors(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def test_deepseek_v3_hf_to_megatron_and_back_bit_for_bit(tmp_path):
    from megarl.commands.conversion import convert_hf_to_megatron, export_model_checkpoint
    from megarl.models.carried_tensors import CARRIED_FILE
    from megarl.models.tiny import build_tiny_model

    hf = build_tiny_model(tmp_path / "ds", "deepseek_v3", hidden_size=64, num_layers=3, num_heads=4, ffn_hidden_size=96,
                          deepseek={"num_nextn_predict_layers": 1})  # fmt: skip
    ckpt = convert_hf_to_megatron(hf, tmp_path / "ckpt", in_process=True)
    assert sorted(_tensors_in(ckpt / CARRIED_FILE)) == sorted(n for n in _tensors(hf) if n.startswith("model.layers.3."))
    out = export_model_checkpoint(ckpt, tmp_path / "hf_again", in_process=True)
    a, b = _tensors(hf), _tensors(out)
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in b and "model.layers.3.eh_proj.weight" in b
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def _tensors_in(path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())
