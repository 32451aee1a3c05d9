"""Import slicing of HF tensors into Megatron TP shards (fused QKV, gate/up, vocab padding)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from megarl.models.layouts import ParamRule, ShardInfo, read_shard
from megarl.models.safetensors_reader import SafetensorsReader

HEADS, GROUPS, D, H, F, V = 4, 2, 3, 5, 6, 5


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "q": torch.randn(HEADS * D, H, generator=gen), "k": torch.randn(GROUPS * D, H, generator=gen),
        "v": torch.randn(GROUPS * D, H, generator=gen), "qb": torch.randn(HEADS * D, generator=gen),
        "kb": torch.randn(GROUPS * D, generator=gen), "vb": torch.randn(GROUPS * D, generator=gen),
        "gate": torch.randn(F, H, generator=gen), "up": torch.randn(F, H, generator=gen),
        "down": torch.randn(H, F, generator=gen), "emb": torch.randn(V, H, generator=gen),
    }
    path = tmp_path_factory.mktemp("layouts")
    save_file(tensors, str(path / "model.safetensors"))
    return SafetensorsReader(path), tensors


def _info(rank: int, tp: int = 2, padded: int = 6) -> ShardInfo:
    return ShardInfo(tp_rank=rank, tp_size=tp, num_heads=HEADS, num_groups=GROUPS, head_dim=D,
                     vocab_size=V, padded_vocab_size=padded)


def test_qkv_is_interleaved_per_query_group(hf):
    reader, t = hf
    qpg = HEADS // GROUPS
    for names, (q, k, v) in [(("q", "k", "v"), (t["q"], t["k"], t["v"])), (("qb", "kb", "vb"), (t["qb"], t["kb"], t["vb"]))]:
        # Megatron's fused layout, built independently: for each group [its q heads, k, v]
        full = torch.cat([
            torch.cat([q[g * qpg * D:(g + 1) * qpg * D], k[g * D:(g + 1) * D], v[g * D:(g + 1) * D]])
            for g in range(GROUPS)
        ])
        rule = ParamRule("qkv", names, "qkv")
        shards = [read_shard(rule, reader, _info(r)) for r in range(2)]
        assert torch.equal(torch.cat(shards), full)  # rank r holds group r
        assert torch.equal(read_shard(rule, reader, _info(0, tp=1)), full)


def test_fc1_row_and_vocab(hf):
    reader, t = hf
    fc1 = [read_shard(ParamRule("fc1", ("gate", "up"), "fc1"), reader, _info(r)) for r in range(2)]
    assert torch.equal(fc1[1], torch.cat([t["gate"][3:], t["up"][3:]]))
    row = [read_shard(ParamRule("fc2", ("down",), "row"), reader, _info(r)) for r in range(2)]
    assert torch.equal(torch.cat(row, dim=1), t["down"])
    emb = [read_shard(ParamRule("emb", ("emb",), "vocab"), reader, _info(r)) for r in range(2)]
    assert torch.equal(emb[0], t["emb"][:3])
    assert torch.equal(emb[1][:2], t["emb"][3:]) and torch.equal(emb[1][2], torch.zeros(H))
