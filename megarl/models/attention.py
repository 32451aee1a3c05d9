"""Core attention for Megatron's local layer spec, computed by torch's scaled_dot_product_attention.

Megatron's own local ``DotProductAttention`` materialises ``[b, heads, s, s]`` scores and needs
the fused softmax kernels of apex/TE for speed; transformer-engine does not run without CUDA.
:class:`SdpaAttention` keeps Megatron's constructor and call signature (so it drops into the
spec's ``core_attention`` slot) and lets torch pick a fused kernel (flash / memory-efficient on
GPU, a fused CPU kernel on CPU). GQA is handled without repeating K/V (``enable_gqa``).

Mask convention (Megatron's): ``attention_mask`` is bool, True = masked, broadcastable to
``[b, 1, sq, sk]``. A query row whose every key is masked (a left-padding position) attends to
all keys instead, which keeps its (unused) output finite, as Megatron's unfused softmax does;
rows with at least one visible key are computed exactly.

Left out: packed sequences (THD) and attention bias (Megatron's DotProductAttention refuses them
too), sliding windows (the bridges refuse such configs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megarl.models.mcore_version import require_megatron_core

require_megatron_core()  # a one-line error instead of a deep ImportError (e.g. no triton)
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402


class SdpaAttention(DotProductAttention):
    """Drop-in replacement of Megatron's ``DotProductAttention`` (see module docstring)."""

    def forward(
        self,
        query: torch.Tensor,  # [sq, b, np, hn]
        key: torch.Tensor,  # [sk, b, ng, hn]
        value: torch.Tensor,  # [sk, b, ng, hn]
        attention_mask: torch.Tensor | None,  # bool [b|1, 1, sq, sk], True = masked
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
        **extra,  # arguments newer megatron-core versions may add; only None values are accepted
    ) -> torch.Tensor:  # [sq, b, np * hn]
        unsupported = sorted(k for k, v in extra.items() if v is not None)
        if unsupported:
            raise NotImplementedError(f"SdpaAttention does not support {', '.join(unsupported)}")
        if packed_seq_params is not None:
            raise NotImplementedError("SdpaAttention does not support packed sequences (THD)")
        if attention_bias is not None:
            raise NotImplementedError("SdpaAttention does not support an attention bias")
        sq, b = query.shape[0], query.shape[1]
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)  # [b, ng, sk, hn]
        v = value.permute(1, 2, 0, 3)
        dropout = self.attention_dropout.p if self.training else 0.0
        if attention_mask is None:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=sq > 1, dropout_p=dropout, scale=self.softmax_scale,
                enable_gqa=k.shape[1] != q.shape[1],
            )
        else:
            allowed = ~attention_mask.to(torch.bool)
            # A fully masked row (left padding) would give NaN; let it see everything instead.
            allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, dropout_p=dropout, scale=self.softmax_scale,
                enable_gqa=k.shape[1] != q.shape[1],
            )
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
