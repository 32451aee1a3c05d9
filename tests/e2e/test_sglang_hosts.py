"""The Ray side of the SGLang wiring on CPU: SGLangHost actors pinned to a node run a stand-in
server process (SGLangServer's ``command=`` path), which a controller-side SGLangEngine checks,
restarts through the actor and shuts down; bundle probes report where a placement landed."""

from __future__ import annotations

import re
import sys
import textwrap

import pytest

from megarl.ray_cluster.session import ray_session

# Answers /health_generate with 200 on the port SGLangServer picked (as in test_sglang_server.py).
STAND_IN = textwrap.dedent("""
    import http.server
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health_generate" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    print("stand-in up", flush=True)
    http.server.HTTPServer(("127.0.0.1", {port}), H).serve_forever()
""")


@pytest.fixture(scope="module")
def ray_local():
    with ray_session(None, num_cpus=2) as session:
        yield session


def test_host_actor_runs_restarts_and_stops_its_server(ray_local, tmp_path):
    import ray

    from megarl.rollout_sglang.engine import SGLangEngine
    from megarl.rollout_sglang.hosts import EngineSlot, HostHandle, slot_spec, start_hosts
    from megarl.rollout_sglang.server import ServerSpec, probe_health

    node = ray.get_runtime_context().get_node_id()
    slot = EngineSlot(0, node, "127.0.0.1", (0,), (0,))
    spec = slot_spec(ServerSpec(model_path="m"), slot, str(tmp_path / "logs" / "sglang_engine0.log"))
    (host,) = start_hosts([slot], [spec], command=[sys.executable, "-c", STAND_IN])
    try:
        url = ray.get(host.start.remote(60.0))
        assert url.startswith("http://127.0.0.1:") and ray.get(host.healthy.remote())
        engine = SGLangEngine(HostHandle(host, url, spec))
        assert engine.health().alive
        engine.restart(60.0)  # through the actor: kill the process group, relaunch
        assert engine.url == url and engine.health().alive  # same port while it is free
        assert "stand-in up" in engine.server.log_tail()
        assert (tmp_path / "logs" / "sglang_engine0.log").is_file()  # the host made the folder
        ray.get(host.shutdown.remote())
        assert not probe_health(url, timeout=1.0) and not engine.health().alive
    finally:
        ray.get(host.shutdown.remote())
        ray.kill(host)


def test_bundle_probes_report_each_bundle_and_keep_the_reservation(ray_local):
    import ray

    from megarl.ray_cluster.placement import RolePlacement, place_roles, release
    from megarl.rollout_sglang.hosts import probe_bundles

    placed = place_roles([RolePlacement("rollout", 1, 2, gpus_per_proc=0.0, cpus_per_proc=0.5)])
    try:
        infos = probe_bundles(placed["rollout"])
        node = ray.get_runtime_context().get_node_id()
        assert [i["node_id"] for i in infos] == [node, node] and all(i["gpu_ids"] == [] for i in infos)
        assert ray.available_resources().get("CPU", 0.0) <= 1.0  # the 2 x 0.5 CPU stay reserved
    finally:
        release(placed)


def test_a_host_shuts_its_server_down_while_its_start_still_waits(ray_local, tmp_path):
    """A failed start of the engines closes every host: a shutdown must reach a host whose start
    waits (up to its timeout) for a server that never gets healthy, and kill that server."""
    import ray

    from megarl.rollout_sglang.hosts import EngineSlot, slot_spec, start_hosts
    from megarl.rollout_sglang.server import ServerLaunchError, ServerSpec

    node = ray.get_runtime_context().get_node_id()
    slot = EngineSlot(0, node, "127.0.0.1", (0,), (0,))
    spec = slot_spec(ServerSpec(model_path="m"), slot, str(tmp_path / "sglang_engine0.log"))
    never_healthy = [sys.executable, "-c", "import time; print('stand-in up', flush=True); time.sleep(600)"]
    (host,) = start_hosts([slot], [spec], command=never_healthy)
    try:
        starting = host.start.remote(300.0)
        ready, _ = ray.wait([starting], timeout=3)
        assert not ready  # still waiting for health
        ray.get(host.shutdown.remote(), timeout=60)  # not queued behind the start
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(starting, timeout=60)  # the start sees its server gone at once
        # On a loaded machine the shutdown can run before the start launched anything: then the
        # start refuses to launch at all.
        assert isinstance(info.value.cause, ServerLaunchError)
        assert re.search(r"was shut down (before it started|while starting)", str(info.value.cause))
    finally:
        ray.kill(host)
