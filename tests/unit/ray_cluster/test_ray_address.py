"""`megarl launch --address` fails in a second with one line when no Ray cluster answers there
(ray.init itself retries a dead address for minutes): probed with one TCP connect, not joined."""

from __future__ import annotations

import socket
import time

import pytest

from megarl.ray_cluster.address import find_cluster, one_machine_problem, unanswered
from megarl.ray_cluster.session import ray_session


def test_a_dead_address_is_refused_at_once_naming_it(monkeypatch, refused_port):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    port = refused_port
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"--address / cluster.ray_address '127.0.0.1:{port}': no Ray cluster answered "
                       rf"\(127.0.0.1:{port} does not answer: Connection refused\)"):  # fmt: skip
        with ray_session(f"127.0.0.1:{port}"):
            pass
    assert time.monotonic() - start < 10


def test_auto_follows_ray_address_then_the_address_file(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert find_cluster("auto") is None
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("10.0.0.7:6379\n")
    assert find_cluster("auto") == (str(tmp_path / "ray" / "ray_current_cluster"), "10.0.0.7:6379")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.8:6379")
    assert find_cluster("auto") == ("RAY_ADDRESS", "10.0.0.8:6379")
    assert find_cluster("10.0.0.9:1") == ("given", "10.0.0.9:1")


def test_a_listening_port_answers_and_client_addresses_are_not_probed():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert unanswered(f"127.0.0.1:{server.getsockname()[1]}") is None
    assert unanswered("ray://head:10001") is None
    assert unanswered("garbage") == "not host:port"  # RAY_ADDRESS=garbage attaches to nothing


def test_several_nodes_need_a_cluster_address():
    for embedded in (None, "", "local"):
        assert "or set cluster.nnodes=1" in one_machine_problem(2, embedded)
        assert one_machine_problem(1, embedded) is None
    assert one_machine_problem(4, "auto") is None and one_machine_problem(4, "10.0.0.1:6379") is None
