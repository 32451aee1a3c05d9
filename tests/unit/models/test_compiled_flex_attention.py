"""The compiled FlexAttention path of ``actor.packed_attention: flex`` on CPU: the block mask
built by the compiled create_block_mask, and the compiled kernel, which skips the blocks the mask
rules out (the uncompiled path the parity tests run applies the mask token by token, so a wrong
block structure would only show here). torch has a compiled FlexAttention forward on CPU, no
backward: the backward is in tests/gpu/test_packed_attention.py."""

from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")
if (not shutil.which(os.environ.get("CC") or "cc") or not shutil.which(os.environ.get("CXX") or "g++")
        or not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file()):  # fmt: skip
    pytest.skip("torch.compile on CPU needs a C and a C++ compiler and Python.h (`megarl doctor` says which is missing)",
                allow_module_level=True)

LENGTHS = [300, 7, 64, 1, 129]  # segments across FlexAttention's 128-token blocks, and within one
HEADS, KV_HEADS, DIM = 4, 2, 16


def test_compiled_flex_attention_equals_each_segment_alone():
    from megarl.models.attention import document_block_mask, flex_attend
    from megarl.models.packed_sequences import PackedLayout

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(LENGTHS), h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))  # [T, h, 16]
    layout = PackedLayout.build(LENGTHS, "cpu")
    mask = document_block_mask(layout, compiled=True)
    assert torch.equal(mask.to_dense(), document_block_mask(layout, compiled=False).to_dense())
    assert mask.sparsity() > 0  # some blocks are skipped: the kernel relies on the block structure
    out = flex_attend(q, k, v, mask, 0.1, True, compiled=True)  # [T, heads, dim]
    start, expected = 0, []
    for n in LENGTHS:
        qs, ks, vs = (x[start : start + n].permute(1, 0, 2)[None] for x in (q, k, v))  # [1, h, n, 16]
        ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.1, enable_gqa=True)
        expected.append(ref[0].permute(1, 0, 2))
        start += n
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=1e-5)
