#!/usr/bin/env python3
"""Measures, on one lent GPU, the cluster paths megarl cannot exercise on CPU.

Each section runs in a process of its own under its own time limit, so a hang or a CUDA crash in
one leaves the others' results; together they fit in --budget-s (default 280 s: the GPU machine
is lent for 15 minutes, its start-up and a rerun included). The sections, in the order they run:

  cuda_init    unpickling what Ray sends a rank (the rank classes of megarl/actors/, the worker
               group's actor class, the config) leaves CUDA uninitialised and the driver untouched,
               so the rank's later rewrite of CUDA_VISIBLE_DEVICES holds
  ipc_push     megarl's colocated push (PolicyWorker's export -> WeightStream ->
               SGLangTensorTransport, export thread on and off) into a second process that rebuilds
               the tensors the way SGLang 0.5.23 does, loads them into an HF model and compares
               log-probs with the trainer's; GPU memory before, during and after; after an
               offload/onload; with expandable_segments on the producer
  offload      megarl's offload of a ~1B policy with the distributed optimizer: bytes freed, the
               trainer's residual, D2H/H2D GB/s, bit-exact states after onload, a second update,
               what a second process can then allocate
  nccl_group   the weight-update group (megarl/weight_sync/update_group.py) on NCCL at world 1:
               open, broadcast, close, reopen under the same name; and on gloo with CUDA tensors
               against an SGLang-style join in a second process
  packed_rope  the packed-rope re-measure of the 1B step that bench/results/train_step.md asks for
               (optional, last: it gets what is left of the budget)

Without CUDA (the CI dry run) what can run on CPU runs: cuda_init's imports, and ipc_push, offload
and nccl_group with a tiny model and CPU tensors; the rest is reported skipped, with the reason.

Output (--out): probe_<section>.json (status ok / failed / skipped, the reason, results, checks,
skipped parts, the plan constants a number feeds), probe_<section>.log (the section's output),
probe_summary.json and .md, probe_results.json (all of it in one file). Exit code 1 when a
section failed. Ray and SGLang are never imported (the GPU machine has neither): the few lines
of SGLang's receiving side are copied below. Where a GPU run's results go: ci/gpu/README.md.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import importlib
import importlib.abc
import importlib.util
import io
import json
import math
import os
import pickle
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
MIB, GIB = 1 << 20, 1 << 30

# name -> (own time limit in s, what it measures); run in this order.
SECTIONS: dict[str, tuple[float, str]] = {
    "cuda_init": (60, "unpickling a rank's classes leaves CUDA uninitialised (CUDA_VISIBLE_DEVICES rewrite holds)"),
    "ipc_push": (120, "colocated CUDA-IPC push into an SGLang-0.5.23-style receiver: exactness, log-probs, memory"),
    "offload": (120, "offload/onload of a ~1B policy, distributed optimizer: bytes, GB/s, exactness, engine's view"),
    "nccl_group": (60, "weight-update group: NCCL world 1 open/broadcast/close/reopen; gloo + CUDA vs SGLang's join"),
    "packed_rope": (200, "bench/train_step.py's packed-rope re-measure of the 1B step (optional, last)"),
}
BUDGET_S = 280.0  # the whole run: the lease is 15 minutes, start-up and a rerun included
MIN_START_S = 20.0  # a section is not started with less of the budget left
NO_CUDA = "no CUDA"


# ==== orchestration (standard library only: --help and the parent need no torch) ================


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    sections = "\n".join(f"  {name:<12} {what} (limit {limit:.0f} s)" for name, (limit, what) in SECTIONS.items())
    ap = argparse.ArgumentParser(
        prog="probe_cluster_paths.py", description=__doc__.split("\n\n")[0],
        epilog=f"sections:\n{sections}\n\nDetails: the module docstring and ci/gpu/README.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or HERE.parent / "out"),
                    help="folder of the JSON results and logs (default: $OUT, else ci/gpu/out)")  # fmt: skip
    ap.add_argument("--only", action="append", default=[], metavar="SECTION",
                    help="run only these sections (repeatable, or a comma list)")  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help=f"time for the whole run; no section starts with under {MIN_START_S:.0f} s of it left (default {BUDGET_S:.0f})")  # fmt: skip
    ap.add_argument("--timeout-s", type=float, default=None, help="every section's time limit instead of its own")
    ap.add_argument("--role", help=argparse.SUPPRESS)  # this script in a child process (a section, a peer)
    ap.add_argument("--role-args", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    wanted = [s.strip() for item in args.only for s in item.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        ap.error(f"--only {', '.join(unknown)}: the sections are {', '.join(SECTIONS)}")
    args.sections = [s for s in SECTIONS if not wanted or s in wanted]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role:
        return ROLES[args.role](json.loads(args.role_args))
    # `timeout` (ci/gpu/run.sh) sends SIGTERM: end the running section's processes, keep the summary.
    signal.signal(signal.SIGTERM, _terminated)
    args.out.mkdir(parents=True, exist_ok=True)
    started, records = time.monotonic(), {}
    try:
        for name in args.sections:
            left = args.budget_s - (time.monotonic() - started)
            if left < MIN_START_S:
                records[name] = _write_record(args.out, name, {"status": "skipped", "reason": f"the run's budget "
                                              f"(--budget-s {args.budget_s:g}) had {left:.0f} s left"})  # fmt: skip
            else:
                try:
                    records[name] = run_section(name, args.out, min(args.timeout_s or SECTIONS[name][0], left))
                except BaseException:  # told to stop (SIGTERM, Ctrl-C): the summary still says where
                    records[name] = _write_record(args.out, name, {"status": "failed", "reason": "the probe was stopped"})
                    raise
            print(_line(name, records[name]), flush=True)
    finally:
        summary = write_summary(args, records, time.monotonic() - started)
    for feed in summary["feeds"]:
        print(f"feeds {feed['constant']}: now {feed['current']}, measured {feed['measured']} ({feed['section']})")
    return 1 if any(r["status"] == "failed" for r in records.values()) else 0


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _line(name: str, record: dict) -> str:
    reason = f": {record['reason']}" if record.get("reason") else ""
    return f"probe {name:<12} {record['status']:<8} {record.get('seconds', 0.0):6.1f} s{reason}"


def run_section(name: str, out: Path, limit_s: float) -> dict:
    """One section in a session of its own (killed whole at its limit); its JSON, or a failure."""
    path, log = out / f"probe_{name}.json", out / f"probe_{name}.log"
    path.unlink(missing_ok=True)
    started, code = time.monotonic(), None
    with open(log, "w") as log_file:
        proc = subprocess.Popen(_role_cmd("section", {"section": name, "out": str(out), "limit_s": limit_s}),
                                stdout=log_file, stderr=subprocess.STDOUT, env=_child_env(), cwd=ROOT,
                                start_new_session=True)  # fmt: skip
        try:
            code = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            # The section and every process it started (timed out, stopped, or left behind).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            path.with_suffix(".json.tmp").unlink(missing_ok=True)  # a write the kill cut short
    record = json.loads(path.read_text()) if path.exists() else {"section": name}
    if code is None:
        part = f" (in part: {record['part']})" if record.get("part") else ""
        record |= {"status": "failed", "reason": f"timed out after {limit_s:.0f} s{part}"}
    elif record.get("status") in (None, "running"):
        record |= {"status": "failed", "reason": f"exited with {_exit_name(code)} before it finished: {_last_line(log)}"}
    record["seconds"] = round(time.monotonic() - started, 1)
    return _write_record(out, name, record)


def _write_record(out: Path, name: str, record: dict) -> dict:
    record = {"section": name, "reason": None} | record
    (out / f"probe_{name}.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    return record


def _exit_name(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(no output)"


def write_summary(args: argparse.Namespace, records: dict[str, dict], seconds: float) -> dict:
    """probe_summary.json (every section's status, the numbers that feed plan constants), the same
    as a Markdown draft for bench/results/cluster_probe_h200.md, and probe_results.json: the
    summary with every section's whole record (what bench/results/cluster_probe_h200.json keeps)."""
    feeds = [f | {"section": name} for name, r in records.items() for f in r.get("feeds", [])]
    summary = {
        "probe": "ci/gpu/probe_cluster_paths.py", "argv": sys.argv[1:], "budget_s": args.budget_s,
        "seconds": round(seconds, 1), "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": next((r["machine"] for r in records.values() if r.get("machine")), None),
        "sections": {name: {k: r.get(k) for k in ("status", "reason", "seconds", "skipped_parts")} for name, r in records.items()},
        "feeds": feeds,
    }  # fmt: skip
    (args.out / "probe_summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    bundle = summary | {"records": records}
    (args.out / "probe_results.json").write_text(json.dumps(bundle, indent=2, default=str) + "\n")
    md = ["| section | status | s | reason / parts skipped |", "|---|---|---:|---|"]
    for name, r in records.items():
        note = r.get("reason") or "; ".join(f"{p}: {why}" for p, why in (r.get("skipped_parts") or {}).items())
        md.append(f"| {name} | {r['status']} | {r.get('seconds', 0):.1f} | {note} |")
    md += ["", "| constant | now | measured | how |", "|---|---|---|---|"]
    md += [f"| `{f['constant']}` | {f['current']} | {f['measured']} | {f['how']} |" for f in feeds]
    (args.out / "probe_summary.md").write_text("\n".join(md) + "\n")
    return summary


def _child_env(extra: dict[str, str | None] | None = None) -> dict[str, str]:
    """This environment, the checkout first on the path; ``extra``'s None values are removed."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _role_cmd(role: str, role_args: dict) -> list[str]:
    return [sys.executable, str(HERE), "--role", role, "--role-args", json.dumps(role_args)]


# ==== inside a section ========================================================================


class Report:
    """One section's findings, written to probe_<name>.json after every part, so a section killed
    at its limit still leaves what it measured (and the part it was in)."""

    def __init__(self, name: str, out: Path, limit_s: float) -> None:
        self.out, self.path = out, out / f"probe_{name}.json"
        self.deadline = time.monotonic() + limit_s
        self.data: dict[str, Any] = {"section": name, "status": "running", "reason": None, "part": None,
                                     "machine": None, "results": {}, "checks": [], "skipped_parts": {}, "feeds": [],
                                     "part_seconds": {}}  # fmt: skip
        self.flush()

    def left(self, margin: float = 5.0) -> float:
        """Seconds left to this section, less ``margin`` (for writing up)."""
        return max(1.0, self.deadline - time.monotonic() - margin)

    def part(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(...)``; an exception fails this part (its traceback in the log), not the section."""
        self.data["part"] = name
        self.flush()
        print(f"[probe] part: {name}", flush=True)
        start = time.monotonic()
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - recorded; the next parts still run
            traceback.print_exc()
            self.check(name, False, f"raised {type(exc).__name__}: {str(exc).strip()[:400]}")
            return None
        finally:
            self.data["part"] = None
            self.data["part_seconds"][name] = round(time.monotonic() - start, 2)
            self.flush()

    def check(self, name: str, ok: bool, detail: Any = None) -> None:
        self.data["checks"].append({"check": name, "ok": bool(ok), "detail": detail})
        print(f"[probe] {'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail is not None else ""), flush=True)
        self.flush()

    def result(self, key: str, value: Any) -> None:
        self.data["results"][key] = value
        self.flush()

    def skip(self, part: str, reason: str) -> None:
        self.data["skipped_parts"][part] = reason
        self.flush()

    def feed(self, constant: str, current: Any, measured: Any, how: str) -> None:
        """A measured number that replaces (or checks) a constant of the plan."""
        self.data["feeds"].append({"constant": constant, "current": current, "measured": measured, "how": how})
        self.flush()

    def finish(self, skipped: str | None = None) -> None:
        failed = [c for c in self.data["checks"] if not c["ok"]]
        if failed:
            detail = f": {failed[0]['detail']}" if failed[0]["detail"] is not None else ""
            self.data |= {"status": "failed", "reason": f"{failed[0]['check']}{detail}"[:500]}
        else:
            self.data |= {"status": "skipped" if skipped else "ok", "reason": skipped}
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        tmp.replace(self.path)


def role_section(a: dict) -> int:
    rep = Report(a["section"], Path(a["out"]), a["limit_s"])
    try:
        rep.data["machine"] = _machine()
        skipped = SECTION_FUNCS[a["section"]](rep)
    except Exception as exc:  # noqa: BLE001 - the section's JSON says what stopped it
        traceback.print_exc()
        rep.check("section ran to its end", False, f"{type(exc).__name__}: {str(exc).strip()[:400]}")
        skipped = None
    rep.finish(skipped)
    return _exit_now(0)


def _exit_now(code: int) -> NoReturn:
    """Ends a child process once its answer is written, without Python's teardown: torch.distributed's
    and Megatron's finalizers take seconds, and after a CUDA error they can hang."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _machine() -> dict:
    import torch

    props = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None  # no allocation here
    return {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": props.name if props else "cpu", "gpu_total_gib": round(props.total_memory / GIB, 1) if props else None,
            "megatron_core": _version_of("megatron-core"), "transformers": _version_of("transformers")}  # fmt: skip


def _version_of(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


# ---- helpers shared by the sections -----------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _set_rank_env() -> None:
    """torchrun's variables for a world of one (megarl/parallel/groups.py reads them)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def _protocol_stdout() -> io.TextIOWrapper:
    """A role's answers go to the real stdout; whatever else is printed (libraries, warnings)
    goes to stderr (the section's log), so the answers stay one JSON object a line."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)
    return proto


def _answer(proto: io.TextIOWrapper, obj: Any) -> None:
    proto.write(json.dumps(obj, default=str) + "\n")
    proto.flush()


def _run_role(role: str, role_args: dict, timeout: float, env: dict[str, str | None] | None = None) -> dict:
    """A one-shot role of this script in a process of its own: its last line of output, as JSON."""
    try:
        proc = subprocess.run(_role_cmd(role, role_args), stdout=subprocess.PIPE, text=True, timeout=timeout,
                              env=_child_env(env), cwd=ROOT)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{role} did not finish in {timeout:.0f} s") from exc
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{role} ended with {_exit_name(proc.returncode)} (its traceback is in this section's log)")
    return json.loads(lines[-1])


class Peer:
    """A role of this script in a process of its own, spoken to in JSON lines (its stdin, its
    stdout); its stderr goes to the section's log. The first line it writes says it is ready."""

    def __init__(self, role: str, role_args: dict, env: dict[str, str | None] | None = None) -> None:
        self.role = role
        self.proc = subprocess.Popen(_role_cmd(role, role_args), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=_child_env(env), cwd=ROOT)  # fmt: skip
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read_lines, daemon=True).start()

    def _read_lines(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)  # the peer closed its stdout: it ended

    def send(self, msg: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout: float) -> dict:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty as exc:
            raise RuntimeError(f"{self.role} did not answer within {timeout:.0f} s") from exc
        if line is None:
            raise RuntimeError(f"{self.role} ended with {_exit_name(self.proc.wait())} (see this section's log)")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.role}: {reply['error']}")
        return reply

    def ask(self, msg: dict, timeout: float = 120.0) -> dict:
        self.send(msg)
        return self.read(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "quit"})
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def _serve(handlers: dict[str, Callable[[dict], dict]], ready: dict) -> int:
    """A peer's loop: one JSON request a line on stdin, one answer a line on stdout."""
    proto = _protocol_stdout()
    _answer(proto, ready)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "quit":
            break
        try:
            reply = handlers[msg["op"]](msg)
        except Exception as exc:  # noqa: BLE001 - the asking process fails the part, with the cause
            traceback.print_exc()
            reply = {"error": f"{type(exc).__name__}: {str(exc).strip()[:400]}"}
        _answer(proto, reply)
    return _exit_now(0)


def _fingerprint(t: Any) -> list[int]:
    """Two exact integer sums of a tensor's bits, plain and weighted by position (mod 8191): equal
    bits give equal sums on any device, whatever the order of the reduction."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    x = t.detach().contiguous().view(ints).reshape(-1).to(torch.int64)  # [numel]
    w = torch.arange(x.numel(), device=x.device, dtype=torch.int64) % 8191 + 1  # [numel]
    return [int(x.sum()), int((x * w).sum())]


def _memory() -> dict | None:
    """The GPU as the driver sees it (every process) and as this process's allocator does."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return {"free": free, "total": total, "allocated": torch.cuda.memory_allocated(),
            "reserved": torch.cuda.memory_reserved()}  # fmt: skip


def _settled_memory() -> dict | None:
    """``_memory`` once this process has let go of all it can: garbage, IPC handles the other
    side closed, cached blocks."""
    import gc

    import torch

    if not torch.cuda.is_available():
        return None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()
    return _memory()


def _gib(n: float | None) -> float | None:
    return None if n is None else round(n / GIB, 3)


def _bench() -> types.ModuleType:
    """bench/train_step.py (its model presets, batch and loss): the same model as the MFU table."""
    sys.path.insert(0, str(ROOT / "bench"))
    return importlib.import_module("train_step")


def _build_hf_dir(out: Path, shape: dict, dtype: str, device: str = "cpu") -> Path:
    """A random-init Qwen2-shaped HF model directory (bench/train_step.py's shape keys), made on
    ``device`` (a GPU inits a ~1B model in a moment rather than half a minute on the host)."""
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.models.tiny import tiny_hf_config

    cfg = tiny_hf_config("qwen2", vocab_size=shape["vocab"], hidden_size=shape["hidden"], num_layers=shape["layers"],
                         num_heads=shape["heads"], num_kv_heads=shape["kv_heads"], ffn_hidden_size=shape["ffn"],
                         max_position_embeddings=4096)  # fmt: skip
    cfg.head_dim = shape["head_dim"]
    cfg.initializer_range = shape.get("init_std", cfg.initializer_range)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.save_pretrained(out)
    return out


def _policy(path: Path, dtype: str, micro: int, distributed: bool) -> Any:
    """megarl's policy worker (Megatron, TP=1, DDP + optimizer) on this process's device."""
    from megarl.actors.policy import PolicyWorker
    from megarl.config.train_sections import ActorConfig, OptimizerConfig

    _set_rank_env()
    cfg = ActorConfig(micro_batch_size=micro, recompute="none", optimizer=OptimizerConfig(lr=1e-6, distributed=distributed))
    return PolicyWorker(path, cfg, dtype, seed=0)


def _trainer_logprobs(worker: Any, batch: Any) -> Any:
    from megarl.data.batch import TokenRows

    rows = worker.compute_logprobs(batch, 1.0)
    return TokenRows.assemble([rows], len(batch), batch.response_len)["logprobs"]  # [B, R] float32


# ==== (a) cuda_init ============================================================================

# Functions that initialise CUDA or the driver (cuInit reads CUDA_VISIBLE_DEVICES once per process).
# is_available() does too unless PYTORCH_NVML_BASED_CUDA_CHECK=1; device_count() asks NVML first.
DRIVER_CALLS = ("is_available", "_lazy_init", "init", "current_device", "set_device", "get_device_properties",
                "get_device_capability", "get_device_name", "mem_get_info", "synchronize", "is_bf16_supported")  # fmt: skip
NVML_CALLS = ("device_count",)
CONTROL_MODULE = "megarl_probe_driver_call"  # written by the section: calls is_available() at import


def section_cuda_init(rep: Report) -> str | None:
    import torch

    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="megarl-probe-") as tmp:
        blob = Path(tmp) / "rank_calls.pkl"
        rep.part("pickle what WorkerGroup sends a rank", _pickle_rank_calls, blob)
        modules = [f"megarl.actors.{p.stem}" for p in sorted((ROOT / "megarl" / "actors").glob("*.py"))]
        modules.append("megarl.ray_cluster.worker_group")
        args = {"blob": str(blob), "modules": modules, "rewrite": cuda, "path": None}
        found = rep.part("unpickle in a fresh process", _run_role, "unpickle", args, timeout=rep.left())
        if found is not None:
            rep.result("unpickled", found)
            rep.check("CUDA is not initialised after unpickling", not found["initialized"], found["initialized"])
            rep.check("no CUDA driver call while unpickling", not found["driver_calls"], found["driver_calls"] or None)
            if cuda:
                rep.check("the rewrite of CUDA_VISIBLE_DEVICES after unpickling holds (0 devices seen)",
                          found["devices_after_rewrite"] == 0, found["devices_after_rewrite"])  # fmt: skip
        # The control: a module that asks the driver at import must be caught, else the checks above prove nothing.
        (Path(tmp) / f"{CONTROL_MODULE}.py").write_text("import torch\n\ntorch.cuda.is_available()\n")
        args |= {"modules": [CONTROL_MODULE], "path": tmp}
        control = rep.part("control: a module that asks the driver at import", _run_role, "unpickle", args, timeout=rep.left())
        if control is not None:
            rep.result("control", control)
            rep.check("control: its is_available() call is caught", any(CONTROL_MODULE in c["from"] for c in control["driver_calls"]),
                      control["driver_calls"] or None)  # fmt: skip
            if cuda:
                rep.check("control: after its call the rewrite does not hold (devices still seen)",
                          control["devices_after_rewrite"] > 0, control["devices_after_rewrite"])  # fmt: skip
    if not cuda:
        rep.skip("CUDA_VISIBLE_DEVICES rewrite after unpickling", NO_CUDA)
    return None


def _pickle_rank_calls(blob: Path) -> None:
    """The driver's side of WorkerGroup._start: the actor class, then each rank class with its
    init arguments (the config) as ``construct`` receives them."""
    _stub_ray()
    from megarl.actors.conversion_rank import ExportRank, ImportRank
    from megarl.actors.critic_rank import CriticRank
    from megarl.actors.policy_rank import PolicyRank
    from megarl.actors.sft_rank import SFTRank
    from megarl.config.loading import load_config
    from megarl.ray_cluster.worker_group import _WorkerHost

    cfg = load_config(ROOT / "configs" / "tiny_grpo.yaml")
    sent = [_WorkerHost, (PolicyRank, ((cfg, 10, "/tmp/weights"), {})), (CriticRank, ((cfg, 10), {})),
            (SFTRank, ((cfg, 10), {})), (ExportRank, ((cfg.model.path, cfg.actor, "float32", 0, 16.0), {})),
            (ImportRank, ((cfg.model.path, cfg.actor, "float32", 0), {}))]  # fmt: skip
    blob.write_bytes(pickle.dumps(sent))


def role_unpickle(a: dict) -> int:
    """A fresh process: unpickle what a rank receives, import the rank modules, then report
    whether CUDA was initialised and which driver calls were made; with ``rewrite``, set
    CUDA_VISIBLE_DEVICES to no GPU (as the rank's rewrite would change it) and count the devices
    the driver then sees: 0 means the rewrite holds."""
    proto = _protocol_stdout()
    import torch

    if a["path"]:
        sys.path.insert(0, a["path"])  # the control module's folder
    calls = _trace_cuda_calls()
    _stub_ray()
    pickle.loads(Path(a["blob"]).read_bytes())
    for module in a["modules"]:
        importlib.import_module(module)
    found = {"initialized": torch.cuda.is_initialized(),
             "driver_calls": [c for c in calls if c["call"].split(".")[-1] not in NVML_CALLS],
             "nvml_calls": [c for c in calls if c["call"].split(".")[-1] in NVML_CALLS],
             "megarl_modules": sum(m.startswith("megarl") for m in sys.modules), "megatron_imported": "megatron" in sys.modules}  # fmt: skip
    if a["rewrite"]:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        found["devices_after_rewrite"] = int(torch._C._cuda_getDeviceCount())
    _answer(proto, found)
    return _exit_now(0)


def _trace_cuda_calls() -> list[dict]:
    """Records every call of DRIVER_CALLS / NVML_CALLS (and torch._C's CUDA entry points where
    torch has them) with the first caller outside torch: on CPU too, where they do nothing, the
    calls show what a GPU process would do."""
    import torch

    calls: list[dict] = []
    for name in DRIVER_CALLS + NVML_CALLS:
        original = getattr(torch.cuda, name, None)
        if original is None:
            continue
        wrapper = _recording(original, f"torch.cuda.{name}", calls)
        for module in list(sys.modules.values()):  # torch's own modules bound some of them at import
            if getattr(module, "__name__", "").startswith("torch") and getattr(module, name, None) is original:
                setattr(module, name, wrapper)
    for name in ("_cuda_getDeviceCount", "_cuda_init"):
        if hasattr(torch._C, name):
            setattr(torch._C, name, _recording(getattr(torch._C, name), f"torch._C.{name}", calls))
    return calls


def _recording(fn: Callable[..., Any], label: str, calls: list[dict]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        caller = next((f"{f.filename}:{f.lineno} ({f.name})" for f in reversed(traceback.extract_stack()[:-1])
                       if "/torch/" not in f.filename and f.filename != str(HERE)), "?")  # fmt: skip
        calls.append({"call": label, "from": caller})
        return fn(*args, **kwargs)

    return wrapper


class _RayStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``ray`` and its submodules as stubs: megarl's Ray glue imports Ray at module level,
    the GPU machine has no Ray, and this probe imports none where there is one. Ray itself does
    not touch CUDA; what is checked is megarl's and its dependencies' import-time code."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name == "ray" or name.startswith("ray."):
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        return _RayStubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []


class _RayStubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr.endswith(("Error", "Exception")):
            return type(attr, (Exception,), {})
        return _ray_stub_call


def _ray_stub_call(*args: Any, **kwargs: Any) -> Any:
    """``ray.remote(cls)`` and ``ray.remote(**options)(cls)``: the class itself."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return _ray_stub_call


def _stub_ray() -> None:
    if not any(isinstance(f, _RayStub) for f in sys.meta_path):
        sys.meta_path.insert(0, _RayStub())


# ==== SGLang 0.5.23's receiving side, copied (SGLang cannot be installed on the GPU machine) ====
# python/sglang/srt/weight_sync/tensor_bucket.py: FlattenedTensorMetadata, FlattenedTensorBucket;
# python/sglang/srt/utils/common.py: MultiprocessingSerializer.deserialize, SafeUnpickler (the
# entries of its ALLOWED_GLOBALS a weight payload can name: a subset, so what passes here passes
# there); model_runner_components/weight_updater.py: update_weights_from_tensor (the rebuild).
# The classes are registered under SGLang's module name, so a payload names the same globals as
# one from a trainer with SGLang installed, and the allow-list finds them.

SGLANG_BUCKET_MODULE = "sglang.srt.weight_sync.tensor_bucket"


@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: Any  # torch.Size
    dtype: Any  # torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    supports_multi_dtypes = True

    def __init__(self, named_tensors: Any = None, flattened_tensor: Any = None, metadata: Any = None) -> None:
        import torch

        if named_tensors is not None:
            if not named_tensors:
                raise ValueError("Cannot create empty tensor bucket")
            flat, self.metadata, start = [], [], 0
            for name, tensor in named_tensors:
                flat.append(tensor.flatten().view(torch.uint8))  # [nbytes]
                self.metadata.append(FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, start,
                                                             start + flat[-1].numel(), flat[-1].numel()))  # fmt: skip
                start += flat[-1].numel()
            self.flattened_tensor = torch.cat(flat, dim=0)  # [sum of nbytes] uint8
        else:
            if flattened_tensor is None or metadata is None:
                raise ValueError("Must provide either named_tensors or both flattened_tensor and metadata")
            self.flattened_tensor, self.metadata = flattened_tensor, metadata

    def get_flattened_tensor(self) -> Any:
        return self.flattened_tensor

    def get_metadata(self) -> list[FlattenedTensorMetadata]:
        return self.metadata

    def reconstruct_tensors(self) -> list[tuple[str, Any]]:
        return [(m.name, self.flattened_tensor[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape))
                for m in self.metadata]  # fmt: skip


for _cls in (FlattenedTensorMetadata, FlattenedTensorBucket):
    _cls.__module__ = SGLANG_BUCKET_MODULE


def _register_sglang_replica() -> None:
    """Puts the two classes above where pickle looks for SGLang's (never imports SGLang)."""
    module = types.ModuleType(SGLANG_BUCKET_MODULE)
    module.FlattenedTensorMetadata, module.FlattenedTensorBucket = FlattenedTensorMetadata, FlattenedTensorBucket
    for parent in ("sglang", "sglang.srt", "sglang.srt.weight_sync"):
        sys.modules.setdefault(parent, types.ModuleType(parent))
    sys.modules[SGLANG_BUCKET_MODULE] = module


SGLANG_ALLOWED_GLOBALS = (
    {("builtins", n) for n in ("bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int", "list",
                               "range", "set", "slice", "str", "tuple")}
    | {("collections", "OrderedDict"), ("copyreg", "__newobj__"), ("copyreg", "__newobj_ex__"), ("_codecs", "encode")}
    | {("torch", n) for n in ("Tensor", "Size", "device", "dtype", "UntypedStorage", "bfloat16", "float16", "float32",
                              "float64", "float", "half", "double", "int8", "int16", "int32", "int64", "uint8", "bool",
                              "long", "int", "short")}
    | {("torch.nn.parameter", "Parameter"), ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
       ("torch._tensor", "_rebuild_from_type_v2")}
    | {("torch._utils", n) for n in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
                                     "_rebuild_parameter_with_state")}
    | {("torch.multiprocessing.reductions", n) for n in ("rebuild_tensor", "rebuild_cuda_tensor", "rebuild_storage_fd",
                                                         "rebuild_storage_filename", "rebuild_storage_empty",
                                                         "rebuild_typed_storage", "rebuild_typed_storage_child")}
    | {(SGLANG_BUCKET_MODULE, "FlattenedTensorMetadata"), (SGLANG_BUCKET_MODULE, "FlattenedTensorBucket")}
)  # fmt: skip


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _safe_load_torch_storage  # torch's helper would call an unrestricted torch.load
        if (module, name) in SGLANG_ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def _safe_load_torch_storage(data: bytes) -> Any:
    import torch

    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, torch.storage.TypedStorage | torch.UntypedStorage):
        raise pickle.UnpicklingError(f"Expected a Torch storage, got {type(storage).__name__}")
    return storage


def sglang_rebuild(payload: str, load_format: str | None, device: Any) -> list[tuple[str, Any]]:
    """SGLang's path from one TP rank's payload to the named tensors it hands ``load_weights``."""
    data = _SafeUnpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()
    if load_format == "flattened_bucket":
        meta = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                        end_idx=m.end_idx, numel=m.numel) for m in data["metadata"]]  # fmt: skip
        return FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=meta).reconstruct_tensors()
    return [(name, tensor.to(device)) for name, tensor in data]  # _unwrap_tensor


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str) -> Any:
    """SGLang's join of a weight-update group (sglang/srt/utils/common.py, itself from PyTorch and
    OpenRLHF): rendezvous at ``init_method``, a PrefixStore named after the group, torch's helper."""
    import torch
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        default_pg_timeout,
        rendezvous,
    )

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=default_pg_timeout))
    store.set_timeout(default_pg_timeout)
    store = PrefixStore(group_name, store)
    release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    options = "backend_options" if release >= (2, 6) else "pg_options"
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      **{options: None}, timeout=default_pg_timeout, device_id=None)  # fmt: skip
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


# ==== (b) ipc_push =============================================================================

# A ~0.15B model on a GPU (several 64 MiB buckets, the 64 MiB embedding a bucket of its own);
# the tiny one on CPU, in buckets of 100 KiB so that a push has several. Weights at 2.5x HF's
# init scale: log-probs far enough from uniform that wrong weights show in them, not so peaked
# that bf16's rounding in two implementations (Megatron, HF) parts them.
IPC_GPU = dict(layers=8, hidden=1024, heads=8, kv_heads=2, head_dim=128, ffn=2816, vocab=32000, bucket_mb=64.0, init_std=0.05)
IPC_CPU = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=259, bucket_mb=0.1, init_std=0.05)
IPC_LEAK_TOLERANCE = 64 * MIB  # the allocator's granularity; an IPC handle still open keeps a whole block
PUSH_VARIANTS = {  # name -> (export thread, SGLang payload format, offload + onload of the weights first)
    "overlap_off": (False, "flattened_bucket", False),
    "overlap_on": (True, "flattened_bucket", False),
    "overlap_on_list": (True, None, False),
    "after_offload_onload": (True, "flattened_bucket", True),
}


def section_ipc_push(rep: Report) -> str | None:
    import torch

    cuda = torch.cuda.is_available()
    shape, dtype = (IPC_GPU, "bfloat16") if cuda else (IPC_CPU, "float32")
    tmp = Path(tempfile.mkdtemp(prefix="megarl-probe-ipc-"))
    try:
        path = rep.part("build the HF model", _build_hf_dir, tmp / "model", shape, dtype)
        rep.result("model", {**shape, "dtype": dtype, "export": "megarl's own: PolicyWorker.export_weights (Megatron, "
                             "TP=1) -> WeightStream -> SGLangTensorTransport, the engine a process of its own"})  # fmt: skip
        runs = {"default allocator": ({}, list(PUSH_VARIANTS))}
        if cuda:
            runs["expandable_segments:True"] = ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
                                                ["overlap_on", "after_offload_onload"])  # fmt: skip
        else:
            rep.skip("expandable_segments:True on the producer", f"{NO_CUDA} (a CUDA allocator setting)")
            rep.skip("GPU memory before / during / after", f"{NO_CUDA}: CPU tensors travel pickled with their "
                     "bytes, not as CUDA IPC handles")  # fmt: skip
        rep.result("ptrace_scope", _read_text("/proc/sys/kernel/yama/ptrace_scope"))
        for label, (env, variants) in runs.items():
            if path is None:
                break
            args = {"model": str(path), "dtype": dtype, "device": "cuda" if cuda else "cpu",
                    "bucket_mb": shape["bucket_mb"], "variants": variants}  # fmt: skip
            found = rep.part(f"push, {label}", _push_run, rep, args, env) or {}
            rep.result(f"{label}: producer timing", found.get("timing"))
            for name, r in found.get("variants", {}).items():
                _judge_push(rep, f"{label}, {name}", r, cuda)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return None


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _push_run(rep: Report, args: dict, env: dict[str, str | None]) -> dict:
    """The engine (receiver) and the trainer (producer) as two children of this process, as an
    SGLang server and a policy rank are of their launchers: neither descends from the other,
    which CUDA IPC's file-descriptor path (expandable segments: pidfd_getfd under Yama's
    ptrace_scope) cares about. They talk over a local socket; the receiver keeps the default
    allocator whatever the producer's."""
    key = os.urandom(16).hex()
    receiver = Peer("ipc-receiver", {"model": args["model"], "dtype": args["dtype"], "device": args["device"], "authkey": key},
                    env={"PYTORCH_CUDA_ALLOC_CONF": None})  # fmt: skip
    try:
        address = receiver.read(timeout=60)["address"]  # bound before it loads its model: both load at once
        return _run_role("ipc-producer", args | {"receiver": address, "authkey": key}, timeout=rep.left(), env=env)
    finally:
        receiver.close()


class _Link:
    """The producer's connection to the receiver: one request, one answer."""

    def __init__(self, address: list, authkey: str) -> None:
        from multiprocessing.connection import Client

        self.conn = Client((address[0], address[1]), authkey=bytes.fromhex(authkey))

    def ask(self, msg: dict, timeout: float = 120.0) -> dict:
        self.conn.send(msg)
        if not self.conn.poll(timeout):
            raise RuntimeError(f"the receiver did not answer {msg['op']!r} within {timeout:.0f} s")
        reply = self.conn.recv()
        if "error" in reply:
            raise RuntimeError(f"receiver: {reply['error']}")
        return reply

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send({"op": "quit"})
            self.conn.close()


def _judge_push(rep: Report, label: str, r: dict, cuda: bool) -> None:
    rep.result(label, r)
    if "error" in r:
        rep.check(f"{label}: the push ran", False, r["error"])
        return
    rep.check(f"{label}: every tensor arrived bit for bit", not r["mismatched"] and not r["missing"],
              {"mismatched": r["mismatched"][:5], "missing": r["missing"][:5]} if r["mismatched"] or r["missing"] else None)  # fmt: skip
    rep.check(f"{label}: megarl's export check passed", r["export_check"] == "ok", r["export_check"])
    rep.check(f"{label}: the engine's log-probs differed before the push (the comparison can tell)",
              r["logprob_diff_before"]["mean"] > r["max_logprob_diff"], r["logprob_diff_before"])  # fmt: skip
    rep.check(f"{label}: engine log-probs = trainer's (mean |diff| <= max_logprob_diff {r['max_logprob_diff']})",
              r["logprob_diff_after"]["mean"] <= r["max_logprob_diff"],
              {"before": r["logprob_diff_before"], "after": r["logprob_diff_after"]})  # fmt: skip
    if cuda:
        leak = r["memory"]["held_after_push"]
        rep.check(f"{label}: the push holds no GPU memory once done", leak <= IPC_LEAK_TOLERANCE, f"{leak / MIB:.1f} MiB")
        if label in ("default allocator, overlap_off", "default allocator, overlap_on"):
            rep.feed("rollout push working memory (megarl/plan/planner.py: held x bucket + 2 x gather)",
                     f"{r['memory']['plan_working_bytes'] / MIB:.0f} MiB", f"{r['memory']['peak_working_bytes'] / MIB:.0f} MiB",
                     f"ipc_push {label}: the producer's peak allocation during the push above what it held before")  # fmt: skip


def role_ipc_producer(a: dict) -> int:
    """The trainer's side: a policy worker, megarl's tensor transport, an engine that is another
    process (the receiver); one push per variant."""
    proto = _protocol_stdout()
    _register_sglang_replica()
    start, found, timing = time.monotonic(), {}, {}
    worker = _policy(Path(a["model"]), a["dtype"], micro=4, distributed=True)
    batch = _bench().make_batch(4, 16, 16, _vocab_of(a["model"]))
    timing["policy_built_s"] = round(time.monotonic() - start, 2)
    receiver = _Link(a["receiver"], a["authkey"])
    try:
        names = receiver.ask({"op": "names"}, timeout=300)["names"]  # answered once its model is loaded
        timing["receiver_ready_s"] = round(time.monotonic() - start, 2)
        for version, name in enumerate(a["variants"], start=1):
            try:
                found[name] = _push_variant(worker, receiver, batch, PUSH_VARIANTS[name], version, a, names)
            except Exception as exc:  # noqa: BLE001 - one variant's failure is its result; the others still run
                traceback.print_exc()
                found[name] = {"error": f"{type(exc).__name__}: {str(exc).strip()[:400]}"}
            timing[f"{name}_done_s"] = round(time.monotonic() - start, 2)
    finally:
        receiver.close()
    _answer(proto, {"variants": found, "timing": timing})
    return _exit_now(0)


def _vocab_of(model: str) -> int:
    return json.loads((Path(model) / "config.json").read_text())["vocab_size"]


def _push_variant(worker: Any, receiver: _Link, batch: Any, variant: tuple, version: int, a: dict,
                  names: list[str]) -> dict:  # fmt: skip
    from megarl.config.rollout_sections import WeightSyncConfig

    overlap, load_format, offload_first = variant
    receiver.ask({"op": "reset"})  # fresh random weights: this push must replace every tensor
    states = worker.trainer.states
    if offload_first:  # the hand-over before a push: everything off, then the weights back (weight_push phase)
        states.offload(["weights", "grads", "optimizer"])
        states.onload(["weights"])
    expected = {n: _fingerprint(t) for n, t in worker.export_weights(gather_bytes=MIB)}
    trainer = _trainer_logprobs(worker, batch)  # [B, R]
    tokens, _, _ = batch.sequences()  # [B, P + R]
    ask_logprobs = {"op": "logprobs", "tokens": tokens.tolist(), "prompt_len": batch.prompt_len}
    before = _logprob_diff(receiver.ask(ask_logprobs)["logprobs"], trainer)
    engine, pushed = _push_through_megarl(worker, receiver, overlap, load_format, version, a["bucket_mb"])
    if offload_first:
        states.onload(["grads", "optimizer"])
    received, raw = engine.received, pushed.pop("memory_raw")
    return {"overlap": overlap, "load_format": load_format, "offload_first": offload_first, **pushed,
            "mismatched": sorted(n for n in expected if n in received and received[n] != expected[n]),
            "missing": sorted((set(expected) | set(names)) - set(received)),
            "logprob_diff_before": before, "logprob_diff_after": _logprob_diff(receiver.ask(ask_logprobs)["logprobs"], trainer),
            "max_logprob_diff": WeightSyncConfig.model_fields["max_logprob_diff"].default,
            "memory": _push_memory(raw, engine.samples, _plan_push_bytes(a, overlap))}  # fmt: skip


def _push_through_megarl(worker: Any, receiver: _Link, overlap: bool, load_format: str | None, version: int,
                         bucket_mb: float) -> tuple[_ReceiverEngine, dict]:  # fmt: skip
    """One push the way PolicyRank.push_weights makes it: the stream observed by the export
    check, SGLangTensorTransport's posts, ipc_collect, the verdict."""
    from functools import partial

    import torch

    from megarl.rollout_sglang.engine import EngineEndpoint
    from megarl.weight_sync.cuda_ipc import SGLangTensorTransport
    from megarl.weight_sync.stream import WeightStream

    stream = WeightStream(partial(worker.export_weights, gather_bytes=MIB, collect="all"), bucket_mb, overlap=overlap,
                          observe=partial(worker.export_check.observe, collect="all"))  # fmt: skip
    engine = _ReceiverEngine(receiver)
    transport = SGLangTensorTransport(stream, rank=0, make_engine=lambda _endpoint: engine,
                                      bucket_class=FlattenedTensorBucket if load_format else None)  # fmt: skip
    transport.connect([EngineEndpoint(url="probe://receiver", tp=1)])
    before = _settled_memory()
    if before is not None:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        metrics = transport.push(version)
    except Exception as exc:
        worker.export_check.verdict(version, failure=exc)  # as PolicyRank.push_weights: the next push starts clean
        transport.close()
        raise
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if before is not None else None
    after_push = _memory()  # the transport has called ipc_collect: what the push still holds
    try:
        worker.export_check.verdict(version)
        verdict = "ok"
    except Exception as exc:  # noqa: BLE001 - a refused export is this variant's result
        verdict = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
    transport.close()
    raw = {"before": before, "peak_allocated": peak, "after_push": after_push, "settled": _settled_memory()}
    return engine, {"seconds": round(seconds, 4), "metrics": metrics, "stream_peak_bytes": stream.peak_bytes,
                    "export_check": verdict, "memory_raw": raw}  # fmt: skip


class _ReceiverEngine:
    """What SGLangTensorTransport calls on an engine (the order: megarl/weight_sync/sglang_push.py),
    each bucket's payload sent to the receiver process instead of an SGLang server; notes the
    GPU's memory once the bucket is loaded, while the transport still holds it."""

    tp, url = 1, "probe://receiver"

    def __init__(self, receiver: _Link) -> None:
        self.receiver, self.version = receiver, 0
        self.received: dict[str, list[int]] = {}
        self.samples: list[dict] = []

    def update_from_tensor(self, payloads: list[str], load_format: str | None, version: int | None) -> None:
        reply = self.receiver.ask({"op": "load", "payload": payloads[0], "load_format": load_format})
        self.received.update(reply["fingerprints"])
        here = _memory()  # the transport still holds the bucket and its payload
        if here is not None:
            self.samples.append({"producer": here, "receiver_free_while_open": reply["free_while_open"]})
        if version is not None:
            self.version = version

    def check_weight_version(self, expected: int) -> None:
        if self.version != expected:
            raise RuntimeError(f"the receiver holds version {self.version}, the push was {expected}")

    def pause_generation(self, mode: str = "abort") -> None: ...
    def flush_cache(self) -> int: return 0  # fmt: skip
    def begin_weight_update(self) -> None: ...
    def end_weight_update(self) -> None: ...
    def continue_generation(self) -> None: ...
    def close(self) -> None: ...


def _logprob_diff(engine: list[list[float]], trainer: Any) -> dict:
    import torch

    diff = (torch.tensor(engine) - trainer.float()).abs()  # [B, R]; every response token counts here
    return {"mean": round(float(diff.mean()), 6), "max": round(float(diff.max()), 6)}


def _push_memory(raw: dict, samples: list[dict], plan_bytes: float) -> dict:
    """Bytes: what the push took above what the producer held before (its peak allocation), the
    GPU's free memory during (lowest, while the receiver had a bucket open), what it held after
    the push, and what megarl's planner counts for it."""
    before = raw["before"]
    if before is None:
        return {}
    during = min((s["producer"]["free"] for s in samples), default=None)
    return {"free_before": before["free"], "free_lowest_during": during,
            "free_after_push": raw["after_push"]["free"], "free_settled": raw["settled"]["free"],
            "held_after_push": max(0, before["free"] - raw["settled"]["free"]),
            "peak_working_bytes": raw["peak_allocated"] - before["allocated"],
            "plan_working_bytes": plan_bytes,
            "samples": samples}  # fmt: skip


def _plan_push_bytes(a: dict, overlap: bool) -> float:
    """The push's working memory as megarl/plan/planner.py's memory check counts it for the tensor
    transport: (2 with overlap, else 1) + 1 (the flattened copy) buckets, plus a TP gather group
    twice; a bucket or a group is at least the largest tensor."""
    from megarl.config.architectures import arch_from_hf_dir
    from megarl.config.rollout_sections import WeightSyncConfig
    from megarl.memory.residency import WEIGHT_PUSH
    from megarl.plan.gpu_memory import largest_hf_tensor_bytes, phase_working_bytes

    largest = largest_hf_tensor_bytes(arch_from_hf_dir(a["model"]), a["dtype"])
    gather_mb = WeightSyncConfig.model_fields["gather_mb"].default
    bucket, gather = (max(mb * MIB, largest) for mb in (a["bucket_mb"], gather_mb))
    return phase_working_bytes(None, None, ((2 if overlap else 1) + 1) * bucket, gather)[WEIGHT_PUSH]


def _load_into(params: dict[str, Any], named: list[tuple[str, Any]]) -> dict[str, list[int]]:
    """SGLang's load_weights for this probe: each tensor copied into the parameter of its name
    (dtype and shape must be the parameter's); returns each tensor's fingerprint."""
    import torch

    prints = {}
    with torch.no_grad():
        for name, tensor in named:
            if tensor.dtype != params[name].dtype or tensor.shape != params[name].shape:
                raise ValueError(f"{name}: got {tensor.dtype} {tuple(tensor.shape)}, the model has "
                                 f"{params[name].dtype} {tuple(params[name].shape)}")  # fmt: skip
            prints[name] = _fingerprint(tensor)
            params[name].copy_(tensor)
    return prints


def role_ipc_receiver(a: dict) -> int:
    """The engine's side: an HF model of the same shape with other random weights; each bucket's
    payload rebuilt as SGLang 0.5.23 does and copied into the model's parameters. Serves one
    producer over a local socket; stdin's end (the section's close) ends it too."""
    from multiprocessing.connection import Listener

    proto = _protocol_stdout()
    listener = Listener(("127.0.0.1", 0), authkey=bytes.fromhex(a["authkey"]))
    _answer(proto, {"address": list(listener.address)})
    threading.Thread(target=_exit_at_stdin_end, daemon=True).start()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    _register_sglang_replica()
    device = torch.device(a["device"])
    if device.type == "cuda":
        torch.cuda.set_device(0)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(a["model"]), dtype=getattr(torch, a["dtype"]))
    model = model.to(device).eval()
    params = dict(model.named_parameters())
    handlers = _receiver_handlers(model, params, device)
    handlers["names"] = lambda msg: {"names": sorted(params)}
    conn = listener.accept()
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg["op"] == "quit":
            break
        try:
            reply = handlers[msg["op"]](msg)
        except Exception as exc:  # noqa: BLE001 - the producer fails the variant, with the cause
            traceback.print_exc()
            reply = {"error": f"{type(exc).__name__}: {str(exc).strip()[:400]}"}
        conn.send(reply)
    return _exit_now(0)


def _exit_at_stdin_end() -> None:
    for line in sys.stdin:
        if json.loads(line).get("op") == "quit":
            break
    _exit_now(0)


def _receiver_handlers(model: Any, params: dict[str, Any], device: Any) -> dict[str, Callable[[dict], dict]]:
    import torch

    cuda = device.type == "cuda"

    def load(msg: dict) -> dict:
        named = sglang_rebuild(msg["payload"], msg["load_format"], device)
        prints = _load_into(params, named)
        if cuda:
            torch.cuda.synchronize()  # the copies are done before the producer may reuse the memory
        free = torch.cuda.mem_get_info()[0] if cuda else None
        del named  # the IPC-opened memory goes back to the producer (SGLang drops it too)
        if cuda:
            torch.cuda.empty_cache()  # the fingerprints' scratch: not to be read as the producer's
        return {"fingerprints": prints, "free_while_open": free}

    def reset(msg: dict) -> dict:
        with torch.no_grad():
            for p in params.values():  # other weights than the trainer's, norms included
                p.normal_(0.0, 0.1)
        return {}

    def logprobs(msg: dict) -> dict:
        tokens, p = torch.tensor(msg["tokens"], device=device), msg["prompt_len"]  # [B, P + R]
        with torch.no_grad():
            logits = model(tokens).logits[:, p - 1 : -1].float()  # [B, R, V]: position t predicts token t + 1
        lp = torch.log_softmax(logits, -1).gather(-1, tokens[:, p:, None])[..., 0]  # [B, R]
        if cuda:
            torch.cuda.empty_cache()
        return {"logprobs": lp.cpu().tolist()}

    return {"load": load, "reset": reset, "logprobs": logprobs}


# ==== (c) offload ==============================================================================

OFFLOAD_CPU = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=259)
STATES = ("weights", "grads", "optimizer")
COPIED = ("weights", "optimizer")  # grads are freed without a copy and come back zeroed


def section_offload(rep: Report) -> str | None:
    import torch

    cuda = torch.cuda.is_available()
    bench = _bench()
    shape = bench.PRESETS["1b"] if cuda else OFFLOAD_CPU
    rows, half = (2, 256) if cuda else (4, 8)
    tmp = Path(tempfile.mkdtemp(prefix="megarl-probe-offload-"))
    try:
        # On the GPU: this process is the trainer anyway (the ipc_push section's stays off the GPU).
        path = rep.part("build the HF model", _build_hf_dir, tmp / "model", shape, "bfloat16", "cuda" if cuda else "cpu")
        worker = path and rep.part("build the policy (bf16, distributed optimizer)", _policy, path, "bfloat16",
                                   micro=1, distributed=True)  # fmt: skip
        if worker is None:
            return None
        batch = bench.make_batch(rows, half, half, shape["vocab"])
        rep.result("model", {"preset": "1b (bench/train_step.py)" if cuda else "tiny", **shape, "dtype": "bfloat16",
                             "params": sum(p.numel() for p in worker.model.module.parameters()),
                             "batch": f"{rows} rows x {2 * half} tokens"})  # fmt: skip
        rep.part("first update (Adam's moments exist from here)", _first_update, rep, worker, batch, path)
        rep.part("offload cycle 1: host buffers made and pinned; bit-exact onload", _cycle_exact, rep, worker)
        rep.part("offload cycle 2: buffers reused; what a second process can allocate", _cycle_view, rep, worker, cuda)
        rep.part("second update after the cycles", _second_update, rep, worker, batch)
        if not cuda:
            for what in ("GPU memory freed (mem_get_info)", "D2H / H2D GB/s", "a second process's allocation"):
                rep.skip(what, f"{NO_CUDA}: on CPU megarl's offload copies host to host and frees nothing")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return None


def _first_update(rep: Report, worker: Any, batch: Any, path: Path) -> None:
    import torch

    from megarl.config.architectures import arch_from_hf_dir
    from megarl.plan.gpu_memory import train_memory

    if _settled_memory() is not None:  # the HF model's and the build's cached blocks are not the update's slack
        torch.cuda.reset_peak_memory_stats()
    metrics = worker.update(batch, _bench().pg_loss)
    rep.check("first update finite", all(math.isfinite(v) for v in metrics.values()), metrics)
    measured = worker.trainer.states.device_bytes()
    plan = train_memory(arch_from_hf_dir(path), tp=1, pp=1, dp=1, tokens_per_micro_batch=batch.prompt_len + batch.response_len,
                        dtype="bfloat16", recompute="none", sequence_parallel=False, distributed_optimizer=True)  # fmt: skip
    planned = {"weights": plan.weights, "grads": plan.grads, "optimizer": plan.optimizer}
    rep.result("states_bytes", {s: {"measured": measured[s], "plan": int(planned[s]),
                                    "measured_over_plan": round(measured[s] / planned[s], 4)} for s in STATES})  # fmt: skip
    if torch.cuda.is_available():
        slack = torch.cuda.max_memory_reserved() - torch.cuda.max_memory_allocated()
        rep.result("update_peak", {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved(),
                                   "allocator_slack": slack})  # fmt: skip


def _state_views(worker: Any) -> dict[str, list[Any]]:
    """Each state's storages with bytes now, as flat ``[nbytes]`` uint8 views (kept across the
    offload: onload resizes the same storages back)."""
    import torch

    return {s: [torch.empty(0, dtype=torch.uint8, device=st.device).set_(st) for st in sts]
            for s, sts in worker.trainer.states.storages().items()}  # fmt: skip


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    import torch

    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def _cycle_exact(rep: Report, worker: Any) -> None:
    """Offload everything and onload it back: weights and optimizer bit for bit (against copies
    taken on the device before), grads zeroed; the first offload also allocates and pins the host
    buffers, so its speed is the first step's, not the steady one's."""
    import torch

    states = worker.trainer.states
    views = _state_views(worker)
    kept = {s: [v.clone() for v in views[s]] for s in COPIED}  # on the device: no host round trip to trust
    total = sum(v.numel() for vs in views.values() for v in vs)
    copied = sum(v.numel() for s in COPIED for v in views[s])
    before = _settled_memory()
    freed, off_s = _timed(lambda: states.offload(STATES))
    after, left_on_device = _memory(), states.device_bytes()
    _, on_s = _timed(lambda: states.onload(STATES))
    rep.check("every state left the device (megarl's count)", freed == total and not any(left_on_device.values()),
              {"freed": freed, "states": total, "left": left_on_device})  # fmt: skip
    exact = all(torch.equal(v, k) for s in COPIED for v, k in zip(views[s], kept[s]))
    rep.check("weights and optimizer bit for bit after onload", exact)
    rep.check("grads zeroed after onload", all(int(v.count_nonzero()) == 0 for v in views["grads"]))
    del kept
    cycle = {"states_bytes": total, "copied_bytes": copied, "offload_s": round(off_s, 4), "onload_s": round(on_s, 4)}
    if before is not None:
        cycle |= {"freed_on_device": after["free"] - before["free"], "d2h_gb_per_s": round(copied / off_s / 1e9, 2),
                  "h2d_gb_per_s": round(copied / on_s / 1e9, 2)}  # fmt: skip
        rep.check("the GPU gained >= 95 % of the states' bytes", cycle["freed_on_device"] >= 0.95 * total,
                  f"{cycle['freed_on_device'] / GIB:.2f} of {total / GIB:.2f} GiB")  # fmt: skip
    rep.result("cycle_1_first_offload", cycle)


def _cycle_view(rep: Report, worker: Any, cuda: bool) -> None:
    """The steady offload (host buffers reused): speeds, the trainer's residual, and what an
    engine process sees and can allocate while the policy is off the device."""
    states = worker.trainer.states
    views = _state_views(worker)
    total = sum(v.numel() for vs in views.values() for v in vs)
    copied = sum(v.numel() for s in COPIED for v in views[s])
    before = _settled_memory()
    _, off_s = _timed(lambda: states.offload(STATES))
    after = _memory()
    engine = _run_role("engine-view", {}, timeout=rep.left()) if cuda else None
    if engine is not None:  # the engine's own context: what it found taken beyond what the trainer held
        engine["context_bytes"] = after["free"] - engine["free_at_start"]
    _, on_s = _timed(lambda: states.onload(STATES))
    cycle = {"states_bytes": total, "copied_bytes": copied, "offload_s": round(off_s, 4), "onload_s": round(on_s, 4)}
    if not cuda:
        rep.result("cycle_2_steady", cycle)
        return
    cycle |= {"d2h_gb_per_s": round(copied / off_s / 1e9, 2), "h2d_gb_per_s": round(copied / on_s / 1e9, 2),
              "freed_on_device": after["free"] - before["free"], "trainer_residual_allocated": after["allocated"],
              "trainer_reserved": after["reserved"], "trainer_outside_allocator": after["total"] - after["free"] - after["reserved"],
              "engine": engine}  # fmt: skip
    rep.result("cycle_2_steady", cycle)
    rep.check("the GPU gained >= 95 % of the states' bytes (steady cycle)", cycle["freed_on_device"] >= 0.95 * total,
              f"{cycle['freed_on_device'] / GIB:.2f} of {total / GIB:.2f} GiB")  # fmt: skip
    rep.check("a second process allocates what it sees free (within 512 MiB)",
              engine["allocated"] >= engine["free_at_start"] - 512 * MIB,
              f"{engine['allocated'] / GIB:.2f} of {engine['free_at_start'] / GIB:.2f} GiB")  # fmt: skip
    _feed_offload(rep, cycle)


def _feed_offload(rep: Report, cycle: dict) -> None:
    from megarl.config.sections import ClusterConfig
    from megarl.plan.gpu_memory import SGLANG_CONTEXT_GIB, TRAINER_RUNTIME_GIB

    slack = rep.data["results"].get("update_peak", {}).get("allocator_slack", 0)
    engine_ctx = cycle["engine"]["context_bytes"]
    trainer = cycle["trainer_outside_allocator"] + cycle["trainer_residual_allocated"] + slack
    rep.result("runtime_overhead", {"trainer_outside_allocator": cycle["trainer_outside_allocator"],
                                    "trainer_residual_allocated": cycle["trainer_residual_allocated"],
                                    "allocator_slack_at_update_peak": slack, "engine_context": engine_ctx,
                                    "trainer_gib": _gib(trainer), "colocated_gib": _gib(trainer + engine_ctx)})  # fmt: skip
    rep.feed("megarl/plan/gpu_memory.py:TRAINER_RUNTIME_GIB", TRAINER_RUNTIME_GIB, _gib(trainer),
             "offload: the trainer's memory outside its allocator (CUDA context, NCCL) + what offload leaves allocated "
             "+ the update's allocator slack (world 1: NCCL's buffers grow with peers)")  # fmt: skip
    rep.feed("megarl/plan/gpu_memory.py:SGLANG_CONTEXT_GIB", SGLANG_CONTEXT_GIB, _gib(engine_ctx),
             "offload: a second (engine) process's CUDA context on the GPU, before it allocates (no NCCL, no graphs)")  # fmt: skip
    host = ClusterConfig.model_fields["host_gb_per_s"].default
    rep.feed("cluster.host_gb_per_s (megarl/config/sections.py default)", host,
             min(cycle["d2h_gb_per_s"], cycle["h2d_gb_per_s"]),
             "offload: the slower of megarl's steady offload (D2H) and onload (H2D) of the policy, whole calls")  # fmt: skip


def role_engine_view(a: dict) -> int:
    """A second process on the GPU, as an engine is: what it sees free, and what it can allocate
    (1 GiB blocks, then 64 MiB, until the allocator refuses)."""
    proto = _protocol_stdout()
    import torch

    torch.cuda.set_device(0)
    torch.empty(1, device="cuda")  # its own context first: an engine has one too
    free, total = torch.cuda.mem_get_info()
    blocks, got = [], 0
    for size in (GIB, 64 * MIB):
        while True:
            try:
                blocks.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                break
            got += size
    _answer(proto, {"free_at_start": free, "total": total, "allocated": got})
    return _exit_now(0)


def _second_update(rep: Report, worker: Any, batch: Any) -> None:
    metrics = worker.update(batch, _bench().pg_loss)
    rep.check("second update after offload/onload finite", all(math.isfinite(v) for v in metrics.values()), metrics)


# ==== (d) nccl_group ===========================================================================

# MiB broadcast per group test: bf16 and fp32 tensors of the kinds a push sends (a matrix, a
# vector, an odd size), a third each.
GROUP_TENSORS_MB = {"cuda": 192, "cpu": 1}
JOIN_TIMEOUT = timedelta(seconds=20)  # a rendezvous that does not meet fails the part, not the section's clock


def section_nccl_group(rep: Report) -> str | None:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(0)
    # The trainer has its default group (Megatron's) before any update group; SGLang asserts one too.
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    if cuda:
        rep.part("NCCL, world 1: open, broadcast, close, reopen under the same name", _nccl_world1, rep)
    else:
        rep.skip("NCCL, world 1: open, broadcast, close, reopen", NO_CUDA)
    rep.part("gloo, 2 processes: megarl's group against SGLang's join", _gloo_join, rep, "cuda" if cuda else "cpu")
    return None  # the default group goes with the process (_exit_now): a destroy could only hang


def _group_tensors(device: str) -> list[Any]:
    import torch

    n = GROUP_TENSORS_MB[device] * MIB // 6  # elements of a bf16 third
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(n // 1024, 1024, generator=g, device=device).to(torch.bfloat16),  # [n / 1024, 1024] bf16
            torch.randn(n, generator=g, device=device).to(torch.bfloat16),  # [n] bf16
            torch.randn(n // 2 + 3, generator=g, device=device)]  # [n / 2 + 3] fp32  # fmt: skip


def _nccl_world1(rep: Report) -> None:
    import torch

    from megarl.weight_sync.update_group import (
        broadcast_tensors,
        close_update_group,
        open_update_group,
        stage_group_name,
    )

    name, port = stage_group_name(0), _free_port()
    tensors = _group_tensors("cuda")
    expected = [_fingerprint(t) for t in tensors]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    found: dict[str, Any] = {"group": name, "bytes": nbytes}
    group, found["open_s"] = _timed(lambda: open_update_group("127.0.0.1", port, 0, 1, name, backend="nccl", timeout=JOIN_TIMEOUT))
    _, found["first_broadcast_s"] = _timed(lambda: broadcast_tensors(group, tensors))  # the communicator starts here
    _, found["broadcast_s"] = _timed(lambda: broadcast_tensors(group, tensors))
    _, found["close_s"] = _timed(lambda: close_update_group(group))
    # A fixed master port (master_ports) reopens on the same port; the default picks a new one.
    for how, again in (("same_port", port), ("new_port", _free_port())):
        try:
            group, found[f"reopen_{how}_s"] = _timed(
                lambda p=again: open_update_group("127.0.0.1", p, 0, 1, name, backend="nccl", timeout=JOIN_TIMEOUT))
            broadcast_tensors(group, tensors)
            torch.cuda.synchronize()
            close_update_group(group)
            found[f"reopen_{how}"] = "ok"
        except Exception as exc:  # noqa: BLE001 - recorded: which reopen works is the finding
            found[f"reopen_{how}"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
    rep.result("nccl_world1", found)
    rep.check("NCCL: tensors intact after the broadcasts", [_fingerprint(t) for t in tensors] == expected)
    rep.check("NCCL: reopened under the same name (on the same or a new port)",
              "ok" in (found["reopen_same_port"], found["reopen_new_port"]),
              {k: found[k] for k in ("reopen_same_port", "reopen_new_port")})  # fmt: skip


def _gloo_join(rep: Report, device: str) -> None:
    """Rank 0: megarl's open_update_group on gloo; rank 1: SGLang's init_custom_process_group in a
    second process (the engine), which receives each tensor as SGLang's update does; then both
    close, and join again under the same name."""
    from megarl.weight_sync.update_group import (
        broadcast_tensors,
        close_update_group,
        open_update_group,
        stage_group_name,
    )

    name = stage_group_name(0)
    tensors = _group_tensors(device)
    spec = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]
    expected = [_fingerprint(t) for t in tensors]
    engine = Peer("sglang-join", {"device": device, "group": name, "tensors": spec})
    found: dict[str, Any] = {"device": device, "bytes": sum(t.numel() * t.element_size() for t in tensors)}
    try:
        engine.read(timeout=rep.left())
        for attempt in ("first join", "rejoin"):  # the rejoin: same name, a new port (megarl's default)
            port = _free_port()
            engine.send({"op": "join", "port": port})  # it answers after the rendezvous, which needs us too
            group, open_s = _timed(lambda p=port: open_update_group("127.0.0.1", p, 0, 2, name, backend="gloo", timeout=JOIN_TIMEOUT))
            engine.read(timeout=60)
            engine.send({"op": "receive"})
            _, bcast_s = _timed(lambda g=group: broadcast_tensors(g, tensors))
            got = engine.read(timeout=rep.left())["fingerprints"]
            engine.ask({"op": "destroy"})
            close_update_group(group)
            key = attempt.replace(" ", "_")
            found |= {f"{key}_port": port, f"{key}_open_s": round(open_s, 4), f"{key}_broadcast_s": round(bcast_s, 4),
                      f"{key}_gb_per_s": round(found["bytes"] / bcast_s / 1e9, 3)}  # fmt: skip
            rep.check(f"gloo ({device} tensors), {attempt}: the engine received every tensor bit for bit", got == expected)
    finally:
        engine.close()
        rep.result("gloo_two_processes", found)


def role_sglang_join(a: dict) -> int:
    """The engine's side of a weight-update group, as SGLang 0.5.23's model runner does it."""
    import torch
    import torch.distributed as dist

    device = torch.device(a["device"])
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    groups: dict[str, Any] = {}

    def join(msg: dict) -> dict:
        groups[a["group"]] = init_custom_process_group("gloo", f"tcp://127.0.0.1:{msg['port']}", 2, 1, a["group"])
        return {"joined": True}

    def receive(msg: dict) -> dict:  # receive_weights_from_distributed, load_format None
        weights, handles = [], []
        for dtype, shape in a["tensors"]:
            weights.append(torch.empty(shape, dtype=getattr(torch, dtype), device=device))
            handles.append(dist.broadcast(weights[-1], src=0, group=groups[a["group"]], async_op=True))
        for handle in handles:
            handle.wait()
        return {"fingerprints": [_fingerprint(w) for w in weights]}

    def destroy(msg: dict) -> dict:
        dist.destroy_process_group(groups.pop(a["group"]))
        return {}

    return _serve({"join": join, "receive": receive, "destroy": destroy}, ready={"ready": True})


# ==== (e) packed_rope ==========================================================================

# bench/results/train_step.md: "The 1B model's step at 8 rows x 4 on a GPU is still to be re-measured".
PACKED_ROPE_ARGS = ["--presets", "1b", "--seqs", "4096", "--rows", "8", "--micro", "4",
                    "--attention", "padded,packed,packed-seg,padded,packed,packed-seg", "--profile"]  # fmt: skip


def section_packed_rope(rep: Report) -> str | None:
    import torch

    if not torch.cuda.is_available():
        return f"{NO_CUDA} (its CPU half, the count of torch operations, is in bench/results/train_step.md)"
    results = rep.out / "probe_packed_rope_train_step.json"
    results.unlink(missing_ok=True)
    cmd = [sys.executable, str(ROOT / "bench" / "train_step.py"), *PACKED_ROPE_ARGS, "--results", str(results)]
    rep.result("command", " ".join(["python bench/train_step.py", *PACKED_ROPE_ARGS]))
    try:  # the bench writes its file after every row: a cut run keeps the rows it measured
        code = subprocess.run(cmd, cwd=ROOT, env=_child_env(), timeout=rep.left(10)).returncode
    except subprocess.TimeoutExpired:
        code = None
    rows = [r for entry in (json.loads(results.read_text()).values() if results.exists() else []) for r in entry["results"]]
    rep.result("rows", rows)
    rep.check("the bench finished", code == 0, "cut at the section's time limit" if code is None else f"exit code {code}")
    by = {a: [r for r in rows if r.get("attention") == a and "error" not in r] for a in ("padded", "packed", "packed-seg")}
    rep.result("by_attention", {a: _rope_summary(rs) for a, rs in by.items()})
    if by["padded"] and by["packed"]:
        med = {a: statistics.median(r["step_seconds"] for r in rs) for a, rs in by.items() if rs}
        rep.result("ratios", {"packed_over_padded": round(med["packed"] / med["padded"], 3),
                              "packed_seg_over_packed": round(med["packed-seg"] / med["packed"], 3) if "packed-seg" in med else None})  # fmt: skip
        rep.feed("bench/results/train_step.md: the 1B model at 8 rows x 4 (packed / padded step time)", 1.33,
                 rep.data["results"]["ratios"]["packed_over_padded"], "packed_rope: medians of the interleaved rows "
                 "(1.33 = 0.69 / 0.52 s, measured before megarl's packed rope)")  # fmt: skip
    return None


def _rope_summary(rows: list[dict]) -> dict:
    keys = ("step_seconds", "tokens_per_s", "gpu_busy", "host_ops", "peak_gib")
    return {k: [r.get(k) for r in rows] for k in keys} | {"runs": len(rows)}


# ==== the roles this script plays in child processes ============================================

SECTION_FUNCS: dict[str, Callable[[Report], str | None]] = {
    "cuda_init": section_cuda_init, "ipc_push": section_ipc_push, "offload": section_offload,
    "nccl_group": section_nccl_group, "packed_rope": section_packed_rope,
}  # fmt: skip
ROLES: dict[str, Callable[[dict], int]] = {
    "section": role_section, "unpickle": role_unpickle, "ipc-producer": role_ipc_producer,
    "ipc-receiver": role_ipc_receiver, "engine-view": role_engine_view, "sglang-join": role_sglang_join,
}  # fmt: skip

if __name__ == "__main__":
    sys.exit(main())
