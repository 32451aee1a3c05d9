"""Run a Python function in N local processes joined by a gloo process group (for tests).

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes, each with the
standard launcher variables (MASTER_ADDR, MASTER_PORT on a free port, RANK, WORLD_SIZE,
LOCAL_RANK), one torch thread, and an initialised gloo default group; calls
``fn(rank, world_size, *args)`` in each; destroys the process groups; and returns the
per-rank return values (picklable) in rank order. If any rank raises, the others are
stopped and a RuntimeError carries every failed rank's traceback; a run longer than
``timeout_s`` is killed and reported the same way.

Processes come from a ``forkserver`` that pre-imports torch, megatron-core and transformers
once per test session, so each launch costs a fork, not a ~10 s import (2-core CI).
``fn`` must be a module-level function of an importable module (e.g. a test module).
"""

from __future__ import annotations

import faulthandler
import importlib
import importlib.util
import multiprocessing as mp
import os
import pickle
import socket
import sys
import time
import traceback
from typing import Any

PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "transformers"]
_ctx: Any = None


def _context():
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload([m for m in PRELOAD if importlib.util.find_spec(m.split(".")[0])])
    return _ctx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fn_ref(fn) -> tuple[str, str, str]:
    """(module name, qualified name, module file) so a child can load ``fn`` by itself."""
    module = sys.modules[fn.__module__]
    return fn.__module__, fn.__qualname__, os.path.abspath(module.__file__ or "")


def _resolve(ref: tuple[str, str, str]):
    """Load ``fn``'s module from its file (works whatever pytest's import mode), with the file's
    directory on sys.path so its sibling helpers (``from spawn import ...``) import too."""
    module_name, qualname, file = ref
    folder = os.path.dirname(file)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, file)
        assert spec is not None and spec.loader is not None, file
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _child(ref, rank: int, world_size: int, port: int, init_group: bool, args: tuple, queue, timeout_s: float) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",  # gloo tests of CPU tensors, also on a GPU box (whose rank 1 may have no GPU)
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # A hung rank prints every thread's stack to stderr just before the parent gives up.
    faulthandler.dump_traceback_later(max(1.0, timeout_s - 2.0), exit=False)
    try:
        if init_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = _resolve(ref)(rank, world_size, *args)
        # As bytes: tensors put on a multiprocessing queue as they are travel through shared
        # memory that this process must outlive, and it exits right after (the parent's read
        # then hung, now and then).
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # report everything, including assertion failures, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()
        _teardown()


def _teardown() -> None:
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    except Exception:
        pass
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args: Any, timeout_s: float = 300.0, init_group: bool = True,
                    daemon: bool = True) -> list[Any]:  # fmt: skip
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes (see module docstring).

    ``daemon=False`` lets ``fn`` start processes of its own (e.g. a reward worker pool)."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    ref = _fn_ref(fn)
    procs = [
        ctx.Process(target=_child, args=(ref, r, world_size, port, init_group, args, queue, timeout_s), daemon=daemon)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                failures.setdefault(-1, f"timed out after {timeout_s:.0f} s")
                break
            try:
                rank, ok, value = queue.get(timeout=min(remaining, 1.0))
            except Exception:  # queue.Empty: check for ranks that died without reporting
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead and not failures:
                    failures[dead[0]] = f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}"
                if failures:
                    _await_others(queue, results, failures, world_size, grace_s=5.0)
                    break
                continue
            (results if ok else failures)[rank] = pickle.loads(value) if ok else value
            if failures:  # others may be stuck in a collective with the failed rank
                _await_others(queue, results, failures, world_size, grace_s=5.0)
                break
    finally:
        for p in procs:
            p.join(timeout=5.0 if not failures else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
        queue.close()
    if failures:
        detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        raise RuntimeError(f"{len(failures)} rank(s) failed in {fn.__qualname__}:\n{detail}")
    return [results[r] for r in range(world_size)]


def _await_others(queue, results: dict, failures: dict, world_size: int, grace_s: float) -> None:
    end = time.monotonic() + grace_s
    while len(results) + len(failures) < world_size and time.monotonic() < end:
        try:
            rank, ok, value = queue.get(timeout=max(0.05, end - time.monotonic()))
        except Exception:
            return
        (results if ok else failures)[rank] = pickle.loads(value) if ok else value
