"""Rotary position embedding settings read from an HF config, and llama3 frequency scaling.

transformers 5 keeps rope settings in ``config.rope_parameters`` (``rope_type``, ``rope_theta``,
scaling keys); transformers 4 in ``config.rope_theta`` + ``config.rope_scaling``. :func:`read_rope`
reads either into one :class:`RopeSettings`.

Supported rope types: ``default``; ``linear`` (positions divided by ``factor``: Megatron's
``seq_len_interpolation_factor``); ``llama3``; ``yarn`` only where a bridge asks for it (the
DeepSeek-V3 bridge: Megatron's multi-latent attention has yarn, its plain attention not). Megatron's built-in llama3 scaling hard-codes
low/high frequency factors 1/4 and 8192 original positions, so for llama3 the bridge replaces
the rotary embedding's ``inv_freq`` with :func:`llama3_inv_freq` computed from the config's own
values. Everything else (dynamic, longrope, partial rotary) is refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where frequencies are computed: the planner reads rope settings without it
    import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
MLA_ROPE_TYPES = ("default", "yarn")  # Megatron's multi-latent attention has yarn (the DeepSeek-V3 bridge)


def bridge_rope_types(model_type: str) -> tuple[str, ...]:
    """The rope types the bridge of ``model_type`` implements (megarl/models/bridges.py's rope_types)."""
    return MLA_ROPE_TYPES if model_type == "deepseek_v3" else SUPPORTED_ROPE_TYPES
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_YARN_REQUIRED = ("factor", "original_max_position_embeddings")
# attention_factor and truncate are only checked: Megatron takes neither (it always truncates).
_YARN_KEYS = (*_YARN_REQUIRED, "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")
# Keys a rope dict may carry that change nothing for the supported types.
_IGNORED_KEYS = {"rope_type", "type", "rope_theta"}


@dataclass(frozen=True)
class RopeSettings:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn, as Megatron's YarnRotaryEmbedding takes them (read_rope maps HF's values)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


def _rope_dict(hf_config: Any) -> dict[str, Any]:
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        return dict(params)
    rope = dict(getattr(hf_config, "rope_scaling", None) or {})
    theta = getattr(hf_config, "rope_theta", None)
    if theta is None:
        raise ValueError("HF config has neither rope_parameters nor rope_theta; cannot set RoPE")
    rope["rope_theta"] = theta
    return rope


def read_rope(hf_config: Any, supported: tuple[str, ...] = SUPPORTED_ROPE_TYPES) -> RopeSettings:
    """Rope settings of ``hf_config``; raises ValueError naming any unsupported key or value.
    ``supported``: the rope types the caller implements (``yarn`` is not in the default)."""
    rope = _rope_dict(hf_config)
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rope_type not in supported:
        raise ValueError(
            f"HF config rope_type={rope_type!r} is not supported; supported: "
            f"{', '.join(supported)}"
        )
    partial = rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1.0, 1):
        raise ValueError(f"HF config partial_rotary_factor={partial} is not supported; supported: 1.0")
    allowed = set(_IGNORED_KEYS) | {"partial_rotary_factor"}
    if rope_type == "linear":
        allowed |= {"factor"}
    elif rope_type == "llama3":
        allowed |= set(_LLAMA3_KEYS)
        missing = [k for k in _LLAMA3_KEYS if k not in rope]
        if missing:
            raise ValueError(f"HF config llama3 rope scaling lacks {', '.join(missing)}")
    elif rope_type == "yarn":
        allowed |= set(_YARN_KEYS)
    unknown = sorted(k for k, v in rope.items() if k not in allowed and v is not None)
    if unknown:
        raise ValueError(
            f"HF config rope setting(s) {', '.join(f'{k}={rope[k]!r}' for k in unknown)} are not "
            f"supported for rope_type={rope_type!r}; supported keys: {', '.join(sorted(allowed))}"
        )
    kwargs = {k: rope[k] for k in _LLAMA3_KEYS if k in rope}
    if rope_type == "linear":
        kwargs = {"factor": rope.get("factor", 1.0)}
    elif rope_type == "yarn":
        kwargs = _yarn_settings(rope)
    return RopeSettings(theta=float(rope["rope_theta"]), rope_type=rope_type, **kwargs)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 when ``factor`` <= 1), as
    HF's ``get_mscale`` and Megatron's ``_yarn_get_mscale`` compute it."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_settings(rope: dict[str, Any]) -> dict[str, Any]:
    """HF's yarn values as Megatron's MLA takes them. cos/sin: HF scales them by
    ``attention_factor``, by default ``mscale(f, mscale) / mscale(f, mscale_all_dim)`` when both are
    set and ``mscale(f)`` otherwise; Megatron always by ``mscale(f, mscale) / mscale(f,
    mscale_all_dim)``: so ``mscale`` goes over only when HF uses it (else 1), and a config whose
    factor Megatron cannot reproduce is refused. The softmax scale (``mscale(f, mscale_all_dim)``
    squared, 0 meaning none) is the same formula in both."""
    missing = [k for k in _YARN_REQUIRED if rope.get(k) is None]
    if missing:
        raise ValueError(f"HF config yarn rope scaling lacks {', '.join(missing)}")
    if rope.get("truncate", True) is False:
        raise ValueError("HF config yarn rope scaling truncate=False is not supported; supported: true (Megatron rounds the range)")
    factor, mscale, all_dim = float(rope["factor"]), rope.get("mscale"), float(rope.get("mscale_all_dim") or 0.0)
    hf = rope.get("attention_factor") or (yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim) if mscale and all_dim
                                          else yarn_mscale(factor))  # fmt: skip
    megatron_mscale = float(mscale) if mscale and all_dim else 1.0
    megatron = yarn_mscale(factor, megatron_mscale) / yarn_mscale(factor, all_dim)
    if not math.isclose(hf, megatron, rel_tol=1e-12):
        raise ValueError(f"HF config yarn rope scaling (attention_factor={rope.get('attention_factor')}, mscale={mscale}, "
                         f"mscale_all_dim={rope.get('mscale_all_dim')}) scales cos/sin by {hf:.6g}, which Megatron's yarn "
                         f"cannot ({megatron:.6g}); supported: attention_factor unset with mscale set whenever "
                         "mscale_all_dim is")  # fmt: skip
    return {"factor": factor, "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
            "beta_fast": float(rope.get("beta_fast") or 32), "beta_slow": float(rope.get("beta_slow") or 1),
            "mscale": megatron_mscale, "mscale_all_dim": all_dim}  # fmt: skip


def default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """``1 / theta^(2i/dim)`` for i < dim/2, in float32 (as HF and Megatron compute it)."""
    import torch

    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))


def llama3_inv_freq(dim: int, rope: RopeSettings) -> torch.Tensor:
    """Llama 3.x inverse frequencies: low frequencies divided by ``factor``, high ones kept,
    a smooth interpolation between the two wavelength bands. ``[dim / 2]`` float32."""
    import torch

    inv_freq = default_inv_freq(dim, rope.theta)
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)
