"""One process of the critic group: the Megatron value model (its own layout and processes).

Called through megarl/actors/clients.py (CriticClient), like PolicyRank.
"""

from __future__ import annotations

from megarl.actors.critic import CriticWorker
from megarl.actors.trained_rank import TrainedRank
from megarl.algos.losses import make_value_loss_fn
from megarl.config.sections import MegaRLConfig
from megarl.data.batch import Batch, TokenRows
from megarl.engines.seeds import shuffle_seed
from megarl.megatron_runtime.offload import ModelStates


class CriticRank(TrainedRank):
    role = "critic"

    def __init__(self, cfg: MegaRLConfig, total_optimizer_steps: int) -> None:
        self.cfg = cfg
        path = cfg.critic.path or cfg.model.path
        assert path is not None  # a run needs model.path (preflight refuses one without)
        self.worker = CriticWorker(path, cfg.critic, cfg.model.dtype, cfg.trainer.seed, total_optimizer_steps=total_optimizer_steps,
                                   layer_spec=cfg.model.layer_spec)  # fmt: skip
        self.info = self.worker.info
        self.loss_fn = make_value_loss_fn(cfg.algorithm, cfg.rollout.sampling.max_new_tokens)

    def compute_values(self, batch: Batch) -> TokenRows | None:
        return self.worker.compute_values(batch)

    def update(self, batch: Batch, step: int = 0) -> dict[str, float]:
        """The value update of step ``step`` (its mini-batch shuffles' seed with critic.shuffle)."""
        c = self.cfg.critic
        seed = shuffle_seed(self.cfg.trainer.seed, step) if c.shuffle else None
        return self.worker.update(batch, self.loss_fn, mini_batch_size=c.mini_batch_size, ppo_epochs=c.ppo_epochs,
                                  shuffle_seed=seed)  # fmt: skip

    def profile_name(self) -> str:
        return f"critic_rank{self.info.rank}"

    def model_states(self) -> dict[str, ModelStates]:
        return {"critic": self.worker.trainer.states}
