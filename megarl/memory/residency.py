"""What lives on the devices in each phase of the RL step: the residency table (torch-free).

One table, two readers: the planner sums the bytes of the resident states of every phase
(megarl/plan/planner.py, bytes per state from megarl/plan/gpu_memory.py), and the memory
hand-over (megarl/memory/handover.py) moves exactly the states that differ between the phase
it leaves and the phase it enters. Nothing else decides what is on a device.

States (``owner/what``):

- ``policy/weights | grads | optimizer``, ``critic/...``: a trained model's parameters, its
  fp32 gradient buffer, and its optimizer state (fp32 main params where the weights are not
  fp32, Adam's moments);
- ``reference/weights``: the frozen reference (in the policy's processes); with LoRA
  (``actor.lora``) there is none: ``reference_forward`` is the policy's own forward with its
  adapters off, and works with the policy's weights;
- ``engine/weights | kv_cache | cuda_graph``: the rollout engine's (SGLang's memory tags; the
  torch engine has weights and a KV cache that lives only while it generates);
- ``reward_model/weights``: a colocated reward model's (``reward.model.placement: colocated``:
  its actors share the training devices, megarl/rollout/reward_model_role.py).

Phases: ``start`` (as built), ``launch`` (colocated SGLang servers starting or restarting),
the phases of one step (``generate``, ``reward`` (with a colocated reward model only), ``policy_forward``, ``reference_forward``,
``critic_forward``, ``critic_update``, ``policy_update``, ``weight_push``) and ``checkpoint``
(save, load, the parameter checksum); `megarl sft` has a table of its own (``start``, then
``export``: :func:`sft_residency`). ReMax's baseline, validation and the post-push check
generate in ``generate``; the check's trainer side and the old log-probs are
``policy_forward``.

The rules:

1. A trained model without its offload flag (``actor.offload``, ``critic.offload``) keeps
   every state on its devices in every phase (except ``launch``). With the flag, it keeps only
   what the phase works with (:data:`NEEDS`): weights for its forward passes and the push,
   everything for its update, weights and optimizer state for checkpoints. Gradients are
   stale after ``optimizer.step()``: they are freed, not copied, and come back zeroed.
2. The reference with ``reference.offload`` is on the device only in ``reference_forward``.
3. Colocated SGLang releases its KV cache and CUDA graphs outside ``generate``, and its weights
   only for the updates and checkpoints (the heavy phases); ``weight_push`` resumes them and
   the push refills them. A generation that follows a weights release without SGLang's CPU
   copy (``rollout.weights_cpu_backup``) is preceded by a re-push of the last version.
   Keeping the weights through the forward passes is what lets the post-push check, ReMax's
   baseline and validation generate again without a re-push.
4. ``launch`` (colocated SGLang only; elsewhere a launch moves nothing): nothing of the trained models is on the GPUs, whatever the
   flags, because SGLang sizes its KV cache from the free memory it sees when it starts;
   right after, the servers release everything and the trained models come back.
5. A colocated reward model is on the devices in ``reward`` only (the step's scoring, after
   ``generate``): it is loaded on the host and comes to the devices to score. In ``reward`` the
   other states are kept as in a forward phase: offloaded models keep nothing, colocated SGLang
   its weights.
6. The torch engine keeps its weights in the policy's replica leaders all the time; its KV
   cache exists while it generates. Disaggregated SGLang engines keep everything on their
   own GPUs: nothing of theirs moves, and they share no device with the trained models.

The offload flags are honoured for every placement and engine: besides making room for the
engines, an offloaded model leaves room for the other models' phases (the critic for the
policy's update, the policy for the critic's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The states of a trained model (policy, critic) that can leave the device and come back.
TRAINED_STATES = ("weights", "grads", "optimizer")
ENGINE_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's memory tags
POLICY, CRITIC, REFERENCE, ENGINE = "policy", "critic", "reference", "engine"
REWARD_MODEL = "reward_model"  # a colocated reward model (rule 5)

START, LAUNCH, GENERATE = "start", "launch", "generate"
REWARD = "reward"  # the step's scoring, after generate (in the table only when it moves something)
POLICY_FORWARD, REFERENCE_FORWARD, CRITIC_FORWARD = "policy_forward", "reference_forward", "critic_forward"
CRITIC_UPDATE, POLICY_UPDATE, WEIGHT_PUSH, CHECKPOINT = "critic_update", "policy_update", "weight_push", "checkpoint"
STEP_PHASES = (GENERATE, REWARD, POLICY_FORWARD, REFERENCE_FORWARD, CRITIC_FORWARD, CRITIC_UPDATE, POLICY_UPDATE, WEIGHT_PUSH)
PHASES = (START, LAUNCH, *STEP_PHASES, CHECKPOINT)
# `megarl sft`'s last phase: the trained model written out and loaded back beside itself to verify.
EXPORT = "export"
# Phases whose working memory includes the engine's (the generation-side peak).
GENERATION_PHASES = (LAUNCH, GENERATE)


def states_of(owner: str) -> tuple[str, ...]:
    """The table's states of one owner (policy, critic, reference, engine)."""
    if owner in (REFERENCE, REWARD_MODEL):
        return (f"{owner}/weights",)
    whats = ENGINE_TAGS if owner == ENGINE else TRAINED_STATES
    return tuple(f"{owner}/{w}" for w in whats)


def owner_of(state: str) -> str:
    return state.split("/", 1)[0]


def _all(*owners: str) -> frozenset[str]:
    return frozenset(s for o in owners for s in states_of(o))


# What each phase works with: an offloaded model keeps exactly these of its states (rule 1, 2).
NEEDS: Mapping[str, frozenset[str]] = {
    START: _all(POLICY, CRITIC, REFERENCE),  # everything is built on the device
    LAUNCH: frozenset(),
    GENERATE: frozenset(),
    REWARD: frozenset({f"{REWARD_MODEL}/weights"}),
    POLICY_FORWARD: frozenset({f"{POLICY}/weights"}),
    REFERENCE_FORWARD: frozenset({f"{REFERENCE}/weights"}),
    CRITIC_FORWARD: frozenset({f"{CRITIC}/weights"}),
    CRITIC_UPDATE: _all(CRITIC),
    POLICY_UPDATE: _all(POLICY),
    WEIGHT_PUSH: frozenset({f"{POLICY}/weights"}),
    CHECKPOINT: frozenset({f"{POLICY}/weights", f"{POLICY}/optimizer", f"{CRITIC}/weights", f"{CRITIC}/optimizer"}),
}

# Colocated SGLang (rule 3): where its tags are resumed.
_SGLANG_COLOCATED: Mapping[str, frozenset[str]] = {
    START: frozenset(),  # the servers released everything after their launch
    LAUNCH: _all(ENGINE),
    GENERATE: _all(ENGINE),
    REWARD: frozenset({f"{ENGINE}/weights"}),
    POLICY_FORWARD: frozenset({f"{ENGINE}/weights"}),
    REFERENCE_FORWARD: frozenset({f"{ENGINE}/weights"}),
    CRITIC_FORWARD: frozenset({f"{ENGINE}/weights"}),
    CRITIC_UPDATE: frozenset(),
    POLICY_UPDATE: frozenset(),
    WEIGHT_PUSH: frozenset({f"{ENGINE}/weights"}),
    CHECKPOINT: frozenset(),
}


@dataclass(frozen=True)
class Residency:
    """The table of one run: ``rows[phase]`` = the states resident in that phase."""

    placement: str  # colocated | disaggregated
    engine: str  # sglang | torch
    models: tuple[str, ...]  # the trained / frozen models of the run: policy [, critic] [, reference] [, reward_model]
    offloaded: frozenset[str]  # the models whose offload flag is on
    weights_cpu_backup: bool  # SGLang keeps a host copy of released weights
    rows: Mapping[str, frozenset[str]]
    policy_is_reference: bool = False  # reference_forward runs the policy with its adapters off (LoRA)

    @property
    def phases(self) -> tuple[str, ...]:
        return tuple(p for p in (*PHASES, EXPORT) if p in self.rows)

    def needs(self, phase: str) -> frozenset[str]:
        """What ``phase`` works with (:data:`NEEDS`; with LoRA, reference_forward is the policy's)."""
        return _needs(phase, self.policy_is_reference)

    def resident(self, phase: str) -> frozenset[str]:
        if phase not in self.rows:
            raise ValueError(f"phase {phase!r} is not in this run's residency table; phases: {', '.join(self.phases)}")
        return self.rows[phase]

    @property
    def engine_shares_devices(self) -> bool:
        """Whether the engine's states sit on the trained models' GPUs (torch, colocated SGLang)."""
        return self.engine == "torch" or self.placement == "colocated"

    def on_training_devices(self, state: str) -> bool:
        return owner_of(state) != ENGINE or self.engine_shares_devices

    def states(self) -> tuple[str, ...]:
        owners = (*self.models, ENGINE)
        return tuple(s for o in owners for s in states_of(o))

    def text(self) -> str:
        """The table as text: one line per phase, ``x`` where a state is resident."""
        states = self.states()
        width = max(len(p) for p in self.phases)
        lines = [" " * width + "  " + " ".join(states)]
        for phase in self.phases:
            row = self.rows[phase]
            cells = " ".join(("x" if s in row else "-").center(len(s)) for s in states)
            lines.append(f"{phase:<{width}}  {cells}")
        return "\n".join(lines)


def build_residency(placement: str, engine: str, *, critic: bool = False, reference: bool = False,
                    actor_offload: bool = False, critic_offload: bool = False, reference_offload: bool = False,
                    weights_cpu_backup: bool = False, policy_reference: bool = False,
                    reward_model: bool = False) -> Residency:  # fmt: skip
    """The table for one (placement, engine) and the run's offload flags (module docstring).
    ``policy_reference``: the reference log-probs come from the policy with its adapters off
    (LoRA): reference_forward exists with no reference model, and needs the policy's weights.
    ``reward_model``: a colocated reward model (rule 5), always offloaded outside ``reward``."""
    policy_reference = policy_reference and not reference
    models = (POLICY,) + ((CRITIC,) if critic else ()) + ((REFERENCE,) if reference else ()) + ((REWARD_MODEL,) if reward_model else ())
    flags = {POLICY: actor_offload, CRITIC: critic_offload, REFERENCE: reference_offload, REWARD_MODEL: True}
    offloaded = frozenset(m for m in models if flags[m])
    colocated_sglang = engine == "sglang" and placement == "colocated"
    # launch moves something only with colocated SGLang; a model's own phases exist with the model
    absent = ({LAUNCH} if not colocated_sglang else set()) | ({REFERENCE_FORWARD} if not (reference or policy_reference) else set())
    absent |= {CRITIC_FORWARD, CRITIC_UPDATE} if not critic else set()
    absent |= {REWARD} if not reward_model else set()  # scoring moves nothing without a colocated reward model
    phases = [p for p in PHASES if p not in absent]
    rows = {}
    for phase in phases:
        trained = _trained_row(phase, models, offloaded, _needs(phase, policy_reference))
        rows[phase] = trained | _engine_row(phase, engine, placement)
    return Residency(placement, engine, models, offloaded, weights_cpu_backup, rows, policy_reference)


def _needs(phase: str, policy_reference: bool) -> frozenset[str]:
    if policy_reference and phase == REFERENCE_FORWARD:
        return NEEDS[POLICY_FORWARD]  # the same forward pass, adapters off
    return NEEDS[phase]


def _trained_row(phase: str, models: tuple[str, ...], offloaded: frozenset[str], needs: frozenset[str]) -> frozenset[str]:
    if phase == LAUNCH:
        return frozenset()  # rule 4
    row: set[str] = set()
    for model in models:
        mine = set(states_of(model))
        row |= (mine & needs) if model in offloaded else mine
    return frozenset(row)


def _engine_row(phase: str, engine: str, placement: str) -> frozenset[str]:
    if engine == "torch":
        return frozenset({"engine/weights", "engine/kv_cache"} if phase == GENERATE else {"engine/weights"})
    if placement == "disaggregated":
        return _all(ENGINE)
    return _SGLANG_COLOCATED[phase]


def sft_residency() -> Residency:
    """`megarl sft`'s table: the policy alone, all of it on its devices while it trains
    (``start``), only its weights while the model is written and a second copy is loaded back to
    verify it (``export``: the run is over, its gradients and optimizer state are not needed)."""
    rows = {START: _all(POLICY), EXPORT: frozenset({f"{POLICY}/weights"})}
    return Residency("colocated", "none", (POLICY,), frozenset({POLICY}), False, rows)


def residency_of(cfg: Any) -> Residency:
    """The table of a run's config (a megarl.config.sections.MegaRLConfig)."""
    return build_residency(
        cfg.cluster.placement, cfg.rollout.engine, critic=cfg.critic_enabled, reference=cfg.reference_model,
        actor_offload=cfg.actor.offload, critic_offload=cfg.critic_enabled and cfg.critic.offload,
        reference_offload=cfg.reference_model and cfg.reference.offload,
        weights_cpu_backup=cfg.rollout.weights_cpu_backup,
        policy_reference=cfg.reference_enabled and not cfg.reference_model,  # LoRA: adapters off
        reward_model=cfg.reward.model is not None and cfg.reward.model.placement == "colocated",
    )  # fmt: skip
