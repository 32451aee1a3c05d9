"""Megatron policy at TP=2 -> torch engine on rank 0: log-probs agree before and after training.

Two gloo processes, one thread each. The engine starts from OTHER weights (same architecture),
so agreement after the push proves the push, not a shared checkpoint. The vocabulary (259) is
not divisible by 2, so the export's vocab-padding removal is exercised too.
"""

from __future__ import annotations

import weakref
from functools import partial

import pytest
from spawn import run_distributed

from megarl.models.tiny import build_tiny_model
from megarl.weight_sync.stream import MIB

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

    def __call__(self):
        for name, t in self.export_fn():
            nbytes = t.numel() * t.element_size()
            self.largest = max(self.largest, nbytes)
            if t.untyped_storage().data_ptr() not in self.param_ptrs:
                self.alive[id(t)] = nbytes
                weakref.finalize(t, self.alive.pop, id(t), None)
            self.peak = max(self.peak, sum(self.alive.values()))
            yield name, t
            del t


PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]]


def _engine_vs_trainer(policy, engine) -> float:
    """Max |engine - trainer| log-prob over responses rank 0's engine sampled (what the post-push
    check compares); every rank scores the same batch (the forward is collective)."""
    import torch.distributed as dist
    from actor_cases import gathered

    from megarl.engines.base import SamplingParams
    from megarl.rollout.batching import batch_from_generations

    box = [None]
    if engine is not None:
        params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=6, seed=3)
        box[0] = batch_from_generations(PROMPTS, engine.generate(PROMPTS, params), 1)
    dist.broadcast_object_list(box, src=0)
    batch = box[0]
    trainer = gathered(policy.compute_logprobs(batch, TEMPERATURE), batch)["logprobs"]
    return float((batch.rollout_logprobs - trainer).abs()[batch.response_mask.bool()].max())


def _run(rank: int, world_size: int, model_dir: str, engine_dir: str) -> None:
    from megarl.actors.policy import PolicyWorker
    from megarl.config.train_sections import ActorConfig, OptimizerConfig, ParallelConfig
    from megarl.engines.torch_engine import TorchEngine
    from megarl.weight_sync.stream import WeightStream
    from megarl.weight_sync.transports import InProcessTransport

    cfg = ActorConfig(
        parallel=ParallelConfig(tp=2), micro_batch_size=2,
        optimizer=OptimizerConfig(lr=1e-2, clip_grad=0.0),
    )  # fmt: skip
    policy = PolicyWorker(model_dir, cfg, dtype="float32", seed=1)
    engine = TorchEngine(engine_dir, dtype="float32") if rank == 0 else None
    # TP gathers in groups of a bucket (rollout.weight_sync.gather_mb), through a real push
    export = partial(policy.export_weights, gather_bytes=int(BUCKET_MB * MIB))
    live = _LiveBytes(export, policy.model.core.parameters())
    stream = WeightStream(live, bucket_mb=BUCKET_MB)
    transport = InProcessTransport(stream, [engine] if engine is not None else [])
    transport.connect(None)
    assert _engine_vs_trainer(policy, engine) > 0.1  # different weights before the push

    metrics = transport.push(version=1)
    assert metrics["weight_sync/bytes"] > 0 and metrics["weight_sync/gbps"] > 0
    assert _engine_vs_trainer(policy, engine) <= TOL
    if engine is not None:
        assert engine.weight_version == 1

    from megarl.rollout.batching import batch_from_generations

    batch = batch_from_generations(PROMPTS, [_fixed(i) for i in range(len(PROMPTS))], 1)
    policy.update(batch, _nll_loss, temperature=TEMPERATURE)
    assert _engine_vs_trainer(policy, engine) > 1e-3  # trained, not yet pushed: they differ
    transport.push(version=2)
    assert _engine_vs_trainer(policy, engine) <= TOL
    if engine is not None:
        assert engine.weight_version == 2
    # Double buffered (the stream's default, as the config's): the bucket being loaded and the one
    # being exported beside it, plus the tensor that did not fit. (What the stream holds; the
    # gather group being joined inside the export comes on top, and the planner counts it.)
    assert 0 < live.peak <= 2 * stream.bucket_bytes + live.largest, (live.peak, stream.bucket_bytes, live.largest)
    assert stream.peak_bytes <= 2 * stream.bucket_bytes + live.largest


def _fixed(prompt_index: int):
    """A fixed training sample per prompt (the same on every rank)."""
    from megarl.engines.base import GenerationResult

    return GenerationResult(prompt_index, [20 + prompt_index, 21, 22, 23], [0.0] * 4, "length")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    policy_dir = build_tiny_model(tmp_path_factory.mktemp("policy"), seed=0)
    engine_dir = build_tiny_model(tmp_path_factory.mktemp("engine"), seed=1)
    return str(policy_dir), str(engine_dir)


def test_tp2_policy_pushes_into_torch_engine_and_logprobs_match(model_dirs):
    run_distributed(_run, WORLD, *model_dirs)
