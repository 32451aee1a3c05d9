"""Micro-batch balancing and row layout (pure functions, no processes)."""

import torch

from megarl.data.batch import Batch
from megarl.megatron_runtime.micro_batches import (
    MicroBatching,
    balanced_partition,
    equal_counts,
    micro_batch_indices,
    pack_micro_batch,
)
from megarl.models.packed_sequences import PackedLayout, group_segments


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


def test_packed_micro_batches_fill_the_budget_first_fit_decreasing():
    lengths = [10, 50, 20, 40, 30]
    # Longest first into the first group with room (budget 80): 50 -> g0; 40 -> g1 (90 > 80);
    # 30 -> g0 (80); 20 -> g1 (60); 10 -> g1 (70). Padded, the same budget needs three.
    assert micro_batch_indices(lengths, max_tokens=80, packed=True) == [[1, 4], [3, 2, 0]]
    assert micro_batch_indices([200, 5], max_tokens=100, packed=True) == [[0], [1]]
    # A fixed number of rows is the same cut either way.
    assert micro_batch_indices(lengths, micro_batch_size=2, packed=True) == [[1, 3], [4, 2], [0]]


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



def test_packed_layout_restarts_positions_and_points_at_predicting_columns():
    # Batch rows 1 then 0: [4, 5, 6 | 1] (4 tokens) then [5, 6 | 7, 8, 9] (5 tokens); T = 9,
    # rounded up to 10 by a padding segment of one token.
    mb = pack_micro_batch(_batch(), [1, 0], width_multiple=2, packed=True)
    assert mb.tokens.tolist() == [[4, 5, 6, 1, 5, 6, 7, 8, 9, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 0]]
    assert mb.layout.lengths == (4, 5, 1)
    assert mb.layout.cu_seqlens.tolist() == [0, 4, 9, 10]
    assert mb.token_rows.tolist() == [0, 0, 0, 0]
    # Row 0's response token is predicted at column 2; row 1's at 4 + (2 - 1) + t.
    assert mb.token_columns.tolist() == [2, 5, 6, 7]
    assert mb.token_index.tolist() == [0, 3, 4, 5]
    assert mb.token_targets().tolist() == [1, 7, 8, 9]
    assert mb.tokens[0, mb.token_columns + 1].tolist() == mb.token_targets().tolist()


def test_segment_groups_bound_the_attention_padding():
    # 100 alone: with 50 the call would cost 2 x 100^2 > 1.5 x (100^2 + 50^2). 50, 48, 45 and 3
    # share one (4 x 50^2 <= 1.5 x (50^2 + 48^2 + 45^2 + 3^2)).
    assert group_segments([50, 100, 48, 45, 3]) == [[1], [0, 2, 3, 4]]
    assert group_segments([100, 10]) == [[0], [1]]
    # Segments of 3, 1 and 2 tokens at 0, 3 and 4: 3 and 2 share [n=2, L=3] (2 x 9 <= 1.5 x 13),
    # 1 would make it 27 > 1.5 x 14, so it goes alone.
    layout = PackedLayout.build([3, 1, 2])
    pair, single = layout.groups
    assert pair.gather.tolist() == [[0, 1, 2], [4, 5, 5]]  # past its end, a segment repeats its last token
    assert pair.scatter.tolist() == [0, 1, 2, 4, 5]  # the padded step is dropped
    assert pair.gather.flatten()[pair.real].tolist() == pair.scatter.tolist()
    assert single.gather.tolist() == [[3]]
    assert layout.scatter.tolist() == [0, 1, 2, 4, 5, 3]


def test_replicas_run_equal_micro_batch_counts():
    batch = Batch(
        prompt_ids=torch.ones(4, 2, dtype=torch.long),
        prompt_mask=torch.ones(4, 2, dtype=torch.long),
        response_ids=torch.ones(4, 30, dtype=torch.long),
        response_lengths=torch.tensor([30, 30, 30, 1]),
        response_mask=torch.ones(4, 30),
        group_id=torch.arange(4),
    )
    replicas = MicroBatching(None, 40, True).replica_groups(batch, 2)
    assert replicas == [[[0], [2]], [[1, 3]]]
    lengths = [32, 32, 32, 3]
    assert equal_counts(replicas, 0, lengths) == ([[0], [2]], 0)
    # Replica 1 runs its shortest row again, as a filler, to match replica 0's two micro-batches;
    # first, so that its last micro-batch is a real one.
    assert equal_counts(replicas, 1, lengths) == ([[3], [1, 3]], 1)
