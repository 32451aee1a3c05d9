"""Launch, watch and stop one SGLang HTTP server process (one rollout engine).

A :class:`ServerSpec` (typed, immutable) says how one engine runs: model, TP size, GPUs,
memory fraction, port. :func:`build_launch_command` turns it into the
``python -m sglang.launch_server`` command line and :class:`SGLangServer` runs that command
in its own process group, logs to a file, waits for ``/health_generate``, detects a dead
process and relaunches it.

A spec with ``device="cpu"`` runs SGLang's CPU engine (``--device cpu``,
``SGLANG_USE_CPU_ENGINE=1``): what the real-server tests in tests/sglang/ use, with the
interpreter of the venv ``make sglang-cpu`` builds as ``python``.

Deliberately left out: multi-node engines (``--nnodes``/``--dist-init-addr``), routers, data
parallel attention. One server = one engine = ``tp`` GPUs on one node.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from megarl.config.rollout_sections import engine_kwargs_args
from megarl.process_signals import die_with_parent, unblock_stop_signals
from megarl.ray_cluster.rank_env import NCCL_CUMEM_ENV, nccl_cumem_enable
from megarl.rollout_sglang.client import open_url
from megarl.rollout_sglang.server_sizes import CPU_MAX_TOTAL_TOKENS

if TYPE_CHECKING:
    from megarl.config.rollout_sections import RolloutConfig
    from megarl.config.sections import ClusterConfig
    from megarl.config.train_sections import LoRAConfig

# Environment variables the launcher removes from the server's environment, and why:
# - PYTORCH_CUDA_ALLOC_CONF: expandable segments break the memory saver's release/resume and
#   CUDA IPC (slime and verl both drop it before starting SGLang).
# - SGLANG_RETURN_ORIGINAL_LOGPROB: would make SGLang report log-probs before temperature,
#   while megarl's contract is log_softmax(logits / T) (megarl/engines/base.py).
_DROPPED_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "SGLANG_RETURN_ORIGINAL_LOGPROB")

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DEVICES = ("cuda", "cpu")
# SGLang's LoRA kernels per device (0.5.23, srt/lora/backend/lora_registry.py): its default,
# csgmv, is Triton (CUDA only); on CPU only torch_native runs.
LORA_BACKENDS = {"cuda": "csgmv", "cpu": "torch_native"}
# Adapter slots of one batch (--max-loras-per-batch, SGLang's default 8): the previous version
# (requests in flight during a push), the new one, and the base model, which takes a slot of its
# own (a request without lora_path, e.g. /health_generate). Each slot holds max-rank buffers of
# every targeted layer, so slots cost memory.
LORA_SLOTS = 3


class ServerLaunchError(RuntimeError):
    """The server did not become healthy; the message carries the tail of its log."""


def pick_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it; a race is possible but rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class ServerSpec:
    """How to run one SGLang server.

    ``gpu_ids`` are physical GPU ids on this node, indices or UUIDs (``GPU-...``: what Ray
    reports when the node's CUDA_VISIBLE_DEVICES holds UUIDs), as strings; the server gets them
    through ``CUDA_VISIBLE_DEVICES`` and therefore ``--base-gpu-id 0``. Leave ``gpu_ids`` empty to
    keep the caller's ``CUDA_VISIBLE_DEVICES`` and pass ``base_gpu_id`` instead (what a Ray
    actor that was handed its GPUs does).
    """

    model_path: str
    tp: int = 1
    mem_fraction: float = 0.8
    max_running_requests: int = 256
    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port at launch
    gpu_ids: tuple[str, ...] = ()
    base_gpu_id: int = 0
    seed: int = 1
    memory_saver: bool = True  # colocated mode: release/resume need it
    weights_cpu_backup: bool = False  # weights survive release/resume via a host copy
    deterministic: bool = False  # --enable-deterministic-inference (needed for sampling_seed)
    # --enable-return-routed-experts: requests may ask for the experts each token went to (MoE
    # models, actor.moe.routing_replay); SGLang keeps a host buffer of them per KV-cache slot.
    return_routed_experts: bool = False
    dtype: str | None = None  # "bfloat16" | "float16" | "float32"; None = the model's
    load_format: str | None = None  # e.g. "dummy": random weights, real ones pushed later
    log_level: str = "warning"
    log_path: str | None = None  # None = a file in the temp directory
    extra_args: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    python: str = sys.executable  # the interpreter with SGLang installed (rollout.server_python)
    device: str = "cuda"  # "cuda" | "cpu" (SGLang's CPU engine: tests, no GPU)
    max_total_tokens: int | None = None  # KV cache in tokens; None: from mem_fraction (cuda),
    # CPU_MAX_TOTAL_TOKENS (cpu)
    overlap_schedule: bool | None = None  # None: SGLang's default on cuda, off on cpu (its CPU
    # engine runs with --disable-overlap-schedule)
    sleep_on_idle: bool | None = None  # None: on for cpu (an idle scheduler otherwise spins a
    # whole core, which a small machine shares with the trainer), SGLang's default on cuda
    # NCCL_CUMEM_ENABLE of the server, read where the spec is made (the controller), as the
    # policy ranks' is: the two ends of the weight-update group must agree (rank_env.py).
    nccl_cumem_enable: str = field(default_factory=nccl_cumem_enable)
    # Serve LoRA adapters pushed by the trainer (rollout.weight_sync.lora "adapter"): their rank
    # and HF target modules (lora_server_args); None = no adapters.
    lora_rank: int | None = None
    lora_modules: tuple[str, ...] = ()
    # SIGKILL the server when the thread that launched it ends (PR_SET_PDEATHSIG; SGLang's own
    # children die with it the same way): a server the launching process owns, such as the LLM
    # judge's, is never left behind by a controller that was killed before its shutdown ran.
    die_with_parent: bool = False

    def __post_init__(self) -> None:
        # Kept as strings end to end: CUDA_VISIBLE_DEVICES takes indices and UUIDs alike.
        object.__setattr__(self, "gpu_ids", tuple(str(g) for g in self.gpu_ids))
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        if self.lora_rank is not None:
            # raises on a bad rank or no modules
            lora_server_args(self.lora_rank, self.lora_modules, self.device)
        if self.tp < 1:
            raise ValueError(f"rollout.tp ({self.tp}) must be >= 1")
        if self.device not in DEVICES:
            raise ValueError(f"ServerSpec.device {self.device!r} must be one of {DEVICES}")
        if self.device == "cpu" and self.memory_saver:
            raise ValueError(
                "ServerSpec.memory_saver needs a CUDA device (SGLang's torch_memory_saver); "
                "set memory_saver=False for device 'cpu'"
            )
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(
                f"ServerSpec.max_total_tokens ({self.max_total_tokens}) must be >= 1 or None"
            )
        if self.gpu_ids and len(self.gpu_ids) != self.tp:
            raise ValueError(
                f"ServerSpec.gpu_ids {list(self.gpu_ids)} has {len(self.gpu_ids)} GPUs but "
                f"rollout.tp is {self.tp}; give exactly tp GPU ids"
            )
        if not 0 < self.mem_fraction < 1:
            raise ValueError(
                f"rollout.mem_fraction ({self.mem_fraction}) must be in (0, 1), e.g. 0.8"
            )
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"ServerSpec.log_level {self.log_level!r} must be one of {LOG_LEVELS}")
        if self.weights_cpu_backup and not self.memory_saver:
            raise ValueError(
                "ServerSpec.weights_cpu_backup needs memory_saver=True (the CPU backup only "
                "exists for release/resume); set memory_saver=True or drop weights_cpu_backup"
            )


def lora_server_args(
    rank: int, modules: Sequence[str], device: str = "cuda", slots: int = LORA_SLOTS
) -> list[str]:
    """The flags that make SGLang serve adapters of rank <= ``rank`` on ``modules`` (HF names,
    e.g. q_proj). Both must be given up front: with no adapter at launch SGLang sizes its adapter
    buffers from them, and refuses to start without them."""
    if rank < 1 or not modules:
        raise ValueError(
            f"LoRA serving needs a rank >= 1 and target modules; got rank {rank}, "
            f"modules {list(modules)}"
        )
    return ["--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules", *modules,
            "--max-loras-per-batch", str(slots), "--lora-backend", LORA_BACKENDS[device]]  # fmt: skip


def build_launch_command(spec: ServerSpec, port: int) -> list[str]:
    """The ``python -m sglang.launch_server`` argv for ``spec`` listening on ``port``."""
    cmd = [
        spec.python, "-m", "sglang.launch_server",
        "--model-path", spec.model_path,
        "--tp-size", str(spec.tp),
        "--mem-fraction-static", repr(spec.mem_fraction),
        "--host", spec.host,
        "--port", str(port),
    ]  # fmt: skip
    if spec.device == "cuda":
        cmd += ["--base-gpu-id", str(0 if spec.gpu_ids else spec.base_gpu_id)]
    else:
        cmd += ["--device", spec.device]
    cmd += [
        "--max-running-requests", str(spec.max_running_requests),
        "--random-seed", str(spec.seed),
        "--log-level", spec.log_level,
        # Warm-up sends a request before we can pause the server; health_generate covers it.
        "--skip-server-warmup",
    ]  # fmt: skip
    if spec.memory_saver:
        # The "breakable" CUDA-graph prefill backend refuses to run under the memory saver
        # once graph memory is releasable (SGLANG_MEMORY_SAVER_CUDA_GRAPH, see the env).
        cmd += ["--enable-memory-saver", "--cuda-graph-backend-prefill", "disabled"]
    if spec.weights_cpu_backup:
        cmd.append("--enable-weights-cpu-backup")
    if spec.deterministic:
        cmd.append("--enable-deterministic-inference")
    if spec.return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    if spec.dtype is not None:
        cmd += ["--dtype", spec.dtype]
    if spec.load_format is not None:
        cmd += ["--load-format", spec.load_format]
    tokens = spec.max_total_tokens
    if tokens is None and spec.device == "cpu":
        tokens = CPU_MAX_TOTAL_TOKENS
    if tokens is not None:
        cmd += ["--max-total-tokens", str(tokens)]
    overlap = spec.overlap_schedule if spec.overlap_schedule is not None else spec.device != "cpu"
    if not overlap:
        cmd.append("--disable-overlap-schedule")
    if spec.sleep_on_idle if spec.sleep_on_idle is not None else spec.device == "cpu":
        cmd.append("--sleep-on-idle")
    if spec.lora_rank is not None:
        cmd += lora_server_args(spec.lora_rank, spec.lora_modules, spec.device)
    return cmd + list(spec.extra_args)


def build_launch_env(spec: ServerSpec, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: the caller's, minus :data:`_DROPPED_ENV`, plus its GPUs, the
    run's NCCL_CUMEM_ENABLE and what its mode needs (``extra_env`` last, so it can override any
    of them)."""
    env = dict(os.environ if base is None else base)
    for name in _DROPPED_ENV:
        env.pop(name, None)
    env[NCCL_CUMEM_ENV] = spec.nccl_cumem_enable
    if spec.device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    elif spec.gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.gpu_ids)
    if spec.memory_saver:
        # Without it, releasing "cuda_graph" frees nothing (SGLang's graph pools are allocated
        # outside the memory saver unless this is set; slime sets it too).
        env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] = "true"
        # SGLang's scheduler checks its memory pools whenever it is idle and raises on a leak it
        # sees (SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE, true by default in 0.5.23:
        # srt/environ.py, scheduler_components/invariant_checker.py): a crash surface while
        # release / resume moves those pools; "false" only logs (slime sets it too).
        env["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] = "false"
        if spec.tp > 1:
            # Colocated, the trainer holds different amounts of memory on each GPU; SGLang's
            # check that all TP ranks see about the same free memory would refuse to start.
            # (slime's SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK is not read by SGLang >= 0.5.21.)
            env["SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"] = "false"
    env.update(dict(spec.extra_env))
    return env


def launch_header(command: Sequence[str], env: dict[str, str], base: dict[str, str], launch: int) -> str:
    """The lines a launch writes at the top of its part of the server's log, before the server's
    own output: the argv shell-quoted (it can be pasted to run the server again) and what megarl
    set or removed in the environment it was given (``base``: the launching process's)."""
    changed = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()) if base.get(k) != v)
    removed = " ".join(sorted(k for k in base if k not in env))
    lines = [
        f"# megarl: SGLang server launch {launch} at {time.strftime('%Y-%m-%d %H:%M:%S')}",
        f"# command: {shlex.join(command)}",
        f"# environment set by megarl: {changed or '(nothing)'}",
    ]
    if removed:
        lines.append(f"# environment removed by megarl: {removed}")
    return "\n".join(lines) + "\n"


def read_log_tail(path: str | Path, max_lines: int = 40) -> str:
    """The last ``max_lines`` lines of a log file ('' when it does not exist)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            text = fh.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-max_lines:])


def probe_health(url: str, timeout: float = 5.0, path: str = "/health_generate") -> bool:
    """True when ``GET url+path`` answers 200 (503 while SGLang starts or is stuck); never
    through a proxy (:func:`~megarl.rollout_sglang.client.open_url`)."""
    try:
        with open_url(url + path, timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


class SGLangServer:
    """One SGLang server process: launch, health wait, liveness, shutdown, relaunch.

    ``command`` overrides the argv built from the spec (tests run a stand-in process with
    it); everything else (process group, log file, health wait, log tail on failure) is the
    same code path the real server uses.
    """

    def __init__(self, spec: ServerSpec, command: Sequence[str] | None = None) -> None:
        self.spec = spec
        self._command_override = list(command) if command is not None else None
        self.port = spec.port
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = spec.log_path
        self.launches = 0
        # A host actor runs start and shutdown at once (a shutdown must not queue behind a start
        # that waits for health): the lock orders a launch against a shutdown, and a shutdown that
        # comes first makes the start refuse, so no server outlives the shutdown that was meant for it.
        self._lock = threading.Lock()
        self._shut = False

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    def command(self) -> list[str]:
        if self._command_override is not None:
            return [a.replace("{port}", str(self.port)) for a in self._command_override]
        return build_launch_command(self.spec, self.port)

    def launch(self) -> None:
        """Start the process (does not wait for health; see :meth:`wait_healthy`)."""
        with self._lock:
            if self._shut:
                raise ServerLaunchError(f"SGLang server {self.url} was shut down before it started")
            self._launch()

    def _launch(self) -> None:
        if self.alive():
            assert self.proc is not None  # alive: a process was started
            raise RuntimeError(
                f"SGLang server at {self.url} is already running (pid {self.proc.pid})"
            )
        python = self.command()[0]
        if shutil.which(python) is None:
            raise ServerLaunchError(
                f"rollout.server_python {python!r} is not an executable on this node; point it "
                "at the bin/python of a venv with SGLang installed, or leave it unset"
            )
        # A relaunch keeps its port (clients keep their URL) unless something else took it.
        if self.port == 0 or (self.launches > 0 and not _port_free(self.spec.host, self.port)):
            self.port = pick_free_port(self.spec.host)
        if self.log_path is None:
            import tempfile

            fd, self.log_path = tempfile.mkstemp(prefix=f"sglang-{self.port}-", suffix=".log")
            os.close(fd)
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        command, env = self.command(), build_launch_env(self.spec)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it after Popen
        try:
            # How this launch was started, above the server's own output: a user (and a test)
            # sees the argv and the environment megarl gave it without re-deriving them.
            log.write(launch_header(command, env, dict(os.environ), self.launches + 1).encode())
            log.flush()
            self.proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # own process group: shutdown kills TP workers too
                # The host actor inherits an embedded Ray's blocked SIGTERM, and a server started
                # with it would ignore shutdown's SIGTERM (its own session: no group kill reaches it).
                preexec_fn=partial(_dies_with_parent, os.getpid()) if self.spec.die_with_parent else unblock_stop_signals,
            )
        finally:
            log.close()
        self.launches += 1

    def wait_healthy(self, timeout: float = 600.0, poll: float = 1.0) -> None:
        """Block until ``/health_generate`` answers 200; raise with the log tail otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                code = self.proc.returncode if self.proc is not None else None
                if self._shut:  # not a crash: the shutdown meant for it came while it started
                    raise ServerLaunchError(f"SGLang server {self.url} was shut down while starting (exit code {code})")
                raise ServerLaunchError(self._failure(f"exited with code {code} while starting"))
            if probe_health(self.url, timeout=min(5.0, poll + 1.0)):
                return
            time.sleep(poll)
        raise ServerLaunchError(self._failure(f"was not healthy after {timeout:g} s"))

    def start(self, timeout: float = 600.0, poll: float = 1.0) -> None:
        """:meth:`launch` then :meth:`wait_healthy`; kills the process if it never gets healthy."""
        self.launch()
        try:
            self.wait_healthy(timeout, poll)
        except ServerLaunchError:
            self._kill()
            raise

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self, timeout: float = 5.0) -> bool:
        """Alive and answering ``/health_generate``: what restart detection checks."""
        return self.alive() and probe_health(self.url, timeout=timeout)

    def log_tail(self, max_lines: int = 40) -> str:
        return read_log_tail(self.log_path, max_lines) if self.log_path else ""

    def shutdown(self, grace: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds; a start still to come
        refuses (only :meth:`restart` starts it again)."""
        with self._lock:
            self._shut = True
        self._kill(grace)

    def _kill(self, grace: float = 10.0) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=grace)
        # Children (scheduler / TP workers) may outlive the leader: kill what is left.
        _signal_group(proc.pid, signal.SIGKILL)

    def restart(self, timeout: float = 600.0, poll: float = 1.0) -> None:
        """Kill whatever is left of the old process and start a new one."""
        with self._lock:
            self._shut = False
        self._kill()
        self.start(timeout, poll)

    def _failure(self, what: str) -> str:
        tail = self.log_tail()
        return (
            f"SGLang server {self.url} {what}. Command: {shlex.join(self.command())}\n"
            f"Log {self.log_path} (last lines):\n{tail or '<empty>'}"
        )


def _dies_with_parent(parent: int) -> None:
    """In the child before exec: stop signals unblocked, and SIGKILL when its parent thread ends
    (``parent``: the launcher's pid, which already ending before the prctl would leave unseen)."""
    unblock_stop_signals()
    die_with_parent(parent)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _port_free(host: str, port: int) -> bool:
    """Whether a server could bind ``port`` now (with SO_REUSEADDR, as uvicorn binds, so
    connections of the previous process in TIME_WAIT do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def spec_from_config(
    model_path: str,
    rollout: RolloutConfig,
    cluster: ClusterConfig,
    gpu_ids: Sequence[str] = (),
    seed: int = 1,
    dtype: str | None = None,
    *,
    weights_pushed: bool = False,
    lora: LoRAConfig | None = None,
    **overrides: object,
) -> ServerSpec:
    """A ServerSpec from the validated config sections (rollout.*, cluster.*).

    ``cluster`` gives the placement and device. Colocated CUDA engines get the memory saver
    (release/resume while the trainer runs, with releasable CUDA-graph memory); whether they
    keep a CPU copy of their weights is the caller's (``rollout.weights_cpu_backup``: without
    it, the memory hand-over re-pushes the weights before a generation that follows a
    release). Disaggregated engines keep their memory, and so do CPU engines (the memory saver
    is CUDA-only). ``rollout.server_python`` (None = this interpreter) runs
    ``sglang.launch_server``. ``weights_pushed``: a weight push follows every launch before any
    generation (a training run: the trainer pushes first, the hand-over re-pushes after a
    restart), so the server starts from random weights (``--load-format dummy``) instead of
    reading the checkpoint for nothing (4 x 145 GB at 72B); ``megarl generate`` serves the model
    as it is and loads it. ``lora`` (actor.lora): with ``rollout.weight_sync.lora`` "adapter" the
    server is launched to serve the trainer's adapters (their rank and target modules), from the
    base model's own weights.
    """
    from megarl.checkpoint.model_checkpoint import is_model_checkpoint

    placement, device = cluster.placement, cluster.device
    adapters = lora is not None and rollout.weight_sync.lora == "adapter"
    fields: dict[str, object] = dict(
        model_path=model_path,
        tp=rollout.tp,
        mem_fraction=rollout.mem_fraction,
        max_running_requests=rollout.max_running_requests,
        gpu_ids=tuple(gpu_ids) if device == "cuda" else (),
        seed=seed,
        memory_saver=placement == "colocated" and device == "cuda",
        dtype=dtype,
        deterministic=rollout.deterministic,
        device=device,
        python=rollout.server_python or sys.executable,
        # rollout.engine_kwargs (checked against SGLang's arguments) as flags, then the unchecked server_args
        extra_args=(*engine_kwargs_args(rollout.engine_kwargs), *rollout.server_args),
        # A model checkpoint of `megarl convert hf-to-megatron` has no HF weights either: the
        # server starts from its config and the trainer's initial push brings the weights.
        # Serving adapters, the server loads the real base: SGLang's LoRA loader reads an adapter with
        # the server's own load format, and a dummy one refuses it (0.5.23).
        load_format="dummy" if (weights_pushed and not adapters) or is_model_checkpoint(model_path) else None,
    )
    if adapters and lora is not None:
        fields.update(lora_rank=lora.rank, lora_modules=lora.modules)
    fields.update(overrides)
    return ServerSpec(**fields)  # type: ignore[arg-type]
