"""How routed expert ids are stored in ``Batch.routed_experts``: the narrowest integer that holds
them, since a step's routing (``[B, P+R, L, k]``) is the largest thing the Batch carries for a
large mixture-of-experts model.

uint8 when every id and the "not routed" mark fit in a byte (up to 255 experts: 255 is the mark,
as -1 has no uint8 value), int16 otherwise (-1 the mark). A 256-expert model (DeepSeek-V3) thus
keeps int16: its ids 0..255 use every uint8 value. The dtype tells which mark a tensor uses, so
a reader needs nothing but the tensor (:func:`unpack_expert_ids`).
"""

from __future__ import annotations

import torch

UINT8_UNROUTED = 255  # the uint8 "not routed" mark


def expert_id_dtype(num_experts: int) -> torch.dtype:
    """The dtype of the ids of a model with ``num_experts`` routed experts."""
    return torch.uint8 if num_experts < UINT8_UNROUTED + 1 else torch.int16


def unrouted_id(dtype: torch.dtype) -> int:
    """The value that marks a token the engine did not route, in ids of ``dtype``."""
    return UINT8_UNROUTED if dtype == torch.uint8 else -1


def pack_expert_ids(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``ids`` (any integer dtype, -1 = not routed) in :func:`expert_id_dtype`'s dtype."""
    dtype = expert_id_dtype(num_experts)
    if dtype == torch.uint8:
        return torch.where(ids < 0, UINT8_UNROUTED, ids).to(torch.uint8)
    return ids.to(dtype)


def unpack_expert_ids(ids: torch.Tensor) -> torch.Tensor:
    """Packed ``ids`` back to long, -1 = not routed (what the trainer's routers compare)."""
    out = ids.long()
    if ids.dtype == torch.uint8:
        out[out == UINT8_UNROUTED] = -1
    return out
