"""Ray's report of a raylet that died, kept off the terminal.

When a raylet dies unexpectedly (SIGKILL, the OOM killer, a crash), each of its agent processes
(the dashboard agent, the runtime-env agent) publishes the same error to the driver: a line
naming the possible causes, then the raylet log's last 20 lines, mostly ``[state-dump]``
statistics. The driver's error-listener thread (``ray._private.worker.listen_error_messages``,
started by every ray.init; no Ray setting or variable turns it off: RAY_BACKEND_LOG_LEVEL and
log_to_driver govern other output) prints each to stdout as ``(raylet) ...``: some 45 lines
before megarl's own ``error:`` line about the node; a driver still waiting some 15 s later also
gets the GCS's own report of it (the node "has been marked dead"). A rank killed on a live node
(``kill -9``, the OOM killer) gets the raylet's one long line "A worker died or was killed ...",
before megarl's own line that names the rank's death. :func:`raylet_reports_to_log` sends them
to the command's log file instead (a warning the terminal's handler skips,
megarl/terminal.py); every other message of the listener is printed as Ray prints it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from megarl.terminal import FILE_ONLY, LogFileHandler

log = logging.getLogger(__name__)
RAYLET_DIED = "Raylet is terminated."  # how Ray's report begins (ray/_private/process_watcher.py)
# The GCS's word on the same death, once its health checks of the raylet failed (some 15 s later,
# for a driver still waiting then): "The node with node id: ... has been marked dead because the
# detector has missed too many heartbeats from it. ..." (gcs_server, published as an error).
NODE_MARKED_DEAD = "has been marked dead because"
# The raylet's word on one of its workers killed (a rank's `kill -9`, the OOM killer): one long line
# ("... Worker PID: ... Worker exit type: SYSTEM_ERROR ...") before megarl's own line naming the rank's death.
WORKER_DIED = "A worker died or was killed while executing a task by an unexpected system error"
RAY_REPORTS = (RAYLET_DIED, NODE_MARKED_DEAD, WORKER_DIED)  # what the listener's first line holds (a start, or words within)


@contextmanager
def raylet_reports_to_log(file: Path | None = None) -> Iterator[None]:
    """Within the block, a raylet's death report goes to the log file only: the command's
    (launch's and sft's driver.log take every record), or ``file`` for a command without one
    (convert's, beside its ranks' logs; written only if a report comes). The listener looks
    ``print_to_stdstream`` up on each message, so it takes the wrapper; log_to_driver's printer
    was bound at ray.init and is left as it is. Another Ray (no such function): nothing changes."""
    import ray

    module = ray._private.worker
    original = getattr(module, "print_to_stdstream", None)
    if original is None:
        yield
        return
    routed = _routed(original)
    module.print_to_stdstream = routed
    handler = LogFileHandler(file, delay=True) if file is not None else None
    if handler is not None:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S"))
        log.addHandler(handler)
    try:
        yield
    finally:
        if module.print_to_stdstream is routed:
            module.print_to_stdstream = original
        if handler is not None:
            log.removeHandler(handler)
            handler.close()


def _routed(original: Callable[..., Any]) -> Callable[..., Any]:
    def print_to_stdstream(data: dict[str, Any], ignore_prefix: bool) -> None:
        if not logged_instead(data):
            original(data, ignore_prefix)

    return print_to_stdstream


def logged_instead(data: dict[str, Any]) -> bool:
    """Log ``data`` (the listener's message: ``lines``, ``pid``) to the log file only when it is
    a raylet's death report, its agents' or the GCS's, or the raylet's report of a worker's death;
    False (not handled) otherwise."""
    lines = data.get("lines") or []
    if data.get("pid") != "raylet" or not lines:
        return False
    if not any(words in str(lines[0]) for words in RAY_REPORTS):
        return False
    log.warning("Ray reported (raylet): %s", "\n".join(str(line).rstrip("\n") for line in lines), extra=FILE_ONLY)
    return True
