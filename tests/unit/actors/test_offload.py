"""Storage offload round trip: views keep their data, the storage is really freed meanwhile."""

import torch

from megarl.actors.megatron_runtime.offload import StorageOffloader


def test_offload_frees_storage_and_onload_restores_every_view():
    buffer = torch.arange(12, dtype=torch.float32)
    a, b = buffer[:4].view(2, 2), buffer[4:]  # two views of one storage (like DDP params)
    other = torch.ones(3)
    expect_a, expect_b = a.clone(), b.clone()
    off = StorageOffloader()
    moved = off.offload([a, b, other])
    assert moved == 12 * 4 + 3 * 4  # each storage once
    assert buffer.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 0
    off.onload()
    assert torch.equal(a, expect_a) and torch.equal(b, expect_b) and torch.equal(other, torch.ones(3))
    a.add_(1)  # still a view of the same buffer
    assert buffer[0] == 1.0 and not off.offloaded
