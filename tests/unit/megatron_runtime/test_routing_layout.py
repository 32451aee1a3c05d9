"""RoutingReplay.layout puts each token's routing where the router sees that token.

The check: routing whose every entry is the token id of its Batch column (so the routing of a
column can be read back as the token it belongs to) must come out of ``layout`` as exactly the
micro-batch's tokens in Megatron's order: ``tokens [lines, S]`` transposed to ``[S, lines]``,
this TP rank's slice of S under sequence parallelism, flattened. Packed and padded, TP 1 and 2.
"""

from __future__ import annotations

import pytest
import torch

from megarl.data.batch import Batch
from megarl.megatron_runtime.micro_batches import pack_micro_batch
from megarl.megatron_runtime.routing_replay import RoutingReplay

LAYERS, K = 3, 2


def _batch_with_token_routing():
    # Rows of prompt / response lengths 2/3, 3/1 and 1/2 (left-padded prompts, right-padded responses).
    batch = Batch(
        prompt_ids=torch.tensor([[0, 5, 6], [4, 5, 6], [0, 0, 3]]),
        prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]]),
        response_ids=torch.tensor([[7, 8, 9], [1, 0, 0], [2, 0, 0]]),
        response_lengths=torch.tensor([3, 1, 2]),
        response_mask=torch.ones(3, 3),
        group_id=torch.arange(3),
    )
    tokens, mask, _ = batch.sequences()  # [B, P+R]
    ids = torch.where(mask.bool(), tokens + 1, -1)  # +1: token 0 must not read as "no routing" (-1) or padding
    ids = ids[:, :, None, None].expand(-1, -1, LAYERS, K).to(torch.int16)
    return batch.replace(routed_experts=ids, routing_weights=ids.float())


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("tp", [1, 2])
def test_layout_follows_the_tokens(packed: bool, tp: int):
    batch = _batch_with_token_routing()
    mb = pack_micro_batch(batch, [2, 0, 1], width_multiple=tp, packed=packed)
    real = torch.zeros_like(mb.tokens, dtype=torch.bool)  # [lines, S] positions holding a real token
    for i, row in enumerate(mb.rows.tolist()):
        n = int(batch.prompt_lengths[row] + batch.response_lengths[row])
        line, start = (0, mb.layout.starts[i]) if mb.layout is not None else (i, 0)
        real[line, start : start + n] = True
    expected = torch.where(real, mb.tokens + 1, -1).t()  # [S, lines], Megatron's sequence-first order
    chunk = expected.shape[0] // tp
    for rank in range(tp):
        replay = RoutingReplay([], "experts_and_weights", sequence_parallel=tp > 1, tp_rank=rank, tp_size=tp)
        laid = replay.layout(mb)
        assert laid is not None and laid[1] is not None
        ids, weights = laid  # [N, L, k] each
        want = expected[rank * chunk : (rank + 1) * chunk].flatten()  # [N]
        assert torch.equal(ids, want[:, None, None].expand(-1, LAYERS, K))
        assert torch.equal(weights, torch.where(want >= 0, want, 0).float()[:, None, None].expand(-1, LAYERS, K))


def test_weights_mode_refuses_ids_only():
    batch = _batch_with_token_routing()
    mb = pack_micro_batch(batch.replace(routing_weights=None), [0, 1], packed=True)
    with pytest.raises(ValueError, match="routing_replay=experts"):
        RoutingReplay([], "experts_and_weights", False, 0, 1).layout(mb)
    assert RoutingReplay([], "experts", False, 0, 1).layout(mb) is not None
