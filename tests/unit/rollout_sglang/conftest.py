"""A stand-in SGLang HTTP server for the rollout_sglang tests (no GPU, no SGLang).

It speaks SGLang's documented request/response formats (docs/sglang.md, SGLang 0.5.15+
``http_server.py`` / ``io_struct.py``): ``/generate`` batches with ``meta_info``
(``output_token_logprobs`` as ``[logprob, token_id, null]``, ``finish_reason`` dicts,
``weight_version`` strings), ``{"success", "message"}`` bodies for weight updates, ``null``
bodies for memory release/resume, 400 from ``/flush_cache`` while busy. It records every
call so tests can assert the order megarl drives. Its weight receivers do what SGLang does
with the payloads: unpickle base64 ForkingPickler strings (one per TP rank), or join a
standalone group per TP rank and receive broadcasts in ``names`` order.
"""

from __future__ import annotations

import base64
import json
import pickle
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch
import torch.distributed as dist


class FakeSGLang:
    """State and behaviour of one fake server (one engine with ``tp`` ranks)."""

    def __init__(self, tp: int = 1, generate_delay: float = 0.0, flush_busy: int = 0) -> None:
        self.tp = tp
        self.generate_delay = generate_delay
        self.flush_busy = flush_busy  # answer 400 to this many /flush_cache calls first
        self.calls: list[str] = []
        self.bodies: list[tuple[str, Any]] = []
        self.weight_version = "default"
        self.weights: dict[str, torch.Tensor] = {}
        self.released: set[str] = set()
        self.paused = False
        self.inflight = 0
        self.max_inflight = 0
        self.ignore_version = False  # simulate an engine that loses the version
        self.legacy_info = False  # only /get_model_info (pre-0.5.15 servers)
        self.abort_sample: int | None = None  # finish this batch item with "abort"
        self.fail_update = False
        self.groups: dict[str, list[Any]] = {}
        self.lock = threading.Lock()

    # ---- endpoints -----------------------------------------------------------------

    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        with self.lock:
            self.calls.append(path)
            self.bodies.append((path, body))
        name = path.strip("/").replace("/", "_")
        handler = getattr(self, f"ep_{name}", None)
        if handler is None:
            return 404, {"detail": "Not Found"}
        return handler(body)

    def ep_health_generate(self, body: Any) -> tuple[int, Any]:
        return (503, None) if self.released else (200, None)

    def ep_model_info(self, body: Any) -> tuple[int, Any]:
        if self.legacy_info:
            return 404, {"detail": "Not Found"}
        return 200, {
            "model_path": "/fake",
            "is_generation": True,
            "weight_version": self.weight_version,
        }

    def ep_get_model_info(self, body: Any) -> tuple[int, Any]:
        return 200, {
            "model_path": "/fake",
            "is_generation": True,
            "weight_version": self.weight_version,
        }

    def ep_generate(self, body: dict) -> tuple[int, Any]:
        if isinstance(body["input_ids"][0], int):  # a single prompt (the scoring request)
            return 200, self._prefill(body["input_ids"], body.get("logprob_start_len", -1))
        prompts, params = body["input_ids"], body["sampling_params"]
        with self.lock:
            self.inflight += len(prompts)
            self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            time.sleep(self.generate_delay)
            return 200, [
                self._sample(p, sp, i)
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
            ]
        finally:
            with self.lock:
                self.inflight -= len(prompts)

    def _sample(self, prompt: list[int], sp: dict, i: int) -> dict:
        # Deterministic in (prompt, seed): length = prompt length capped by max_new_tokens.
        seed = sp.get("sampling_seed", 0)
        length = min(len(prompt), sp["max_new_tokens"])
        ids = [(sum(prompt) + seed + k) % 97 for k in range(length)]
        version_shift = 0.0 if self.weight_version == "default" else 0.01 * int(self.weight_version)
        pairs = [[-0.5 - 0.1 * k - version_shift, t, None] for k, t in enumerate(ids)]
        if self.abort_sample == i:
            finish = {
                "type": "abort",
                "message": "Abort before prefill",
                "status_code": 400,
                "err_type": None,
            }
        elif length == sp["max_new_tokens"]:
            finish = {"type": "length", "length": length}
        else:
            finish = {"type": "stop", "matched": 2}
        meta = {
            "id": f"r{i}", "finish_reason": finish, "prompt_tokens": len(prompt),
            "completion_tokens": length, "cached_tokens": 0, "weight_version": self.weight_version,
            "output_token_logprobs": pairs,
        }  # fmt: skip
        return {"text": "", "output_ids": ids, "meta_info": meta}

    def token_logprob(self, token: int) -> float:
        shift = 0.0 if self.weight_version == "default" else 0.01 * int(self.weight_version)
        return -0.01 * (token + 1) - shift

    def _prefill(self, ids: list[int], start: int) -> dict:
        # input_token_logprobs: entry i is the token at position start + i given the tokens
        # before it; position 0 has no log-prob (None), as in SGLang.
        first = max(start, 0)
        pairs = [[None if i == 0 else self.token_logprob(t), t, None] for i, t in enumerate(ids)]
        meta = {"finish_reason": {"type": "length", "length": 1}, "weight_version": self.weight_version,
                "input_token_logprobs": pairs[first:], "output_token_logprobs": [[-1.0, 0, None]]}  # fmt: skip
        return {"text": "", "output_ids": [0], "meta_info": meta}

    def ep_pause_generation(self, body: Any) -> tuple[int, Any]:
        self.paused = True
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def ep_continue_generation(self, body: Any) -> tuple[int, Any]:
        self.paused = False
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def ep_flush_cache(self, body: Any) -> tuple[int, Any]:
        if self.flush_busy > 0:
            self.flush_busy -= 1
            return 400, "Cache not flushed. Please check for pending requests."
        return 200, "Cache flushed."

    def ep_release_memory_occupation(self, body: dict) -> tuple[int, Any]:
        if self.inflight:
            return 500, {
                "error": "release_memory_occupation should be called only when no ongoing request"
            }
        self.released.update(body["tags"])
        return 200, None

    def ep_resume_memory_occupation(self, body: dict) -> tuple[int, Any]:
        self.released.difference_update(body["tags"])
        return 200, None

    def _finish_update(self, body: dict) -> tuple[int, Any]:
        if body.get("weight_version") is not None and not self.ignore_version:
            self.weight_version = body["weight_version"]
        return 200, {"success": True, "message": "Succeeded to update model weights."}

    def ep_update_weights_from_tensor(self, body: dict) -> tuple[int, Any]:
        if self.fail_update:
            return 400, {"success": False, "message": "Failed to update weights: size mismatch"}
        if "weights" in self.released:
            return 400, {"success": False, "message": "weights are released"}
        payloads = body["serialized_named_tensors"]
        if len(payloads) != self.tp:
            return 400, {"success": False, "message": f"{len(payloads)} payloads for tp {self.tp}"}
        per_rank = [pickle.loads(base64.b64decode(p)) for p in payloads]
        assert all([n for n, _ in r] == [n for n, _ in per_rank[0]] for r in per_rank)
        for name, tensor in per_rank[0]:
            self.weights[name] = tensor.clone()
        return self._finish_update(body)

    def ep_update_weights_from_disk(self, body: dict) -> tuple[int, Any]:
        return self._finish_update(body)

    def ep_update_weight_version(self, body: dict) -> tuple[int, Any]:
        if not self.ignore_version:
            self.weight_version = body["new_version"]
        return 200, {"success": True, "message": "ok", "new_version": body["new_version"]}

    def ep_init_weights_update_group(self, body: dict) -> tuple[int, Any]:
        # Each TP rank joins with rank_offset + tp_rank, through the same store layout as
        # torch's group constructor: PrefixStore(group) -> "<group>/" -> "cpu/" (gloo).
        name, world = body["group_name"], body["world_size"]
        groups: list[Any] = [None] * self.tp

        def join(r: int) -> None:
            store = dist.TCPStore(body["master_address"], body["master_port"], world, is_master=False,
                                  timeout=timedelta(seconds=30))  # fmt: skip
            chain = dist.PrefixStore(
                "cpu/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store))
            )
            groups[r] = dist.ProcessGroupGloo(
                chain, body["rank_offset"] + r, world, timedelta(seconds=30)
            )

        self._on_ranks(join)
        self.groups[name] = groups
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    def ep_update_weights_from_distributed(self, body: dict) -> tuple[int, Any]:
        groups = self.groups[body["group_name"]]
        received: list[list[torch.Tensor]] = [[] for _ in range(self.tp)]

        def recv(r: int) -> None:
            for dtype, shape in zip(body["dtypes"], body["shapes"], strict=True):
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                opts = dist.BroadcastOptions()
                opts.rootRank = 0
                groups[r].broadcast([t], opts).wait()
                received[r].append(t)

        self._on_ranks(recv)
        for r in range(1, self.tp):
            assert all(torch.equal(a, b) for a, b in zip(received[0], received[r], strict=True))
        self.weights.update(zip(body["names"], received[0], strict=True))
        return self._finish_update(body)

    def ep_destroy_weights_update_group(self, body: dict) -> tuple[int, Any]:
        self.groups.pop(body["group_name"], None)
        return 200, {"success": True, "message": "Succeeded to destroy custom process group."}

    def _on_ranks(self, fn: Any) -> None:
        threads = [threading.Thread(target=fn, args=(r,)) for r in range(self.tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def control_calls(self) -> list[str]:
        skip = {"/generate", "/health_generate", "/model_info", "/get_model_info"}
        return [c for c in self.calls if c not in skip]


class FakeServer:
    """A FakeSGLang behind ThreadingHTTPServer on 127.0.0.1 (a free port), in a thread.

    Also the ServerHandle an SGLangEngine restarts: ``restart`` starts a fresh fake (new
    state, like a relaunched process with its initial weights).
    """

    def __init__(self, **fake_kwargs: Any) -> None:
        self.fake_kwargs = fake_kwargs
        self.history: list[FakeSGLang] = []
        self._start()

    def _start(self) -> None:
        self.fake = FakeSGLang(**self.fake_kwargs)
        self.history.append(self.fake)
        fake = self.fake

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                status, body = fake.handle(method, self.path, json.loads(raw) if raw else None)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                self._serve("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._serve("POST")

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def kill(self) -> None:
        """The engine dies: its port stops answering."""
        self.httpd.shutdown()
        self.httpd.server_close()

    def restart(self, timeout: float = 600.0) -> None:
        self.shutdown()
        self._start()

    def shutdown(self) -> None:
        if self.thread.is_alive():
            self.kill()

    def log_tail(self, max_lines: int = 40) -> str:
        return ""


@pytest.fixture
def fake_server():
    servers: list[FakeServer] = []

    def make(**kwargs: Any) -> FakeServer:
        servers.append(FakeServer(**kwargs))
        return servers[-1]

    yield make
    for s in servers:
        s.shutdown()
