"""Planning of /update_weights_from_tensor requests and of the per-stage update groups; what
SGLang unpickles from them; the weight-update session of SGLang >= 0.5.21; the disk update's
load format. [real] marks refusals seen on a real SGLang 0.5.23 server (conftest.py)."""

from __future__ import annotations

import base64
import io
import pickle
import pickletools
import sys
import types
from dataclasses import make_dataclass
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from megarl.rollout_sglang.client import SGLangClient, SGLangUnreachable
from megarl.rollout_sglang.engine import SGLangEngine, parse_version
from megarl.rollout_sglang.tensor_payload import (
    build_tensor_requests,
    group_by_dtype,
    plan_requests,
    serialize_for_http,
)
from megarl.weight_sync.update_group import engine_rank_offsets, plan_stage_group


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
    assert [(f, [n for n, _ in ts]) for f, ts in plan_requests(NAMED, MultiDtypeBucket)] == [
        ("flattened_bucket", ["a", "c", "b", "d"])  # widest dtype first: aligned offsets
    ]
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
    groups = [plan_stage_group([2, 1, 4], s, "10.0.0.1", 5000 + s) for s in range(2)]
    assert [(g.name, g.master_port, g.world_size) for g in groups] == [
        ("megarl_wsync_pp0", 5000, 8), ("megarl_wsync_pp1", 5001, 8)
    ]  # fmt: skip
    assert all(g.engine_rank_offsets == (1, 3, 4) for g in groups)
    with pytest.raises(ValueError, match="no engines"):
        plan_stage_group([], 0, "h", 7)


# ---- what a real SGLang server unpickles (the fake decodes the same way) -------------------


def test_cpu_tensors_travel_as_bytes_not_as_shared_file_descriptors(fake_server):
    # ForkingPickler would pass CPU storage by file descriptor through a resource_sharer
    # handshake that a separate process fails; SGLang 0.5.23's scheduler died of it [real].
    payload = serialize_for_http([("w", torch.arange(6.0))])
    ops = {
        arg for op, arg, _ in pickletools.genops(base64.b64decode(payload)) if isinstance(arg, str)
    }
    assert "rebuild_storage_fd" not in ops and "DupFd" not in ops
    server = fake_server()
    engine = SGLangEngine(server.url, retries=0)
    engine.begin_weight_update()
    engine.update_from_tensor([payload], None, 1)
    assert torch.equal(server.fake.weights["w"], torch.arange(6.0))

    buf = io.BytesIO()
    ForkingPickler(buf).dump([("w", torch.zeros(3))])
    shared = base64.b64encode(buf.getvalue()).decode()
    with pytest.raises(SGLangUnreachable):
        engine.update_from_tensor([shared], None, 2)
    assert "AuthenticationError" in server.fake.crashed


@pytest.fixture
def sglang_bucket_module(monkeypatch):
    """``sglang.srt.weight_sync.tensor_bucket`` importable, as on a trainer with SGLang: its
    FlattenedTensorBucket as SGLang 0.5.23 builds one (uint8 view, no padding) and its
    metadata class, pickled under SGLang's module path."""
    names = [
        "sglang",
        "sglang.srt",
        "sglang.srt.weight_sync",
        "sglang.srt.weight_sync.tensor_bucket",
    ]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    module = sys.modules[names[-1]]
    meta_class = make_dataclass(
        "FlattenedTensorMetadata",
        ["name", "shape", "dtype", "start_idx", "end_idx", "numel"],
        namespace={"__module__": module.__name__},
    )

    class FlattenedTensorBucket:
        supports_multi_dtypes = True

        def __init__(self, named_tensors):
            flats, self.metadata, start = [], [], 0
            for name, t in named_tensors:
                flat = t.flatten().view(torch.uint8)
                self.metadata.append(
                    meta_class(name, t.shape, t.dtype, start, start + flat.numel(), flat.numel())
                )
                flats.append(flat)
                start += flat.numel()
            self.flattened_tensor = torch.cat(flats)

        def get_flattened_tensor(self):
            return self.flattened_tensor

        def get_metadata(self):
            return self.metadata

    module.FlattenedTensorMetadata = meta_class
    module.FlattenedTensorBucket = FlattenedTensorBucket
    return module


def test_flattened_bucket_payload_is_decoded_like_sglang_does(fake_server, sglang_bucket_module):
    requests = build_tensor_requests(NAMED, tp=2)  # bucket class "auto": SGLang's (above)
    assert [r.load_format for r in requests] == ["flattened_bucket"]  # mixed dtypes, one bucket
    server = fake_server(tp=2)
    engine = SGLangEngine(server.url, tp=2)
    engine.begin_weight_update()
    engine.update_from_tensor(requests[0].payloads, "flattened_bucket", 3)
    engine.end_weight_update()
    assert sorted(server.fake.weights) == ["a", "b", "c", "d"]
    for name, tensor in NAMED:
        got = server.fake.weights[name]
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name


def test_a_misaligned_flattened_bucket_kills_sglang(fake_server, sglang_bucket_module):  # [real]
    # In NAMED's own order the 3-element bf16 tensor puts the next fp32 one at byte 22.
    bucket = sglang_bucket_module.FlattenedTensorBucket(named_tensors=NAMED)
    payload = serialize_for_http(
        {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    )
    server = fake_server()
    engine = SGLangEngine(server.url, retries=0)
    engine.begin_weight_update()
    with pytest.raises(SGLangUnreachable):
        engine.update_from_tensor([payload], "flattened_bucket", 1)
    assert "must be divisible by 4" in server.fake.crashed


# ---- the weight-update session (SGLang >= 0.5.21) ---------------------------------------------


def test_tensor_update_needs_begin_and_end_on_0_5_21_and_later(fake_server):
    server = fake_server(version="0.5.21")
    engine = SGLangEngine(server.url)
    (request,) = build_tensor_requests(NAMED, tp=1, bucket_class=None)
    body = {"serialized_named_tensors": request.payloads, "load_format": None, "flush_cache": False}
    refused = SGLangClient(server.url).post("/update_weights_from_tensor", body)  # [real]
    assert (
        refused.status == 400
        and "must run between begin_weight_update()" in refused.body["message"]
    )
    with pytest.raises(
        RuntimeError, match=r"SGLang 0\.5\.21 .*call engine\.begin_weight_update\(\)"
    ):
        engine.update_from_tensor(request.payloads, None, 1)
    engine.begin_weight_update()
    engine.begin_weight_update()  # already open: kept, not sent twice (SGLang would say 400)
    engine.update_from_tensor(request.payloads, None, 1)
    engine.end_weight_update()
    calls = server.fake.control_calls()
    assert calls == ["/update_weights_from_tensor", "/begin_weight_update",
                     "/update_weights_from_tensor", "/end_weight_update"]  # fmt: skip
    assert server.fake.weight_version == "1" and not server.fake.session_open
    client = SGLangClient(server.url)
    assert client.post("/end_weight_update").status == 400  # [real] no session open
    assert client.post("/begin_weight_update").status == 200
    assert client.post("/begin_weight_update").status == 400  # [real] already open


def test_older_servers_take_updates_without_a_session(fake_server):
    server = fake_server(version="0.5.20")
    engine = SGLangEngine(server.url)
    assert not engine.needs_update_session
    (request,) = build_tensor_requests(NAMED, tp=1, bucket_class=None)
    engine.begin_weight_update()  # nothing to open on 0.5.20
    engine.update_from_tensor(request.payloads, None, 2)
    engine.end_weight_update()
    assert "/begin_weight_update" not in server.fake.calls and server.fake.weight_version == "2"
    assert SGLangClient(server.url).post("/begin_weight_update").status == 404  # no such route


def test_distributed_update_outside_a_session_is_refused_before_it_is_posted(fake_server):
    server = fake_server()
    engine = SGLangEngine(server.url)
    with pytest.raises(RuntimeError, match="begin_weight_update"):
        engine.update_from_distributed_async(["w"], ["float32"], [[2]], "g", 1)
    # Posted anyway, SGLang answers at once, and the sender's broadcast would hang [real].
    assert "/update_weights_from_distributed" not in server.fake.calls


def test_server_version_falls_back_to_get_server_info_and_is_read_again_after_restart(fake_server):
    server = fake_server(version="0.5.15")
    server.fake.legacy_info = True
    engine = SGLangEngine(server)
    assert engine.server_version() == "0.5.15" and not engine.needs_update_session
    assert server.fake.calls == ["/server_info", "/get_server_info"]
    server.fake_kwargs["version"] = "0.5.23"  # relaunched on a newer install
    engine.begin_weight_update()
    engine.restart()
    assert not engine.update_session and engine.server_version() == "0.5.23"
    assert engine.needs_update_session


def test_parse_version():
    assert parse_version("0.5.15.post1") == (0, 5, 15) and parse_version("0.5.22rc0") == (0, 5, 22)
    with pytest.raises(ValueError, match="'main' is not of the form"):
        parse_version("main")


def test_disk_update_names_its_load_format(fake_server, tmp_path):
    server = fake_server(load_format="dummy")  # launched with random weights
    refused = SGLangClient(server.url).post("/update_weights_from_disk",
                                            {"model_path": str(tmp_path), "weight_version": "1"})  # fmt: skip
    assert refused.status == 400 and "DummyModelLoader" in refused.body["message"]  # [real]
    engine = SGLangEngine(server.url)
    engine.load_weights_from_disk(tmp_path, 1)
    (body,) = [b for p, b in server.fake.bodies if p == "/update_weights_from_disk"][1:]
    assert body == {"model_path": str(tmp_path), "weight_version": "1", "load_format": "auto"}
    assert engine.weight_version == 1 and server.fake.load_format == "auto"
