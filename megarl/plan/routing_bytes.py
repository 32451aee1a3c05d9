"""Routing replay's bytes per step (actor.moe.routing_replay): the engine's expert ids, and with
``experts_and_weights`` its routing weights, of every token of the step's samples, ``[B, P+R, L, k]``
with B = prompts_per_step x n, P + R = max_prompt_length + max_new_tokens (full-length samples: an
upper bound per step), L the MoE layers, k the router's top-k.

Ids take a byte up to 255 experts, two beyond (megarl/data/routing_ids.py); weights the engine's
dtype (model.dtype). Where they sit, at least: the controller holds the step's Batch (on the head
node, node 0); each policy rank is sent only the rows its data-parallel replica runs
(megarl/actors/routing_split.py): of a forward B / dp rows, of an update its share of the whole
batch (the replay metrics' forwards) and of each epoch's mini-batches, up to (1 + ppo_epochs)
x B / dp rows, and Ray's object store on the head node keeps a copy of what it sends. SGLang
sends each sample's ids as base64 of int32 over all ``num_layers`` (dense ones too); the
controller decodes them reply by reply: counted as traffic per step, not as held memory. The
planner imports no torch: the dtype rule is repeated here, and a test compares the two."""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config.architectures import ArchSpec
from megarl.config.sections import MegaRLConfig
from megarl.plan.gpu_memory import DTYPE_BYTES


@dataclass(frozen=True)
class RoutingBytes:
    """One step's routing: its shape, and bytes by where they are."""

    shape: tuple[int, int, int, int]  # [B, P+R, L, k]
    id_bytes: int  # per id: 1 (uint8) or 2 (int16)
    weight_bytes: int  # per weight; 0 when weights are not replayed
    sglang_base64: float  # bytes of base64 the controller decodes a step (SGLang), 0 with the torch engine
    dp: int  # the policy's data-parallel replicas
    epochs: int  # actor.ppo_epochs

    @property
    def step(self) -> float:
        """Bytes of one step's ids and weights (one copy)."""
        b, t, layers, k = self.shape
        return float(b * t * layers * k * (self.id_bytes + self.weight_bytes))

    @property
    def controller(self) -> float:
        """Held on the head node by the controller: its Batch and the object store's copy of the
        shares it sends to the replicas in an update (each once, whatever its ranks)."""
        return self.step * (1 + min(1 + self.epochs, self.dp))

    @property
    def per_policy_rank(self) -> float:
        """Held by a policy rank while an update runs: its replica's share (module docstring)."""
        return self.step * min(1.0, (1 + self.epochs) / self.dp)


def routing_bytes(cfg: MegaRLConfig, arch: ArchSpec, dp: int) -> RoutingBytes | None:
    """The step's routing replay bytes with the policy over ``dp`` data-parallel replicas, None
    when the run replays none (a dense model, or mode none)."""
    mode = cfg.actor.moe.routing_replay
    if mode == "none" or not arch.num_experts:
        return None
    samples = cfg.data.prompts_per_step * cfg.rollout.n
    tokens = cfg.data.max_prompt_length + cfg.rollout.sampling.max_new_tokens
    shape = (samples, tokens, arch.num_moe_layers, arch.experts_per_token)
    id_bytes = 1 if arch.num_experts < 256 else 2  # 255 is uint8's "not routed" mark
    weight_bytes = DTYPE_BYTES[cfg.model.dtype] if mode == "experts_and_weights" else 0
    base64 = 0.0
    if cfg.rollout.engine == "sglang":  # int32 per id over every layer, tokens - 1 rows, 4/3 for base64
        base64 = samples * (tokens - 1) * arch.num_layers * arch.experts_per_token * 4 * 4 / 3
    return RoutingBytes(shape, id_bytes, weight_bytes, base64, dp, cfg.actor.ppo_epochs)


def routing_text(r: RoutingBytes) -> str:
    """The plan's line: ``ids uint8 [2048 x 4096 x 94 x 8] 6.3 GB a step at full length:
    controller 18.9 GB (...), each policy rank 0.8 GB (...); SGLang's base64 ... 33.6 GB a step``."""
    gb = lambda x: f"{x / 1e9:.1f} GB"  # noqa: E731
    kinds = "ids " + ("uint8" if r.id_bytes == 1 else "int16") + (f" + weights {r.weight_bytes} B" if r.weight_bytes else "")
    text = (f"{kinds} [{' x '.join(map(str, r.shape))}] {gb(r.step)} a step at full length: controller {gb(r.controller)} "
            f"(node 0: its Batch and the object store's copy of the replicas' shares), each policy rank at most "
            f"{gb(r.per_policy_rank)} (its data-parallel replica's rows)")  # fmt: skip
    if r.sglang_base64:
        text += f"; SGLang's base64 of int32 ids decoded on the controller {gb(r.sglang_base64)} a step"
    return text
