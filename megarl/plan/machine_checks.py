"""What a launch needs of the machine and the Ray cluster it names, checked before Ray starts and
reported with the planner's issues (megarl/trainer/launch.py joins them), so that a config with
several problems names all of them at once:

- a config for several nodes needs a Ray cluster to attach to (embedded Ray is this machine alone);
- the cluster that --address or cluster.ray_address names answers (one TCP connect, Ray not joined);
- an embedded Ray with cluster.device=cuda needs cluster.gpus_per_node GPUs on this machine (Ray
  would otherwise be told of GPUs that are not there, and every rank fail in CUDA's start-up).

Left out: what only the attached cluster knows (its nodes' GPUs and CPUs), checked when the
placement is asked for (megarl/ray_cluster/placement.py).
"""

from __future__ import annotations

import os

from megarl.config.sections import MegaRLConfig
from megarl.plan.issues import Issue
from megarl.ray_cluster.address import address_problem, one_machine_problem


def machine_issues(cfg: MegaRLConfig, address: str | None) -> list[Issue]:
    """Every problem of the machine and Ray cluster a launch of ``cfg`` would run on (``address``:
    --address, else cluster.ray_address; None or ``local`` starts an embedded Ray)."""
    issues: list[Issue] = []
    address = address or cfg.cluster.ray_address
    problem = one_machine_problem(cfg.cluster.nnodes, address)
    if problem:
        issues.append(Issue("cluster.nnodes", problem))
    if address not in (None, "", "local"):
        assert address is not None  # (for mypy: not None, per the test above)
        problem = address_problem(address)
        if problem:
            issues.append(Issue("cluster.ray_address", f"(or --address: {address}) no Ray cluster answered: {problem}; start "
                                "one with `ray start --head` (or the launch/ scripts), or unset it to run an embedded local Ray"))  # fmt: skip
    elif cfg.cluster.device == "cuda" and cfg.cluster.nnodes == 1:
        problem = local_gpus_problem(cfg.cluster.gpus_per_node)
        if problem:
            issues.append(Issue("cluster.device", problem))
    return issues


def local_gpus_problem(wanted: int) -> str | None:
    """Why this machine cannot give an embedded Ray ``wanted`` CUDA devices, or None."""
    import torch  # (the launch imports it anyway; torch.cuda.device_count() asks NVML, not a CUDA context)

    found = torch.cuda.device_count()
    if found >= wanted:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    why = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "torch.cuda.device_count()"
    fewer = f", set cluster.gpus_per_node={found}" if found else ""
    return (f"(cuda) with no Ray cluster given runs on this machine's GPUs: it has {found} ({why}) and cluster.gpus_per_node "
            f"is {wanted}; run on a machine with {wanted} GPUs, pass --address of a Ray cluster{fewer}, or set cluster.device=cpu")
