"""A mixture-of-experts model (tiny Qwen3-MoE: 4 experts, layer 1 dense) through both conversion
directions on the real command paths (Ray groups of CPU ranks):

HF -> Megatron at TP=2 x EP=2 (2 ranks: each TP rank holds two experts) -> HF with the recorded
layout (`megarl convert CKPT OUT`, the short form), and the same checkpoint -> HF at PP=2 x EP=2
(4 ranks: the expert-parallel groups span the two data-parallel replicas, every stage's experts
resharded from the TP=2 x EP=2 save): every tensor bit for bit under transformers 5's on-disk
names (one tensor per expert), each parameter counted once.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow

SHAPE = dict(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=96, num_experts=4,
             experts_per_token=2, moe_ffn_hidden_size=32, mlp_only_layers=[1])  # fmt: skip
# Megatron's parameters of SHAPE, each once: per layer qkv, q/k norms, proj, the two norms; per
# MoE layer a router and 2 per expert, the dense layer fc1 and fc2; embedding, final norm, output layer.
PARAMETERS = 4 * 6 + 3 * (1 + 2 * 4) + 2 + 3


def _tensors(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _assert_same_tensors(original, converted) -> None:
    a, b = _tensors(original), _tensors(converted)
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    assert "model.layers.3.mlp.experts.3.down_proj.weight" in b  # transformers 5's names on disk, per expert
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_moe_hf_to_megatron_tp2_ep2_and_back_bit_for_bit(ray_local, tmp_path):
    from megarl.checkpoint.model_checkpoint import check_model_checkpoint
    from megarl.commands.conversion import convert_hf_to_megatron, export_model_checkpoint
    from megarl.models.tiny import build_tiny_model

    hf = build_tiny_model(tmp_path / "moe", "qwen3_moe", **SHAPE)
    ckpt = convert_hf_to_megatron(hf, tmp_path / "ckpt", tp=2, ep=2)
    record = check_model_checkpoint(ckpt)
    assert (record["tp"], record["pp"], record["ep"]) == (2, 1, 2) and record["verified_parameters"] == PARAMETERS
    out = tmp_path / "hf_again"
    done = subprocess.run([sys.executable, "-m", "megarl.cli", "convert", str(ckpt), str(out)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(TP=2, PP=1, EP=2)" in done.stdout and "bit for bit" in done.stdout
    _assert_same_tensors(hf, out)
    assert json.loads((out / "megarl_export.json").read_text())["verified_parameters"] == PARAMETERS
    pp2 = export_model_checkpoint(ckpt, tmp_path / "hf_pp2", tp=1, pp=2, ep=2)
    _assert_same_tensors(hf, pp2)
    assert json.loads((pp2 / "megarl_export.json").read_text())["verified_parameters"] == PARAMETERS


def test_moe_hf_to_megatron_etp2_and_back_bit_for_bit(ray_local, tmp_path):
    """Each expert split over 2 ranks (--etp 2, the two data-parallel replicas of TP=1), saved and
    exported with the recorded layout, then by one rank in this process (each expert whole again)."""
    from megarl.checkpoint.model_checkpoint import check_model_checkpoint
    from megarl.commands.conversion import convert_hf_to_megatron, export_model_checkpoint
    from megarl.models.tiny import build_tiny_model

    hf = build_tiny_model(tmp_path / "moe", "qwen3_moe", **SHAPE)
    said: list[str] = []
    ckpt = convert_hf_to_megatron(hf, tmp_path / "ckpt", etp=2, report=said.append)
    assert any("into 2 rank(s) (TP=1, PP=1, ETP=2" in line for line in said), said
    record = check_model_checkpoint(ckpt)
    assert (record["tp"], record["ep"], record["etp"]) == (1, 1, 2) and record["verified_parameters"] == PARAMETERS
    _assert_same_tensors(hf, export_model_checkpoint(ckpt, tmp_path / "hf_again"))
    _assert_same_tensors(hf, export_model_checkpoint(ckpt, tmp_path / "hf_whole", in_process=True))
