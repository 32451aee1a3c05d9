"""One process of the policy group: the Megatron policy, the reference (same layout, same
process), and on the first rank of each data-parallel replica the torch engine it feeds.

The trainer calls these methods on every rank of the group (WorkerGroup.call); each method is
collective where the Megatron work is, and only rank 0 returns the (identical) results, so the
controller does not receive one copy per rank. Ranks that hold no engine answer ``generate``
with None. Runs under Ray (WorkerGroup) or plain torchrun.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megarl.actors.policy import PolicyWorker
from megarl.actors.reference import ReferenceWorker
from megarl.algos.losses import make_policy_loss_fn
from megarl.config.sections import MegaRLConfig
from megarl.data.batch import Batch
from megarl.rollout.engine import GenerationResult, SamplingParams
from megarl.rollout.logprob_check import (
    compare_logprobs,
    engine_logprobs,
    probe_batch,
    probe_sequences,
)
from megarl.rollout.weight_sync import HFWeightStream, InProcessWeightSync


class PolicyRank:
    """Policy (+ reference, + torch engine on replica leaders) in one process."""

    def __init__(self, cfg: MegaRLConfig, total_optimizer_steps: int) -> None:
        self.cfg = cfg
        path, dtype, seed = cfg.model.path, cfg.model.dtype, cfg.trainer.seed
        self.policy = PolicyWorker(path, cfg.actor, dtype, seed, total_optimizer_steps=total_optimizer_steps)
        self.info = self.policy.info
        self.reference = ReferenceWorker(path, cfg.actor, dtype, seed, offload=cfg.reference.offload) if cfg.reference_enabled else None
        self.engine = None
        if cfg.rollout.engine == "torch" and self.info.is_replica_leader:
            from megarl.rollout.torch_engine import TorchEngine

            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
            self.engine = TorchEngine(path, device=device, dtype=dtype, max_running_requests=cfg.rollout.max_running_requests)
        self.sync = InProcessWeightSync(HFWeightStream(self.policy.export_weights, cfg.rollout.weight_sync.bucket_mb))
        self.sync.connect([self.engine] if self.engine is not None else [])
        self.sglang_engines: list[Any] = []  # the SGLang engines this rank posts to (connect_sglang)
        self._gloo_groups: dict[tuple[int, ...], Any] = {}
        self.max_new_tokens = cfg.rollout.sampling.max_new_tokens
        self._profiler: Any = None
        self._probe: tuple[Batch, torch.Tensor, float] | None = None  # the check's trainer side

    @property
    def rank(self) -> int:
        return self.info.rank

    def layout(self) -> dict[str, int]:
        """This rank's coordinates (the controller maps engines to ranks with it)."""
        i = self.info
        return {"rank": i.rank, "dp_rank": i.dp_rank, "dp_size": i.dp_size, "leader": int(i.is_replica_leader)}

    # ---- rollout (replica leaders) -------------------------------------------------------
    def generate(self, request: tuple[list[list[int]], SamplingParams, int] | None) -> list[GenerationResult] | None:
        """``request = (prompts, params, first_sample_index)`` on engine ranks, None elsewhere."""
        if request is None:
            return None
        if self.engine is None:
            raise RuntimeError(f"rank {self.rank} holds no engine but was sent prompts")
        prompts, params, first = request
        offload = self.cfg.actor.offload and torch.cuda.is_available()
        if offload:  # colocated on one GPU: the policy's states make room for the KV cache
            self.policy.offload()
        try:
            return self.engine.generate(prompts, params, first_sample_index=first)
        finally:
            if offload:
                self.policy.onload()

    # ---- forward passes (collective) -------------------------------------------------------
    def compute_logprobs(self, batch: Batch, temperature: float, with_entropy: bool = False):
        out = self.policy.compute_logprobs(batch, temperature, with_entropy)
        return out if self.rank == 0 else None

    def compute_ref_logprobs(self, batch: Batch, temperature: float):
        assert self.reference is not None, "the controller asked for reference log-probs without a reference"
        logprobs, _ = self.reference.compute_logprobs(batch, temperature)
        return logprobs if self.rank == 0 else None

    def update(self, batch: Batch, temperature: float) -> dict[str, float] | None:
        loss_fn = make_policy_loss_fn(self.cfg.algorithm, self.max_new_tokens)
        metrics = self.policy.update(
            batch, loss_fn, mini_batch_size=self.cfg.actor.mini_batch_size, ppo_epochs=self.cfg.actor.ppo_epochs, temperature=temperature
        )
        return metrics if self.rank == 0 else None

    # ---- weight sync -----------------------------------------------------------------------
    def push_weights(self, version: int) -> dict[str, float] | None:
        metrics = self.sync.push(version)
        return metrics if self.rank == 0 else None

    def check_logprobs(self, temperature: float) -> dict[str, float] | None:
        """Engine vs trainer log-probs of fixed probe sequences (collective over the policy).

        Every rank that feeds engines compares each of them; raises LogprobMismatchError above
        rollout.weight_sync.max_logprob_diff. Rank 0 (always such a rank) returns the metrics
        (the worst engine's). SGLang scores prompts from unscaled logits, so with SGLang both
        sides are compared at temperature 1.0 whatever the sampling temperature.
        """
        self.probe_trainer_logprobs(temperature)
        return self.compare_probe_logprobs()

    def probe_trainer_logprobs(self, temperature: float) -> None:
        """The trainer's side of the check (collective): log-probs of the probe sequences."""
        if self.cfg.rollout.engine == "sglang":
            temperature = 1.0
        prompts, responses = probe_sequences(self.policy.model.vocab_size)
        batch = probe_batch(prompts, responses)
        trainer, _ = self.policy.compute_logprobs(batch, temperature)
        self._probe = (batch, trainer, temperature)

    def compare_probe_logprobs(self) -> dict[str, float] | None:
        """The engines' side: score the probes, compare with the stored trainer log-probs.

        Needs no policy memory, so it runs after a colocated hand-over offloaded the policy."""
        assert self._probe is not None, "probe_trainer_logprobs must run first"
        batch, trainer, temperature = self._probe
        self._probe = None
        scorers = [self.engine] if self.engine is not None else self.sglang_engines
        if not scorers:
            return None
        limit = self.cfg.rollout.weight_sync.max_logprob_diff
        results = [compare_logprobs(engine_logprobs(e, batch, temperature), trainer, batch.response_mask, limit) for e in scorers]
        metrics = max(results, key=lambda m: m["weight_sync/logprob_diff"])
        return metrics if self.rank == 0 else None

    # ---- SGLang engines (rollout.engine = sglang) -------------------------------------------
    def connect_sglang(self, engines: list[dict[str, Any]], transport: str, holders: list[list[int]]) -> None:
        """Point ``push_weights`` at SGLang servers (collective: every rank calls it, again
        after an engine restart). ``engines``: url / tp / max_running_requests of each.

        ``transport="tensor"`` (colocated): ``holders[k]`` are the policy ranks on engine k's
        GPUs in engine TP order; each serializes its own CUDA IPC copy, gathered on a gloo
        group to ``holders[k][0]``, which posts (SGLangTensorSync with PayloadGather).
        ``transport="distributed"`` (disaggregated): one NCCL group per pipeline stage, the
        stage's first rank (tp 0, dp 0) sends; rank 0 drives pause / flush / version checks.
        """
        from megarl.rollout_sglang.engine import SGLangEngine
        from megarl.rollout_sglang.transports import SGLangDistributedSync

        if isinstance(self.sync, SGLangDistributedSync):
            self.sync.close()  # the old groups (a restart rebuilds them)
        clients = [SGLangEngine(e["url"], tp=e["tp"], max_running_requests=e["max_running_requests"]) for e in engines]
        if transport == "tensor":
            self.sync, self.sglang_engines = self._tensor_sync(clients, holders)
        elif transport == "distributed":
            self.sync, self.sglang_engines = self._distributed_sync(clients)
        else:
            raise ValueError(f"connect_sglang: transport {transport!r} must be 'tensor' or 'distributed'")
        self.sync.connect(self.sglang_engines)

    def _gloo_group(self, ranks: list[int]) -> Any:
        """A gloo group over ``ranks`` (made once; every rank must ask for every group, in order)."""
        import torch.distributed as dist

        key = tuple(sorted(ranks))
        if key not in self._gloo_groups:
            self._gloo_groups[key] = dist.new_group(list(key), backend="gloo")
        return self._gloo_groups[key]

    def _tensor_sync(self, clients: list[Any], holders: list[list[int]]) -> tuple[Any, list[Any]]:
        from megarl.rollout_sglang.transports import SGLangTensorSync

        if len(holders) != len(clients):
            raise ValueError(f"connect_sglang: {len(holders)} holder lists for {len(clients)} engines")
        groups = [self._gloo_group(ranks) for ranks in holders]  # collective creation, all ranks
        stream = HFWeightStream(self.policy.export_weights, self.cfg.rollout.weight_sync.bucket_mb)
        for k, ranks in enumerate(holders):
            if self.rank in ranks:
                gather = _payload_gather(groups[k], ranks) if len(ranks) > 1 else None
                return SGLangTensorSync(stream, per_gpu=gather), [clients[k]] if self.rank == ranks[0] else []
        return SGLangTensorSync(stream), []  # on no engine's GPUs: export (collective) only

    def _distributed_sync(self, clients: list[Any]) -> tuple[Any, list[Any]]:
        import torch.distributed as dist

        from megarl.rollout_sglang.transports import SGLangDistributedSync, StageRole

        i = self.info
        model = self.policy.model
        bucket_mb = self.cfg.rollout.weight_sync.bucket_mb
        # Each stage exports only its own tensors (no cross-stage broadcast); its sender sends them.
        stream = HFWeightStream(lambda b: model.bridge.export_hf_weights(model.core, b, gather_pp=False), bucket_mb)
        sender = i.tp_rank == 0 and i.dp_rank == 0
        role = StageRole(pp_size=i.pp_size, stages=(i.pp_rank,), sender_stages=(i.pp_rank,) if sender else (),
                         coordinator=self.rank == 0)  # fmt: skip
        world = self._gloo_group(list(range(i.world_size)))
        sync = SGLangDistributedSync({i.pp_rank: stream}, role, master_address=_node_ip(),
                                     backend="nccl" if torch.cuda.is_available() else "gloo",
                                     barrier=lambda: dist.barrier(group=world))  # fmt: skip
        return sync, clients if sender or self.rank == 0 else []

    def offload_states(self) -> int | None:
        """Policy params, grads and optimizer state to host memory (colocated SGLang generates)."""
        moved = self.policy.offload()
        return moved if self.rank == 0 else None

    def onload_states(self) -> None:
        self.policy.onload()

    # ---- checkpoints, memory, profiling -----------------------------------------------------
    def save(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)  # dist-checkpointing needs the directory
        self.policy.save(Path(path))

    def load(self, path: str) -> None:
        self.policy.load(Path(path))

    def parameter_checksum(self) -> float | None:
        """Sum of |p| over this rank's shard, reduced over the group (for exact-resume checks)."""
        import torch.distributed as dist

        local = sum(float(p.detach().double().abs().sum()) for p in self.policy.model.core.parameters())
        total = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(total)
        return float(total) if self.rank == 0 else None

    def start_profile(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._profiler = profile(activities=activities, record_shapes=False)
        self._profiler.__enter__()

    def stop_profile(self, path: str) -> None:
        if self._profiler is None:
            return
        self._profiler.__exit__(None, None, None)
        target = Path(path) / f"policy_rank{self.rank}.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        self._profiler.export_chrome_trace(str(target))
        self._profiler = None


def _payload_gather(group: Any, ranks: list[int]) -> Any:
    """PayloadGather over ``group``: payloads in engine TP order (``ranks``' order) on ranks[0]."""
    import torch.distributed as dist

    from megarl.rollout_sglang.transports import PayloadGather

    me = dist.get_rank()
    order = sorted(ranks)  # a group's ranks are numbered in sorted global order

    def gather(payload: str) -> list[str] | None:
        out: list[Any] | None = [None] * len(ranks) if me == ranks[0] else None
        dist.gather_object(payload, out, dst=ranks[0], group=group)
        return None if out is None else [out[order.index(r)] for r in ranks]

    return PayloadGather(gather=gather, barrier=lambda: dist.barrier(group=group))


def _node_ip() -> str:
    """This node's address as the engines on other nodes reach it."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    import socket

    return socket.gethostbyname(socket.gethostname())
