"""token_ids_problem: whether a model (a critic) reads the token ids of another's tokenizer."""

from __future__ import annotations

from megarl.data.tasks import TASK_VOCAB
from megarl.models.hf_files import token_ids_problem
from megarl.models.tiny import build_tokenizer


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
