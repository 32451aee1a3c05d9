"""Routed expert ids are stored in a byte up to 255 experts, in int16 beyond, and read back equal."""

import pytest
import torch

from megarl.data.batch import Batch
from megarl.data.routing_ids import expert_id_dtype, pack_expert_ids, unpack_expert_ids


@pytest.mark.parametrize(("experts", "dtype"), [(4, torch.uint8), (128, torch.uint8), (255, torch.uint8),
                                                (256, torch.int16), (384, torch.int16)])  # fmt: skip
def test_ids_take_the_narrowest_dtype_and_come_back_equal(experts, dtype):
    assert expert_id_dtype(experts) == dtype
    ids = torch.randint(0, experts, (3, 5, 2, 4), generator=torch.Generator().manual_seed(experts))
    ids[0, -1] = -1  # a token the engine did not route
    ids[:, :, 1, 0] = experts - 1  # the largest id must not read as "not routed"
    packed = pack_expert_ids(ids, experts)
    assert packed.dtype == dtype and packed.element_size() == (1 if dtype == torch.uint8 else 2)
    assert torch.equal(unpack_expert_ids(packed), ids)


def test_concat_pads_packed_ids_with_their_own_not_routed_mark():
    def batch(prompt: int, response: int) -> Batch:
        ids = pack_expert_ids(torch.full((1, prompt + response, 1, 2), 3), 128)
        return Batch(prompt_ids=torch.ones(1, prompt, dtype=torch.long), prompt_mask=torch.ones(1, prompt, dtype=torch.long),
                     response_ids=torch.ones(1, response, dtype=torch.long), response_lengths=torch.tensor([response]),
                     response_mask=torch.ones(1, response), group_id=torch.tensor([0]), routed_experts=ids)  # fmt: skip

    both = Batch.concat([batch(2, 3), batch(4, 1)])
    assert both.routed_experts is not None and both.routed_experts.dtype == torch.uint8
    ids = unpack_expert_ids(both.routed_experts)
    assert ids[0, :, 0, 0].tolist() == [-1, -1, 3, 3, 3, 3, 3]  # prompt padded on the left
    assert ids[1, :, 0, 0].tolist() == [3, 3, 3, 3, 3, -1, -1]  # response padded on the right
