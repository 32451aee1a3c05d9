"""Pack a stream of named tensors into buckets of bounded byte size (for weight transfer).

A bucket's total bytes never exceed ``bucket_bytes``, except a single tensor larger than the
bucket, which travels alone. Packing is lazy: at most one bucket is held at a time, so a caller
that produces tensors one by one keeps memory at one bucket plus one tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bucketize(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield lists of (name, tensor) in input order, each within ``bucket_bytes`` (see module)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor_bytes(tensor)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
