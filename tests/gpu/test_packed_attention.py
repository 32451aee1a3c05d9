"""Packed-sequence attention on CUDA: torch's varlen flash kernel, as megarl calls it (causal,
GQA, the model's softmax scale), equals each segment attended alone in fp32, forward and
backward.

Skipped without CUDA, without megatron-core (the attention module imports it) or without a
torch that has ``torch.nn.attention.varlen``. NOT yet run: it was written on a machine without
a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_varlen_kernel_equals_each_segment_alone():
    pytest.importorskip("megatron.core")
    pytest.importorskip("torch.nn.attention.varlen")
    from megarl.models.attention import _varlen_call
    from megarl.models.packed_sequences import PackedLayout

    lengths = [300, 7, 64, 1, 129]
    heads, kv_heads, dim = 8, 2, 64
    scale = dim**-0.5
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), h, dim, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
               for h in (heads, kv_heads, kv_heads))  # fmt: skip
    layout = PackedLayout.build(lengths, "cuda")
    attend = _varlen_call(q, scale)
    assert attend is not None, "this torch has the varlen kernel but megarl would not use it"
    out = attend(q, k, v, layout, True)  # [T, heads, dim]
    weights = torch.randn(out.shape, device="cuda", generator=g)
    (out.float() * weights).sum().backward()
    ref_out, ref_grads = [], [torch.zeros_like(x, dtype=torch.float32) for x in (q, k, v)]
    start = 0
    for n in lengths:
        pieces = [x.detach()[start : start + n].float().requires_grad_() for x in (q, k, v)]
        qs, ks, vs = (x.permute(1, 0, 2)[None] for x in pieces)
        ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)[0].permute(1, 0, 2)
        (ref * weights[start : start + n]).sum().backward()
        ref_out.append(ref.detach())
        for total, piece in zip(ref_grads, pieces, strict=True):
            total[start : start + n] = piece.grad
        start += n
    torch.testing.assert_close(out.float(), torch.cat(ref_out), atol=2e-2, rtol=2e-2)
    for name, x, ref in zip("qkv", (q, k, v), ref_grads, strict=True):
        torch.testing.assert_close(x.grad.float(), ref, atol=5e-2, rtol=5e-2, msg=lambda m, n=name: f"d{n}: {m}")
