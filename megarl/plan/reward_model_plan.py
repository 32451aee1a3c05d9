"""The reward model's role in the plan (``reward.model.placement: disaggregated`` or ``colocated``):
its devices, its memory per device, and what the planner refuses about it.

Colocated: one actor per device of the training pool (the policy's), sharing the policy ranks'
placement-group bundles, so actor i is on the policy rank i's device. The model is loaded on the
host and is on the device only in the step's ``reward`` phase (megarl/memory/residency.py rule 5):
the planner counts its weights there, and the activations of one batch as that phase's working
memory; its process's runtime (a CUDA context) stays on the device in every phase.

Devices: ``reward.model.gpus`` of the cluster (on cpu: processes) kept out of the rollout pool
(disaggregated) and the training pool, which are cut from the rest; one actor each, each holding
the whole model. The plan counts them among the last devices (megarl/plan/own_devices.py, which
also refuses too many of them, with the judge's), and the role reserves them as the pools
do theirs: placement groups of its own, one bundle (one GPU) per actor (megarl/ray_cluster/placement.py
role_placements); like the pools' node-groups, which node a group lands on is Ray's choice.

Memory per device (:func:`reward_model_memory`, from the model's config.json through the planner's
shapes (megarl/plan/model_size.py), in the dtype it was saved in, which is what the loader keeps):
- weights: parameters x dtype bytes (embedding, decoder layers, the score head; no LM head);
- activations of one forward of ``batch_size`` samples of ``max_length`` tokens (the model's
  positions when unset), no gradients: the working tensors of one decoder layer at a time (the
  residual stream in and out, q, k, v and the attention output, the MLP's gate, up and their
  product) and the boolean attention mask [batch x length x length]; with SDPA no score matrix;
- runtime: the actor's CUDA context and allocator slack (REWARD_MODEL_RUNTIME_GIB, an estimate).
Disaggregated, the role holds all of it in every phase of the step (it scores after ``generate``),
so it is checked against ``cluster.gpu_memory_gib`` once, not per phase; colocated, its weights and
activations count in the ``reward`` phase of the training devices and its runtime in every phase.

Refused: the role with ``--in-process`` (its actors are Ray actors), colocated with an
asynchronous run (its producer scores while the training phases hold the devices), ``reward.model.gpus``
with colocated (one actor per training device), ``reward.model.device`` set for a role (the role runs on ``cluster.device``).
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config.reward_sections import RewardModelConfig
from megarl.config.sections import MegaRLConfig
from megarl.plan.gpu_memory import GIB
from megarl.plan.issues import Issue
from megarl.plan.model_size import model_size
from megarl.plan.own_devices import REWARD_MODEL_ROLE, own_device_counts, own_gpus
from megarl.plan.role_layout import RoleLayout

REWARD_MODEL_RUNTIME_GIB = 1.0  # an actor's CUDA context and allocator slack (no NCCL): an estimate, not measured


def _check_max_length(model: RewardModelConfig, issues: list[Issue]) -> None:
    """reward.model.max_length within the model's positions (config.json's max_position_embeddings):
    past them the position embeddings run out (an index error, or scores of garbage)."""
    if model.max_length is None:
        return
    size = model_size(model.path)
    positions = size.arch.max_positions if size is not None else None
    if positions and model.max_length > positions:
        issues.append(Issue("reward.model.max_length", f"({model.max_length}) is above the reward model's "
                            f"max_position_embeddings ({positions}, {model.path}/config.json); lower it to {positions} or "
                            "leave it null (the model's own)"))  # fmt: skip


def reward_model_gpus(cfg: MegaRLConfig) -> int:
    """The devices the reward model's role takes out of the cluster (0: none, it runs in the reward workers)."""
    return own_device_counts(cfg).get(REWARD_MODEL_ROLE, 0)


def reward_model_layout(cfg: MegaRLConfig, training: RoleLayout | None = None) -> RoleLayout | None:
    """The role's devices, one actor (replica) each: disaggregated, reward.model.gpus of the cluster's
    last (megarl/plan/own_devices.py: before the judge's, if it has any); colocated, those of
    ``training`` (the policy's layout)."""
    if colocated_reward_model(cfg):
        return RoleLayout(REWARD_MODEL_ROLE, 1, 1, len(training.gpus), training.gpus) if training is not None else None
    gpus = own_gpus(cfg, REWARD_MODEL_ROLE)
    return RoleLayout(REWARD_MODEL_ROLE, 1, 1, len(gpus), gpus) if gpus else None


def colocated_reward_model(cfg: MegaRLConfig) -> bool:
    """Whether the reward model shares the training devices (reward.model.placement colocated)."""
    return cfg.reward.model is not None and cfg.reward.model.placement == "colocated"


def check_reward_model(cfg: MegaRLConfig, issues: list[Issue], *, in_process: bool) -> None:
    """What the planner refuses about reward.model.placement (module docstring)."""
    model, cl = cfg.reward.model, cfg.cluster
    if model is None:
        return
    _check_max_length(model, issues)
    if model.placement == "colocated":
        _check_colocated(cfg, issues, in_process=in_process)
        return
    if model.placement == "workers":
        if "gpus" in model.model_fields_set:
            issues.append(Issue("reward.model.gpus", "is used only with reward.model.placement=disaggregated; remove it or set the placement"))
        return
    if "device" in model.model_fields_set and model.device is not None:  # null: unset from the command line
        issues.append(Issue("reward.model.device", f"({model.device}) is for placement workers; the role runs on "
                            f"cluster.device ({cl.device}); remove it"))  # fmt: skip
    if in_process:
        issues.append(Issue("reward.model.placement", "(disaggregated) is a Ray actor and --in-process runs without Ray; "
                            "use reward.model.placement=workers"))  # fmt: skip
        return


def _check_colocated(cfg: MegaRLConfig, issues: list[Issue], *, in_process: bool) -> None:
    model = cfg.reward.model
    assert model is not None
    for key, value in (("gpus", model.gpus), ("device", model.device)):
        if key in model.model_fields_set:
            issues.append(Issue(f"reward.model.{key}", f"({value}) is not used with reward.model.placement=colocated (one actor "
                                "on each training device, on cluster.device); remove it"))  # fmt: skip
    if in_process:
        issues.append(Issue("reward.model.placement", "(colocated) runs Ray actors and --in-process runs without Ray; "
                            "use reward.model.placement=workers"))  # fmt: skip
    if cfg.asynchronous:
        issues.append(Issue("reward.model.placement", f"(colocated) loads the reward model onto the training devices to "
                            f"score, which an asynchronous run (rollout.max_staleness {cfg.rollout.max_staleness}) does while "
                            "they train; use reward.model.placement=disaggregated"))  # fmt: skip


@dataclass(frozen=True)
class RewardModelMemory:
    """Bytes per device of one reward-model actor (module docstring)."""

    weights: float
    activations: float
    runtime: float
    tokens: tuple[int, int]  # (batch_size, max_length) of the batch the activations are counted for
    dtype: str

    @property
    def total(self) -> float:
        return self.weights + self.activations + self.runtime


def reward_model_memory(cfg: MegaRLConfig) -> RewardModelMemory | None:
    """The role's memory per device from its config.json; None when unreadable (the preflight names it)."""
    model = cfg.reward.model
    size = model_size(model.path) if model is not None else None
    if model is None or size is None:
        return None
    a, wbytes = size.arch, size.dtype_bytes
    h, q, kv = a.hidden_size, a.num_heads * a.qk_head_dim, a.num_kv_heads * a.qk_head_dim
    length = model.max_length or a.max_positions or 2048
    tokens = model.batch_size * length
    activations = tokens * wbytes * (2 * h + 2 * q + 2 * kv + 3 * a.ffn_hidden_size) + model.batch_size * length * length
    runtime = REWARD_MODEL_RUNTIME_GIB * GIB if cfg.cluster.device == "cuda" else 0.0
    return RewardModelMemory(size.classifier_params * wbytes, activations, runtime, (model.batch_size, length), size.dtype)


def check_reward_model_memory(cfg: MegaRLConfig, mem: RewardModelMemory | None, issues: list[Issue]) -> None:
    """On cuda, one actor's memory fits cluster.gpu_memory_gib (disaggregated; colocated, its phase is
    checked with the others'); the fix names the knobs that move it."""
    gpu = cfg.cluster.gpu_memory_gib * GIB
    if mem is None or cfg.cluster.device != "cuda" or mem.total <= gpu:
        return
    b, length = mem.tokens
    fix = ("its weights alone do not fit one GPU and the role has no tensor parallelism; use a smaller reward model"
           if mem.weights + mem.runtime > gpu else "lower reward.model.batch_size or reward.model.max_length")
    issues.append(Issue("reward.model.batch_size", f"the reward model needs an estimated {mem.total / GIB:.1f} GiB per GPU "
                        f"(weights {mem.weights / GIB:.1f} + activations of one batch of {b} x {length} tokens "
                        f"{mem.activations / GIB:.1f} + runtime {mem.runtime / GIB:.1f}), {(mem.total - gpu) / GIB:.1f} GiB over "
                        f"cluster.gpu_memory_gib ({cfg.cluster.gpu_memory_gib:g}); {fix}"))  # fmt: skip
