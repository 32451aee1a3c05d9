"""The torch engine takes a mixture-of-experts push one tensor per expert, as the trainer sends
it, into transformers' fused experts parameters."""

from __future__ import annotations

import pytest
import torch

from megarl.engines.base import WeightBucket
from megarl.engines.torch_engine import TorchEngine, WeightLoadError
from megarl.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("moe"), arch="qwen3_moe", num_layers=2, num_experts=4, seed=3)


def _pushed(moe_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    (weights,) = moe_dir.glob("*.safetensors")
    return load_file(str(weights))  # transformers' on-disk names: one tensor per expert


def test_per_expert_push_fills_the_fused_experts_exactly(moe_dir):
    from transformers import AutoModelForCausalLM

    engine = TorchEngine(moe_dir, dtype="float32")
    pushed = _pushed(moe_dir)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in pushed
    with torch.no_grad():
        for p in engine.model.parameters():
            p.zero_()
    names = sorted(pushed)
    engine.load_weights(WeightBucket([(n, pushed[n]) for n in names[::2]], 5, last=False))
    engine.load_weights(WeightBucket([(n, pushed[n]) for n in names[1::2]], 5, last=True))
    reference = AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32).state_dict()
    loaded = engine.model.state_dict()
    assert loaded.keys() == reference.keys()
    assert all(torch.equal(loaded[k], reference[k]) for k in reference), "an expert landed in the wrong slice"
    assert engine.weight_version == 5


def test_a_missing_or_misshapen_expert_is_refused_by_name(moe_dir):
    engine = TorchEngine(moe_dir, dtype="float32")
    pushed = _pushed(moe_dir)
    missing = "model.layers.0.mlp.experts.2.down_proj.weight"
    with pytest.raises(WeightLoadError, match=r"ended without 1 parameter\(s\): " + missing.replace(".", r"\.")):
        engine.load_weights(WeightBucket([(n, t) for n, t in pushed.items() if n != missing], 1, last=True))
    with pytest.raises(WeightLoadError, match="experts.0.gate_proj.weight' with shape"):
        engine.load_weights(WeightBucket([("model.layers.0.mlp.experts.0.gate_proj.weight", torch.zeros(3, 3))], 1, last=True))
