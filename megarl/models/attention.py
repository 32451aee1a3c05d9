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

Packed sequences (THD, ``PackedSeqParams.qkv_format == "thd"``): query, key and value come as
``[T, heads, hn]`` for several segments end to end, and each segment attends only to itself
(causally). The parameters must be a :class:`PackedSegments` (made by :func:`packed_seq_params`),
which carries the host-side plan of ``megarl.models.packed_sequences``. On CUDA, half-precision
inputs go to torch's variable-length flash kernel (``torch.nn.attention.varlen``) when this torch
has it; elsewhere (CPU, fp32) the segments are attended in groups of similar length as padded
batches, exactly. ``actor.packed_attention: flex`` hands the segments to FlexAttention instead,
as one sequence with a document mask (:func:`document_block_mask`, made once per micro-batch and
shared by every layer); compiled on CUDA. On CPU it runs uncompiled by default, forward only
(torch has no FlexAttention backward there), which is enough for the parity tests; a unit test
runs the compiled forward on CPU too.

Left out: attention bias (Megatron's DotProductAttention refuses it too), sliding windows (the
bridges refuse such configs).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F

from megarl.parallel.mcore_version import require_megatron_core

require_megatron_core()  # a one-line error instead of a deep ImportError (e.g. no triton)
from dataclasses import dataclass  # noqa: E402

from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402

from megarl.models.packed_sequences import PackedLayout  # noqa: E402


@dataclass
class PackedSegments(PackedSeqParams):
    """Megatron's packed-sequence parameters plus the segment plan the attention uses."""

    layout: PackedLayout | None = None
    block_mask: Any = None  # FlexAttention's BlockMask of the segments, when actor.packed_attention is flex


def packed_seq_params(layout: PackedLayout, *, host_offsets: bool, flex: bool = False) -> PackedSegments:
    """The THD parameters of one packed micro-batch: one ``cu_seqlens`` for queries and keys
    (self-attention, no padding between segments). ``host_offsets``: hand Megatron the host copy
    (the local spec: its unfused THD rope reads the offsets on the host in every layer, which
    would wait on the GPU each time; megarl's attention takes the device copy from the layout);
    TE's attention needs them on the device. ``flex``: attend through FlexAttention, with the
    segments' block mask made here, once for all layers."""
    cu = layout.cu_seqlens_host if host_offsets else layout.cu_seqlens
    return PackedSegments(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=layout.longest,
        max_seqlen_kv=layout.longest,
        layout=layout,
        block_mask=document_block_mask(layout) if flex else None,
    )


def document_block_mask(layout: PackedLayout, compiled: bool | None = None):
    """FlexAttention's block mask of a packed sequence: a token sees the tokens of its own segment
    up to itself. Built on the layout's device; ``compiled`` (default: on CUDA, where a long
    sequence's dense mask would not fit) builds it block by block."""
    device = layout.cu_seqlens.device
    lengths = torch.tensor(layout.lengths, device=device)  # [k]
    segment = torch.repeat_interleave(torch.arange(len(layout.lengths), device=device), lengths)  # [T]

    def same_segment_causal(batch, head, q, kv):
        return (segment[q] == segment[kv]) & (q >= kv)

    t = segment.shape[0]
    build = _block_mask_builder(device.type == "cuda" if compiled is None else compiled)
    return build(same_segment_causal, None, None, t, t, device=device)


@functools.cache
def _block_mask_builder(compiled: bool):
    """torch's create_block_mask, compiled once per process (torch's advice; its ``_compile``
    flag is deprecated): later lengths reuse the compiled code, dynamic after the first change."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask) if compiled else create_block_mask


class SdpaAttention(DotProductAttention):
    """Drop-in replacement of Megatron's ``DotProductAttention`` (see module docstring)."""

    def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any) -> None:
        """Megatron's constructor, plus transformer-engine's ``k_channels`` / ``v_channels``, which
        multi-latent attention passes (q/k heads of another size than v heads; Megatron's local
        attention takes neither): the output is sized by the v heads, q/k by the tensors."""
        super().__init__(*args, **kwargs)
        del k_channels  # the q/k head size is the tensors' own
        if v_channels is not None:
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels

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
        if attention_bias is not None:
            raise NotImplementedError("SdpaAttention does not support an attention bias")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
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

    def _packed(
        self,
        query: torch.Tensor,  # [T, np, hn]
        key: torch.Tensor,  # [T, ng, hn]
        value: torch.Tensor,  # [T, ng, hn]
        params: PackedSeqParams,
    ) -> torch.Tensor:  # [T, np * hn]
        layout = getattr(params, "layout", None)
        if params.qkv_format != "thd" or layout is None:
            raise NotImplementedError(
                "SdpaAttention takes packed sequences only as megarl.models.attention.PackedSegments (thd)"
            )
        dropout = self.attention_dropout.p if self.training else 0.0
        gqa = key.shape[1] != query.shape[1]
        if getattr(params, "block_mask", None) is not None:  # (no dropout: the bridges refuse attention dropout)
            out = flex_attend(query, key, value, params.block_mask, self.softmax_scale, gqa)  # [T, np, hn]
            return out.reshape(out.shape[0], self.hidden_size_per_partition)
        varlen = _varlen_call(query, self.softmax_scale) if dropout == 0.0 else None
        if varlen is not None:
            out = varlen(query, key, value, layout, gqa)  # [T, np, hn]
            return out.reshape(out.shape[0], self.hidden_size_per_partition)
        if len(set(layout.lengths)) == 1:  # n segments of one length L: a view, no gather
            n, t = len(layout.lengths), query.shape[0]
            q, k, v = (x.view(n, t // n, *x.shape[1:]).transpose(1, 2) for x in (query, key, value))  # [n, heads, L, hn]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=t // n > 1, dropout_p=dropout, scale=self.softmax_scale,
                                               enable_gqa=gqa)  # fmt: skip
            return o.transpose(1, 2).reshape(t, self.hidden_size_per_partition)
        pieces = []
        for group in layout.groups:
            q, k, v = (x[group.gather].permute(0, 2, 1, 3) for x in (query, key, value))  # [n, heads, L, hn]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, dropout_p=dropout,
                                               scale=self.softmax_scale, enable_gqa=gqa)  # fmt: skip
            pieces.append(o.permute(0, 2, 1, 3).reshape(-1, self.hidden_size_per_partition)[group.real])  # [m, np * hn]
        # Every packed position is some group's real token: one copy puts them all in place.
        real = pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # [T, np * hn], in group order
        return real.new_empty(real.shape).index_copy(0, layout.scatter, real)


def flex_attend(
    query: torch.Tensor,  # [T, np, hn]
    key: torch.Tensor,  # [T, ng, hn]
    value: torch.Tensor,  # [T, ng, hn]
    block_mask: Any,  # document_block_mask of the packed sequence
    scale: float | None,
    gqa: bool,
    compiled: bool | None = None,
) -> torch.Tensor:  # [T, np, hn]
    """A packed sequence through FlexAttention as one batch row, its segments kept apart by
    ``block_mask``; ``compiled`` by default on CUDA (CPU has a compiled forward, no backward)."""
    q, k, v = (x.transpose(0, 1)[None] for x in (query, key, value))  # [1, heads, T, hn]
    attend = _flex_attention(query.is_cuda if compiled is None else compiled)
    out = attend(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


@functools.cache
def _flex_attention(compiled: bool):
    """FlexAttention, compiled (a fused kernel; the uncompiled one computes the dense scores, and
    has no backward on CPU)."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    if compiled:
        return torch.compile(flex_attention)

    def uncompiled(*args, **kwargs):
        with warnings.catch_warnings():  # torch warns that it is uncompiled: here that is the point
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(*args, **kwargs)

    return uncompiled


def _varlen_call(query: torch.Tensor, scale: float | None):
    """A function attending each packed segment causally through torch's flash varlen kernel,
    or None where it cannot serve: not CUDA, not half precision, a torch without the kernel,
    or one whose kernel takes no ``scale`` when the model's differs from the default."""
    if not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16):
        return None
    kernel = _varlen_kernel()
    if kernel is None:
        return None
    varlen_attn, accepted = kernel
    # Its causal switch changed between torch versions (``is_causal``, then a ``(-1, 0)`` window).
    kwargs: dict = {"is_causal": True} if "is_causal" in accepted else {"window_size": (-1, 0)}
    if "scale" in accepted:
        kwargs["scale"] = scale
    elif scale is not None and abs(scale - query.shape[-1] ** -0.5) > 1e-12:
        return None

    def attend(q, k, v, layout: PackedLayout, gqa: bool) -> torch.Tensor:  # [T, np, hn]
        if gqa and "enable_gqa" in accepted:
            kwargs["enable_gqa"] = True
        elif gqa:  # an older kernel takes equal head counts only: repeat the key/value heads
            reps = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1)
        cu = layout.cu_seqlens
        return varlen_attn(q, k, v, cu, cu, layout.longest, layout.longest, **kwargs)

    return attend


@functools.cache
def _varlen_kernel() -> tuple[Any, frozenset[str]] | None:
    """torch's varlen attention and the keyword arguments it takes (looked up once)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)
