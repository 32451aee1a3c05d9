"""Planning of /update_weights_from_tensor requests and of the per-stage update groups."""

from __future__ import annotations

import base64
import pickle

import pytest
import torch

from megarl.rollout_sglang.tensor_payload import (
    build_tensor_requests,
    group_by_dtype,
    plan_requests,
)
from megarl.rollout_sglang.update_group import engine_rank_offsets, plan_stage_groups


class OneDtypeBucket:
    """SGLang's FlattenedTensorBucket before multi-dtype support (torch.cat of one dtype)."""

    def __init__(self, named_tensors):
        assert len({t.dtype for _, t in named_tensors}) == 1
        self.flat = torch.cat([t.flatten() for _, t in named_tensors])
        self.meta = [(n, tuple(t.shape)) for n, t in named_tensors]

    def get_flattened_tensor(self):
        return self.flat

    def get_metadata(self):
        return self.meta


class MultiDtypeBucket(OneDtypeBucket):
    supports_multi_dtypes = True

    def __init__(self, named_tensors):
        self.flat = torch.cat([t.flatten().view(torch.uint8) for _, t in named_tensors])
        self.meta = [(n, tuple(t.shape)) for n, t in named_tensors]


NAMED = [
    ("a", torch.zeros(2, 2)),
    ("b", torch.ones(3, dtype=torch.bfloat16)),
    ("c", torch.ones(4)),
    ("d", torch.zeros(1, dtype=torch.bfloat16)),
]


def test_group_by_dtype_keeps_relative_order():
    groups = group_by_dtype(NAMED)
    assert [[n for n, _ in g] for g in groups] == [["a", "c"], ["b", "d"]]


def test_plan_depends_on_what_sglangs_bucket_supports():
    assert [(f, [n for n, _ in ts]) for f, ts in plan_requests(NAMED, None)] == [
        (None, ["a", "b", "c", "d"])
    ]
    assert [f for f, _ in plan_requests(NAMED, MultiDtypeBucket)] == ["flattened_bucket"]
    assert [[n for n, _ in ts] for _, ts in plan_requests(NAMED, OneDtypeBucket)] == [
        ["a", "c"],
        ["b", "d"],
    ]
    assert plan_requests([], None) == []


def test_flattened_requests_hold_bucket_and_metadata_per_rank():
    requests = build_tensor_requests(NAMED, tp=3, bucket_class=OneDtypeBucket)
    assert [r.last for r in requests] == [False, True]
    assert all(len(r.payloads) == 3 and r.load_format == "flattened_bucket" for r in requests)
    obj = pickle.loads(base64.b64decode(requests[0].payloads[2]))
    assert sorted(obj) == ["flattened_tensor", "metadata"]
    assert obj["metadata"] == [("a", (2, 2)), ("c", (4,))]
    assert torch.equal(obj["flattened_tensor"], torch.cat([torch.zeros(4), torch.ones(4)]))
    assert requests[0].names == ("a", "c")


def test_plain_requests_round_trip_named_tensors():
    (request,) = build_tensor_requests(NAMED, tp=1, bucket_class=None)
    decoded = pickle.loads(base64.b64decode(request.payloads[0]))
    assert [n for n, _ in decoded] == ["a", "b", "c", "d"]
    assert all(
        torch.equal(x, y) and x.dtype == y.dtype
        for (_, x), (_, y) in zip(decoded, NAMED, strict=True)
    )


def test_rank_offsets_and_stage_groups():
    assert engine_rank_offsets([2, 1, 4]) == [1, 3, 4]
    groups = plan_stage_groups(
        [2, 1, 4], pp_size=2, master_address="10.0.0.1", master_ports=[5000, 5001]
    )
    assert [(g.name, g.master_port, g.world_size) for g in groups] == [
        ("megarl_wsync_pp0", 5000, 8), ("megarl_wsync_pp1", 5001, 8)
    ]  # fmt: skip
    assert all(g.engine_rank_offsets == (1, 3, 4) for g in groups)
    with pytest.raises(ValueError, match="2 master ports for 3 pipeline stages"):
        plan_stage_groups([1], 3, "h", [1, 2])
    with pytest.raises(ValueError, match="repeat"):
        plan_stage_groups([1], 2, "h", [7, 7])
    with pytest.raises(ValueError, match="no engines"):
        plan_stage_groups([], 1, "h", [7])
