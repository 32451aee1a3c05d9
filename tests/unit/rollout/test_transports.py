"""Weight loading into the torch engine, the weight stream's bucket bounds, the in-process and
disk transports."""

from __future__ import annotations

import weakref

import pytest
import torch

from megarl.engines.base import WeightBucket
from megarl.engines.torch_engine import TorchEngine, WeightLoadError
from megarl.models.tiny import build_tiny_model
from megarl.weight_sync.stream import MIB, WeightStream
from megarl.weight_sync.transports import DiskTransport, InProcessTransport


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    """Same architecture as ``tied_model_dir``, other weights: the 'trainer' that pushes."""
    return build_tiny_model(tmp_path_factory.mktemp("other"), arch="qwen3", tie_word_embeddings=True, seed=9)


@pytest.fixture(scope="module")
def source(other_model_dir):
    return TorchEngine(other_model_dir, dtype="float32")


def _exporter(model: torch.nn.Module, log: list | None = None):
    """An export_fn over an HF model's parameters (fresh copies, as a TP gather produces)."""

    def export():
        for name, p in model.named_parameters():
            t = p.detach().clone()
            if log is not None:
                log.append(t)
            yield name, t

    return export


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sb = b.state_dict()
    return all(torch.equal(t, sb[n]) for n, t in a.state_dict().items())


def test_in_process_push_makes_engine_equal_to_source(tied_model_dir, source):
    engine = TorchEngine(tied_model_dir, dtype="float32")
    assert not same_weights(engine.model, source.model)
    transport = InProcessTransport(WeightStream(_exporter(source.model), bucket_mb=0.05), [engine])
    transport.connect(None)
    metrics = transport.push(version=3)
    assert engine.weight_version == 3
    total = sum(p.numel() * p.element_size() for p in source.model.parameters())
    assert metrics["weight_sync/bytes"] == total and metrics["weight_sync/buckets"] > 1
    assert metrics["weight_sync/seconds"] > 0 and metrics["weight_sync/gbps"] > 0
    assert same_weights(engine.model, source.model)


def test_disk_push_reloads_and_keeps_only_latest(tied_model_dir, other_model_dir, source, tmp_path):
    engine = TorchEngine(tied_model_dir, dtype="float32")
    transport = DiskTransport(WeightStream(_exporter(source.model), bucket_mb=0.05), tmp_path, writer=True,
                              hf_dir=other_model_dir, engines_of=lambda _: [engine])  # fmt: skip
    (tmp_path / "vocab").mkdir()  # the user's, in a directory the transport shares
    transport.connect(None)
    transport.push(version=1)
    metrics = transport.push(version=2)
    assert engine.weight_version == 2 and metrics["weight_sync/bytes"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v2", "vocab"]  # v1 went; nothing else
    assert (tmp_path / "v2" / "config.json").exists()
    assert len(list((tmp_path / "v2").glob("*.safetensors"))) > 1  # one file per bucket
    assert same_weights(engine.model, source.model)


def test_stream_buckets_respect_size_and_hold_at_most_one_bucket_plus_one_tensor(source):
    created: list[torch.Tensor] = []
    stream = WeightStream(_exporter(source.model, created), bucket_mb=0.03, overlap=False)
    cap = stream.bucket_bytes
    largest = max(p.numel() * p.element_size() for p in source.model.parameters())
    assert largest > cap  # some tensor travels alone
    alive: dict[int, int] = {}

    def track_new() -> None:
        while created:
            t = created.pop()
            alive[id(t)] = t.numel() * t.element_size()
            weakref.finalize(t, alive.pop, id(t), None)

    names, lasts, live_peak = [], [], 0
    for bucket in stream.buckets(version=1):
        track_new()
        live_peak = max(live_peak, sum(alive.values()))
        assert bucket.nbytes <= cap or len(bucket.tensors) == 1
        names += [n for n, _ in bucket.tensors]
        lasts.append(bucket.last)
        del bucket
    assert lasts[-1] and not any(lasts[:-1]) and len(lasts) > 3
    assert sorted(names) == sorted(n for n, _ in source.model.named_parameters())
    assert stream.peak_bytes <= cap + largest
    assert 0 < live_peak <= cap + largest  # what really stayed alive, not just what was counted


def _full_push(model, version, drop=()):
    tensors = [(n, p.detach().clone()) for n, p in model.named_parameters() if n not in drop]
    return WeightBucket(tensors, version, last=True)


def test_load_weights_rejects_unknown_name(tied_model_dir):
    engine = TorchEngine(tied_model_dir, dtype="float32")
    with pytest.raises(WeightLoadError, match="model.layers.0.self_attn.qkv_proj.weight"):
        engine.load_weights(WeightBucket([("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(3))], 1))


def test_load_weights_rejects_wrong_shape(tied_model_dir):
    engine = TorchEngine(tied_model_dir, dtype="float32")
    with pytest.raises(WeightLoadError, match=r"model.norm.weight.*\(7,\)"):
        engine.load_weights(WeightBucket([("model.norm.weight", torch.zeros(7))], 1))


def test_load_weights_last_bucket_requires_every_parameter(tied_model_dir, source):
    engine = TorchEngine(tied_model_dir, dtype="float32")
    with pytest.raises(WeightLoadError, match="1 parameter.*model.norm.weight"):
        engine.load_weights(_full_push(source.model, 5, drop=("model.norm.weight",)))
    assert engine.weight_version == 0
    engine.load_weights(_full_push(source.model, 6))  # a complete push afterwards succeeds
    assert engine.weight_version == 6


def test_tied_lm_head_may_arrive_under_its_own_name(tied_model_dir, source):
    engine = TorchEngine(tied_model_dir, dtype="float32")
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    embed = source.model.model.embed_tokens.weight.detach().clone()
    rest = [(n, p.detach().clone()) for n, p in source.model.named_parameters() if "embed_tokens" not in n]
    engine.load_weights(WeightBucket([*rest, ("lm_head.weight", embed)], 2, last=True))
    assert engine.weight_version == 2
    assert same_weights(engine.model, source.model)


def test_bucket_mb_must_be_positive(source):
    with pytest.raises(ValueError, match="bucket_mb"):
        WeightStream(_exporter(source.model), bucket_mb=0)
    assert WeightStream(_exporter(source.model), bucket_mb=2).bucket_bytes == 2 * MIB


def test_a_failed_disk_reload_still_meets_the_other_ranks(tmp_path, source, other_model_dir):
    """The writer's engine refuses the weights (here: another architecture's, as a dead engine
    fails its reload): the writer raises, and the rank beside it is not left in the barrier."""
    import threading

    wrong = TorchEngine(build_tiny_model(tmp_path / "llama", arch="llama", seed=2), dtype="float32")
    barrier = threading.Barrier(2, timeout=60)
    outcome: dict[str, object] = {}

    def rank(writer: bool) -> None:
        transport = DiskTransport(WeightStream(_exporter(source.model), bucket_mb=0.05), tmp_path / "w", writer=writer,
                                  hf_dir=other_model_dir, engines_of=lambda _: [wrong] if writer else [],
                                  barrier=barrier.wait)  # fmt: skip
        transport.connect(None)
        try:
            transport.push(version=1)
            outcome[f"writer={writer}"] = "returned"
        except Exception as exc:  # noqa: BLE001 - the test records what each rank saw
            outcome[f"writer={writer}"] = type(exc).__name__

    threads = [threading.Thread(target=rank, args=(w,)) for w in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert outcome == {"writer=True": "WeightLoadError", "writer=False": "returned"}
