"""Architecture numbers for planning: from a local HF config.json, or a built-in table.

The planner needs only shapes (layers, hidden size, heads, vocabulary, positions and, for a
mixture-of-experts model, its experts), so `megarl plan configs/qwen72b_grpo.yaml` works on a
laptop with no weights present. Reading config.json is plain json: no transformers import on the
planning path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class ArchSpec:
    """The shape of a decoder-only transformer, dense or mixture-of-experts (routed experts with a
    SwiGLU each and a router; a layer is an MoE layer unless listed in ``dense_layers`` or off the
    ``moe_layer_step``, as HF's Qwen3MoeDecoderLayer decides). DeepSeek-V3's layout adds shared
    experts (SwiGLUs every token passes through, beside the routed ones), multi-latent attention
    (the ``*_lora_rank`` / ``*_head_dim`` fields; None = standard attention) and a sigmoid router
    whose top-k choice adds a correction bias (``router_bias``)."""

    name: str
    model_type: str  # HF model_type: llama | qwen2 | qwen3 | qwen3_moe | deepseek_v3
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
    num_experts: int = 0  # routed experts per MoE layer; 0 = a dense model
    experts_per_token: int = 0  # the router's top-k (HF num_experts_per_tok)
    moe_ffn_hidden_size: int = 0  # one expert's SwiGLU width (HF moe_intermediate_size)
    moe_layer_step: int = 1  # HF decoder_sparse_step: layer i is MoE when (i + 1) % step == 0
    dense_layers: tuple[int, ...] = ()  # HF mlp_only_layers: layers with a dense MLP of ffn_hidden_size
    num_shared_experts: int = 0  # HF n_shared_experts: one SwiGLU of num_shared_experts x moe_ffn_hidden_size per MoE layer
    router_bias: bool = False  # HF e_score_correction_bias (DeepSeek-V3's noaux_tc): [num_experts] per MoE layer
    # Multi-latent attention (DeepSeek-V2/V3): q = up(norm(down(x))), k/v from a compressed latent.
    q_lora_rank: int | None = None  # None with MLA: q projected directly (DeepSeek-V2-Lite)
    kv_lora_rank: int | None = None  # the cached latent's width; None = standard attention
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None  # the rotary part of q/k, one shared key per token in the cache
    v_head_dim: int | None = None
    # HF num_nextn_predict_layers: multi-token-prediction layers in the checkpoint, not part of the
    # trained model (num_params leaves them out, as the published totals do).
    num_mtp_layers: int = 0

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def qk_head_dim(self) -> int:
        """One head's query/key width (MLA: its no-rope and rope parts)."""
        return (self.qk_nope_head_dim or 0) + (self.qk_rope_head_dim or 0) if self.is_mla else self.kv_channels

    @property
    def v_dim(self) -> int:
        """One head's value width."""
        return self.v_head_dim or self.kv_channels if self.is_mla else self.kv_channels

    @property
    def mla_params(self) -> int:
        """Multi-latent attention's projections and latent norms (HF DeepseekV3Attention): q down
        [h, q_lora], its norm, q up [q_lora, heads x qk]; kv down [h, kv_lora + rope], its norm,
        kv up [kv_lora, heads x (nope + v)]; output [heads x v, h]."""
        h, heads, q_lora, kv_lora = self.hidden_size, self.num_heads, self.q_lora_rank, self.kv_lora_rank or 0
        q = h * heads * self.qk_head_dim if q_lora is None else h * q_lora + q_lora + q_lora * heads * self.qk_head_dim
        kv = h * (kv_lora + (self.qk_rope_head_dim or 0)) + kv_lora + kv_lora * heads * ((self.qk_nope_head_dim or 0) + self.v_dim)
        return q + kv + heads * self.v_dim * h

    @property
    def attention_params(self) -> int:
        """One layer's attention (QKV, output projection, biases, q/k norms) and its two RMSNorms."""
        if self.is_mla:
            return self.mla_params + 2 * self.hidden_size
        h, d = self.hidden_size, self.kv_channels
        q_dim, kv_dim = self.num_heads * d, self.num_kv_heads * d
        attn = h * (q_dim + 2 * kv_dim) + q_dim * h
        if self.qkv_bias:
            attn += q_dim + 2 * kv_dim
        if self.model_type in ("qwen3", "qwen3_moe"):
            attn += 2 * d  # q/k norms
        return attn + 2 * h

    @property
    def layer_params(self) -> int:
        """Parameters of one dense transformer layer (attention, SwiGLU MLP, two RMSNorms)."""
        return self.attention_params + 3 * self.hidden_size * self.ffn_hidden_size

    @property
    def expert_params(self) -> int:
        """One expert's SwiGLU (gate, up, down)."""
        return 3 * self.hidden_size * self.moe_ffn_hidden_size

    @property
    def moe_layer_params(self) -> tuple[int, int]:
        """(non-expert, expert) parameters of one MoE layer: attention, norms, the router
        [num_experts x hidden] and its correction bias (replicated), the shared experts (split over
        TP as a dense MLP); and the routed experts (split over EP x ETP)."""
        router = self.num_experts * (self.hidden_size + int(self.router_bias))
        dense = self.attention_params + router + self.num_shared_experts * self.expert_params
        return dense, self.num_experts * self.expert_params

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.dense_layers and (i + 1) % self.moe_layer_step == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def layers_params(self, first: int, last: int) -> tuple[int, int]:
        """(non-expert, expert) parameters of layers ``first`` .. ``last - 1``."""
        moe = sum(self.is_moe_layer(i) for i in range(first, last))
        dense, experts = self.moe_layer_params
        return (last - first - moe) * self.layer_params + moe * dense, moe * experts

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        heads = 1 if self.tie_embeddings else 2
        return sum(self.layers_params(0, self.num_layers)) + heads * self.embedding_params + self.hidden_size

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: every MoE layer's top-k experts of its num_experts."""
        idle = self.num_experts - self.experts_per_token
        return self.num_params - self.num_moe_layers * idle * self.expert_params


def _qwen25(name: str, h: int, layers: int, heads: int, kv: int, ffn: int, tie: bool, vocab: int = 152064) -> ArchSpec:
    return ArchSpec(name, "qwen2", h, layers, heads, kv, ffn, vocab, 32768, tie, qkv_bias=True)


def _qwen3(name: str, h: int, layers: int, heads: int, kv: int, ffn: int, tie: bool) -> ArchSpec:
    return ArchSpec(name, "qwen3", h, layers, heads, kv, ffn, 151936, 40960, tie, head_dim=128)


def _qwen3_moe(name: str, h: int, layers: int, heads: int, ffn: int, moe_ffn: int) -> ArchSpec:
    return ArchSpec(name, "qwen3_moe", h, layers, heads, 4, ffn, 151936, 40960, False, head_dim=128,
                    num_experts=128, experts_per_token=8, moe_ffn_hidden_size=moe_ffn)


def _deepseek_v3(name: str, layers_dense: int, experts: int, heads: int, vocab: int, positions: int, mtp: int) -> ArchSpec:
    """DeepSeek-V3's shape (deepseek-ai/DeepSeek-V3 config.json: hidden 7168, 61 layers,
    intermediate 18432, moe_intermediate 2048, top-8, 1 shared expert, q_lora 1536, kv_lora 512,
    qk_nope 128, qk_rope 64, v_head 128, noaux_tc routing, untied), with what its derivatives change."""
    return ArchSpec(name, "deepseek_v3", 7168, 61, heads, heads, 18432, vocab, positions, False, num_experts=experts,
                    experts_per_token=8, moe_ffn_hidden_size=2048, dense_layers=tuple(range(layers_dense)),
                    num_shared_experts=1, router_bias=True, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, num_mtp_layers=mtp)  # fmt: skip


# Published config.json values of each model.
BUILTIN_ARCHS: dict[str, ArchSpec] = {
    a.name: a
    for a in (
        # Qwen2's 7B (verl's GRPO examples' Qwen/Qwen2-7B-Instruct): Qwen2.5-7B's shape.
        _qwen25("qwen2-7b", 3584, 28, 28, 4, 18944, False),
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
        _qwen3_moe("qwen3-30b-a3b", 2048, 48, 32, 6144, 768),
        _qwen3_moe("qwen3-235b-a22b", 4096, 94, 64, 12288, 1536),
        # deepseek-ai/DeepSeek-V3 (and R1, same config.json): first_k_dense_replace 3, n_routed_experts 256,
        # 128 heads (num_key_value_heads 128), vocab 129280, max_position_embeddings 163840,
        # num_nextn_predict_layers 1. Model card: 671B total (685B with the MTP module), 37B activated.
        _deepseek_v3("deepseek-v3", 3, 256, 128, 129280, 163840, 1),
        # moonshotai/Kimi-K2-Instruct config.json: first_k_dense_replace 1, n_routed_experts 384, 64 heads,
        # vocab 163840, max_position_embeddings 131072, num_nextn_predict_layers 0 (the rest as DeepSeek-V3).
        # Model card: 1T total, 32B activated (counted here: 1.026T, 32.9B).
        _deepseek_v3("kimi-k2", 1, 384, 64, 163840, 131072, 0),
        # The CPU demo's model (megarl demo builds it with megarl/models/tiny.py).
        ArchSpec("tiny-demo", "qwen2", 64, 2, 4, 2, 128, 14, 64, False, qkv_bias=True),
        # The tool-use demo's (configs/tiny_tool_agent.yaml): tiny-demo with '+' and two call markers.
        ArchSpec("tiny-tool-demo", "qwen2", 64, 2, 4, 2, 128, 17, 64, False, qkv_bias=True),
        # The MoE demo's (configs/tiny_moe_grpo.yaml; megarl/commands/demo.py DEMO_MOE_MODEL).
        ArchSpec("tiny-moe-demo", "qwen3_moe", 64, 2, 4, 2, 128, 14, 64, False, num_experts=4, experts_per_token=2,
                 moe_ffn_hidden_size=64),
        # The DeepSeek-V3 demo's (configs/tiny_dsv3_grpo.yaml; megarl/commands/demo.py DEMO_DSV3_MODEL).
        ArchSpec("tiny-dsv3-demo", "deepseek_v3", 64, 3, 4, 4, 128, 14, 64, False, head_dim=8, num_experts=4,
                 experts_per_token=2, moe_ffn_hidden_size=64, dense_layers=(0,), num_shared_experts=1, router_bias=True,
                 q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
        # deepseek-ai/deepseek-llm-7b-chat (verl's default model path): a Llama without GQA.
        ArchSpec("deepseek-llm-7b", "llama", 4096, 30, 32, 32, 11008, 102400, 4096, False),
        ArchSpec("llama-3-8b", "llama", 4096, 32, 32, 8, 14336, 128256, 8192, False),
        ArchSpec("llama-3-70b", "llama", 8192, 80, 64, 8, 28672, 128256, 8192, False),
        ArchSpec("llama-3.1-8b", "llama", 4096, 32, 32, 8, 14336, 128256, 131072, False),
        ArchSpec("llama-3.1-70b", "llama", 8192, 80, 64, 8, 28672, 128256, 131072, False),
    )
}


def describe_archs() -> str:
    """The built-in table, one line per architecture (what `megarl plan --list-archs` prints);
    a mixture-of-experts model also shows its active parameters and experts (top-k of all)."""
    kinds = max(len(a.model_type) for a in BUILTIN_ARCHS.values())  # the widest type sets the column
    lines = [f"{'name':<16} {'type':<{kinds}} {'params':>9} {'active':>8} {'experts':>7} {'layers':>6} {'heads/kv':>8} "
             f"{'hidden':>6} {'vocab':>7} {'positions':>9}"]  # fmt: skip
    for a in BUILTIN_ARCHS.values():
        active, experts = (f"{a.active_params / 1e9:.2f}B", f"{a.experts_per_token}/{a.num_experts}") if a.num_experts else ("-", "-")
        lines.append(f"{a.name:<16} {a.model_type:<{kinds}} {a.num_params / 1e9:>8.2f}B {active:>8} {experts:>7} {a.num_layers:>6} "
                     f"{f'{a.num_heads}/{a.num_kv_heads}':>8} {a.hidden_size:>6} {a.vocab_size:>7} {a.max_positions:>9}")
    return "\n".join(lines)


# What a Hugging Face repo name may end with beyond its architecture's built-in name.
_NAME_SUFFIXES = ("-instruct", "-chat", "-base", "-it")


def arch_for_model_name(path: str) -> str | None:
    """The built-in architecture a model's hub id or directory names (``Qwen/Qwen2.5-7B-Instruct``
    -> qwen2.5-7b), else None: so a config translated from another framework plans without weights."""
    name = path.rstrip("/").rsplit("/", 1)[-1].lower().removeprefix("meta-")
    for suffix in _NAME_SUFFIXES:
        name = name.removesuffix(suffix)
    return name if name in BUILTIN_ARCHS else None


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
            **_moe_fields(cfg),
            **_mla_fields(cfg),
        )
    except KeyError as exc:
        raise ArchError(f"{name}: config.json lacks {exc.args[0]!r}; is this a decoder-only language model?") from None
    return spec


def _moe_fields(cfg: dict) -> dict:
    """A mixture-of-experts config.json's expert shape (Qwen3-MoE's names; Mixtral's
    num_local_experts and DeepSeek-V3's n_routed_experts too); none for a dense model."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
    if not experts:
        return {}
    fields = {
        "num_experts": experts,
        "experts_per_token": int(cfg.get("num_experts_per_tok") or 0),
        "moe_ffn_hidden_size": int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        "moe_layer_step": int(cfg.get("decoder_sparse_step") or 1),
        "dense_layers": tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
    }
    if "first_k_dense_replace" in cfg or "n_shared_experts" in cfg:  # DeepSeek-V3's names (HF DeepseekV3DecoderLayer)
        first, freq = int(cfg.get("first_k_dense_replace") or 0), int(cfg.get("moe_layer_freq") or 1)
        fields["dense_layers"] = tuple(i for i in range(cfg["num_hidden_layers"]) if i < first or i % freq)
        fields["num_shared_experts"] = int(cfg.get("n_shared_experts") or 0)
        fields["router_bias"] = cfg.get("topk_method", "noaux_tc") == "noaux_tc"  # the e_score_correction_bias
    return fields


def _mla_fields(cfg: dict) -> dict:
    """Multi-latent attention's widths (DeepSeek-V2/V3 config.json), and its MTP layers; none
    for standard attention."""
    if cfg.get("kv_lora_rank") is None:
        return {}
    keys = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    fields: dict = {k: None if cfg.get(k) is None else int(cfg[k]) for k in keys}
    return fields | {"num_mtp_layers": int(cfg.get("num_nextn_predict_layers") or 0)}


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
