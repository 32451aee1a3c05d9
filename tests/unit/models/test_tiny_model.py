"""megarl.models.tiny builds real HF model directories offline."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megarl.models.tiny import build_tiny_model, build_tokenizer


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_directory_loads_with_auto_classes(tmp_path, arch):
    path = build_tiny_model(tmp_path / arch, arch, tie_word_embeddings=arch == "qwen3")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == arch
    assert model.config.vocab_size == len(tok) == 259
    assert model.config.tie_word_embeddings is (arch == "qwen3")
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert ids == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    out = model(torch.tensor([tok("hello")["input_ids"]]))
    assert out.logits.shape == (1, 5, 259)


def test_byte_level_round_trip():
    tok = build_tokenizer()
    text = "Ünïcode ∑ and\nnewlines 123"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_task_vocab_is_one_token_per_character():
    tok = build_tokenizer("0123456789")
    ids = tok("472")["input_ids"]
    assert len(ids) == 3 and tok.decode(ids) == "472"
    assert len(tok) == 1 + 10 + 3  # unk, digits, specials
    prompt = tok.apply_chat_template([{"role": "user", "content": "472"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>472<|im_end|><|im_start|>"


def test_llama3_rope_scaling_is_kept(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128}
    path = build_tiny_model(tmp_path / "l", "llama", rope_scaling=scaling, rope_theta=500000.0)
    cfg = AutoModelForCausalLM.from_pretrained(path).config
    params = getattr(cfg, "rope_parameters", None) or {**(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    assert params["rope_type"] == "llama3" and params["factor"] == 8.0 and params["rope_theta"] == 500000.0


def test_building_prints_no_progress_bar_and_leaves_the_setting_as_it_was(tmp_path, capfd):
    from transformers.utils import logging as hf_logging

    build_tiny_model(tmp_path / "m")  # the demo's first output line was transformers' "Writing model shards" bar
    assert capfd.readouterr().err == "" and hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        build_tiny_model(tmp_path / "m2")
        assert not hf_logging.is_progress_bar_enabled()  # the caller's choice stays
    finally:
        hf_logging.enable_progress_bar()
