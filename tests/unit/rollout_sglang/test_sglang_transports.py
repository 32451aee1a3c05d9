"""Weight transports to the fake SGLang server: the order of calls a push makes, payloads,
version checks, reconnect + re-push after a restart, and the distributed path over gloo."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

from megarl.engines.base import SamplingParams
from megarl.rollout_sglang.client import SGLangHTTPError
from megarl.rollout_sglang.engine import (
    EngineBusy,
    EngineEndpoint,
    SGLangEngine,
    WeightVersionMismatch,
)
from megarl.weight_sync.cuda_ipc import PayloadGather, SGLangTensorTransport
from megarl.weight_sync.nccl_broadcast import SGLangDistributedTransport, StageRole
from megarl.weight_sync.sglang_push import RetractingDiskReload, pause_mode
from megarl.weight_sync.stream import WeightStream
from megarl.weight_sync.transports import DiskTransport

TIMEOUT = timedelta(seconds=30)


def make_weights(prefix: str = "model.layers.0", count: int = 5) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(len(prefix) + count)
    out = {
        f"{prefix}.w{i}": torch.randn(64, 64, generator=gen) for i in range(count)
    }  # 16 KiB each
    out[f"{prefix}.norm"] = torch.ones(64, dtype=torch.bfloat16)
    return out


def stream_of(weights: dict[str, torch.Tensor], bucket_mb: float = 0.04) -> WeightStream:
    # The shared bucket stream (megarl/weight_sync/stream.py) over a fixed "export".
    return WeightStream(lambda: ((n, t.clone()) for n, t in weights.items()), bucket_mb)


def endpoints(engines: list[SGLangEngine]) -> list[EngineEndpoint]:
    return [EngineEndpoint(e.url, e.tp, e.max_running_requests) for e in engines]


def these(engines: list[SGLangEngine]):
    """The transports' engine factory, handing out the test's own clients (to look at their state)."""
    return lambda endpoint: next(e for e in engines if e.url == endpoint.url)  # URLs change on restart


def assert_same_weights(received: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> None:
    assert sorted(received) == sorted(sent)
    for name, tensor in sent.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name


def tensor_sync(weights: dict[str, torch.Tensor], *engines: SGLangEngine) -> SGLangTensorTransport:
    """A connected tensor transport (one process: it posts to every engine)."""
    transport = SGLangTensorTransport(stream_of(weights), bucket_class=None, make_engine=these(list(engines)))
    transport.connect(endpoints(list(engines)))
    return transport


def test_tensor_push_makes_the_calls_a_real_server_needs_in_order(fake_server):
    server = fake_server(flush_busy=1)  # an SGLang 0.5.23: updates only inside begin/end
    engine = SGLangEngine(server, flush_interval=0.01)
    weights = make_weights()
    sync = tensor_sync(weights, engine)
    metrics = sync.push(1)

    calls = server.fake.control_calls()
    n_updates = calls.count("/update_weights_from_tensor")
    assert n_updates == metrics["weight_sync/buckets"] >= 3  # 16 KiB tensors, 40 KiB buckets
    assert [c for c in calls if c != "/server_info"] == (
        ["/pause_generation", "/flush_cache", "/flush_cache",  # the first flush answered 400 and was retried
         "/begin_weight_update"]
        + ["/update_weights_from_tensor"] * n_updates
        + ["/end_weight_update", "/continue_generation"]
    )  # fmt: skip
    updates = [b for p, b in server.fake.bodies if p == "/update_weights_from_tensor"]
    assert all(b["flush_cache"] is False and b["load_format"] is None for b in updates)
    assert [b.get("weight_version") for b in updates] == [None] * (n_updates - 1) + ["1"]
    assert_same_weights(server.fake.weights, weights)
    assert engine.weight_version == 1 and server.fake.weight_version == "1"
    assert metrics["weight_sync/bytes"] == sum(
        t.numel() * t.element_size() for t in weights.values()
    )


def test_tensor_push_sends_one_payload_per_tp_rank(fake_server):
    server = fake_server(tp=2)  # the fake refuses a payload count other than its TP size
    weights = make_weights(count=2)
    sync = tensor_sync(weights, SGLangEngine(server, tp=2))
    sync.push(4)
    updates = [b for p, b in server.fake.bodies if p == "/update_weights_from_tensor"]
    assert all(len(b["serialized_named_tensors"]) == 2 for b in updates)
    assert_same_weights(server.fake.weights, weights)


def test_generation_reports_the_new_weight_version(fake_server):
    server = fake_server()
    engine = SGLangEngine(server)
    sync = tensor_sync(make_weights(count=1), engine)
    sync.push(2)
    results = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    assert results[0].weight_version == 2
    assert results[0].logprobs == pytest.approx([-0.52, -0.62])  # the fake shifts by version


def test_lost_weight_version_raises_clearly(fake_server):
    server = fake_server()
    server.fake.ignore_version = True
    sync = tensor_sync(make_weights(count=1), SGLangEngine(server))
    with pytest.raises(WeightVersionMismatch, match="weight_version is 0 after pushing version 5"):
        sync.push(5)


def test_failed_update_raises_with_the_servers_message(fake_server):
    server = fake_server()
    server.fake.fail_update = True
    sync = tensor_sync(make_weights(count=1), SGLangEngine(server))
    with pytest.raises(
        SGLangHTTPError, match="update_weights_from_tensor: HTTP 400: .*size mismatch"
    ):
        sync.push(1)


def test_flush_gives_up_after_its_retry_bound(fake_server):
    server = fake_server(flush_busy=10)
    engine = SGLangEngine(server, flush_retries=3, flush_interval=0.0)
    with pytest.raises(SGLangHTTPError, match="still refused after 3 attempts"):
        engine.flush_cache()
    assert server.fake.calls.count("/flush_cache") == 3


def test_version_check_falls_back_to_get_model_info(fake_server):
    server = fake_server()
    server.fake.legacy_info = True
    engine = SGLangEngine(server)
    sync = tensor_sync(make_weights(count=1), engine)
    sync.push(3)
    assert server.fake.calls[-2:] == ["/model_info", "/get_model_info"]
    assert engine.weight_version == 3


def test_release_needs_an_idle_engine_and_resume_only_what_was_released(fake_server):
    running = threading.Event()  # the generation runs until the release was refused
    server = fake_server(generate_gate=running)
    engine = SGLangEngine(server)
    worker = threading.Thread(
        target=engine.generate, args=([[1, 2]], SamplingParams(max_new_tokens=1))
    )
    worker.start()
    deadline = time.monotonic() + 5
    while server.fake.inflight == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        with pytest.raises(EngineBusy, match="1 requests in flight"):
            engine.release_memory()
    finally:
        running.set()
    worker.join()
    engine.release_memory(["kv_cache"])
    engine.resume_memory()  # only kv_cache was released
    bodies = [b for p, b in server.fake.bodies if p.endswith("_memory_occupation")]
    assert [b["tags"] for b in bodies] == [["kv_cache"], ["kv_cache"]]


def test_a_restarted_engine_gets_the_weights_again_after_reconnect(fake_server):
    server = fake_server()
    engine = SGLangEngine(server)
    weights = make_weights(count=2)
    sync = tensor_sync(weights, engine)
    sync.push(7)
    server.kill()
    assert engine.health().alive is False
    engine.restart()  # what the controller's hand-over does, then reconnect + re-push
    sync.connect(endpoints([engine]))
    sync.push(7)
    fresh = server.history[-1]
    assert fresh is not server.history[0]
    assert fresh.weight_version == "7"
    assert_same_weights(fresh.weights, weights)
    assert [c for c in fresh.control_calls() if c != "/server_info"][:3] == ["/pause_generation", "/flush_cache", "/begin_weight_update"]
    assert engine.health().alive is True


def test_disk_push_loads_the_written_directory(fake_server, tmp_path):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    server = fake_server()
    weights = make_weights(count=2)
    engine = SGLangEngine(server)
    sync = DiskTransport(stream_of(weights), str(tmp_path / "push"), writer=True, hf_dir=str(hf_dir),
                         engines_of=lambda _: [engine])  # fmt: skip
    sync.connect(None)
    metrics = sync.push(2)
    (body,) = [b for p, b in server.fake.bodies if p == "/update_weights_from_disk"]
    target = tmp_path / "push" / "v2"
    assert body["model_path"] == str(target) and body["weight_version"] == "2"
    assert body.get("load_format") == "auto"  # not the launch's dummy format
    assert (target / "config.json").exists() and list(target.glob("*.safetensors"))
    assert server.fake.weight_version == "2" and metrics["weight_sync/bytes"] > 0


def test_distributed_push_per_stage_groups_over_gloo(fake_server):
    # Two engines (tp 1 and tp 2) and a 2-stage policy whose stages this process both sends.
    servers = [fake_server(tp=1), fake_server(tp=2)]
    engines = [SGLangEngine(servers[0], tp=1), SGLangEngine(servers[1], tp=2)]
    stage_weights = {0: make_weights("model.layers.0", 2), 1: make_weights("model.layers.1", 3)}
    sync = SGLangDistributedTransport(
        {s: stream_of(w) for s, w in stage_weights.items()},
        StageRole(pp_size=2, stages=(0, 1), sender_stages=(0, 1)),
        backend="gloo",
        make_engine=these(engines),
        group_prefix="test_dist_a",
        timeout=TIMEOUT,
    )
    sync.connect(endpoints(engines))
    try:
        sync.push(3)
        everything = stage_weights[0] | stage_weights[1]
        for server in servers:
            assert_same_weights(server.fake.weights, everything)
            assert server.fake.weight_version == "3"
        inits = [b for p, b in servers[1].fake.bodies if p == "/init_weights_update_group"]
        assert [(b["group_name"], b["rank_offset"], b["world_size"]) for b in inits] == [
            ("test_dist_a_pp0", 2, 4), ("test_dist_a_pp1", 2, 4)
        ]  # fmt: skip
        updates = [b for p, b in servers[0].fake.bodies if p == "/update_weights_from_distributed"]
        assert [b["group_name"] for b in updates] == ["test_dist_a_pp0"] * 1 + [
            "test_dist_a_pp1"
        ] * 2
        assert all("weight_version" not in b for b in updates)  # set once, after all stages
        # The version label goes on once every stage is in, inside the update session.
        assert servers[0].fake.control_calls()[-3:] == [
            "/update_weight_version",
            "/end_weight_update",
            "/continue_generation",
        ]

        servers[1].kill()  # engine 1 dies: restart, rebuild both groups, re-push (the hand-over's steps)
        engines[1].restart()
        sync.connect(endpoints(engines))
        sync.push(3)
        assert_same_weights(servers[1].history[-1].weights, everything)
        assert servers[1].history[-1].weight_version == "3"
        destroyed = [
            b["group_name"]
            for p, b in servers[0].fake.bodies
            if p == "/destroy_weights_update_group"
        ]
        assert destroyed == ["test_dist_a_pp0", "test_dist_a_pp1"]
    finally:
        sync.close()


def test_distributed_single_stage_tags_the_last_bucket(fake_server):
    server = fake_server()
    weights = make_weights(count=3)
    engine = SGLangEngine(server)
    sync = SGLangDistributedTransport(
        {0: stream_of(weights)}, backend="gloo", make_engine=these([engine]), group_prefix="test_dist_b", timeout=TIMEOUT
    )
    sync.connect(endpoints([engine]))
    try:
        sync.push(9)
        updates = [b for p, b in server.fake.bodies if p == "/update_weights_from_distributed"]
        assert [b.get("weight_version") for b in updates] == [None] * (len(updates) - 1) + ["9"]
        assert all(b["flush_cache"] is False for b in updates)
        assert "/update_weight_version" not in server.fake.calls
        assert_same_weights(server.fake.weights, weights)
    finally:
        sync.close()


def test_distributed_push_before_connect_is_refused():
    sync = SGLangDistributedTransport({0: stream_of(make_weights(count=1))}, backend="gloo")
    with pytest.raises(RuntimeError, match="before connect"):
        sync.push(1)


def test_failed_push_leaves_a_live_paused_engine_that_the_next_push_finishes(fake_server):
    server = fake_server()
    server.fake.fail_update = True
    engine = SGLangEngine(server)
    sync = tensor_sync(make_weights(count=1), engine)
    with pytest.raises(SGLangHTTPError):
        sync.push(1)
    assert server.fake.paused and engine.paused
    health_calls = len(server.fake.calls)
    assert engine.health().alive  # paused: checked through /model_info, not a generation
    assert server.fake.calls[health_calls:] == ["/model_info"]
    server.fake.fail_update = False
    sync.push(1)
    assert not server.fake.paused and server.fake.weight_version == "1"


def _two_holders(engine: SGLangEngine, weights: dict[str, torch.Tensor], version: int) -> list[BaseException | None]:
    """Two trainer processes (threads here) on the two GPUs of a TP=2 engine push ``version``:
    each serializes its own copy, rank 0 gathers them in TP-rank order and posts. Returns each
    rank's error (None: its push returned); a rank left waiting fails the test by timing out."""
    slots: list[str | None] = [None, None]
    meet = threading.Barrier(2, timeout=30)

    def gather_for(rank: int):
        def gather(payload: str) -> list[str] | None:
            slots[rank] = payload
            meet.wait()
            out = list(slots) if rank == 0 else None
            meet.wait()
            return out

        return gather

    syncs = [
        SGLangTensorTransport(stream_of(weights), rank=r, bucket_class=None, make_engine=these([engine]),
                              payload_gather=lambda ranks, r=r: PayloadGather(gather_for(r), meet.wait))  # fmt: skip
        for r in range(2)
    ]
    for sync in syncs:  # the engine's GPUs are held by policy ranks 0 and 1, in TP order
        sync.connect([EngineEndpoint(engine.url, 2, holders=(0, 1))])
    errors: list[BaseException | None] = [None, None]

    def run(rank: int) -> None:
        try:
            syncs[rank].push(version)
        except BaseException as err:  # noqa: BLE001 - returned to the test
            errors[rank] = err

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank was left waiting"
    return errors


def test_per_gpu_payloads_are_gathered_in_tp_rank_order(fake_server):
    server = fake_server(tp=2)
    weights = make_weights(count=3)
    engine = SGLangEngine(server, tp=2)
    assert _two_holders(engine, weights, 6) == [None, None]
    updates = [b for p, b in server.fake.bodies if p == "/update_weights_from_tensor"]
    assert len(updates) >= 2 and all(len(b["serialized_named_tensors"]) == 2 for b in updates)
    # Each rank's payload is its own serialization (distinct strings, same tensors).
    assert all(
        b["serialized_named_tensors"][0] != b["serialized_named_tensors"][1] for b in updates
    )
    assert_same_weights(server.fake.weights, weights)
    assert server.fake.weight_version == "6"


def test_a_failed_post_still_meets_the_other_gpus_and_names_the_engine(fake_server):
    # The poster's first update fails: the other GPU's rank must still get through every gather
    # and barrier of the push (not wait for the deadline), and the poster raise at the end.
    server = fake_server(tp=2)
    server.fake.fail_update = True
    engine = SGLangEngine(server, tp=2)
    errors = _two_holders(engine, make_weights(count=3), 2)
    assert errors[1] is None
    assert isinstance(errors[0], RuntimeError) and isinstance(errors[0].__cause__, SGLangHTTPError)
    assert f"sending weights to engine(s) {engine.url} failed: SGLangHTTPError: " in str(errors[0])
    assert [p for p, _ in server.fake.bodies].count("/update_weights_from_tensor") == 1  # no post after the failure


def mixed_weights() -> dict[str, torch.Tensor]:
    """A 3-element bf16 tensor before fp32 ones: sent in this order as one flattened bucket, the
    fp32 tensor would start at byte 6, which SGLang refuses."""
    gen = torch.Generator().manual_seed(7)
    return {"model.norm.bias": torch.randn(3, generator=gen).to(torch.bfloat16),
            "model.w0": torch.randn(8, 4, generator=gen), "model.w1": torch.randn(5, generator=gen),
            "model.step": torch.tensor(3.0)}  # fmt: skip


def distributed(engines: list[SGLangEngine], weights: dict[str, torch.Tensor], prefix: str) -> SGLangDistributedTransport:
    sync = SGLangDistributedTransport({0: stream_of(weights, bucket_mb=1.0)}, backend="gloo", make_engine=these(engines),
                                      group_prefix=prefix, timeout=TIMEOUT)  # fmt: skip
    sync.connect(endpoints(engines))
    return sync


def test_distributed_push_sends_one_flattened_broadcast_per_bucket(fake_server):
    """SGLang >= 0.5.6 takes a bucket as one broadcast of its bytes: widest dtypes first, so that
    every tensor starts aligned (the fake refuses an unaligned one, as SGLang 0.5.23 does)."""
    servers = [fake_server(tp=1), fake_server(tp=2)]
    engines = [SGLangEngine(servers[0], tp=1), SGLangEngine(servers[1], tp=2)]
    weights = mixed_weights()
    sync = distributed(engines, weights, "test_dist_flat")
    try:
        sync.push(4)
        for server in servers:
            (update,) = [b for p, b in server.fake.bodies if p == "/update_weights_from_distributed"]
            assert update["load_format"] == "flattened_bucket" and server.fake.broadcasts == 1
            assert update["names"][-1] == "model.norm.bias"  # the 2-byte dtype after the 4-byte ones
            assert_same_weights(server.fake.weights, weights)
            assert server.fake.weight_version == "4"
    finally:
        sync.close()


@pytest.mark.parametrize("versions", [("0.5.5",), ("0.5.23", "0.5.5")])
def test_distributed_push_to_a_server_before_0_5_6_goes_tensor_by_tensor(fake_server, versions):
    """An older server receives tensor by tensor; one such engine and the whole group does (all
    receivers of a broadcast must expect the same)."""
    servers = [fake_server(version=v) for v in versions]
    engines = [SGLangEngine(s) for s in servers]
    weights = mixed_weights()
    sync = distributed(engines, weights, "test_dist_old")
    try:
        sync.push(2)
        for server in servers:
            (update,) = [b for p, b in server.fake.bodies if p == "/update_weights_from_distributed"]
            assert "load_format" not in update and server.fake.broadcasts == len(weights)
            assert_same_weights(server.fake.weights, weights)
    finally:
        sync.close()


def test_a_flattened_bucket_is_refused_to_an_old_server_before_it_is_posted(fake_server):
    server = fake_server(version="0.5.5")
    engine = SGLangEngine(server)
    with pytest.raises(RuntimeError, match=r"SGLang 0.5.5 receives distributed updates tensor by tensor; .* SGLang >= 0.5.6"):
        engine.update_from_distributed_async(["w"], ["float32"], [[2]], "g", None, "flattened_bucket")
    assert "/update_weights_from_distributed" not in server.fake.calls


def test_the_fake_refuses_an_unaligned_flattened_bucket_before_receiving(fake_server):
    """As SGLang 0.5.23 (tests/sglang/test_engine.py shows it on the real server): a 4-byte dtype
    at byte offset 6 is refused at once, before the broadcast it would wait for."""
    server = fake_server()
    server.fake.groups["g"] = [None]  # a joined group: the refusal comes before any receive on it
    engine = SGLangEngine(server)
    engine.begin_weight_update()
    reply = engine.update_from_distributed_async(["a", "b"], ["bfloat16", "float32"], [[3], [2]], "g", None,
                                                 "flattened_bucket").exception(timeout=10)  # fmt: skip
    assert isinstance(reply, SGLangHTTPError) and reply.status == 400
    assert "Unaligned received tensor b: byte offset 6, dtype torch.float32" in str(reply)
    assert server.fake.broadcasts == 0


def test_an_asynchronous_push_retracts_the_requests_in_flight_and_a_synchronous_one_aborts():
    assert pause_mode(asynchronous=True, partial_rollouts=True) == "retract"
    assert pause_mode(asynchronous=True, partial_rollouts=False) == "abort"
    assert pause_mode(asynchronous=False, partial_rollouts=False) == "abort"


def test_distributed_push_pauses_in_the_mode_it_was_given(fake_server):
    server = fake_server()
    engine = SGLangEngine(server)
    sync = SGLangDistributedTransport({0: stream_of(make_weights(count=2))}, backend="gloo", make_engine=these([engine]),
                                      group_prefix="test_dist_c", timeout=TIMEOUT, pause="retract")  # fmt: skip
    sync.connect(endpoints([engine]))
    try:
        sync.push(1)
    finally:
        sync.close()
    assert [b["mode"] for p, b in server.fake.bodies if p == "/pause_generation"] == ["retract"]
    skip = ("/server_info", "/init_weights_update_group", "/destroy_weights_update_group")  # connect, close
    calls = [c for c in server.fake.control_calls() if c not in skip]
    assert calls[:3] == ["/pause_generation", "/flush_cache", "/begin_weight_update"]  # flushed once, before the buckets
    assert calls[-2:] == ["/end_weight_update", "/continue_generation"]
    updates = [b for p, b in server.fake.bodies if p == "/update_weights_from_distributed"]
    assert updates and all(b["flush_cache"] is False for b in updates)


def test_tensor_push_aborts_by_default(fake_server):
    server = fake_server()
    tensor_sync(make_weights(count=1), SGLangEngine(server)).push(1)
    assert [b["mode"] for p, b in server.fake.bodies if p == "/pause_generation"] == ["abort"]


def test_an_asynchronous_disk_reload_is_paused_with_retract(fake_server, tmp_path):
    server = fake_server()
    engine = RetractingDiskReload(SGLangEngine(server))
    sync = DiskTransport(stream_of(make_weights(count=2)), str(tmp_path / "push"), writer=True, hf_dir=None,
                         engines_of=lambda _: [engine])  # fmt: skip
    sync.connect(None)
    sync.push(4)
    assert [c for c in server.fake.control_calls() if c != "/server_info"] == [
        "/pause_generation", "/flush_cache", "/update_weights_from_disk", "/continue_generation"]  # fmt: skip
    assert [b["mode"] for p, b in server.fake.bodies if p == "/pause_generation"] == ["retract"]
    assert server.fake.weight_version == "4" and engine.weight_version == 4 and not server.fake.paused
