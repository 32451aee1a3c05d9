"""Megatron policy at TP=2 -> torch engine on rank 0: log-probs agree before and after training.

Two gloo processes, one thread each. The engine starts from OTHER weights (same architecture),
so agreement after the push proves the push, not a shared checkpoint. The vocabulary (259) is
not divisible by 2, so the export's vocab-padding removal is exercised too.
"""

from __future__ import annotations

import weakref

import pytest
from spawn import run_distributed

from megarl.models.tiny import build_tiny_model

WORLD = 2
BUCKET_MB = 0.02  # ~20 KiB: many buckets, several tensors larger than one bucket
TEMPERATURE = 0.8
TOL = 1e-4


def _nll_loss(batch, outputs):
    """Token-mean negative log-likelihood of the responses: a real gradient on every weight."""
    mask = batch.response_mask
    return -(outputs.logprobs * mask).sum(), mask.sum(), {}


class _LiveBytes:
    """Wraps an export_fn and records the most exported bytes alive at once (via weakrefs).

    Tensors that share storage with the policy's own parameters (replicated ones at TP=2 are
    exported as views of the parameter) are not counted: they exist whatever the sync does.
    """

    def __init__(self, export_fn, params) -> None:
        self.export_fn = export_fn
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.alive: dict[int, int] = {}
        self.peak = 0
        self.largest = 0

    def __call__(self, bucket_bytes: int):
        for group in self.export_fn(bucket_bytes):
            for _, t in group:
                nbytes = t.numel() * t.element_size()
                self.largest = max(self.largest, nbytes)
                if t.untyped_storage().data_ptr() not in self.param_ptrs:
                    self.alive[id(t)] = nbytes
                    weakref.finalize(t, self.alive.pop, id(t), None)
            del t
            self.peak = max(self.peak, sum(self.alive.values()))
            yield group


def _engine_vs_trainer(policy, engine, batch) -> float:
    """Max |engine - trainer| log-prob over the probe's response tokens (engine on rank 0 only)."""
    from megarl.rollout.logprob_check import engine_logprobs

    trainer, _ = policy.compute_logprobs(batch, temperature=TEMPERATURE)
    if engine is None:
        return 0.0
    diff = (engine_logprobs(engine, batch, TEMPERATURE) - trainer).abs()[batch.response_mask.bool()]
    return float(diff.max())


def _run(rank: int, world_size: int, model_dir: str, engine_dir: str) -> None:
    from megarl.actors.policy import PolicyWorker
    from megarl.config.sections import ActorConfig, OptimizerConfig, ParallelConfig
    from megarl.rollout.logprob_check import (
        check_after_sync,
        engine_logprobs,
        probe_batch,
        probe_sequences,
    )
    from megarl.rollout.torch_engine import TorchEngine
    from megarl.rollout.weight_sync import HFWeightStream, InProcessWeightSync

    cfg = ActorConfig(
        parallel=ParallelConfig(tp=2), micro_batch_size=2,
        optimizer=OptimizerConfig(lr=1e-2, clip_grad=0.0),
    )
    policy = PolicyWorker(model_dir, cfg, dtype="float32", seed=1)
    engine = TorchEngine(engine_dir, dtype="float32") if rank == 0 else None
    live = _LiveBytes(policy.export_weights, policy.model.core.parameters())
    stream = HFWeightStream(live, bucket_mb=BUCKET_MB)
    sync = InProcessWeightSync(stream)
    sync.connect([engine] if engine is not None else [])
    batch = probe_batch(*probe_sequences(259, num=4, prompt_len=6, response_len=5, seed=3))
    if engine is not None:
        assert _engine_vs_trainer(policy, engine, batch) > 0.1  # different weights before the push
    else:
        _engine_vs_trainer(policy, None, batch)

    metrics = sync.push(version=1)
    assert metrics["weight_sync/bytes"] > 0 and metrics["weight_sync/gbps"] > 0
    assert _engine_vs_trainer(policy, engine, batch) <= TOL
    check = check_after_sync(policy, engine, batch, TEMPERATURE, max_diff=0.05)
    if engine is not None:
        assert engine.weight_version == 1
        assert check["weight_sync/logprob_diff"] <= TOL

    before, _ = policy.compute_logprobs(batch, temperature=TEMPERATURE)
    policy.update(batch, _nll_loss, temperature=TEMPERATURE)
    after, _ = policy.compute_logprobs(batch, temperature=TEMPERATURE)
    assert float((after - before).abs().max()) > 1e-3  # the step moved the policy
    if engine is not None:  # not yet pushed: the engine still has the old weights
        assert float((engine_logprobs(engine, batch, TEMPERATURE) - before).abs().max()) <= TOL
    sync.push(version=2)
    assert _engine_vs_trainer(policy, engine, batch) <= TOL
    if engine is not None:
        assert engine.weight_version == 2
    assert 0 < live.peak <= stream.bucket_bytes + live.largest, (live.peak, stream.bucket_bytes, live.largest)
    assert stream.peak_bytes <= stream.bucket_bytes + live.largest


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    policy_dir = build_tiny_model(tmp_path_factory.mktemp("policy"), seed=0)
    engine_dir = build_tiny_model(tmp_path_factory.mktemp("engine"), seed=1)
    return str(policy_dir), str(engine_dir)


def test_tp2_policy_pushes_into_torch_engine_and_logprobs_match(model_dirs):
    run_distributed(_run, WORLD, *model_dirs)
