"""One process of the policy group: the Megatron policy, the reference (same layout, same
process), on the first rank of each data-parallel replica the torch engine it feeds, and the
weight transport that carries the policy's weights to the engines.

The controller calls these methods on every rank through megarl/actors/clients.py, which
declares how each method's answers are collected. Methods are collective where the Megatron
work is. Runs under Ray (WorkerGroup), in-process (InProcessGroup) or plain torchrun.
"""

from __future__ import annotations

from typing import Any, TypedDict

import torch

from megarl.actors.policy import PolicyWorker
from megarl.actors.reference import ReferenceWorker
from megarl.actors.trained_rank import TrainedRank
from megarl.algos.losses import make_policy_loss_fn
from megarl.config.sections import MegaRLConfig
from megarl.data.batch import Batch, RoutingShare, TokenRows
from megarl.engines.base import GenerationResult, SamplingParams
from megarl.engines.seeds import shuffle_seed
from megarl.megatron_runtime.offload import ModelStates, storage_bytes
from megarl.models.lora import lora_of
from megarl.ray_cluster.address import node_address
from megarl.weight_sync.progress import PushProgress, push_group
from megarl.weight_sync.sglang_push import pause_mode
from megarl.weight_sync.transport_base import TRANSPORT_COLLECT
from megarl.weight_sync.transports import build_transport


class Layout(TypedDict):
    """What ``PolicyRank.layout`` answers (the controller's RankLayout)."""

    rank: int
    dp_rank: int
    dp_size: int
    leader: bool


class PolicyRank(TrainedRank):
    """Policy (+ reference, + torch engine on replica leaders, + weight transport) in one process."""

    role = "policy"

    def __init__(self, cfg: MegaRLConfig, total_optimizer_steps: int, weight_dir: str | None = None) -> None:
        """``weight_dir``: the disk transport's directory as the driver resolved it (a relative
        path means nothing to a process on another node, nor to an SGLang server)."""
        self.cfg = cfg
        path, dtype, seed = cfg.model.path, cfg.model.dtype, cfg.trainer.seed
        assert path is not None  # a run needs model.path (preflight refuses one without)
        spec = cfg.model.layer_spec
        self.worker = self.policy = PolicyWorker(path, cfg.actor, dtype, seed, total_optimizer_steps=total_optimizer_steps,
                                                 layer_spec=spec)  # fmt: skip
        self.info = self.policy.info
        self.reference = ReferenceWorker(path, cfg.actor, dtype, seed, layer_spec=spec) if cfg.reference_model else None
        self.engine = None
        # asynchronous: the torch engine is an actor of its own (megarl/engines/engine_actor.py), reloaded from disk
        if cfg.rollout.engine == "torch" and self.info.is_replica_leader and not cfg.asynchronous:
            from megarl.engines.torch_engine import TorchEngine

            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
            self.engine = TorchEngine(path, device=device, dtype=dtype, max_running_requests=cfg.rollout.max_running_requests)
        ws = cfg.rollout.weight_sync
        # Where this rank is in a push, for the deadline report.
        leader_collects = TRANSPORT_COLLECT[cfg.weight_transport] == "leader" and self.info.pp_size > 1
        collects = leader_collects and self.info.is_replica_leader
        self.push_progress = PushProgress(group=push_group(self.info.pp_rank, collects))
        self.transport = build_transport(cfg.weight_transport, self.policy, bucket_mb=ws.bucket_mb, overlap=ws.overlap,
                                         gather_mb=ws.gather_mb, local_engine=self.engine, disk_dir=weight_dir or cfg.weight_disk_dir,
                                         hf_dir=path, progress=self.push_progress, node_address=node_address,
                                         pause=pause_mode(cfg.asynchronous, cfg.partial_rollouts),
                                         lora_adapters=self._pushed_adapters(cfg))  # fmt: skip
        self.loss_fn = make_policy_loss_fn(cfg.algorithm, cfg.rollout.sampling.max_new_tokens)
        self._profiler: Any = None

    def _pushed_adapters(self, cfg: MegaRLConfig) -> Any:
        """The policy's adapters when pushes carry only them (``rollout.weight_sync.lora: adapter``), else None."""
        if cfg.actor.lora is None or cfg.rollout.weight_sync.lora != "adapter":
            return None
        return lora_of(self.policy.model.core)

    def layout(self) -> Layout:
        """This rank's coordinates (the controller maps engines to ranks with them)."""
        i = self.info
        return {"rank": i.rank, "dp_rank": i.dp_rank, "dp_size": i.dp_size, "leader": i.is_replica_leader}

    # ---- rollout (replica leaders) -------------------------------------------------------
    def generate(self, request: tuple[list[list[int]], SamplingParams, int] | None) -> list[GenerationResult] | None:
        """``request = (prompts, params, first_sample_index)`` on engine ranks, None elsewhere."""
        if request is None:
            return None
        if self.engine is None:
            raise RuntimeError(f"policy rank {self.info.rank} holds no engine but was sent prompts")
        prompts, params, first = request
        return self.engine.generate(prompts, params, first_sample_index=first)

    # ---- forward passes and the update (collective) ----------------------------------------
    def compute_logprobs(self, batch: Batch, temperature: float, routing: RoutingShare | None = None) -> TokenRows | None:
        """``routing``: this replica's rows of the step's routing, sent apart from ``batch`` (PolicyClient)."""
        return self.policy.compute_logprobs(batch.with_routing_share(routing), temperature)

    def compute_logprobs_and_reference(self, batch: Batch, temperature: float,
                                       routing: RoutingShare | None = None) -> TokenRows | None:  # fmt: skip
        """``logprobs`` and ``ref_logprobs`` in one pass: the reference runs on each of the policy's
        micro-batches (MegaRLConfig.reference_beside_policy)."""
        if self.reference is None:
            raise RuntimeError("the controller asked for reference log-probs beside the policy's, but this run has no reference model")
        return self.policy.compute_logprobs(batch.with_routing_share(routing), temperature, reference=self.reference)

    def compute_ref_logprobs(self, batch: Batch, temperature: float, routing: RoutingShare | None = None) -> TokenRows | None:
        """The reference model's log-probs; with LoRA, the policy's with its adapters off (the base model)."""
        batch = batch.with_routing_share(routing)
        if self.reference is not None:
            return self.reference.compute_logprobs(batch, temperature)
        lora = lora_of(self.policy.model.core)
        if lora is None or not self.cfg.reference_enabled:
            raise RuntimeError("the controller asked for reference log-probs, but this run has no reference")
        with lora.disabled():
            return self.policy.compute_logprobs(batch, temperature)

    def update(self, batch: Batch, temperature: float, step: int = 0, routing: RoutingShare | None = None) -> dict[str, float]:
        """The RL update of step ``step`` (its mini-batch shuffles' seed with actor.shuffle);
        ``routing`` as for :meth:`compute_logprobs` (the rows routing_split.py says)."""
        batch = batch.with_routing_share(routing)
        a = self.cfg.actor
        seed = shuffle_seed(self.cfg.trainer.seed, step) if a.shuffle else None
        reference = self.reference if self.cfg.reference_in_update else None  # else batch.ref_logprobs, if any
        return self.policy.update(batch, self.loss_fn, mini_batch_size=a.mini_batch_size, ppo_epochs=a.ppo_epochs,
                                  temperature=temperature, shuffle_seed=seed, reference=reference)  # fmt: skip

    # ---- weight sync (collective) -----------------------------------------------------------
    def connect_engines(self, endpoints: Any) -> None:
        """(Re)connect the transport: after the engines start and after each restart."""
        self.transport.connect(endpoints)

    def push_weights(self, version: int) -> dict[str, float]:
        """Push, then check what was exported against the parameters. Every rank meets in the
        verdict, also when its own push failed, so all ranks raise or none (no rank is left
        waiting in a collective the others never reach)."""
        self.push_progress.start(version)
        try:
            metrics = self.transport.push(version)
        except Exception as exc:
            cause = (str(exc).strip().splitlines() or [""])[-1][:400]
            self.push_progress.mark(version, f"failed ({type(exc).__name__}: {cause}), meeting the others in the export check")
            self.policy.export_check.verdict(version, failure=exc)
            raise
        self.push_progress.mark(version, "checking the export")
        self.policy.export_check.verdict(version)
        self.push_progress.mark(version, "done")
        return metrics

    def parameter_checksum(self) -> float:
        """Sum of |p| over the whole policy (for exact-resume checks), as the HF tensors it
        exports: each parameter counted once and without the vocabulary's padding rows, so the
        value depends neither on the data-parallel size nor on TP/PP (a resume may change them;
        up to fp64 rounding). A collective over the replica (expected_fingerprint)."""
        from megarl.weight_sync.export_check import expected_fingerprint

        stats = expected_fingerprint(self.policy.model.bridge, self.policy.model.core, collect="all")
        return float(sum(magnitude for _, magnitude in stats.values()))

    def profile_name(self) -> str:
        return f"policy_rank{self.info.rank}"

    # ---- memory ---------------------------------------------------------------------------
    def model_states(self) -> dict[str, ModelStates]:
        owners = {"policy": self.policy.trainer.states}
        return owners | ({"reference": self.reference.states} if self.reference is not None else {})

    def device_bytes(self) -> dict[str, int]:
        """As TrainedRank's, plus the torch engine's weights on replica leaders (they never move)."""
        engine = storage_bytes(self.engine.model.parameters()) if self.engine is not None else 0
        return super().device_bytes() | {"engine/weights": engine}

