"""Rotary embeddings of a packed (THD) micro-batch as one row of frequencies per token.

For a packed micro-batch Megatron's ``RotaryEmbedding`` gives ``[longest segment, 1, 1, d]``
(positions 0 .. longest), and its unfused THD apply (``apply_rope_fusion`` is off with the local spec)
maps each segment onto the first rows. megatron-core 0.19 does that one segment at a time: in
every layer, for queries and for keys, a split, a rotation and a copy per segment, each a few
small kernels and autograd nodes, host time on a GPU (bench/results/train_step.md counts the
torch operations of one update).

Given one row per token instead (``[T, 1, 1, d]``: each token's position within its segment),
Megatron's apply takes its exact-mapping branch (frequencies as long as the packed sequence),
which rotates the whole packed sequence at once, as a padded batch is rotated. That branch still
reads the offsets one segment at a time on the host, so the parameters also get one span over
the whole sequence as their padded offsets, which Megatron's rope reads in place of the
segments' when given (nothing else of the local layer spec reads them): its host work then does
not grow with the segments either. The values are the same: a token's row is the frequency of
its position in its own segment.

The layout comes from the packed-sequence parameters (``megarl.models.attention.PackedSegments``)
that GPTModel's preprocessing hands to ``get_rotary_seq_len`` right before it calls ``forward``,
once per model forward; ``forward`` takes it (and forgets it). Only models of the local layer
spec get this class: TE's attention reads the padded offsets, and TE's layers keep Megatron's
rotary embedding, with TE's fused THD rope (``apply_rope_fusion``, asked for with the TE spec
alone: megarl/models/dense.py), which takes the short form and the offsets on the device.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from megarl.models.packed_sequences import PackedLayout


class PackedRotaryEmbedding(RotaryEmbedding):
    """Megatron's RotaryEmbedding whose packed output has one row per token (module docstring)."""

    _layout: PackedLayout | None = None  # the layout of the forward in progress, between the two calls

    def get_rotary_seq_len(self, inference_context: Any, transformer: Any, transformer_input: Any,
                           transformer_config: Any, packed_seq_params: Any = None, **kwargs: Any) -> int:  # fmt: skip
        self._layout = getattr(packed_seq_params, "layout", None)
        if self._layout is not None:  # one span, 0 .. T, on the host (where Megatron's rope reads it)
            span = self._layout.cu_seqlens_host[[0, -1]]  # [2] int32
            packed_seq_params.cu_seqlens_q_padded = packed_seq_params.cu_seqlens_kv_padded = span
        return super().get_rotary_seq_len(inference_context, transformer, transformer_input, transformer_config,
                                          packed_seq_params, **kwargs)  # fmt: skip

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Any = None) -> torch.Tensor:
        layout, self._layout = self._layout, None
        emb = super().forward(max_seq_len, offset, packed_seq, cp_group)  # [longest, 1, 1, d]
        if layout is None:  # not packed
            return emb
        return emb[layout.token_positions]  # [T, 1, 1, d]: with the span get_rotary_seq_len set


def rotate_packed_sequences_at_once(model: Any) -> None:
    """Give ``model`` (a GPTModel stage) a PackedRotaryEmbedding: the same module and state, only
    its class changes (GPTModel builds the rotary embedding itself)."""
    rope = getattr(model, "rotary_pos_emb", None)
    if type(rope) is RotaryEmbedding:
        rope.__class__ = PackedRotaryEmbedding
