"""Engine traffic never goes through an HTTP proxy: clusters export http_proxy / HTTP_PROXY into
jobs, and urllib's default opener would send ``http://<node-ip>:<port>/...`` to the proxy (a
health wait that never ends, 403 / 502 on control calls)."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from megarl.rollout_sglang.client import SGLangClient
from megarl.rollout_sglang.engine import SGLangEngine
from megarl.rollout_sglang.server import probe_health


class RefusingProxy:
    """An HTTP proxy on localhost that answers 403 to everything and counts what reached it."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _refuse(self) -> None:
                owner.hits.append(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                self.send_response(403)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = do_CONNECT = _refuse  # noqa: N815

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def refusing_proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[RefusingProxy]:
    proxy = RefusingProxy()
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, proxy.url)
    for name in ("no_proxy", "NO_PROXY"):  # nothing exempted: localhost would go to the proxy too
        monkeypatch.delenv(name, raising=False)
    yield proxy
    proxy.close()


def test_the_environment_really_routes_urllib_to_the_proxy(fake_server, refusing_proxy):
    """Without the bypass, urllib's default opener asks the proxy (what the cluster's jobs do)."""
    server = fake_server()
    with pytest.raises(urllib.error.HTTPError, match="403"):
        urllib.request.urlopen(server.url + "/health_generate", timeout=5)
    assert refusing_proxy.hits == [server.url + "/health_generate"]


def test_health_probe_and_client_bypass_the_proxy(fake_server, refusing_proxy):
    server = fake_server()
    assert probe_health(server.url, timeout=5)
    reply = SGLangClient(server.url, retries=0).get("/model_info")
    assert reply.status == 200 and reply.body["weight_version"] == "default"
    engine = SGLangEngine(server.url, flush_interval=0.01)
    engine.pause_generation()  # a control call (POST)
    engine.continue_generation()
    assert engine.health().alive and engine.server_version() == "0.5.23"
    assert refusing_proxy.hits == []
    assert "/pause_generation" in server.fake.calls
