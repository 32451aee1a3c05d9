"""The reference-policy worker: a frozen Megatron model that only computes log-probs.

Lives in the same processes as the policy, with the same layout (Megatron's parallel state is
process-global; building it second reuses the policy's groups and refuses a different layout).
No DDP, no optimizer, no gradients. With ``offload=True`` its weights stay in host memory
between uses and come to the device only inside :meth:`compute_logprobs` (CUDA only; on CPU
there is nothing to move). Same conventions as the policy: whole batch in, full ``[B, R]`` out
on every rank.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megarl.actors.megatron_runtime.model import MegatronModel, dtype_of, response_logprobs
from megarl.actors.megatron_runtime.offload import StorageOffloader, model_tensors, on_device
from megarl.config.sections import ActorConfig
from megarl.data.batch import Batch


class ReferenceWorker:
    """Frozen policy copy: ``compute_logprobs`` only."""

    def __init__(
        self,
        model_path: str | Path,
        actor_cfg: ActorConfig,
        dtype: str | torch.dtype = "bfloat16",
        seed: int = 1,
        *,
        offload: bool = False,
    ) -> None:
        """``actor_cfg`` gives the layout and micro-batching (the policy's); ``offload`` keeps the
        weights on the host between calls."""
        self.cfg = actor_cfg
        self.dtype = dtype if isinstance(dtype, torch.dtype) else dtype_of(dtype)
        self.model = MegatronModel.build(str(model_path), actor_cfg, self.dtype, seed)
        for p in self.model.module.parameters():
            p.requires_grad_(False)
        self.model.module.eval()
        self.offload_between_uses = offload
        self._offloader = StorageOffloader()
        if offload:
            self.offload()

    @property
    def info(self):
        return self.model.info

    def compute_logprobs(
        self, batch: Batch, temperature: float = 1.0, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logprobs [B, R], entropy [B, R] | None)`` float32 on CPU, on every rank."""
        self.onload()
        try:
            return response_logprobs(self.model, self.cfg, batch, temperature, with_entropy)
        finally:
            if self.offload_between_uses:
                self.offload()

    def offload(self) -> int:
        """Weights to host memory (CUDA; a no-op on CPU); returns the bytes moved."""
        device = self.model.info.device
        if device.type == "cpu" or self._offloader.offloaded:
            return 0
        return self._offloader.offload(on_device(model_tensors(self.model.module), device))

    def onload(self) -> None:
        self._offloader.onload()
