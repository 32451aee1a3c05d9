"""The critic worker: the policy's backbone with a scalar value head, trained on a value loss.

Built from an HF causal-LM directory through the bridge with ``value_head=True``: the
transformer weights are loaded, the LM head is not, and a small freshly initialised
``[1, hidden]`` head gives one value per position. Same conventions as the policy (whole batch
in, each output rank's rows out; global loss normalisation).

Value alignment (verl's convention): the value of response token ``t`` is read at column
``P + t - 1`` of the batch's sequences, the position whose logits predict token ``t``, i.e. the
state before the token is generated. Values past each response's length are 0.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megarl.algos.losses import LossFn, ModelOutputs, loss_count
from megarl.config.train_sections import CriticConfig
from megarl.data.batch import Batch, TokenRows
from megarl.megatron_runtime.micro_batches import MicroBatch, MicroBatching
from megarl.megatron_runtime.model import MegatronModel, dtype_of
from megarl.megatron_runtime.training import TrainableModel, TrainedWorker


def _values(mb: MicroBatch, output: torch.Tensor) -> torch.Tensor:
    """Per-token values ``[b, R]`` (0 past each response) from the value head's output
    ``[1, n, 1]`` (the model only evaluates the head at the real response tokens, see
    megarl/megatron_runtime/model.py)."""
    return mb.to_rows(output.reshape(-1).float())  # [n] -> [b, R]


class CriticWorker(TrainedWorker):
    """Megatron value model: ``compute_values``, ``update``, ``save``/``load``, ``offload``/``onload``."""

    def __init__(
        self,
        model_path: str | Path,
        critic_cfg: CriticConfig,
        dtype: str | torch.dtype = "bfloat16",
        seed: int = 1,
        *,
        total_optimizer_steps: int | None = None,
        layer_spec: str = "local",
    ) -> None:
        self.cfg = critic_cfg
        self.dtype = dtype if isinstance(dtype, torch.dtype) else dtype_of(dtype)
        self.model = MegatronModel.build(str(model_path), critic_cfg, self.dtype, seed, value_head=True,
                                         layer_spec=layer_spec)  # fmt: skip
        self.trainer = TrainableModel(self.model, critic_cfg, self.dtype, total_optimizer_steps, role="critic")

    @property
    def info(self):
        return self.model.info

    def compute_values(self, batch: Batch) -> TokenRows | None:
        """``values [n, R]`` float32 of this rank's rows (``TokenRows``, on output ranks; None
        elsewhere; alignment: module docstring)."""
        return self.model.forward_tokens(batch, lambda mb, output: {"values": _values(mb, output)}, MicroBatching.forward_only(self.cfg))

    def update(
        self, batch: Batch, value_loss_fn: LossFn, *, mini_batch_size: int | None = None, ppo_epochs: int | None = None,
        shuffle_seed: int | None = None,
    ) -> dict[str, float]:
        """Train the value model; ``value_loss_fn`` gets ``ModelOutputs(logprobs=None, values)``."""

        def loss_head(mb: MicroBatch, output: torch.Tensor):
            outputs = ModelOutputs(logprobs=None, values=_values(mb, output))  # type: ignore[arg-type]
            return value_loss_fn(mb.batch, outputs)

        count = lambda mb: loss_count(value_loss_fn, mb.batch, values=True)  # noqa: E731
        return self.trainer.train(batch, loss_head, mini_batch_size=mini_batch_size, ppo_epochs=ppo_epochs,
                                  shuffle_seed=shuffle_seed, loss_count=count)  # fmt: skip

