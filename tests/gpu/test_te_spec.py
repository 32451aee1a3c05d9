"""The transformer-engine layer spec on a GPU: the same tiny model built with TE's modules and
with the local ones gives the same log-probs (packed micro-batches, so TE's THD attention runs)
and a training step, and exports every HF tensor bit for bit.

Skipped without CUDA, megatron-core or transformer-engine. NOT yet run: it was written on a
machine without a GPU.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None,
        reason="needs a CUDA GPU and transformer-engine",
    ),
]


def test_te_spec_equals_local_spec(tmp_path):
    pytest.importorskip("megatron.core")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29561"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")  # fmt: skip
    from safetensors.torch import load_file

    from megarl.actors.policy import PolicyWorker
    from megarl.config.train_sections import ActorConfig
    from megarl.data.batch import Batch, TokenRows
    from megarl.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "m", "qwen2", hidden_size=256, num_heads=4, num_kv_heads=2, ffn_hidden_size=512)
    cfg = ActorConfig(micro_batch_size=None, max_tokens_per_gpu=64)  # several rows per packed micro-batch
    g = torch.Generator().manual_seed(0)
    rlen = torch.tensor([9, 3, 14, 1])
    batch = Batch(
        prompt_ids=torch.randint(0, 259, (4, 6), generator=g),
        prompt_mask=torch.ones(4, 6, dtype=torch.long),
        response_ids=torch.randint(0, 259, (4, 14), generator=g) * (torch.arange(14)[None] < rlen[:, None]),
        response_lengths=rlen,
        response_mask=(torch.arange(14)[None] < rlen[:, None]).float(),
        group_id=torch.arange(4),
    )
    logprobs, workers = {}, {}
    for spec in ("local", "te"):
        workers[spec] = PolicyWorker(path, cfg, "bfloat16", seed=0, layer_spec=spec)
        rows = workers[spec].compute_logprobs(batch, 1.0)
        logprobs[spec] = TokenRows.assemble([rows], len(batch), batch.response_len)["logprobs"]
    # TE's fused rope under TE (the offsets stay on the device), Megatron's unfused one under local.
    assert workers["te"].model.tcfg.apply_rope_fusion and not workers["local"].model.tcfg.apply_rope_fusion
    names = {name for name, _ in workers["te"].model.core.named_parameters()}
    assert any(name.endswith("linear_qkv.layer_norm_weight") for name in names), sorted(names)[:8]
    # bf16 with different kernels (fused norm + linear, TE attention): equal to bf16 rounding.
    torch.testing.assert_close(logprobs["te"], logprobs["local"], atol=5e-2, rtol=0)
    expected = load_file(f"{path}/model.safetensors")
    for name, tensor in workers["te"].export_weights(gather_bytes=1 << 20):
        assert torch.equal(tensor.cpu(), expected[name].to(tensor.dtype)), name
