"""The devices the reward roles take out of the cluster: the reward model's
(``reward.model.placement: disaggregated``, ``reward.model.gpus``) and the LLM judge's SGLang
servers (``reward.judge.engine: sglang`` on ``cluster.device: cuda``, ``reward.judge.gpus``).

They are the cluster's last devices, the reward model's first, then the judge's; the training pool
and the rollout pool are cut from what is left (megarl/plan/planner.py). What is refused here
concerns their count: no device left for training, and on a multi-node cluster a split that leaves
the training pool part of a node (every pool is placed node by node). Each role's own checks are
its module's (megarl/plan/reward_model_plan.py, megarl/plan/judge_plan.py). Torch-free.
"""

from __future__ import annotations

from megarl.config.sections import MegaRLConfig
from megarl.plan.issues import Issue

REWARD_MODEL_ROLE = "reward_model"
JUDGE_ROLE = "judge"
_KEYS = {REWARD_MODEL_ROLE: "reward.model.gpus", JUDGE_ROLE: "reward.judge.gpus"}


def judge_on_devices(cfg: MegaRLConfig) -> bool:
    """Whether the judge's servers take devices of their own (engine sglang on cluster.device cuda;
    on cpu its one server is a child process of the controller)."""
    judge = cfg.reward.judge
    return judge is not None and judge.engine == "sglang" and cfg.cluster.device == "cuda"


def own_device_counts(cfg: MegaRLConfig) -> dict[str, int]:
    """Role -> the devices it takes out of the cluster, in the order they sit at its end."""
    counts = {}
    model = cfg.reward.model
    if model is not None and model.placement == "disaggregated":
        counts[REWARD_MODEL_ROLE] = model.gpus
    if judge_on_devices(cfg):
        assert cfg.reward.judge is not None  # (judge_on_devices)
        counts[JUDGE_ROLE] = cfg.reward.judge.gpus
    return counts


def own_devices(cfg: MegaRLConfig) -> int:
    """The devices the reward roles take out of the cluster together (0: none)."""
    return sum(own_device_counts(cfg).values())


def taken_note(cfg: MegaRLConfig, *, rollout_pool: bool = False) -> str:
    """' (left after reward.judge.gpus (1))': who took the devices a pool's count leaves out, for the
    messages that count a pool (empty: the reward roles take none, or the pool is the disaggregated
    rollout pool, cluster.rollout_gpus itself). The judge's default gpus=1 is easy to miss."""
    takers = [f"{_KEYS[role]} ({n})" for role, n in own_device_counts(cfg).items()]
    if not takers or (rollout_pool and cfg.cluster.placement == "disaggregated"):
        return ""
    if cfg.cluster.placement == "disaggregated":
        takers.append(f"cluster.rollout_gpus ({cfg.cluster.rollout_gpus})")
    return f" (left after {' and '.join(takers)})"


def own_gpus(cfg: MegaRLConfig, role: str) -> tuple[int, ...]:
    """The global device indices of ``role`` (empty: it has none, or the roles ask for the whole
    cluster, which :func:`check_own_devices` refuses)."""
    counts, world = own_device_counts(cfg), cfg.cluster.world_size
    start = world - sum(counts.values())
    if role not in counts or start < 1:
        return ()
    for name, n in counts.items():
        if name == role:
            return tuple(range(start, start + n))
        start += n
    return ()  # (unreachable: role is in counts)


def check_own_devices(cfg: MegaRLConfig, issues: list[Issue]) -> None:
    """The roles' devices leave some to the training pool (and whole nodes of a multi-node cluster);
    the message names the last role's key and what the others take."""
    counts, cl = own_device_counts(cfg), cfg.cluster
    if not counts:
        return
    role = list(counts)[-1]
    key, n = _KEYS[role], counts[role]
    others = cl.rollout_gpus if cl.placement == "disaggregated" else 0
    taken = [f"{_KEYS[r]} takes {c}" for r, c in counts.items() if r != role] + ([f"the rollout pool takes {others}"] if others else [])
    if sum(counts.values()) + others + 1 > cl.world_size:
        issues.append(Issue(key, f"({n}) leaves no device for training: the cluster has {cl.world_size} (nnodes x "
                            f"gpus_per_node){' and ' + ', '.join(taken) if taken else ''}; lower it or add devices"))  # fmt: skip
    elif cl.nnodes > 1 and (sum(counts.values()) + others) % cl.gpus_per_node:
        issues.append(Issue(key, _whole_nodes_message(cfg, counts, others)))


def _whole_nodes_message(cfg: MegaRLConfig, counts: dict[str, int], others: int) -> str:
    """The last role's count (with the other roles' and the rollout pool's) is not whole nodes: the
    counts that would be, and still leave the training pool a node."""
    cl, role = cfg.cluster, list(counts)[-1]
    n, total = counts[role], sum(counts.values()) + others
    rest = total - n
    fits = [v for v in range(1, cl.world_size) if (rest + v) % cl.gpus_per_node == 0 and rest + v < cl.world_size][:2]
    use = f"use {' or '.join(map(str, fits))}" if fits else "lower the others or add nodes"
    if not rest:
        return (f"({n}) is not a multiple of cluster.gpus_per_node ({cl.gpus_per_node}): on a multi-node cluster the "
                f"role must take whole nodes; {use}")  # fmt: skip
    names = [_KEYS[r] for r in counts] + (["cluster.rollout_gpus"] if others else [])
    return (f"({n}): {' + '.join(names)} = {total} is not a multiple of cluster.gpus_per_node ({cl.gpus_per_node}): on a "
            f"multi-node cluster the devices out of the training pool must be whole nodes; {use}")  # fmt: skip
