"""The reference-policy worker: a frozen Megatron model that only computes log-probs.

Lives in the same processes as the policy, with the same layout (Megatron's parallel state is
process-global; building it second reuses the policy's groups and refuses a different layout).
No DDP, no optimizer, no gradients. Its weights leave the device only when the memory hand-over
says so (``reference.offload``: everywhere but in ``reference_forward``, see
megarl/memory/residency.py); it never moves itself. Same conventions as the policy: whole
batch in, each output rank's rows out.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megarl.config.train_sections import ActorConfig
from megarl.data.batch import Batch, TokenRows
from megarl.megatron_runtime.micro_batches import MicroBatch
from megarl.megatron_runtime.model import (
    MegatronModel,
    dtype_of,
    response_logprobs,
    token_logprob_head,
)
from megarl.megatron_runtime.offload import ModelStates, model_weights


class ReferenceWorker:
    """Frozen policy copy: ``compute_logprobs`` only."""

    def __init__(
        self,
        model_path: str | Path,
        actor_cfg: ActorConfig,
        dtype: str | torch.dtype = "bfloat16",
        seed: int = 1,
        *,
        layer_spec: str = "local",
    ) -> None:
        """``actor_cfg`` gives the layout and micro-batching (the policy's); ``layer_spec`` is
        ``model.layer_spec``."""
        self.cfg = actor_cfg
        self.dtype = dtype if isinstance(dtype, torch.dtype) else dtype_of(dtype)
        self.model = MegatronModel.build(str(model_path), actor_cfg, self.dtype, seed, layer_spec=layer_spec)
        for p in self.model.module.parameters():
            p.requires_grad_(False)
        self.model.module.eval()
        # Frozen: one host copy, made at the first offload; later offloads only free the device memory.
        self.states = ModelStates(self.model.info.device, {"weights": lambda: model_weights(self.model.module)},
                                  copied=("weights",), frozen=("weights",))  # fmt: skip

    @property
    def info(self):
        return self.model.info

    def compute_logprobs(self, batch: Batch, temperature: float = 1.0, with_entropy: bool = False) -> TokenRows | None:
        """Like the policy's: this rank's rows (``TokenRows``) on output ranks, None elsewhere."""
        if self.states.offloaded():
            raise RuntimeError("the reference's weights are off the device; the memory hand-over brings them back "
                               "for reference_forward (megarl/memory/handover.py)")  # fmt: skip
        return response_logprobs(self.model, self.cfg, batch, temperature, with_entropy)

    def micro_batch_logprobs(self, mb: MicroBatch, temperature: float) -> torch.Tensor:
        """``[b, R]`` log-probs of one micro-batch the policy's update packed (its rows' order;
        0 past each response's length): the update's own pass computes the reference's too
        (MegaRLConfig.reference_in_update)."""
        if self.states.offloaded():
            raise RuntimeError("the reference's weights are off the device; a reference computed in the update "
                               "stays on it (reference.offload: false)")  # fmt: skip
        return self.model.forward_micro_batch(mb, token_logprob_head(self.model, temperature, False))["logprobs"]
