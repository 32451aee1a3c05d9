"""One process of the critic group: the Megatron value model (its own layout and processes).

Like PolicyRank, every method is collective and only rank 0 returns results.
"""

from __future__ import annotations

from pathlib import Path

from megarl.actors.critic import CriticWorker
from megarl.algos.losses import make_value_loss_fn
from megarl.config.sections import MegaRLConfig
from megarl.data.batch import Batch


class CriticRank:
    def __init__(self, cfg: MegaRLConfig, total_optimizer_steps: int) -> None:
        self.cfg = cfg
        path = cfg.critic.path or cfg.model.path
        self.critic = CriticWorker(path, cfg.critic, cfg.model.dtype, cfg.trainer.seed, total_optimizer_steps=total_optimizer_steps)
        self.rank = self.critic.info.rank
        self.loss_fn = make_value_loss_fn(cfg.algorithm, cfg.rollout.sampling.max_new_tokens)

    def compute_values(self, batch: Batch):
        values = self.critic.compute_values(batch)
        return values if self.rank == 0 else None

    def update(self, batch: Batch) -> dict[str, float] | None:
        metrics = self.critic.update(batch, self.loss_fn, mini_batch_size=self.cfg.critic.mini_batch_size, ppo_epochs=self.cfg.critic.ppo_epochs)
        return metrics if self.rank == 0 else None

    def offload_states(self) -> int | None:
        """Critic params, grads and optimizer state to host memory (while colocated SGLang generates)."""
        moved = self.critic.offload()
        return moved if self.rank == 0 else None

    def onload_states(self) -> None:
        self.critic.onload()

    def save(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)  # dist-checkpointing needs the directory
        self.critic.save(Path(path))

    def load(self, path: str) -> None:
        self.critic.load(Path(path))
