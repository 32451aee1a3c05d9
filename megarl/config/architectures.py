"""Architecture numbers for planning: from a local HF config.json, or a built-in table.

The planner needs only shapes (layers, hidden size, heads, vocabulary, positions), so
`megarl plan configs/qwen72b_grpo.yaml` works on a laptop with no weights present. Reading
config.json is plain json: no transformers import on the planning path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class ArchSpec:
    """The shape of a dense decoder-only transformer."""

    name: str
    model_type: str  # HF model_type: llama | qwen2 | qwen3 | qwen3_moe
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    max_positions: int
    tie_embeddings: bool
    head_dim: int | None = None  # None = hidden_size // num_heads
    qkv_bias: bool = False
    num_experts: int = 0  # MoE: the planner checks expert parallelism against it; not trained yet (no expert memory model)

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer layer (attention, SwiGLU MLP, two RMSNorms)."""
        h, d = self.hidden_size, self.kv_channels
        q_dim, kv_dim = self.num_heads * d, self.num_kv_heads * d
        attn = h * (q_dim + 2 * kv_dim) + q_dim * h
        if self.qkv_bias:
            attn += q_dim + 2 * kv_dim
        if self.model_type == "qwen3":
            attn += 2 * d  # q/k norms
        mlp = 3 * h * self.ffn_hidden_size
        return attn + mlp + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        heads = 1 if self.tie_embeddings else 2
        return self.num_layers * self.layer_params + heads * self.embedding_params + self.hidden_size


def _qwen25(name: str, h: int, layers: int, heads: int, kv: int, ffn: int, tie: bool, vocab: int = 152064) -> ArchSpec:
    return ArchSpec(name, "qwen2", h, layers, heads, kv, ffn, vocab, 32768, tie, qkv_bias=True)


def _qwen3(name: str, h: int, layers: int, heads: int, kv: int, ffn: int, tie: bool) -> ArchSpec:
    return ArchSpec(name, "qwen3", h, layers, heads, kv, ffn, 151936, 40960, tie, head_dim=128)


# Published config.json values of each model.
BUILTIN_ARCHS: dict[str, ArchSpec] = {
    a.name: a
    for a in (
        _qwen25("qwen2.5-0.5b", 896, 24, 14, 2, 4864, True, vocab=151936),
        _qwen25("qwen2.5-1.5b", 1536, 28, 12, 2, 8960, True, vocab=151936),
        _qwen25("qwen2.5-3b", 2048, 36, 16, 2, 11008, True, vocab=151936),
        _qwen25("qwen2.5-7b", 3584, 28, 28, 4, 18944, False),
        _qwen25("qwen2.5-14b", 5120, 48, 40, 8, 13824, False),
        _qwen25("qwen2.5-32b", 5120, 64, 40, 8, 27648, False),
        _qwen25("qwen2.5-72b", 8192, 80, 64, 8, 29568, False),
        _qwen3("qwen3-0.6b", 1024, 28, 16, 8, 3072, True),
        _qwen3("qwen3-1.7b", 2048, 28, 16, 8, 6144, True),
        _qwen3("qwen3-4b", 2560, 36, 32, 8, 9728, True),
        _qwen3("qwen3-8b", 4096, 36, 32, 8, 12288, False),
        _qwen3("qwen3-14b", 5120, 40, 40, 8, 17408, False),
        _qwen3("qwen3-32b", 5120, 64, 64, 8, 25600, False),
        # The CPU demo's model (megarl demo builds it with megarl/models/tiny.py).
        ArchSpec("tiny-demo", "qwen2", 64, 2, 4, 2, 128, 14, 64, False, qkv_bias=True),
        ArchSpec("tiny-moe-demo", "qwen3_moe", 64, 2, 4, 2, 128, 14, 64, False, head_dim=16, num_experts=4),
        ArchSpec("llama-3-8b", "llama", 4096, 32, 32, 8, 14336, 128256, 8192, False),
        ArchSpec("llama-3-70b", "llama", 8192, 80, 64, 8, 28672, 128256, 8192, False),
        ArchSpec("llama-3.1-8b", "llama", 4096, 32, 32, 8, 14336, 128256, 131072, False),
        ArchSpec("llama-3.1-70b", "llama", 8192, 80, 64, 8, 28672, 128256, 131072, False),
    )
}


def describe_archs() -> str:
    """The built-in table, one line per architecture (what `megarl plan --list-archs` prints)."""
    lines = [f"{'name':<16} {'type':<6} {'params':>8} {'layers':>6} {'heads/kv':>8} {'hidden':>6} {'vocab':>7} {'positions':>9}"]
    for a in BUILTIN_ARCHS.values():
        lines.append(f"{a.name:<16} {a.model_type:<6} {a.num_params / 1e9:>7.2f}B {a.num_layers:>6} "
                     f"{f'{a.num_heads}/{a.num_kv_heads}':>8} {a.hidden_size:>6} {a.vocab_size:>7} {a.max_positions:>9}")
    return "\n".join(lines)


class ArchError(ValueError):
    """The model's architecture cannot be determined (names the field and the fix)."""


def builtin_arch(name: str) -> ArchSpec:
    key = name.lower()
    if key not in BUILTIN_ARCHS:
        raise ArchError(f"model.arch ({name!r}) is not a built-in architecture; choose one of: {', '.join(BUILTIN_ARCHS)}")
    return BUILTIN_ARCHS[key]


def arch_from_hf_dir(path: str | Path) -> ArchSpec:
    """Read the shapes from ``path/config.json`` (an HF model directory)."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise ArchError(f"model.path ({path}) has no config.json; point it at a Hugging Face model directory or set model.arch")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise ArchError(f"{cfg_file} is not valid JSON: {exc}") from None
    return arch_from_hf_dict(cfg, name=str(path))


def arch_from_hf_dict(cfg: dict, name: str = "config.json") -> ArchSpec:
    try:
        heads = cfg["num_attention_heads"]
        spec = ArchSpec(
            name=name,
            model_type=cfg.get("model_type", "unknown"),
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            ffn_hidden_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            max_positions=cfg.get("max_position_embeddings", 4096),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            head_dim=cfg.get("head_dim"),
            qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)),
            num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0),
        )
    except KeyError as exc:
        raise ArchError(f"{name}: config.json lacks {exc.args[0]!r}; is this a decoder-only language model?") from None
    return spec


def resolve_arch(path: str | None, arch: str | None) -> ArchSpec:
    """model.path wins when it exists locally; else model.arch; else an error naming both."""
    if path is not None and (Path(path) / "config.json").is_file():
        return arch_from_hf_dir(path)
    if arch is not None:
        spec = builtin_arch(arch)
        return replace(spec, name=arch)
    raise ArchError(
        f"model.path ({path}) is not a local HF directory with config.json; set model.arch to a built-in "
        f"architecture ({', '.join(BUILTIN_ARCHS)}) to plan without weights"
    )
