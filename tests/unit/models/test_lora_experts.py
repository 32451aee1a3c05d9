"""Which LoRA runs adapted mixture-of-experts experts (no HF PEFT form: convert and sft write the
merged model alone, megarl/models/lora.py ``adapts_experts``)."""

from __future__ import annotations

import json

import pytest

from megarl.config.train_sections import LoRAConfig
from megarl.models.lora import adapts_experts


@pytest.mark.parametrize(("hf", "targets", "expected"), [
    ({"model_type": "qwen3_moe", "num_experts": 4}, ["all-linear"], True),
    ({"model_type": "qwen3_moe", "num_experts": 4}, ["down_proj"], True),
    ({"model_type": "qwen3_moe", "num_experts": 4}, ["q_proj", "v_proj"], False),
    ({"model_type": "qwen2"}, ["all-linear"], False),
])  # fmt: skip
def test_expert_adapters_are_the_mlp_modules_of_a_model_with_experts(tmp_path, hf, targets, expected):
    shape = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 259}
    (tmp_path / "config.json").write_text(json.dumps(shape | hf))
    assert adapts_experts(tmp_path, LoRAConfig(target_modules=targets)) is expected


def test_a_directory_without_config_json_has_no_experts(tmp_path):
    assert adapts_experts(tmp_path, LoRAConfig()) is False
