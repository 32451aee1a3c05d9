"""Micro-batch balancing and row layout (pure functions, no processes)."""

import torch

from megarl.actors.megatron_runtime.micro_batches import (
    balanced_partition,
    micro_batch_indices,
    pack_micro_batch,
)
from megarl.data.batch import Batch


def _batch() -> Batch:
    # Row 0: prompt [5, 6] (1 left pad), response [7, 8, 9]; row 1: prompt [4, 5, 6], response [1].
    return Batch(
        prompt_ids=torch.tensor([[0, 5, 6], [4, 5, 6]]),
        prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
        response_ids=torch.tensor([[7, 8, 9], [1, 0, 0]]),
        response_lengths=torch.tensor([3, 1]),
        response_mask=torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]),
        group_id=torch.tensor([0, 1]),
    )


def test_balanced_partition_equal_counts_and_close_loads():
    weights = [100, 90, 10, 10, 10, 5, 3, 1]
    bins = balanced_partition(weights, 2)
    assert sorted(i for b in bins for i in b) == list(range(8))
    assert [len(b) for b in bins] == [4, 4]
    loads = [sum(weights[i] for i in b) for b in bins]
    assert abs(loads[0] - loads[1]) <= 10, loads  # a contiguous split would give 220 vs 19


def test_balanced_partition_uneven_count():
    bins = balanced_partition([3, 3, 3], 2)
    assert sorted(len(b) for b in bins) == [1, 2]


def test_micro_batches_by_count_and_by_tokens():
    lengths = [10, 50, 20, 40, 30]
    assert micro_batch_indices(lengths, micro_batch_size=2) == [[1, 3], [4, 2], [0]]
    # Budget 80: rows x longest <= 80 -> [50] alone (2 x 50 > 80), [40, 30], [20, 10].
    assert micro_batch_indices(lengths, max_tokens=80) == [[1], [3, 4], [2, 0]]
    # A row over the budget travels alone.
    assert micro_batch_indices([200, 5], max_tokens=100) == [[0], [1]]


def test_pack_left_aligns_rows_and_points_at_predicting_columns():
    mb = pack_micro_batch(_batch(), [1, 0])
    assert mb.tokens.tolist() == [[4, 5, 6, 1, 0], [5, 6, 7, 8, 9]]
    # Real response tokens: row 0 (batch row 1) has 1, row 1 has 3; each predicted one column earlier.
    assert mb.token_rows.tolist() == [0, 1, 1, 1]
    assert mb.token_columns.tolist() == [2, 1, 2, 3]
    assert mb.token_index.tolist() == [0, 3, 4, 5]
    assert mb.token_targets().tolist() == [1, 7, 8, 9]
    assert mb.to_rows(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [[1, 0, 0], [2, 3, 4]]
    assert mb.position_ids.tolist() == [list(range(5))] * 2
    assert mb.batch.group_id.tolist() == [1, 0]

