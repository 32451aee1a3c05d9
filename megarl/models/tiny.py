"""Tiny Hugging Face model directories built offline, for tests and the CPU demo.

A directory made here is a real HF model directory (config.json, model.safetensors, a fast
tokenizer with a chat template, generation_config.json): every code path that takes an HF path
runs on it. Nothing is downloaded: the model is random-init from a config and the tokenizer is
made with `tokenizers`.

Two tokenizers:
- byte-level (default): the 256 ByteLevel symbols, no merges, plus ChatML special tokens; any
  text round-trips. Vocabulary 259 (not divisible by 2: exercises vocab padding at TP=2).
- a task vocabulary (``task_vocab="0123456789+="`` ...): one token per character plus special
  tokens, so a random policy already hits the answer alphabet often (the demo's task).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# With tools (an agent's schemas), a first system turn lists them, one JSON object per line, as
# Qwen's templates do.
CHATML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A task vocabulary has no role names or newlines: one marker opens the answer.
TASK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>{% endif %}"
)
ARCHS = ("qwen2", "qwen3", "llama", "qwen3_moe", "deepseek_v3")


def build_tokenizer(task_vocab: str | None = None, markers: Sequence[str] = ()):
    """A ``PreTrainedTokenizerFast`` (byte-level, or one token per character of ``task_vocab``);
    ``markers`` (e.g. ``<tool_call>``) are added as single tokens, after the special ones."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if task_vocab is None:
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        template = CHATML_TEMPLATE
        unk = None
    else:
        chars = list(dict.fromkeys(task_vocab))
        vocab = {ch: i for i, ch in enumerate(["<unk>", *chars])}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tok.decoder = decoders.Fuse()
        template = TASK_TEMPLATE
        unk = "<unk>"
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.add_tokens(list(markers))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=unk,
        chat_template=template,
        model_max_length=1 << 16,
    )


def tiny_hf_config(
    arch: str = "qwen2",
    *,
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    ffn_hidden_size: int = 128,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    num_experts: int = 4,
    experts_per_token: int = 2,
    moe_ffn_hidden_size: int = 32,
    norm_topk_prob: bool = True,
    mlp_only_layers: Sequence[int] = (),
    decoder_sparse_step: int = 1,
    deepseek: dict[str, Any] | None = None,
):
    """The transformers config of a tiny model of architecture ``arch``. ``num_experts`` to
    ``decoder_sparse_step`` shape a ``qwen3_moe`` model's experts (its dense layers,
    ``mlp_only_layers`` or those ``decoder_sparse_step`` skips, are ``ffn_hidden_size`` wide);
    ``deepseek``: a ``deepseek_v3`` model's settings over the tiny ones
    (megarl/models/tiny_deepseek_v3.py). Other archs ignore them."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if arch not in ARCHS:
        raise ValueError(f"tiny model arch {arch!r} is not one of {', '.join(ARCHS)}")
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=ffn_hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-6,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling is not None:
        rope = {**rope_scaling, "rope_theta": rope_theta}
    if arch == "qwen2":
        cfg: Any = Qwen2Config(**common, use_sliding_window=False)
    elif arch == "qwen3":
        cfg = Qwen3Config(**common, head_dim=hidden_size // num_heads, use_sliding_window=False)
    elif arch == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, use_sliding_window=False,  # head_dim: hidden / heads, as Qwen3MoeAttention reads it
                             num_experts=num_experts, num_experts_per_tok=experts_per_token,
                             moe_intermediate_size=moe_ffn_hidden_size, norm_topk_prob=norm_topk_prob,
                             mlp_only_layers=list(mlp_only_layers), decoder_sparse_step=decoder_sparse_step,
                             output_router_logits=False)  # fmt: skip
    elif arch == "deepseek_v3":
        from megarl.models.tiny_deepseek_v3 import deepseek_v3_config

        cfg = deepseek_v3_config(common, **(deepseek or {}))
    else:
        cfg = LlamaConfig(**common, attention_bias=False, mlp_bias=False, head_dim=hidden_size // num_heads)
    _set_rope(cfg, rope)
    return cfg


def _set_rope(cfg, rope: dict[str, Any]) -> None:
    """transformers 5 keeps rope settings in ``rope_parameters``; 4.x in theta + scaling."""
    if hasattr(cfg, "rope_parameters"):
        cfg.rope_parameters = rope
    else:  # transformers 4.x
        cfg.rope_theta = rope["rope_theta"]
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        cfg.rope_scaling = None if scaling.get("rope_type") == "default" else scaling


def build_tiny_model(
    out_dir: str | Path,
    arch: str = "qwen2",
    *,
    task_vocab: str | None = None,
    markers: Sequence[str] = (),
    seed: int = 0,
    dtype: str = "float32",
    **config_kwargs: Any,
) -> Path:
    """Write a random-init HF model + tokenizer to ``out_dir`` and return the path.

    ``config_kwargs`` go to :func:`tiny_hf_config` (hidden_size, num_layers, num_heads,
    num_kv_heads, ffn_hidden_size, tie_word_embeddings, rope_scaling, ...).
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(task_vocab, markers)
    config = tiny_hf_config(
        arch,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **config_kwargs,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    if arch == "deepseek_v3":
        from megarl.models.tiny_deepseek_v3 import spread_routing

        spread_routing(model, seed)
    _save_quietly(model, out)
    if arch == "deepseek_v3":
        from megarl.models.tiny_deepseek_v3 import append_mtp_layers

        append_mtp_layers(out, config, seed)
    tokenizer.save_pretrained(out)
    return out


def build_tiny_reward_model(out_dir: str | Path, tokenizer_dir: str | Path | None = None, *, seed: int = 0,
                            **config_kwargs: Any) -> Path:  # fmt: skip
    """Write a random-init HF sequence classifier with one label (a reward model: its score is
    the logit) and its tokenizer to ``out_dir``; the tokenizer is ``tokenizer_dir``'s (e.g. the
    demo model's) or a fresh :func:`build_tokenizer`. ``config_kwargs`` go to :func:`tiny_hf_config`."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForSequenceClassification

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer() if tokenizer_dir is None else AutoTokenizer.from_pretrained(tokenizer_dir)
    config = tiny_hf_config("qwen2", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **config_kwargs)
    config.num_labels = 1
    torch.manual_seed(seed)
    _save_quietly(Qwen2ForSequenceClassification(config), out)
    tokenizer.save_pretrained(out)
    return out


def _save_quietly(model: Any, out: Path) -> None:
    """``save_pretrained`` without transformers' "Writing model shards" bar (one shard of a tiny
    model: noise in the demo's output); the bar's setting is left as it was."""
    from megarl.terminal import hf_progress_bars_off

    with hf_progress_bars_off():
        model.save_pretrained(out, safe_serialization=True)
