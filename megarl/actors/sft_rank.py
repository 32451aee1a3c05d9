"""One process of the `megarl sft` group: the policy (the same PolicyWorker, layout and
optimizer RL trains) with the supervised loss, and the fine-tuned model written as a model
checkpoint (megarl/checkpoint/model_checkpoint.py) that RL starts from with model.path; with
LoRA (actor.lora), the merged model, and the adapters as an HF PEFT adapter directory too.

Collective methods; the controller calls them through megarl/actors/clients.py ``SFTClient``.
"""

from __future__ import annotations

from megarl.actors.policy import PolicyWorker
from megarl.actors.trained_rank import TrainedRank
from megarl.algos.losses import SFTLossFn
from megarl.config.sections import MegaRLConfig
from megarl.data.batch import Batch, TokenRows
from megarl.megatron_runtime.offload import ModelStates


class SFTRank(TrainedRank):
    role = "policy"

    def __init__(self, cfg: MegaRLConfig, total_optimizer_steps: int) -> None:
        self.cfg = cfg
        assert cfg.model.path is not None  # SFT fine-tunes model.path (read before the ranks start)
        # No engine routes SFT's tokens: the routers route by themselves whatever actor.moe.routing_replay says.
        actor = cfg.actor.model_copy(update={"moe": cfg.actor.moe.model_copy(update={"routing_replay": "none"})})
        self.worker = PolicyWorker(cfg.model.path, actor, cfg.model.dtype, cfg.trainer.seed,
                                   total_optimizer_steps=total_optimizer_steps, layer_spec=cfg.model.layer_spec)  # fmt: skip
        self.info = self.worker.info
        self.loss_fn = SFTLossFn()

    def layout(self) -> dict[str, int]:
        return {"dp_size": self.info.dp_size}

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on ``batch`` (split over the DP ranks, micro-batched); metrics equal on every rank."""
        return self.worker.update(batch, self.loss_fn, mini_batch_size=len(batch), ppo_epochs=1, temperature=1.0,
                                  with_entropy=False)  # fmt: skip

    def compute_logprobs(self, batch: Batch) -> TokenRows | None:
        return self.worker.compute_logprobs(batch, 1.0)

    def save_model(self, weights_dir: str) -> None:
        """The current weights as a dist-checkpoint in ``weights_dir``; with LoRA the merged
        model (the adapters merged into the weights first), a plain model RL starts from."""
        from megarl.checkpoint.model_checkpoint import save_model_weights
        from megarl.models.lora import lora_of

        lora = lora_of(self.worker.model.core)
        if lora is not None and not lora.merged_in:
            lora.merge_into_base()
        save_model_weights(self.worker.model.core, weights_dir)

    def save_adapter(self, directory: str, base: str) -> None:
        """LoRA: the adapters as an HF PEFT adapter directory of the HF model ``base`` (gathered
        over TP and PP; rank 0 writes)."""
        from megarl.models.lora import lora_of, write_peft_adapter

        lora = lora_of(self.worker.model.core)
        assert lora is not None and self.cfg.actor.lora is not None
        tensors = lora.peft_tensors()
        if self.info.rank == 0:
            write_peft_adapter(directory, tensors, self.cfg.actor.lora, base)

    def verify_model(self, checkpoint_dir: str) -> int:
        """Load the written model checkpoint into a fresh model; every parameter must equal the trained one."""
        from megarl.actors.conversion_rank import verify_rebuilt

        return verify_rebuilt(self.worker.model, checkpoint_dir, self.cfg.actor, self.worker.dtype, self.cfg.trainer.seed)

    def profile_name(self) -> str:
        return f"sft_rank{self.info.rank}"

    def model_states(self) -> dict[str, ModelStates]:
        return {"policy": self.worker.trainer.states}
