"""Ray's own failures told apart from a process's crash, each as one line naming the node and what
to check: a node that died (the machine gone, its raylet killed), a worker the memory monitor
killed on a node low on memory, a full object store.

:func:`ray_failure` reads what Ray raised: its type (by name: this module imports no Ray, so the
CLI may use it) and its text, which names the node in Ray's own words ("The actor died because
its node has died. Node Id: ...", "Memory on the node (IP: ..., ID: ...) was ..."); recorded
text is enough, which is how the tests feed it. Ray's text says little when the raylet is
killed under a call (the caller sees "Socket closed"), so where Ray runs, :func:`node_view` adds
the cluster's view of the node a process lived on: whether the GCS counts it alive
(``ray.nodes()``) and whether its raylet still answers a TCP connect (the GCS takes several
seconds of missed health checks to mark it dead; a refused connection is at once).
Anything else (an exception in the process, a segfault) is None: the process's log tells it
(megarl/ray_cluster/worker_group.py quotes it).
"""

from __future__ import annotations

import re
import sys
import threading
from dataclasses import dataclass

NODE_QUERY_TIMEOUT_S = 5.0  # ray.nodes() of a GCS that is itself gone must not hang the report

_NODE_DIED = re.compile(r"its node has died|node it was running on is dead|because its node is dead|Node is dead", re.I)
_OOM = re.compile(r"running low on memory|killed due to memory pressure", re.I)
_STORE_FULL = re.compile(r"ray\.exceptions\.ObjectStoreFullError|object store is full|in object store because it is full", re.I)
_NODE_ID = re.compile(r"(?:[Nn]ode [Ii][Dd]|\bID)[:=]?\s*([0-9a-f]{8,})")  # "Node Id: ", "(IP: ..., ID: ...)"
_NODE_IP = re.compile(r"(?:Node IP|\bIP|\bip)[:=]\s*([0-9]+(?:\.[0-9]+){3}|[0-9a-f:]*:[0-9a-f:]+)")
_MEMORY = re.compile(r"was ([\d.]+)\s*GB used / ([\d.]+)\s*GB limit|was ([\d.]+)GB / ([\d.]+)GB")


@dataclass(frozen=True)
class NodeView:
    """The cluster's view of one node, at the time of a failure."""

    node_id: str
    ip: str | None
    alive: bool | None  # the GCS's verdict (None: not known, e.g. the node is not listed)
    raylet_silent: str | None  # why its raylet does not answer a TCP connect, or None when it does


def ray_failure(exc: BaseException | str, node_id: str | None = None, ip: str | None = None,
                view: NodeView | None = None) -> str | None:  # fmt: skip
    """One line (without the process's name: the caller's) saying which of Ray's failures ended
    the call and what to check, or None when it is none of them. ``exc``: what Ray raised, or its
    text; ``node_id`` / ``ip``: where the process lived, when the caller knows (else read from
    the text); ``view``: :func:`node_view` of that node."""
    # Ray's classes by their full names: torch's OutOfMemoryError (CUDA's) is no node's failure.
    text = exc if isinstance(exc, str) else f"{' '.join(f'{c.__module__}.{c.__name__}' for c in type(exc).__mro__)}\n{exc}"
    node_id = node_id or _first(_NODE_ID, text)
    ip = ip or (view.ip if view else None) or _first(_NODE_IP, text)
    where = f"node {ip or '?'}" + (f" (id {node_id[:12]})" if node_id else "")
    if "ray.exceptions.OutOfMemoryError" in text or _OOM.search(text):
        used = _MEMORY.search(text)
        numbers = f" ({used.group(1) or used.group(3)} of {used.group(2) or used.group(4)} GB used)" if used else ""
        return (f"Ray's memory monitor killed it: {where} ran low on host memory{numbers}; check what else runs on that node, "
                "lower the host memory the run takes there (`megarl plan` estimates it), or raise RAY_memory_usage_threshold "
                "when starting Ray")  # fmt: skip
    if _STORE_FULL.search(text):
        return (f"the Ray object store of {where} is full of objects still in use; check `ray memory` for what holds them, "
                "start Ray with a larger --object-store-memory, or lower data.prompts_per_step")
    died = _NODE_DIED.search(text) is not None or "ray.exceptions.NodeDiedError" in text
    if not died and (view is None or (view.alive is not False and view.raylet_silent is None)):
        return None
    if view is not None and view.alive is False:
        why = "Ray marked it dead"
    elif view is not None and view.raylet_silent is not None:
        why = f"its raylet does not answer ({view.raylet_silent})"
    else:
        why = "Ray reports it dead"
    logs = embedded_logs()
    if logs is not None:  # Ray embedded in the run: no cluster is left to ask with `ray status`
        return (f"its {where} died ({why}): check this machine (killed processes, out of memory: dmesg) and the raylet's "
                f"log {logs}/raylet.out (and raylet.err)")
    return (f"its {where} died ({why}): check that machine (shut down, preempted, out of memory: dmesg), `ray status`, "
            f"and its raylet log (`ray logs raylet.out --ip {ip or '<node ip>'}`)")


def embedded_logs() -> str | None:
    """The logs folder of the Ray this process started itself (an embedded one, whose raylet is
    its child), or None: Ray not running here, attached to a cluster, or another Ray's internals."""
    ray = sys.modules.get("ray")
    try:
        if ray is None or not ray.is_initialized():
            return None
        node = ray._private.worker.global_worker.node
        if not node.all_processes.get(ray._private.ray_constants.PROCESS_TYPE_RAYLET):
            return None
        return str(node.get_logs_dir_path())
    except Exception:  # noqa: BLE001 - another Ray's internals: the cluster's hints then
        return None


def node_view(node_id: str | None) -> NodeView | None:
    """The cluster's view of node ``node_id`` (the GCS's alive flag, its raylet's answer), or None
    when Ray is not running in this process, the node is unknown, or the GCS does not answer
    within NODE_QUERY_TIMEOUT_S."""
    ray = sys.modules.get("ray")
    if node_id is None or ray is None or not ray.is_initialized():
        return None
    found: list[NodeView] = []

    def ask() -> None:
        from megarl.ray_cluster.address import unanswered

        try:
            nodes = ray.nodes()
        except Exception:  # noqa: BLE001 - a GCS that is gone: no view, the text alone decides
            return
        for node in nodes:
            if node.get("NodeID") == node_id:
                ip, port = node.get("NodeManagerAddress"), node.get("NodeManagerPort")
                silent = unanswered(f"{ip}:{port}") if ip and port else None
                found.append(NodeView(node_id, ip, bool(node.get("Alive")), silent))

    thread = threading.Thread(target=ask, name="megarl-node-view", daemon=True)
    thread.start()
    thread.join(NODE_QUERY_TIMEOUT_S)
    return found[0] if found else None


def _first(pattern: re.Pattern[str], text: str) -> str | None:
    found = pattern.search(text)
    return found.group(1) if found else None
