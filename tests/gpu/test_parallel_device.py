"""On a GPU box the model's device follows the process group's backend: with no group made,
init_parallel makes an NCCL one and puts the rank on its GPU; a gloo group made by the caller
(the gloo tests and benches) keeps it on the CPU, whose tensors gloo moves.

Skipped without CUDA or megatron-core. Passed on an H100 (torch 2.11, megatron-core 0.19.2).
"""

from __future__ import annotations

import socket

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("callers_group", ["gloo", None])
def test_the_device_follows_the_backend(monkeypatch, callers_group):
    pytest.importorskip("megatron.core")
    import torch.distributed as dist

    from megarl.parallel.groups import destroy_parallel, init_parallel

    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if callers_group:
        dist.init_process_group(callers_group, rank=0, world_size=1)
    try:
        info = init_parallel(tp=1, pp=1, seed=0)
        assert dist.get_backend() == (callers_group or "nccl")
        assert info.device.type == ("cpu" if callers_group else "cuda")
    finally:
        destroy_parallel()
