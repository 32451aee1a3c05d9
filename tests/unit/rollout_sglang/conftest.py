"""A stand-in SGLang HTTP server for the rollout_sglang tests (no GPU, no SGLang).

It speaks SGLang's request/response formats (docs/sglang.md, SGLang 0.5.15 to 0.5.23
``http_server.py`` / ``io_struct.py``): ``/generate`` batches with ``meta_info``
(``output_token_logprobs`` as ``[logprob, token_id, null]``, ``finish_reason`` dicts,
``weight_version`` strings), ``{"success", "message"}`` bodies for weight updates, ``null``
bodies for memory release/resume, 400 from ``/flush_cache`` while busy. It records every
call so tests can assert the order megarl drives. Its weight receivers do what SGLang does
with the payloads: unpickle base64 strings (one per TP rank; ``load_format`` null or
``flattened_bucket``), or join a standalone group per TP rank and receive broadcasts in
``names`` order: one per tensor, or (``load_format: "flattened_bucket"``, 0.5.6 and later) one
uint8 broadcast of every tensor's bytes, no padding.

It is as strict as SGLang where megarl relies on it. Each rule says where it comes from:
[real] = seen on a real SGLang 0.5.23 CPU server (tests/sglang/ repeats what megarl depends
on); [source] = read in SGLang's code for what happens on a GPU, which the CPU server cannot
show (its memory saver is CUDA-only, so a CPU release frees nothing).

- [real] a tensor or distributed update outside ``/begin_weight_update`` ...
  ``/end_weight_update`` is refused (400) on version >= 0.5.21; older versions have no such
  routes (404) and accept updates anywhere. A second begin, or an end without begin: 400.
- [real] ``/release_memory_occupation`` while a request runs kills the server (SGLang asserts
  idleness in its scheduler); so does resuming a tag that is not released.
- [real] ``/flush_cache`` answers 400 while a request runs.
- [real] a payload that shares CPU storage through a file descriptor (``ForkingPickler`` on
  CPU tensors) kills the server: the fd hand-over fails its handshake across processes. So
  does a ``flattened_bucket`` whose tensor does not start at a multiple of its dtype's size
  (SGLang views the uint8 buffer as that dtype and pads nothing).
- [real] a disk update without ``load_format`` on a server launched with ``--load-format
  dummy`` is refused (400); after a load with ``"auto"`` the server's format is ``auto``.
- [real] a distributed update with ``load_format: "flattened_bucket"`` whose tensor would start
  at a byte offset that is not a multiple of its dtype's size is refused (400 "Failed to receive
  weights: Unaligned received tensor ...") before anything is received: the sender's broadcast
  would wait for a receiver that never comes. [source] before 0.5.6 the request has no
  ``load_format`` and the server receives tensor by tensor, which a single broadcast cannot
  match: the fake dies of it.
- [real] ``/health_generate`` while generation is paused answers 503 (after SGLang's 20 s
  health timeout; here at once).
- [source] any forward (``/generate``, ``/health_generate``) or weight update while
  ``weights``, ``kv_cache`` or ``cuda_graph`` are released kills the server: the memory saver
  unmapped those pages and the kernels fault.
- [source] weights released and resumed without ``--enable-weights-cpu-backup`` come back
  as whatever the fresh pages hold; until a push replaces them the fake answers log-probs of
  ``null`` (what SGLang's orjson writes for NaN) so a test sees garbage was served.
- [source] ``sampling_seed`` outside the int64 range is refused (400).

A dead fake closes every connection without an answer and stops listening, as a dead
server's port does.
"""

from __future__ import annotations

import base64
import io
import json
import math
import pickle
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch
import torch.distributed as dist

UPDATE_SESSION_SINCE = (0, 5, 21)  # first SGLang release with begin/end_weight_update
FLATTENED_DISTRIBUTED_SINCE = (0, 5, 6)  # first with load_format flattened_bucket on distributed updates
NOT_FOUND = (404, {"detail": "Not Found"})


class ServerDied(Exception):
    """Raised inside a handler: the fake server dies (SGLang's scheduler crashed)."""


@dataclass
class FlattenedTensorMetadata:
    """SGLang's ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`` (same fields),
    which a ``flattened_bucket`` payload pickles by that module path."""

    name: str
    shape: Any
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class PayloadUnpickler(pickle.Unpickler):
    """Unpickles weight payloads the way a separate SGLang process can."""

    FD_SHARING = {
        ("multiprocessing.resource_sharer", "DupFd"),
        ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    }
    METADATA = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.FD_SHARING:
            raise ServerDied(
                f"payload shares CPU storage through {module}.{name}: "
                "AuthenticationError('digest sent was rejected') in the scheduler"
            )
        if (module, name) == self.METADATA:
            return FlattenedTensorMetadata
        return super().find_class(module, name)


def decode_payload(payload: str, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    obj = PayloadUnpickler(io.BytesIO(base64.b64decode(payload))).load()
    if load_format is None:
        return [(name, tensor) for name, tensor in obj]
    if load_format != "flattened_bucket":
        raise ValueError(f"the fake does not know load_format {load_format!r}")
    flat = obj["flattened_tensor"]
    return [
        (m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape))
        for m in obj["metadata"]
    ]


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:3])


def flat_layout(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[tuple[int, int]] | str:
    """(start, end) byte range of each tensor of a flattened bucket, in ``names`` order, as
    SGLang 0.5.23's ``FlattenedTensorBucket.empty`` lays them out (no padding), or its refusal of
    an offset that is not a multiple of the dtype's size."""
    out, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        t = getattr(torch, dtype)
        if offset % t.itemsize:
            return f"Unaligned received tensor {name}: byte offset {offset}, dtype {t}"
        size = math.prod(shape) * t.itemsize
        out.append((offset, offset + size))
        offset += size
    return out


class FakeSGLang:
    """State and behaviour of one fake server (one engine with ``tp`` ranks)."""

    def __init__(
        self,
        tp: int = 1,
        generate_delay: float = 0.0,
        generate_gate: threading.Event | None = None,
        flush_busy: int = 0,
        version: str = "0.5.23",
        load_format: str = "auto",
        weights_cpu_backup: bool = False,
    ) -> None:
        self.tp = tp
        self.generate_delay = generate_delay
        # set by a test once it has done what must happen while a generation runs
        self.generate_gate = generate_gate
        self.flush_busy = flush_busy  # answer 400 to this many /flush_cache calls first
        self.version = version
        self.load_format = load_format  # --load-format at launch; a disk load may change it
        self.weights_cpu_backup = weights_cpu_backup
        self.calls: list[str] = []
        self.bodies: list[tuple[str, Any]] = []
        self.weight_version = "default"
        self.weights: dict[str, torch.Tensor] = {}
        self.released: set[str] = set()
        self.paused = False
        self.session_open = False
        self.weights_lost = False  # resumed without a CPU backup and not pushed since
        self.crashed: str | None = None  # why the server died
        self.inflight = 0
        self.max_inflight = 0
        self.ignore_version = False  # simulate an engine that loses the version
        self.legacy_info = False  # only /get_model_info, /get_server_info (pre-0.5.15 servers)
        self.abort_sample: int | None = None  # finish this batch item with "abort"
        self.fail_update = False
        self.groups: dict[str, list[Any]] = {}
        self.broadcasts = 0  # broadcasts received by TP rank 0 (distributed updates)
        self.lock = threading.Lock()

    @property
    def needs_session(self) -> bool:
        return version_tuple(self.version) >= UPDATE_SESSION_SINCE

    # ---- endpoints -----------------------------------------------------------------

    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        """(status, body); raises ServerDied when the request kills the server."""
        with self.lock:
            self.calls.append(path)
            self.bodies.append((path, body))
        if self.crashed:
            raise ServerDied(self.crashed)
        name = path.split("?")[0].strip("/").replace("/", "_")
        handler = getattr(self, f"ep_{name}", None)
        if handler is None:
            return NOT_FOUND
        try:
            return handler(body)
        except ServerDied as err:
            self.crashed = self.crashed or str(err)
            raise

    def _forward_needs_memory(self, what: str) -> None:
        if self.released:
            raise ServerDied(
                f"{what} ran a forward on released memory {sorted(self.released)} "
                "(CUDA illegal memory access)"
            )

    def ep_health_generate(self, body: Any) -> tuple[int, Any]:
        if self.paused:
            return 503, None  # its 1-token request waits behind the pause
        self._forward_needs_memory("/health_generate")
        return 200, None

    def _model_info(self) -> dict[str, Any]:
        return {
            "model_path": "/fake",
            "is_generation": True,
            "weight_version": self.weight_version,
            "load_format": self.load_format,
        }

    def ep_model_info(self, body: Any) -> tuple[int, Any]:
        return NOT_FOUND if self.legacy_info else (200, self._model_info())

    def ep_get_model_info(self, body: Any) -> tuple[int, Any]:
        return 200, self._model_info()

    def ep_server_info(self, body: Any) -> tuple[int, Any]:
        return NOT_FOUND if self.legacy_info else self.ep_get_server_info(body)

    def ep_get_server_info(self, body: Any) -> tuple[int, Any]:
        return 200, {"version": self.version, "tp_size": self.tp, "load_format": self.load_format}

    def ep_generate(self, body: dict) -> tuple[int, Any]:
        self._forward_needs_memory("/generate")
        if isinstance(body["input_ids"][0], int):  # a single prompt (the scoring request)
            return 200, self._prefill(body["input_ids"], body.get("logprob_start_len", -1))
        prompts, params = body["input_ids"], body["sampling_params"]
        for sp in params:
            seed = sp.get("sampling_seed")
            if seed is not None and not -(2**63) <= seed <= 2**63 - 1:
                return 400, {
                    "error": {
                        "message": f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}."
                    }
                }
        with self.lock:
            self.inflight += len(prompts)
            self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            if self.generate_gate is not None:
                assert self.generate_gate.wait(30), "the test never let the generation finish"
            else:
                time.sleep(self.generate_delay)
            if self.crashed:  # died while this request ran (a release while busy)
                raise ServerDied(self.crashed)
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
        if self.weights_lost:
            pairs = [[None, t, None] for t in ids]  # garbage weights: NaN, written as null
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
        if self.flush_busy > 0 or self.inflight:
            self.flush_busy = max(0, self.flush_busy - 1)
            return 400, "Cache not flushed. Please check for pending requests."
        return 200, "Cache flushed."

    def ep_release_memory_occupation(self, body: dict) -> tuple[int, Any]:
        if self.inflight:
            raise ServerDied(
                "AssertionError: release_memory_occupation should be called only when server is idle."
            )
        self.released.update(body.get("tags") or ("kv_cache", "weights", "cuda_graph"))
        return 200, None

    def ep_resume_memory_occupation(self, body: dict) -> tuple[int, Any]:
        tags = body.get("tags") or ("kv_cache", "weights", "cuda_graph")
        for tag in tags:
            if tag not in self.released:
                raise ServerDied(f"KeyError: {tag!r} (resumed but not released)")
        self.released.difference_update(tags)
        if "weights" in tags and not self.weights_cpu_backup:
            self.weights_lost = True
        return 200, None

    def ep_begin_weight_update(self, body: Any) -> tuple[int, Any]:
        if not self.needs_session:
            return NOT_FOUND
        if self.session_open:
            return 400, {"success": False, "message": "a weight-update session is already open; call end_weight_update() first"}  # fmt: skip
        self.session_open = True
        return 200, {"success": True, "message": "Success"}

    def ep_end_weight_update(self, body: Any) -> tuple[int, Any]:
        if not self.needs_session:
            return NOT_FOUND
        if not self.session_open:
            return 400, {"success": False, "message": "no weight-update session is open; call begin_weight_update() first"}  # fmt: skip
        self.session_open = False
        return 200, {"success": True, "message": "Success"}

    def _refuse_update(self, endpoint: str) -> tuple[int, Any] | None:
        """The refusals every weight update shares, in SGLang's order."""
        if endpoint != "update_weights_from_disk" and self.needs_session and not self.session_open:
            return 400, {"success": False, "message": f"{endpoint} must run between begin_weight_update() and end_weight_update()"}  # fmt: skip
        if "weights" in self.released:
            raise ServerDied(f"{endpoint} wrote into released weights (CUDA illegal memory access)")
        return None

    def _finish_update(self, body: dict) -> tuple[int, Any]:
        self.weights_lost = False
        if body.get("weight_version") is not None and not self.ignore_version:
            self.weight_version = body["weight_version"]
        return 200, {"success": True, "message": "Succeeded to update model weights."}

    def ep_update_weights_from_tensor(self, body: dict) -> tuple[int, Any]:
        refused = self._refuse_update("update_weights_from_tensor")
        if refused:
            return refused
        if self.fail_update:
            return 400, {"success": False, "message": "Failed to update weights: size mismatch"}
        payloads = body["serialized_named_tensors"]
        if len(payloads) != self.tp:
            return 400, {"success": False, "message": f"{len(payloads)} payloads for tp {self.tp}"}
        try:
            per_rank = [decode_payload(p, body.get("load_format")) for p in payloads]
        except ServerDied:
            raise
        except Exception as err:  # the scheduler rebuilds the tensors and dies on an error
            raise ServerDied(f"{type(err).__name__}: {err}") from err
        assert all([n for n, _ in r] == [n for n, _ in per_rank[0]] for r in per_rank)
        for name, tensor in per_rank[0]:
            self.weights[name] = tensor.clone()
        return self._finish_update(body)

    def ep_update_weights_from_disk(self, body: dict) -> tuple[int, Any]:
        refused = self._refuse_update("update_weights_from_disk")
        if refused:
            return refused
        load_format = body.get("load_format") or self.load_format
        if load_format == "dummy":
            return 400, {"success": False, "message": "Failed to get model loader: <sglang.srt.model_loader.loader.DummyModelLoader object>.", "num_paused_requests": 0}  # fmt: skip
        self.load_format = load_format
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
        # Refused before receiving anything, as SGLang does: a sender that broadcasts anyway
        # waits for a receiver that never comes.
        refused = self._refuse_update("update_weights_from_distributed")
        if refused:
            return refused
        groups = self.groups[body["group_name"]]
        flat = body.get("load_format") == "flattened_bucket"
        if flat and version_tuple(self.version) < FLATTENED_DISTRIBUTED_SINCE:
            raise ServerDied(
                f"SGLang {self.version} has no load_format for distributed updates: it waits for one "
                "broadcast per tensor, and a flattened bucket's single broadcast does not match them"
            )
        layout = flat_layout(body["names"], body["dtypes"], body["shapes"]) if flat else None
        if isinstance(layout, str):  # SGLang's receive fails before the broadcast
            return 400, {"success": False, "message": f"Failed to receive weights: {layout}"}
        received: list[list[torch.Tensor]] = [[] for _ in range(self.tp)]

        def recv(r: int) -> None:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            if layout is not None:
                buffer = torch.empty(layout[-1][1] if layout else 0, dtype=torch.uint8)
                groups[r].broadcast([buffer], opts).wait()
                received[r] = [buffer[start:end].view(getattr(torch, dtype)).reshape(shape)
                               for (start, end), dtype, shape in zip(layout, body["dtypes"], body["shapes"], strict=True)]  # fmt: skip
                self.broadcasts += r == 0
                return
            for dtype, shape in zip(body["dtypes"], body["shapes"], strict=True):
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                groups[r].broadcast([t], opts).wait()
                received[r].append(t)
                self.broadcasts += r == 0

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
        skip = {"/generate", "/health_generate", "/model_info", "/get_model_info", "/server_info",
                "/get_server_info"}  # fmt: skip
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
        fake, owner = self.fake, self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    status, body = fake.handle(method, self.path, json.loads(raw) if raw else None)
                except ServerDied:
                    # A dead server answers nothing and stops listening.
                    self.close_connection = True
                    threading.Thread(target=owner.kill, daemon=True).start()
                    return
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
        self._closed = False
        self._kill_lock = threading.Lock()
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def kill(self) -> None:
        """The engine dies: its port stops answering."""
        with self._kill_lock:  # a crash kills from a handler thread, a test from its own
            if self._closed:
                return
            self._closed = True
        self.httpd.shutdown()
        self.httpd.server_close()

    def restart(self, timeout: float = 600.0) -> None:
        self.shutdown()
        self._start()

    def shutdown(self) -> None:
        if self.thread.is_alive():
            self.kill()

    def log_tail(self, max_lines: int = 40) -> str:
        return self.fake.crashed or ""


@pytest.fixture
def fake_server():
    servers: list[FakeServer] = []

    def make(**kwargs: Any) -> FakeServer:
        servers.append(FakeServer(**kwargs))
        return servers[-1]

    yield make
    for s in servers:
        s.shutdown()
