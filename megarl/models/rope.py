"""Rotary position embedding settings read from an HF config, and llama3 frequency scaling.

transformers 5 keeps rope settings in ``config.rope_parameters`` (``rope_type``, ``rope_theta``,
scaling keys); transformers 4 in ``config.rope_theta`` + ``config.rope_scaling``. :func:`read_rope`
reads either into one :class:`RopeSettings`.

Supported rope types: ``default``; ``linear`` (positions divided by ``factor``: Megatron's
``seq_len_interpolation_factor``); ``llama3``. Megatron's built-in llama3 scaling hard-codes
low/high frequency factors 1/4 and 8192 original positions, so for llama3 the bridge replaces
the rotary embedding's ``inv_freq`` with :func:`llama3_inv_freq` computed from the config's own
values. Everything else (yarn, dynamic, longrope, partial rotary) is refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
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


def read_rope(hf_config: Any) -> RopeSettings:
    """Rope settings of ``hf_config``; raises ValueError naming any unsupported key or value."""
    rope = _rope_dict(hf_config)
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"HF config rope_type={rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
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
    unknown = sorted(k for k, v in rope.items() if k not in allowed and v is not None)
    if unknown:
        raise ValueError(
            f"HF config rope setting(s) {', '.join(f'{k}={rope[k]!r}' for k in unknown)} are not "
            f"supported for rope_type={rope_type!r}; supported keys: {', '.join(sorted(allowed))}"
        )
    kwargs = {k: rope[k] for k in _LLAMA3_KEYS if k in rope}
    if rope_type == "linear":
        kwargs = {"factor": rope.get("factor", 1.0)}
    return RopeSettings(theta=float(rope["rope_theta"]), rope_type=rope_type, **kwargs)


def default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """``1 / theta^(2i/dim)`` for i < dim/2, in float32 (as HF and Megatron compute it)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))


def llama3_inv_freq(dim: int, rope: RopeSettings) -> torch.Tensor:
    """Llama 3.x inverse frequencies: low frequencies divided by ``factor``, high ones kept,
    a smooth interpolation between the two wavelength bands. ``[dim / 2]`` float32."""
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
