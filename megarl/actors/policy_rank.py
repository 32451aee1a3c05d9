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
from megarl.rollout.logprob_check import compare_logprobs, engine_logprobs, probe_batch, probe_sequences
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
        self.max_new_tokens = cfg.rollout.sampling.max_new_tokens
        self._profiler: Any = None

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

    def update(self, batch: Batch, temperature: float, kl_coef: float | None = None) -> dict[str, float] | None:
        loss_fn = make_policy_loss_fn(self.cfg.algorithm, self.max_new_tokens, kl_coef)
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

        Every engine rank compares its own engine; raises LogprobMismatchError above
        rollout.weight_sync.max_logprob_diff. Rank 0 (always an engine rank) returns the metrics.
        """
        prompts, responses = probe_sequences(self.policy.model.vocab_size)
        batch = probe_batch(prompts, responses)
        trainer, _ = self.policy.compute_logprobs(batch, temperature)
        if self.engine is None:
            return None
        engine = engine_logprobs(self.engine, batch, temperature)
        metrics = compare_logprobs(engine, trainer, batch.response_mask, self.cfg.rollout.weight_sync.max_logprob_diff)
        return metrics if self.rank == 0 else None

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

