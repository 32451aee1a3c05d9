"""Packed-sequence attention on CUDA, as megarl calls it (causal, GQA, the model's softmax
scale), equals each segment attended alone in fp32, forward and backward: torch's varlen flash
kernel (``packed_attention: auto``) and compiled FlexAttention with the segments' block mask
(``packed_attention: flex``; lengths past FlexAttention's 128-token blocks).

Skipped without CUDA, without megatron-core (the attention module imports it) or without a
torch that has ``torch.nn.attention.varlen``. Passed on an H100 (torch 2.11, megatron-core 0.19.2).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LENGTHS = [300, 7, 64, 1, 129]
HEADS, KV_HEADS, DIM = 8, 2, 64


def _inputs() -> tuple[torch.Tensor, ...]:
    """q ``[T, 8, 64]``, k, v ``[T, 2, 64]`` bf16 needing grads, and output weights ``[T, 8, 64]``."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(sum(LENGTHS), h, DIM, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
               for h in (HEADS, KV_HEADS, KV_HEADS))  # fmt: skip
    return q, k, v, torch.randn(sum(LENGTHS), HEADS, DIM, device="cuda", generator=g)


def _check_against_each_segment_alone(q, k, v, weights, out: torch.Tensor, scale: float) -> None:
    """``out`` (and the grads ``(out * weights).sum()`` left in q, k, v) == fp32 SDPA per segment."""
    ref_out, ref_grads = [], [torch.zeros_like(x, dtype=torch.float32) for x in (q, k, v)]
    start = 0
    for n in LENGTHS:
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


def test_varlen_kernel_equals_each_segment_alone():
    pytest.importorskip("megatron.core")
    pytest.importorskip("torch.nn.attention.varlen")
    from megarl.models.attention import _varlen_call
    from megarl.models.packed_sequences import PackedLayout

    q, k, v, weights = _inputs()
    scale = DIM**-0.5
    attend = _varlen_call(q, scale)
    assert attend is not None, "this torch has the varlen kernel but megarl would not use it"
    out = attend(q, k, v, PackedLayout.build(LENGTHS, "cuda"), True)  # [T, heads, dim]
    (out.float() * weights).sum().backward()
    _check_against_each_segment_alone(q, k, v, weights, out, scale)


def test_compiled_flex_attention_equals_each_segment_alone():
    pytest.importorskip("megatron.core")
    from megarl.models.attention import document_block_mask, flex_attend
    from megarl.models.packed_sequences import PackedLayout

    q, k, v, weights = _inputs()
    out = flex_attend(q, k, v, document_block_mask(PackedLayout.build(LENGTHS, "cuda")), 0.1, True)  # [T, heads, dim]
    (out.float() * weights).sum().backward()
    _check_against_each_segment_alone(q, k, v, weights, out, 0.1)
