"""The packed rotary embedding (megarl/models/packed_rope.py): one row of frequencies per token,
restarting at every segment, and Megatron's THD apply given those rows and the offsets it then
finds in the packed parameters rotates every token as its own per-segment mapping does (the reference:
the same apply given Megatron's short rows and the segments' offsets), in one rotation of the
whole packed sequence, its host operations as many however many segments it holds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

LENGTHS = [5, 1, 9, 3]
DIM = 16


class _OneRank:
    """A context-parallel group of one (what Megatron's THD apply asks for: size and rank)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _rope():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megarl.models.packed_rope import PackedRotaryEmbedding, rotate_packed_sequences_at_once
    from megarl.parallel.cpu_compat import enable_cpu_compat

    enable_cpu_compat()  # Megatron moves the frequencies to "the current CUDA device"
    rope = RotaryEmbedding(kv_channels=DIM, rotary_percent=1.0, rotary_base=10000)
    rotate_packed_sequences_at_once(SimpleNamespace(rotary_pos_emb=rope))
    assert type(rope) is PackedRotaryEmbedding
    return rope


def _packed_freqs(rope, lengths: list[int]):
    """As GPTModel's preprocessing asks for them: the length first (handed the packed parameters), then the rows."""
    from megarl.models.attention import packed_seq_params
    from megarl.models.packed_sequences import PackedLayout

    params = packed_seq_params(PackedLayout.build(lengths), host_offsets=True)
    length = rope.get_rotary_seq_len(None, None, None, None, params)
    return rope(length, packed_seq=True), params


def _apply(t, freqs, offsets):
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, apply_rope_fusion=False)
    return apply_rotary_pos_emb(t, freqs, config, cu_seqlens=offsets, cp_group=_OneRank())


def _offsets_megatron_reads(params):
    """As Megatron's attention picks them for its rope: the padded offsets when given."""
    return params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q


def test_one_row_per_token_restarting_at_every_segment():
    rope = _rope()
    freqs, _ = _packed_freqs(rope, LENGTHS)
    short = rope.get_emb(max(LENGTHS))  # [9, 1, 1, 16]: positions 0 .. longest
    assert freqs.shape == (sum(LENGTHS), 1, 1, DIM)
    assert torch.equal(freqs, torch.cat([short[:n] for n in LENGTHS]))
    assert torch.equal(rope(max(LENGTHS)), short)  # not packed: Megatron's own rows
    assert rope(max(LENGTHS), packed_seq=True).shape[0] == max(LENGTHS)  # no packed parameters given: the same
    _, params = _packed_freqs(rope, LENGTHS)
    assert params.cu_seqlens_q_padded.tolist() == params.cu_seqlens_kv_padded.tolist() == [0, sum(LENGTHS)]  # one span
    assert params.cu_seqlens_q.tolist() == [0, 5, 6, 15, 18]  # the segments' own, for the attention


def test_megatrons_apply_rotates_as_per_segment_and_all_at_once():
    from torch.profiler import ProfilerActivity, profile

    rope = _rope()
    t = torch.randn(sum(LENGTHS), 4, DIM, generator=torch.Generator().manual_seed(0))  # [T, heads, dim]
    freqs, params = _packed_freqs(rope, LENGTHS)
    expected = _apply(t, rope.get_emb(max(LENGTHS)), params.cu_seqlens_q)  # Megatron's mapping, segment by segment
    assert torch.equal(_apply(t, freqs, _offsets_megatron_reads(params)), expected)

    def operations(lengths: list[int]) -> tuple[int, int]:
        """(multiplications, all torch operations) of the apply."""
        freqs, params = _packed_freqs(rope, lengths)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _apply(t, freqs, _offsets_megatron_reads(params))
        events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
        return sum(e.count for e in events if e.key == "aten::mul"), sum(e.count for e in events)

    assert operations([1] * sum(LENGTHS)) == operations(LENGTHS) == operations([sum(LENGTHS)])  # one rotation
