"""Where one role's ranks sit: the planner's layout of a trained model (tp, pp, dp, and for a
mixture-of-experts model ep, etp) or of the rollout engines, over global GPU indices."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoleLayout:
    role: str  # policy | critic | rollout | reward_model | judge
    tp: int
    pp: int
    dp: int  # rollout: number of engines; judge: number of servers
    gpus: tuple[int, ...]  # global GPU (process) indices, rank order
    ep: int = 1  # expert parallelism (a trained mixture-of-experts model)
    etp: int = 1

    def coords(self, rank: int, num_experts: int = 0) -> str:
        """Megatron's default rank order: tp fastest, then dp, then pp; for a trained MoE model
        (``num_experts``), also the rank's ep rank and the experts it holds."""
        if self.role == "rollout":
            return f"engine {rank // self.tp} tp{rank % self.tp}"
        if self.role == "judge":  # the LLM judge's SGLang servers (dp of them)
            return f"server {rank // self.tp} tp{rank % self.tp}"
        if self.role == "reward_model":  # one actor per device, each holding the whole model
            return f"actor {rank}"
        tp_rank, dp_rank, pp_rank = rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)
        if not num_experts:
            return f"tp{tp_rank} pp{pp_rank} dp{dp_rank}"
        held = self.experts_held(rank, num_experts)
        return f"tp{tp_rank} pp{pp_rank} dp{dp_rank} ep{self.expert_rank(rank)} experts {held[0]}-{held[-1]}"

    @property
    def expert_dp(self) -> int:
        """The expert-data-parallel size: the ranks of a stage holding the same experts."""
        return self.tp * self.dp // (self.ep * self.etp)

    def expert_rank(self, rank: int) -> int:
        """The expert-parallel rank: Megatron orders a stage's ranks etp fastest, then ep, then expert dp."""
        return (rank % (self.tp * self.dp)) // self.etp % self.ep

    def experts_held(self, rank: int, num_experts: int) -> range:
        """The experts (of each MoE layer of its stage) that ``rank`` holds."""
        per = num_experts // self.ep
        return range(self.expert_rank(rank) * per, (self.expert_rank(rank) + 1) * per)
