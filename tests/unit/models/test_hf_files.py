"""token_ids_problem: whether a model (a critic) reads the token ids of another's tokenizer;
set_config_dtype: config.json names the dtype of the weights written beside it."""

from __future__ import annotations

import json

import torch

from megarl.data.tasks import TASK_VOCAB
from megarl.models.hf_files import set_config_dtype, token_ids_problem
from megarl.models.tiny import build_tiny_model, build_tokenizer


def test_renamed_added_tokens_are_not_another_tokenizer():
    # One family renames its reserved special tokens between releases (Llama 3 -> 3.1): the base
    # vocabulary is the same, and a critic of the older release reads the policy's ids rightly.
    policy, critic = build_tokenizer(TASK_VOCAB, markers=("<a>", "<b>")), build_tokenizer(TASK_VOCAB, markers=("<b>", "<a>"))
    assert policy.convert_tokens_to_ids("<a>") != critic.convert_tokens_to_ids("<a>")
    assert token_ids_problem(policy, len(critic), critic, "model.path's") is None


def test_another_base_vocabulary_or_too_few_embeddings():
    policy, byte_level = build_tokenizer(TASK_VOCAB), build_tokenizer()
    assert token_ids_problem(policy, len(byte_level), byte_level, "model.path's") == (
        "has another tokenizer: 10 of the 10 base tokens of model.path's tokenizer have other ids in its own "
        "(e.g. '0' is 1 in model.path's, 15 in its own)")  # fmt: skip
    assert token_ids_problem(byte_level, 14, None, "model.path's") == (
        "has 14 token embeddings (config.json's vocab_size), fewer than the 259 tokens of model.path's tokenizer")
    assert token_ids_problem(policy, None, None, "model.path's") is None  # nothing to tell it by


def test_config_dtype_names_the_written_weights_dtype(tmp_path):
    # A bf16 model's config.json beside fp32 weights (trained with model.dtype=float32): transformers
    # loads in the config's dtype, and would round the trained weights to bf16 without a word.
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             ffn_hidden_size=32, dtype="bfloat16")  # fmt: skip
    weights = {k: v.float() + 1e-3 for k, v in load_file(str(model / "model.safetensors")).items()}  # not bf16-exact
    save_file(weights, str(model / "model.safetensors"))
    set_config_dtype(model, "float32")
    loaded = AutoModelForCausalLM.from_pretrained(str(model), dtype="auto")
    assert loaded.dtype == torch.float32
    assert torch.equal(loaded.state_dict()["model.norm.weight"], weights["model.norm.weight"])
    # both keys of a config that has both (transformers 5 prefers dtype), torch_dtype where none is named
    for config, want in (({"dtype": "bfloat16", "torch_dtype": "bfloat16"}, {"dtype": "float32", "torch_dtype": "float32"}),
                         ({"model_type": "qwen2"}, {"model_type": "qwen2", "torch_dtype": "float32"})):  # fmt: skip
        (model / "config.json").write_text(json.dumps(config))
        set_config_dtype(model, "float32")
        assert json.loads((model / "config.json").read_text()) == want
    before = (model / "config.json").read_bytes()
    set_config_dtype(model, "float32")  # already right: untouched
    assert (model / "config.json").read_bytes() == before
