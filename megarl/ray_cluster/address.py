"""Which Ray cluster an address names, and whether it answers, without importing or joining Ray.

`megarl launch --address` and `megarl doctor` both ask: Ray's own ``ray.init`` retries a dead
address for minutes, printing only its GCS timeouts, so the launch probes first and fails in a
second with one line. ``auto`` is resolved as Ray resolves it: RAY_ADDRESS, else the address
file the last ``ray start`` on this machine wrote.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path


def find_cluster(address: str) -> tuple[str, str] | None:
    """``(where the address came from, host:port)`` for ``address`` (``auto`` resolved; None when
    no cluster is recorded on this machine), or ``("given", address)`` for an explicit one."""
    if address != "auto":
        return "given", address
    env = os.environ.get("RAY_ADDRESS", "")
    if env and env != "auto":
        return "RAY_ADDRESS", env
    # Ray's own lookup (ray._common.utils.get_ray_address_file).
    tmp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    path = Path(tmp) / "ray" / "ray_current_cluster"
    try:
        return str(path), path.read_text().strip()
    except OSError:
        return None


def address_problem(address: str) -> str | None:
    """Why the cluster ``address`` names does not answer (one line), or None. Ray lets a set
    RAY_ADDRESS win over the address given; with nothing recorded, "auto" is left to ray.init
    (it also finds a local GCS process), which fails at once when there is none."""
    found = find_cluster(os.environ.get("RAY_ADDRESS") or address)
    if found is None:
        return None
    source, resolved = found
    why = unanswered(resolved)
    if why is None:
        return None
    return f"{resolved}{'' if source == 'given' else f' (from {source})'} does not answer: {why}"


def one_machine_problem(nnodes: int, address: str | None) -> str | None:
    """Why a config for ``nnodes`` nodes cannot run on the Ray that ``address`` gives, or None.
    No address (or ``local``) starts Ray on this machine alone, where the placement of several
    nodes' ranks would wait for nodes that never join."""
    if nnodes <= 1 or address not in (None, "", "local"):
        return None
    return (f"({nnodes}) nodes, but no Ray cluster is given, so Ray would start on this machine alone; start Ray on "
            f"the {nnodes} nodes (`ray start`, or `megarl sbatch` on Slurm) and pass --address auto or host:port "
            "(or cluster.ray_address), or set cluster.nnodes=1")


def unanswered(address: str) -> str | None:
    """None when something listens at host:port (one TCP connect, closed at once; Ray is not
    joined), else why not. Ray Client addresses (ray://...) are not probed."""
    if address.startswith("ray://") or address == "local":  # Ray Client; `local`: ray.init starts one
        return None
    found = re.fullmatch(r"\[?([^\]\s/]+?)\]?:(\d+)", address)
    if found is None:
        return "not host:port"
    try:
        with socket.create_connection((found.group(1), int(found.group(2))), timeout=1.0):
            return None
    except OSError as exc:
        return exc.strerror or str(exc)


def node_address() -> str:
    """This node's address as processes on other nodes reach it (Ray's view when Ray runs)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())
