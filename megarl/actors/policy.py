"""The policy (actor) worker: a Megatron model that computes log-probs and trains on a loss.

A plain class that runs in every process of the policy group, under torchrun or inside a Ray
actor (the Ray glue lives in megarl/ray_cluster/). Every method is collective: all ranks of
the group call it with the same arguments.

Conventions (see megarl/megatron_runtime/model.py for the details):

- Every rank is given the WHOLE batch; each DP replica takes a token-balanced share by index;
  the replica's output rank returns the rows it computed (``TokenRows``), the others None.
- Log-probs are ``log_softmax(logits / temperature)`` of the response tokens, from the logits at
  column ``P + t - 1`` of the batch's sequences (the position that predicts token t), computed
  vocab-parallel without gathering the vocabulary; 0 past each response's length.
- ``update`` normalises the loss globally (sum over micro-batches and DP ranks, divided once by
  the loss function's total count).

The reference worker (megarl/actors/reference.py) can live in the same processes: both go
through the same process-global Megatron parallel state.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from megarl.actors.reference import ReferenceWorker
from megarl.algos.losses import LossFn, ModelOutputs, loss_count
from megarl.config.train_sections import ActorConfig
from megarl.data.batch import Batch, TokenRows
from megarl.megatron_runtime.micro_batches import MicroBatch, MicroBatching
from megarl.megatron_runtime.model import (
    MegatronModel,
    dtype_of,
    response_logprobs,
    token_logprob_head,
)
from megarl.megatron_runtime.routing_replay import replay_metrics
from megarl.megatron_runtime.training import TrainableModel, TrainedWorker
from megarl.parallel.stage_collection import Collect
from megarl.weight_sync.export_check import ExportCheck

# The replay metrics cost two extra forwards: measured on the first update with the engine's
# routing, then every this many.
ROUTING_METRICS_EVERY = 10


def lora_base_identity(model: MegatronModel, model_path: str | Path) -> dict[str, object]:
    """What a LoRA checkpoint records of its base model (``lora_base.json``) and a resume or an
    export checks: its path and (sum, sum of |x|) over the base's HF tensors with the adapters
    off, the same at any layout up to fp64 rounding (a collective over the replica), and its
    weight files' fingerprint, which the plan checks before a resume starts anything."""
    from megarl.models.lora import lora_of
    from megarl.models.weight_files import weights_fingerprint
    from megarl.weight_sync.export_check import expected_fingerprint

    lora = lora_of(model.core)
    assert lora is not None
    with lora.disabled():
        stats = expected_fingerprint(model.bridge, model.core, collect="all").values()
    # files: what `megarl plan` compares before Ray starts (the base's weight files' names, sizes
    # and first and last MiB: a few MiB read; megarl/plan/resume_checks.py)
    return {"path": str(Path(model_path).resolve()), "fingerprint": [sum(s for s, _ in stats), sum(a for _, a in stats)],
            "files": [list(f) for f in weights_fingerprint(Path(model_path))]}  # fmt: skip


def _counted_rows(rows: Batch, reference: ReferenceWorker | None) -> Batch:
    """``rows`` as the loss count sees them: with the reference computed in the update, zero
    reference log-probs (the count depends on the rows alone: LossFn contract)."""
    if reference is None:
        return rows
    return rows.replace(ref_logprobs=torch.zeros(rows.response_mask.shape, dtype=torch.float32, device=rows.response_mask.device))


class PolicyWorker(TrainedWorker):
    """Megatron policy: ``compute_logprobs``, ``update``, ``export_weights``, ``save``/``load``,
    ``offload``/``onload``."""

    def __init__(
        self,
        model_path: str | Path,
        actor_cfg: ActorConfig,
        dtype: str | torch.dtype = "bfloat16",
        seed: int = 1,
        *,
        total_optimizer_steps: int | None = None,
        layer_spec: str = "local",
    ) -> None:
        """Build this rank's shard from the HF directory ``model_path``, wrap it in DDP and make
        the optimizer. ``total_optimizer_steps`` is the decay horizon of a linear/cosine schedule;
        ``layer_spec`` is ``model.layer_spec``."""
        self.cfg = actor_cfg
        self.dtype = dtype if isinstance(dtype, torch.dtype) else dtype_of(dtype)
        self.model = MegatronModel.build(str(model_path), actor_cfg, self.dtype, seed, layer_spec=layer_spec)
        self.trainer = TrainableModel(self.model, actor_cfg, self.dtype, total_optimizer_steps, role="actor")
        # Each push's export against the parameters (the weight stream observes, push_weights judges).
        self.export_check = ExportCheck(self.model.bridge, self.model.core)
        if actor_cfg.lora is not None:  # what a checkpoint of the adapters must be resumed on
            self.trainer.base_identity = lora_base_identity(self.model, model_path)
        self._routed_updates = 0  # updates of batches with the engine's routing (gates the replay metrics)

    @property
    def info(self):
        """This rank's place in the layout (``megarl.parallel.groups.ParallelInfo``)."""
        return self.model.info

    def compute_logprobs(self, batch: Batch, temperature: float = 1.0, with_entropy: bool = False,
                         reference: ReferenceWorker | None = None) -> TokenRows | None:  # fmt: skip
        """``logprobs`` (and ``entropy``) ``[n, R]`` float32 of this rank's rows (``TokenRows``,
        on output ranks; None elsewhere). With ``reference``, its ``ref_logprobs`` too, computed
        on each of this pass's micro-batches (the values its own pass gives)."""
        if reference is None:
            return response_logprobs(self.model, self.cfg, batch, temperature, with_entropy)
        head = token_logprob_head(self.model, temperature, with_entropy)

        def both(mb: MicroBatch, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
            return head(mb, hidden) | {"ref_logprobs": reference.micro_batch_logprobs(mb, temperature)}

        return self.model.forward_tokens(batch, both, MicroBatching.forward_only(self.cfg))

    def _replay_metrics(self, batch: Batch, temperature: float) -> dict[str, float]:
        """With routing replay, what it changes (``moe/...``, megarl/megatron_runtime/routing_replay.py):
        two extra forwards, with and without replay, before the update moves the weights, on the
        first update whose batch carries the engine's routing and every ``ROUTING_METRICS_EVERY``-th
        after. Measured here, not in the old-log-prob pass, which an on-policy step skips."""
        routing = self.model.routing
        if routing is None or batch.routed_experts is None or batch.rollout_logprobs is None:
            return {}
        self._routed_updates += 1
        if (self._routed_updates - 1) % ROUTING_METRICS_EVERY:
            return {}
        forward = lambda: response_logprobs(self.model, self.cfg, batch, temperature, False)  # noqa: E731
        return replay_metrics(routing, batch, forward(), forward, self.info.device)

    def update(
        self,
        batch: Batch,
        loss_fn: LossFn,
        *,
        mini_batch_size: int | None = None,
        ppo_epochs: int | None = None,
        temperature: float = 1.0,
        with_entropy: bool = True,
        shuffle_seed: int | None = None,
        reference: ReferenceWorker | None = None,
    ) -> dict[str, float]:
        """Train on ``batch`` with ``loss_fn`` (mini-batch / epoch defaults from the config).

        ``loss_fn`` sees each micro-batch's rows and ``ModelOutputs(logprobs, entropy)`` at
        ``temperature``; ``shuffle_seed`` permutes the rows each epoch (None: in order). With
        ``reference``, each micro-batch's rows carry its ``ref_logprobs``, computed on that very
        micro-batch (no pass of their own; MegaRLConfig.reference_in_update). Returns metrics equal on every rank: the loss function's metrics and
        ``loss`` as global sum/count, ``grad_norm``, ``lr``, ``optimizer_steps``, ``skipped_steps``.
        """
        head = token_logprob_head(self.model, temperature, with_entropy)

        def loss_head(mb: MicroBatch, logits: torch.Tensor):
            out = head(mb, logits)
            rows = mb.batch if reference is None else mb.batch.replace(ref_logprobs=reference.micro_batch_logprobs(mb, temperature))
            return loss_fn(rows, ModelOutputs(logprobs=out["logprobs"], entropy=out.get("entropy")))

        if self.model.routing is not None and batch.routed_experts is None:
            raise ValueError(f"actor.moe.routing_replay is {self.cfg.moe.routing_replay}, and the step's samples carry no "
                             "expert routing: the generate function (rollout.generate_function) must pass the step's "
                             "SamplingParams, whose return_routing asks the engines for it, as the default one does; or "
                             "set actor.moe.routing_replay: none")  # fmt: skip
        replay = self._replay_metrics(batch, temperature)
        count = lambda mb: loss_count(loss_fn, _counted_rows(mb.batch, reference), entropy=with_entropy)  # noqa: E731
        return self.trainer.train(batch, loss_head, mini_batch_size=mini_batch_size, ppo_epochs=ppo_epochs,
                                  shuffle_seed=shuffle_seed, loss_count=count) | replay  # fmt: skip

    def export_weights(self, *, gather_bytes: int, collect: Collect = "all") -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors, one at a time (collective; see the bridge). ``gather_bytes``:
        the most full bytes one TP all-gather collects; ``collect``: which ranks receive the other
        pipeline stages' tensors (megarl/parallel/stage_collection.py)."""
        return self.model.bridge.export_hf_tensors(self.model.core, gather_bytes=gather_bytes, collect=collect)
