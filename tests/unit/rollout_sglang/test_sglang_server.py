"""SGLang server launch: the command line from a spec, its environment, the health wait
(timeout and early exit carry the log tail), shutdown of the process group.

The process tests run small stand-in Python processes through SGLangServer's real launch
path (``command=``), since SGLang itself cannot run here.
"""

from __future__ import annotations

import re
import sys
import textwrap

import pytest

from megarl.config.rollout_sections import RolloutConfig, WeightSyncConfig
from megarl.config.sections import ClusterConfig
from megarl.config.train_sections import LoRAConfig
from megarl.rollout_sglang.engine import SGLangEngine
from megarl.rollout_sglang.server import (
    ServerLaunchError,
    ServerSpec,
    SGLangServer,
    build_launch_command,
    build_launch_env,
    spec_from_config,
)


@pytest.fixture(autouse=True)
def _no_user_nccl_cumem(monkeypatch):
    """The specs here read NCCL_CUMEM_ENABLE from this process: a value of the machine's own
    must not change what the tests expect (0, megarl's default)."""
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)


NCCL = {"NCCL_CUMEM_ENABLE": "0"}  # every server gets the run's one value


def test_command_line_for_a_colocated_engine():
    spec = ServerSpec(model_path="/models/qwen", tp=2, mem_fraction=0.7, max_running_requests=64,
                      gpu_ids=("2", "3"), seed=5, weights_cpu_backup=True, deterministic=True,
                      dtype="bfloat16", log_level="info", python="/py")  # fmt: skip
    assert build_launch_command(spec, port=31001) == [
        "/py", "-m", "sglang.launch_server", "--model-path", "/models/qwen", "--tp-size", "2",
        "--mem-fraction-static", "0.7", "--host", "127.0.0.1", "--port", "31001",
        "--base-gpu-id", "0", "--max-running-requests", "64", "--random-seed", "5",
        "--log-level", "info", "--skip-server-warmup", "--enable-memory-saver",
        "--cuda-graph-backend-prefill", "disabled",
        "--enable-weights-cpu-backup", "--enable-deterministic-inference", "--dtype", "bfloat16",
    ]  # fmt: skip


def test_command_line_for_a_disaggregated_engine_keeps_given_gpus():
    spec = ServerSpec(model_path="m", base_gpu_id=4, memory_saver=False, load_format="dummy",
                      extra_args=("--disable-radix-cache",))  # fmt: skip
    cmd = build_launch_command(spec, port=1)
    assert cmd[cmd.index("--base-gpu-id") + 1] == "4"
    assert "--enable-memory-saver" not in cmd and "--enable-weights-cpu-backup" not in cmd
    assert cmd[-3:] == ["--load-format", "dummy", "--disable-radix-cache"]


def test_environment_pins_gpus_and_drops_settings_that_break_sglang():
    spec = ServerSpec(model_path="m", tp=2, gpu_ids=("6", "7"), memory_saver=False,
                      extra_env=(("NCCL_DEBUG", "WARN"),))  # fmt: skip
    env = build_launch_env(spec, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                                  "SGLANG_RETURN_ORIGINAL_LOGPROB": "1", "HOME": "/h"})  # fmt: skip
    assert env == {"HOME": "/h", "CUDA_VISIBLE_DEVICES": "6,7", **NCCL, "NCCL_DEBUG": "WARN"}


def test_the_server_gets_the_nccl_cumem_value_of_the_process_that_made_its_spec(monkeypatch):
    """One explicit NCCL_CUMEM_ENABLE for the servers and the policy ranks (SGLang sets 0 where
    it is unset, the ranks would keep NCCL's default, and the weight-update group's P2P fails
    between them): the user's where megarl launch runs, else 0; the value travels in the spec
    from the controller to the node that launches the server, whose own environment may say
    otherwise."""
    spec = spec_from_config("/m", RolloutConfig(), ClusterConfig(placement="disaggregated"))
    assert build_launch_env(spec, {"NCCL_CUMEM_ENABLE": "1"})["NCCL_CUMEM_ENABLE"] == "0"
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")
    spec = spec_from_config("/m", RolloutConfig(), ClusterConfig(placement="disaggregated"))
    assert build_launch_env(spec, {})["NCCL_CUMEM_ENABLE"] == "1"


# Under the memory saver: releasable CUDA graphs, and no strict idle memory check (release/resume
# trips it; on by default in SGLang 0.5.23).
SAVER = {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "true", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "false"}


def test_colocated_environment_makes_cuda_graphs_releasable_and_skips_the_strict_checks():
    colocated_tp2 = build_launch_env(ServerSpec(model_path="m", tp=2), {})
    assert colocated_tp2 == {**NCCL, **SAVER, "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "false"}
    # One GPU has nothing to compare; a disaggregated engine (no memory saver) keeps the checks.
    assert build_launch_env(ServerSpec(model_path="m", tp=1), {}) == {**NCCL, **SAVER}
    assert build_launch_env(ServerSpec(model_path="m", tp=2, memory_saver=False), {}) == NCCL
    # extra_env has the last word.
    spec = ServerSpec(
        model_path="m", tp=2, extra_env=(("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "false"),)
    )
    assert build_launch_env(spec, {})["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "false"


def test_cpu_server_command_and_environment():
    spec = ServerSpec(model_path="/tiny", device="cpu", memory_saver=False, mem_fraction=0.05,
                      dtype="float32", python="/venvs/sglang/bin/python", gpu_ids=())  # fmt: skip
    cmd = build_launch_command(spec, port=30000)
    assert cmd[:3] == ["/venvs/sglang/bin/python", "-m", "sglang.launch_server"]
    assert cmd[cmd.index("--device") + 1] == "cpu" and "--base-gpu-id" not in cmd
    assert cmd[cmd.index("--max-total-tokens") + 1] == "4096"  # a cap, not a share of host RAM
    assert "--disable-overlap-schedule" in cmd and "--enable-memory-saver" not in cmd
    assert "--sleep-on-idle" in cmd  # an idle CPU scheduler would otherwise spin a core
    env = build_launch_env(spec, {"CUDA_VISIBLE_DEVICES": "0", "HOME": "/h"})
    assert env == {**NCCL, "CUDA_VISIBLE_DEVICES": "0", "HOME": "/h", "SGLANG_USE_CPU_ENGINE": "1"}
    sized = ServerSpec(model_path="m", device="cpu", memory_saver=False, max_total_tokens=512,
                       overlap_schedule=True)  # fmt: skip
    cmd = build_launch_command(sized, port=1)
    assert cmd[cmd.index("--max-total-tokens") + 1] == "512"
    assert "--disable-overlap-schedule" not in cmd
    gpu = build_launch_command(ServerSpec(model_path="m"), port=1)
    assert "--max-total-tokens" not in gpu and "--disable-overlap-schedule" not in gpu
    assert "--sleep-on-idle" not in gpu


def test_spec_from_config_follows_the_placement():
    rollout = RolloutConfig(tp=2, mem_fraction=0.6, max_running_requests=32)
    colo = spec_from_config("/m", rollout, ClusterConfig(placement="colocated"), gpu_ids=("0", "1"), seed=3)
    assert (colo.tp, colo.mem_fraction, colo.max_running_requests, colo.seed) == (2, 0.6, 32, 3)
    assert colo.memory_saver and not colo.weights_cpu_backup  # weights are re-pushed anyway
    assert colo.device == "cuda" and colo.python == sys.executable
    disagg = spec_from_config(
        "/m", rollout, ClusterConfig(placement="disaggregated"), gpu_ids=("4", "5")
    )
    assert not disagg.memory_saver and not disagg.weights_cpu_backup


def test_spec_from_config_takes_the_device_and_the_server_interpreter():
    rollout = RolloutConfig(tp=1, server_python="/venvs/sglang/bin/python")
    cpu = spec_from_config("/m", rollout, ClusterConfig(device="cpu", placement="colocated"))
    assert cpu.device == "cpu" and not cpu.memory_saver  # nothing to release on a CPU
    assert cpu.python == "/venvs/sglang/bin/python"
    assert build_launch_command(cpu, 1)[0] == "/venvs/sglang/bin/python"


def test_spec_from_config_appends_the_users_server_args():
    rollout = RolloutConfig(server_args=["--disable-radix-cache", "--chunked-prefill-size", "4096"])
    cmd = build_launch_command(spec_from_config("/m", rollout, ClusterConfig()), 1)
    assert cmd[-3:] == ["--disable-radix-cache", "--chunked-prefill-size", "4096"]


def test_adapter_mode_launches_the_server_to_serve_the_policys_adapters():
    lora = LoRAConfig(rank=16, target_modules=["v_proj", "q_proj"])
    adapter = RolloutConfig(weight_sync=WeightSyncConfig(lora="adapter"))
    cpu = spec_from_config("/m", adapter, ClusterConfig(device="cpu"), lora=lora)
    cmd = build_launch_command(cpu, 1)
    start = cmd.index("--enable-lora")
    assert cmd[start:] == ["--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "q_proj", "v_proj",
                           "--max-loras-per-batch", "3", "--lora-backend", "torch_native"]  # fmt: skip
    cuda = spec_from_config("/m", adapter, ClusterConfig(), lora=lora)
    assert build_launch_command(cuda, 1)[-1] == "csgmv"  # SGLang's default kernels (Triton)
    # merged pushes (the default) and full fine-tuning serve plain weights
    merged = spec_from_config("/m", RolloutConfig(), ClusterConfig(), lora=lora)
    assert "--enable-lora" not in build_launch_command(merged, 1)
    full = spec_from_config("/m", adapter, ClusterConfig())  # no actor.lora: full fine-tuning
    assert "--enable-lora" not in build_launch_command(full, 1)
    with pytest.raises(ValueError, match="needs a rank >= 1 and target modules"):
        ServerSpec(model_path="m", lora_rank=8)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tp": 2, "gpu_ids": ("0",)}, "has 1 GPUs but rollout.tp is 2"),
        ({"mem_fraction": 1.2}, r"rollout.mem_fraction \(1.2\) must be in \(0, 1\)"),
        ({"log_level": "loud"}, "log_level 'loud' must be one of"),
        ({"memory_saver": False, "weights_cpu_backup": True}, "needs memory_saver=True"),
        ({"device": "tpu"}, "device 'tpu' must be one of"),
        ({"device": "cpu"}, "memory_saver needs a CUDA device.*set memory_saver=False"),
        ({"max_total_tokens": 0}, r"max_total_tokens \(0\) must be >= 1"),
    ],
)
def test_bad_specs_are_refused_with_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServerSpec(model_path="m", **kwargs)


def _stand_in(tmp_path, code: str) -> SGLangServer:
    spec = ServerSpec(model_path="m", log_path=str(tmp_path / "server.log"))
    return SGLangServer(spec, command=[sys.executable, "-c", textwrap.dedent(code)])


def test_health_timeout_error_carries_the_log_tail(tmp_path):
    server = _stand_in(
        tmp_path,
        """
        import time
        print("loading weights", flush=True)
        print("RuntimeError: CUDA out of memory (stand-in)", flush=True)
        time.sleep(60)
    """,
    )
    with pytest.raises(ServerLaunchError) as info:
        server.start(timeout=2, poll=0.05)  # the stand-in prints within 2 s even on a loaded machine
    message = str(info.value)
    assert "was not healthy after 2 s" in message
    assert "CUDA out of memory (stand-in)" in message and str(tmp_path / "server.log") in message
    assert not server.alive()  # start() killed it


def test_a_missing_server_interpreter_is_named(tmp_path):
    spec = ServerSpec(model_path="m", python=str(tmp_path / "no-venv" / "bin" / "python"))
    with pytest.raises(
        ServerLaunchError,
        match=r"rollout.server_python '.*no-venv/bin/python' is not an executable",
    ):
        SGLangServer(spec).launch()


def test_exit_during_start_is_reported_with_code_and_log(tmp_path):
    server = _stand_in(
        tmp_path,
        """
        import sys
        print("ValueError: unknown model architecture", flush=True)
        sys.exit(3)
    """,
    )
    with pytest.raises(
        ServerLaunchError, match=r"(?s)exited with code 3 .*unknown model architecture"
    ):
        server.start(timeout=30.0, poll=0.05)


# A stand-in that answers /health_generate on the port SGLangServer picked.
HEALTHY_STAND_IN = """
    import http.server
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health_generate" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", {port}), H).serve_forever()
"""


def test_healthy_server_starts_is_detected_dead_and_restarts(tmp_path):
    server = _stand_in(tmp_path, HEALTHY_STAND_IN)
    server.start(timeout=30.0, poll=0.05)
    try:
        assert server.healthy()
        first, port = server.proc, server.port
        server.proc.kill()
        server.proc.wait()
        assert not server.healthy()  # a dead engine is detected
        server.restart(timeout=30.0, poll=0.05)
        assert server.healthy() and server.proc is not first and server.launches == 2
        assert server.port == port  # same URL for the engine's clients
    finally:
        server.shutdown()
    assert not server.alive()


def test_a_shutdown_before_the_start_makes_the_start_refuse_and_restart_starts_again(tmp_path):
    # A host actor runs start and shutdown at once: a shutdown that comes first must win, or the
    # start would launch a server nobody stops and wait its whole timeout for it.
    server = _stand_in(tmp_path, HEALTHY_STAND_IN)
    server.shutdown()
    with pytest.raises(ServerLaunchError, match=r"was shut down before it started"):
        server.start(timeout=30.0, poll=0.05)
    assert server.proc is None and server.launches == 0
    server.restart(timeout=30.0, poll=0.05)  # only an explicit restart starts it again
    try:
        assert server.healthy() and server.launches == 1
    finally:
        server.shutdown()
    assert not server.alive()


def test_a_shutdown_while_the_start_waits_ends_the_start_with_that_not_a_crash(tmp_path):
    import threading
    import time

    server = _stand_in(tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(600)")  # never healthy
    failures: list[Exception] = []

    def start() -> None:
        try:
            server.start(timeout=300.0, poll=0.05)
        except ServerLaunchError as exc:
            failures.append(exc)

    starting = threading.Thread(target=start)
    starting.start()
    deadline = time.monotonic() + 120
    while not server.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    server.shutdown()
    starting.join(timeout=120)
    assert not starting.is_alive() and len(failures) == 1
    assert re.fullmatch(r"SGLang server http://\S+ was shut down while starting \(exit code -15\)", str(failures[0]))


def test_a_server_that_exits_while_starting_fails_with_its_log(tmp_path):
    (tmp_path / "a").mkdir()
    good = _stand_in(tmp_path / "a", HEALTHY_STAND_IN)
    good.start(timeout=30.0, poll=0.05)
    try:
        assert SGLangEngine(good).health().alive  # /health_generate answers 200
    finally:
        good.shutdown()
    bad = _stand_in(tmp_path / "a", "import sys; print('boom', flush=True); sys.exit(2)")
    with pytest.raises(ServerLaunchError, match="(?s)exited with code 2.*boom"):
        bad.start(timeout=30.0, poll=0.05)


def test_a_model_checkpoint_starts_the_server_with_dummy_weights(tmp_path):
    """A model checkpoint of `megarl convert hf-to-megatron` holds no HF weights: the server loads
    none (the trainer's initial push brings them); an HF directory loads its own."""
    from megarl.checkpoint.model_checkpoint import write_record

    write_record(tmp_path, source="/hf", tp=1, pp=1, dtype="bfloat16", hf_config={}, verified_parameters=1)
    cluster = ClusterConfig(device="cpu")
    assert spec_from_config(str(tmp_path), RolloutConfig(), cluster).load_format == "dummy"
    assert "--load-format" in build_launch_command(spec_from_config(str(tmp_path), RolloutConfig(), cluster), 1)
    assert spec_from_config("/m", RolloutConfig(), cluster).load_format is None


def test_a_server_launched_where_sigterm_is_blocked_still_stops_on_sigterm(tmp_path):
    """A host actor of an embedded Ray has SIGTERM blocked (a process-group SIGTERM must not
    reach it); the server it launches must not inherit the block, or shutdown's SIGTERM would be
    a wait of `grace` seconds before a SIGKILL."""
    import signal
    import time

    server = _stand_in(tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(60)")
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        server.launch()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    while "up" not in (tmp_path / "server.log").read_text():  # (Python's own start-up done)
        assert server.alive()
        time.sleep(0.01)
    proc = server.proc
    server.shutdown(grace=30)
    assert proc.returncode == -signal.SIGTERM  # not -SIGKILL after the grace


def test_the_log_starts_with_the_command_line_and_the_environment_megarl_set(tmp_path, monkeypatch):
    """Each launch writes, before the server's own output, its argv (shell-quoted: it can be run
    again as it is) and what megarl set or removed in its environment."""
    import shlex

    python = tmp_path / "bin" / "python"  # a stand-in interpreter: prints its arguments, exits
    python.parent.mkdir()
    python.write_text('#!/bin/sh\necho "server output: $#"\nexit 1\n')
    python.chmod(0o755)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    spec = ServerSpec(model_path="/models/my model", tp=2, gpu_ids=("GPU-5f3e", "GPU-7a21"), python=str(python),
                      log_path=str(tmp_path / "logs" / "sglang_engine0.log"))  # fmt: skip
    server = SGLangServer(spec)
    server.launch()
    server.proc.wait(timeout=30)
    lines = (tmp_path / "logs" / "sglang_engine0.log").read_text().splitlines()
    command = build_launch_command(spec, server.port)
    assert lines[0].startswith("# megarl: SGLang server launch 1 at ")
    assert lines[1] == "# command: " + shlex.join(command)
    assert "'/models/my model'" in lines[1] and shlex.split(lines[1].removeprefix("# command: ")) == command
    assert lines[2] == ("# environment set by megarl: CUDA_VISIBLE_DEVICES=GPU-5f3e,GPU-7a21 NCCL_CUMEM_ENABLE=0 "
                        "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=false SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=false "
                        "SGLANG_MEMORY_SAVER_CUDA_GRAPH=true")  # fmt: skip
    assert lines[3] == "# environment removed by megarl: PYTORCH_CUDA_ALLOC_CONF"
    assert lines[4:] == [f"server output: {len(command) - 1}"]  # then the server's own output
    server.launch()  # a relaunch appends its own header
    server.proc.wait(timeout=30)
    lines = (tmp_path / "logs" / "sglang_engine0.log").read_text().splitlines()
    assert lines[5].startswith("# megarl: SGLang server launch 2 at ") and lines[-1].startswith("server output")


def test_a_server_that_dies_with_its_parent_is_not_left_behind_by_a_killed_launcher(tmp_path):
    """die_with_parent (the LLM judge's server): a launcher killed with SIGKILL, its shutdown never
    run, takes its server with it (PR_SET_PDEATHSIG)."""
    import os
    import signal
    import subprocess
    import time

    launcher = textwrap.dedent(f"""
        import sys, time
        from megarl.rollout_sglang.server import ServerSpec, SGLangServer
        spec = ServerSpec(model_path="m", log_path={str(tmp_path / "server.log")!r}, die_with_parent=True, memory_saver=False)
        server = SGLangServer(spec, command=[sys.executable, "-c", "import time; time.sleep(120)"])
        server.launch()
        print(server.proc.pid, flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    server_pid = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 60  # generous: the kernel delivers the signal at the parent's exit
    while time.monotonic() < deadline and _running(server_pid):
        time.sleep(0.05)
    assert not _running(server_pid)


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, reaped by no one yet, has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
