"""Two hosts without Slurm: launch/ray-node.sh's head and worker roles on one machine, with two
network namespaces as the two hosts (`ip netns` and a veth pair whose addresses exist only inside
the namespaces; each host has its own Ray temp dir; GLOO_SOCKET_IFNAME names the veth).

The Ray head runs in namespace A, a Ray worker node in namespace B (it finds its address through
MEGARL_NODE_IFACE, as `megarl sbatch`'s workers do), `ray-node.sh wait` sees both, and a 2-step tiny
CPU run attaches with `megarl launch --address`. Each node advertises one CPU
(MEGARL_RAY_START_ARGS), so the policy's two ranks (cluster.nnodes=2, one process per node, DP=2)
can only be placed one per host: their gloo groups cross the veth. The test checks where the ranks
ran from each host's own Ray logs (the rank's pid in its log names one host's worker log).

Skipped with the reason when not root, without `ip` or where network namespaces cannot be made.
The namespaces, and every process started in them, are removed even when the test fails.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from run_helpers import ROOT, TINY, read_jsonl, small_overrides

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = str(ROOT / "launch" / "ray-node.sh")
IFACE = "meg0"  # both ends of the veth pair have this name, each in its own namespace
PORT = 6379  # each namespace has its own ports: Ray's default cannot collide with anything
STEPS = 2


@dataclass
class Host:
    netns: str
    ip: str
    ray_tmp: Path  # RAY_TMPDIR: this host's Ray files go to ray_tmp/ray


@dataclass
class TwoHosts:
    a: Host
    b: Host
    env: dict[str, str]  # the environment of everything started in the namespaces
    procs: list[subprocess.Popen] = field(default_factory=list)  # everything started (reaped at the end)
    nodes: list[subprocess.Popen] = field(default_factory=list)  # the Ray nodes (`ray-node.sh head|worker`)

    def _cmd(self, host: Host, args: tuple, env: dict[str, str]) -> list[str]:
        extra = [f"{k}={v}" for k, v in {"RAY_TMPDIR": str(host.ray_tmp), **env}.items()]
        return ["ip", "netns", "exec", host.netns, "env", *extra, *map(str, args)]

    def start_node(self, host: Host, *args, log: Path, **env: str) -> subprocess.Popen:
        """A Ray node (`ray-node.sh head|worker`, blocks) in host's namespace, its output to log."""
        with open(log, "wb") as out:
            proc = subprocess.Popen(self._cmd(host, args, env), env=self.env, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        self.nodes.append(proc)
        return proc

    def run(self, host: Host, *args, timeout: float, **env: str) -> subprocess.CompletedProcess:
        """A command in host's namespace; fails at once when a Ray node started here has exited."""
        proc = subprocess.Popen(self._cmd(host, args, env), env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)  # fmt: skip
        self.procs.append(proc)
        deadline = time.monotonic() + timeout
        while True:
            try:
                out, err = proc.communicate(timeout=1)
                return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
            except subprocess.TimeoutExpired:
                dead = [p for p in self.nodes if p.poll() is not None]
                if dead or time.monotonic() > deadline:
                    proc.kill()
                    out, err = proc.communicate()
                    why = f"a Ray node exited ({dead[0].args[-3:]})" if dead else f"no answer within {timeout:g} s"
                    return subprocess.CompletedProcess(proc.args, -1, out, f"{err}\n{why}")


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _ip_ok(*args: str) -> None:
    done = _ip(*args)
    assert done.returncode == 0, f"ip {' '.join(args)}: {done.stderr.strip()}"


def _pids(netns: str) -> set[int]:
    return {int(p) for p in _ip("netns", "pids", netns).stdout.split()}


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan waits for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_empty(namespaces: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_running(p) for ns in namespaces for p in _pids(ns)):
        time.sleep(0.2)


def _remove(namespaces: list[str], procs: list[subprocess.Popen]) -> dict[str, list[int]]:
    """Stop every process in the namespaces and delete them; returns the pids still running
    afterwards, by namespace. First a TERM to the processes this test started (`ray start --block`
    then stops its node's Ray processes, a few seconds), then a KILL to whatever is left."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    _wait_empty(namespaces, 20.0)
    seen = {ns: _pids(ns) for ns in namespaces}
    for pid in set().union(*seen.values()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _wait_empty(namespaces, 10.0)
    for proc in procs:
        try:
            proc.wait(timeout=1)  # reap our own children
        except subprocess.TimeoutExpired:
            pass
    for ns in namespaces:
        _ip("netns", "del", ns)
    return {ns: sorted(p for p in pids if _running(p)) for ns, pids in seen.items() if any(map(_running, pids))}


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    tag = os.getpid()
    subnet = f"10.213.{tag % 250 + 1}"  # exists only inside the two namespaces
    # Ray's socket paths (AF_UNIX, at most 107 bytes) live in the temp dir: a short one under /tmp.
    ray_root = Path(tempfile.mkdtemp(prefix="megarl-2h-", dir="/tmp"))
    hosts = [Host(f"megarl-{x}-{tag}", f"{subnet}.{i + 1}", ray_root / x) for i, x in enumerate("ab")]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MEGARL_NODE_IP", "MEGARL_NODE_IFACE")}
    env.update({
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",  # `ray` for ray-node.sh
        "PYTHON": sys.executable,
        "GLOO_SOCKET_IFNAME": IFACE,  # Ray's workers inherit it from their node's `ray start`
        "MEGARL_RAY_START_ARGS": "--num-cpus=1 --object-store-memory=200000000",
        "RAY_AUTH_MODE": "token",  # as in `megarl sbatch` scripts: one token for every node and the driver
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "JOIN_TIMEOUT_S": "120",
        "OMP_NUM_THREADS": "1",
    })  # fmt: skip
    net = TwoHosts(hosts[0], hosts[1], env)
    created: list[str] = []
    try:
        for host in hosts:
            if host.netns in _ip("netns", "list").stdout.split():
                _remove([host.netns], [])  # a stale one of a killed run with the same pid
            done = _ip("netns", "add", host.netns)
            if done.returncode != 0:
                pytest.skip(f"cannot create a network namespace: ip netns add: {done.stderr.strip()}")
            created.append(host.netns)
            host.ray_tmp.mkdir()
        _ip_ok("link", "add", IFACE, "netns", net.a.netns, "type", "veth", "peer", "name", IFACE, "netns", net.b.netns)
        for host in hosts:
            _ip_ok("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", IFACE)
            _ip_ok("-n", host.netns, "link", "set", IFACE, "up")
            _ip_ok("-n", host.netns, "link", "set", "lo", "up")
        yield net
    finally:
        leftover = _remove(created, net.procs)
        shutil.rmtree(ray_root, ignore_errors=True)
    assert not leftover, f"processes still running after the namespaces were removed: {leftover}"


def _logs(*paths: Path) -> str:
    return "\n".join(f"--- {p.name}:\n{p.read_text(errors='replace')[-3000:]}" for p in paths if p.exists())


def test_policy_ranks_on_two_hosts_over_gloo(two_hosts, demo_root, tmp_path):
    a, b = two_hosts.a, two_hosts.b
    address = f"{a.ip}:{PORT}"
    ray_logs = (tmp_path / "ray-head.log", tmp_path / "ray-worker.log")
    two_hosts.start_node(a, "bash", SCRIPT, "head", PORT, log=ray_logs[0], MEGARL_NODE_IP=a.ip)
    two_hosts.start_node(b, "bash", SCRIPT, "worker", address, log=ray_logs[1], MEGARL_NODE_IFACE=IFACE)

    waited = two_hosts.run(a, "bash", SCRIPT, "wait", address, 2, 0, 120, timeout=180)
    assert waited.returncode == 0, waited.stderr + _logs(*ray_logs)
    assert "ray-node: 2 node(s) joined" in waited.stdout

    out = tmp_path / "run"
    overrides = small_overrides(demo_root, out, STEPS, "cluster.nnodes=2", "cluster.gpus_per_node=1")
    launched = two_hosts.run(a, sys.executable, "-m", "megarl.cli", "launch", TINY, "--address", address, *overrides,
                             timeout=240)  # fmt: skip
    assert launched.returncode == 0, launched.stderr[-3000:] + _logs(*sorted((out / "logs").glob("*.log")), *ray_logs)
    assert "Connected to Ray cluster" in launched.stderr  # it joined the two-host cluster (and said so)
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == list(range(1, STEPS + 1))

    # Where each rank ran: the pid in its log is a Ray worker process of exactly one host's raylet
    # (each host has its own temp dir, which holds python-core-worker-<worker id>_<pid>.log).
    placed = {}
    for rank in (0, 1):
        found = re.search(r"\[megarl\] rank \d+ pid (\d+): building", (out / "logs" / f"policy_rank{rank}.log").read_text())
        assert found, f"policy_rank{rank}.log names no pid"
        pid = found.group(1)
        placed[rank] = [h.ip for h in (a, b) if list(h.ray_tmp.glob(f"ray/session_*/logs/python-core-worker-*_{pid}.log"))]
    assert all(len(ips) == 1 for ips in placed.values()), placed
    assert {ips[0] for ips in placed.values()} == {a.ip, b.ip}, placed  # one rank on each host
