"""The controller's split of routing by data-parallel replica (megarl/actors/routing_split.py)
against the ranks' own split (MicroBatching.replica_groups over the update's mini-batches), and a
rank's share of the routing through the Batch's row operations."""

from pathlib import Path

import pytest
import torch

from megarl.actors.routing_split import policy_replica_rows
from megarl.config.loading import load_config
from megarl.data.batch import Batch
from megarl.engines.seeds import shuffle_seed
from megarl.megatron_runtime.micro_batches import MicroBatching, mini_batches, replica_rows

B, L, K = 8, 2, 2
TINY = Path(__file__).parents[3] / "configs" / "tiny_grpo.yaml"


def _batch() -> Batch:
    """8 rows of different lengths; group_id = the row's index, routing id = the row's index."""
    g = torch.Generator().manual_seed(0)
    p, r = 4, 6
    plen, rlen = torch.randint(1, p + 1, (B,), generator=g), torch.randint(1, r + 1, (B,), generator=g)
    prompt_mask = (torch.arange(p)[None] >= p - plen[:, None]).long()
    ids = torch.arange(B, dtype=torch.int16)[:, None, None, None].expand(B, p + r, L, K).clone()
    return Batch(prompt_ids=torch.ones(B, p, dtype=torch.long), prompt_mask=prompt_mask,
                 response_ids=torch.ones(B, r, dtype=torch.long), response_lengths=rlen, response_mask=torch.ones(B, r),
                 group_id=torch.arange(B), routed_experts=ids)  # fmt: skip


@pytest.mark.parametrize("shuffle", [True, False])
def test_controller_split_is_the_rows_each_replica_runs(tmp_path, shuffle):
    cfg = load_config(TINY, [f"actor.shuffle={str(shuffle).lower()}", "actor.mini_batch_size=4", "actor.ppo_epochs=2"])
    batch, dp, step = _batch(), 2, 3
    expected: list[set[int]] = [set() for _ in range(dp)]
    batching = MicroBatching(1, None, False)
    seed = shuffle_seed(cfg.trainer.seed, step) if shuffle else None
    for part in [batch, *mini_batches(batch, 4, 2, seed)]:  # the replay metrics' forward, then the update's
        for d, groups in enumerate(batching.replica_groups(part, dp)):
            expected[d] |= {int(part.group_id[r]) for g in groups for r in g}
    assert [set(rows) for rows in policy_replica_rows(cfg, batch, dp, step)] == expected
    assert [set(rows) for rows in policy_replica_rows(cfg, batch, dp, None)] == [
        {int(batch.group_id[r]) for g in groups for r in g} for groups in batching.replica_groups(batch, dp)]


def test_a_share_keeps_only_its_rows_through_select():
    batch = _batch()
    mine = replica_rows(batch, 2)[0]
    share = batch.replace(routed_experts=None).with_routing_share(batch.routing_share(mine))
    assert share.routed_experts is not None and share.routed_experts.shape[0] == len(mine) < B
    shuffled = share.select(torch.randperm(B, generator=torch.Generator().manual_seed(1)))
    assert shuffled.routed_experts is not None and shuffled.routed_experts.shape[0] == len(mine)
    held = [i for i in range(B) if int(shuffled.group_id[i]) in mine]
    micro = shuffled.select(held[:2])  # a micro-batch of this replica: a plain batch of its rows
    assert micro.routing_rows is None and micro.routed_experts[:, 0, 0, 0].tolist() == micro.group_id.tolist()
    ids, _ = shuffled.select(held).dense_routing()
    assert torch.equal(ids, batch.routed_experts[shuffled.select(held).group_id])
    other = next(i for i in range(B) if int(shuffled.group_id[i]) not in mine)
    with pytest.raises(RuntimeError, match="another data-parallel replica"):
        shuffled.select([held[0], other]).dense_routing()
    with pytest.raises(ValueError, match="routing_rows"):
        Batch.concat([share, share])
