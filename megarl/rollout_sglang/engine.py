"""SGLangEngine: one SGLang server seen as a megarl RolloutEngine.

Generation: one ``/generate`` request per prompt carrying its n samples (see
client.build_generate_payload for why), at most ``max_running_requests // n`` requests in
flight, results grouped ``[p0s0 .. p0s(n-1), p1s0, ...]``.

Control: pause / flush / continue, memory release / resume with tags, the weight-update
session (begin / end, SGLang >= 0.5.21 only), the three weight update endpoints, the group
endpoints of the distributed path, weight-version checks, health and restart. The order in
which a weight push calls them lives in megarl/weight_sync/sglang_push.py (docs/sglang.md has it too).

Deliberately left out: routers, streaming, partial rollouts, data-parallel attention.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol

from megarl.engines.base import EngineHealth, GenerationResult, SamplingParams, WeightBucket
from megarl.engines.routing import RoutingLayout
from megarl.rollout_sglang.client import (
    SGLangClient,
    SGLangHTTPError,
    build_generate_payload,
    check_reply,
    parse_generate_reply,
    parse_weight_version,
)

# SGLang's memory tags (sglang.srt.constants.GPU_MEMORY_TYPE_*).
WEIGHTS, KV_CACHE, CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"
ALL_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)
# From this release on, SGLang applies /update_weights_from_tensor and
# /update_weights_from_distributed only between POST /begin_weight_update and POST
# /end_weight_update (400 otherwise); before it those two routes do not exist (404).
UPDATE_SESSION_SINCE = (0, 5, 21)
# From this release on, /update_weights_from_distributed takes load_format "flattened_bucket": the
# bucket's tensors arrive as one broadcast of their bytes (managers/io_struct.py
# UpdateWeightsFromDistributedReqInput.load_format, the model runner's bucketed receive; read in
# the released wheels of 0.5.5, which has neither, and 0.5.6). Older servers receive tensor by tensor.
FLATTENED_DISTRIBUTED_SINCE = (0, 5, 6)
FLATTENED_BUCKET = "flattened_bucket"


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.5.23"``, ``"0.5.15.post1"``, ``"0.5.22rc0"`` -> (major, minor, patch)."""
    match = re.match(r"\s*(\d+)\.(\d+)\.(\d+)", str(text))
    if match is None:
        raise ValueError(f"SGLang version {text!r} is not of the form MAJOR.MINOR.PATCH")
    return int(match[1]), int(match[2]), int(match[3])


class WeightVersionMismatch(RuntimeError):
    """An engine reports another weight version than the one just pushed."""


class EngineBusy(RuntimeError):
    """A control call that needs an idle engine was made while requests were in flight."""


class ServerHandle(Protocol):
    """What the engine needs from the process behind its URL (SGLangServer implements it)."""

    @property
    def url(self) -> str: ...

    def restart(self, timeout: float = 600.0) -> None: ...

    def shutdown(self) -> None: ...

    def log_tail(self, max_lines: int = 40) -> str: ...


@dataclass(frozen=True)
class EngineEndpoint:
    """How a policy rank reaches one engine (plain data: it travels from the controller).

    ``holders`` (colocated only): the policy ranks on the engine's GPUs, in engine TP order.
    """

    url: str
    tp: int
    max_running_requests: int = 256
    holders: tuple[int, ...] = ()


class SGLangEngine:
    """A RolloutEngine backed by one SGLang HTTP server.

    ``server`` is the process handle (for restart and log tails) or just a URL for a server
    started elsewhere (then :meth:`restart` is impossible).
    """

    def __init__(
        self,
        server: ServerHandle | str,
        tp: int = 1,
        max_running_requests: int = 256,
        timeout: float = 3600.0,
        retries: int = 3,
        flush_retries: int = 60,
        flush_interval: float = 1.0,
        control_timeout: float = 600.0,
        routing_layout: RoutingLayout | None = None,
    ) -> None:
        """``routing_layout``: the served model's MoE layers, to parse the experts a request asks for
        (SamplingParams.return_routing); None = read from the server's model path when first needed."""
        self.server = None if isinstance(server, str) else server
        self._routing_layout = routing_layout
        url = server if isinstance(server, str) else server.url
        self.client = SGLangClient(url, timeout=timeout, retries=retries)
        self.tp = tp
        self.max_running_requests = max_running_requests
        self.flush_retries = flush_retries
        self.flush_interval = flush_interval
        self.control_timeout = control_timeout
        self.released: set[str] = set()
        self.paused = False
        # --enable-deterministic-inference: SGLang samples with per-request sampling_seed.
        self.deterministic = bool(
            getattr(getattr(self.server, "spec", None), "deterministic", False)
        )
        self._version = 0
        self._server_version: str | None = None  # SGLang's release, read once per launch
        self.update_session = False  # between begin_weight_update and end_weight_update
        # The LoRA adapter (its name on the server) every generation uses; None = the base model.
        # Set by whoever loads one (client.load_lora_adapter); a relaunched server has none.
        self.active_adapter: str | None = None
        self._inflight = 0
        self._lock = threading.Lock()
        # One thread for HTTP calls that must not block the caller (group init, distributed
        # updates): the caller posts, then joins the collective, then waits for the reply.
        self._background_pool: ThreadPoolExecutor | None = None

    @property
    def url(self) -> str:
        return self.client.url

    @property
    def weight_version(self) -> int:
        return self._version

    def __repr__(self) -> str:
        return f"SGLangEngine({self.url}, tp={self.tp})"

    # ---- generation -------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, first_sample_index: int = 0
    ) -> list[GenerationResult]:
        """``len(prompts) * n`` results grouped by prompt; ``first_sample_index`` is the global
        index (within the step) of this call's first sample, for per-sample seeds."""
        if self.released:
            raise EngineBusy(
                f"{self}: memory is released ({sorted(self.released)}); call resume_memory() before generate()"
            )
        if self.deterministic and params.seed is None and not params.greedy:
            raise ValueError(
                f"{self} runs with deterministic inference, which samples from sampling_seed: "
                "without SamplingParams.seed every sample would share SGLang's one default seed; "
                "set a seed (megarl.engines.seeds.step_seed) or launch with deterministic=False"
            )
        params.check_budgets(len(prompts))
        adapter = self.active_adapter  # one adapter for the whole call, even if a push switches it
        concurrency = max(1, self.max_running_requests // params.n)
        with ThreadPoolExecutor(max_workers=min(concurrency, max(1, len(prompts)))) as pool:
            futures = [
                pool.submit(self._generate_one, p, replace(params, max_new_tokens=params.budget(i), prompt_max_new_tokens=None),
                            i, first_sample_index + i * params.n, adapter)
                for i, p in enumerate(prompts)
            ]
            return [r for f in futures for r in f.result()]

    def _generate_one(
        self, prompt: Sequence[int], params: SamplingParams, index: int, first_sample: int,
        adapter: str | None = None,
    ) -> list[GenerationResult]:  # fmt: skip
        payload = build_generate_payload(prompt, params, first_sample, adapter)
        with self._lock:
            self._inflight += 1
        try:
            reply = self.client.post("/generate", payload)
        finally:
            with self._lock:
                self._inflight -= 1
        if reply.status != 200:
            check_reply(self.url, "/generate", reply)
        routing = (len(prompt), self.routing_layout()) if params.return_routing else None
        try:
            return parse_generate_reply(reply.body, index, params.n, routing)
        except SGLangHTTPError as err:
            raise SGLangHTTPError(self.url, "/generate", reply.status, err.detail) from None

    def routing_layout(self) -> RoutingLayout:
        """The served model's MoE layers and top-k (how SGLang's routed experts are read)."""
        if self._routing_layout is None:
            spec = getattr(self.server, "spec", None)
            if spec is None:
                raise ValueError(f"{self} was asked for expert routing (SamplingParams.return_routing) and knows no "
                                 "model to read its MoE layers from; pass SGLangEngine(..., routing_layout=RoutingLayout.of_model(path))")  # fmt: skip
            self._routing_layout = RoutingLayout.of_model(spec.model_path)
        return self._routing_layout

    # ---- control ----------------------------------------------------------------------

    def pause_generation(self, mode: str = "abort") -> None:
        """Stop scheduling; ``abort`` returns running requests as aborted (their
        finish_reason is "abort"). Servers before the ``mode`` field ignore the body."""
        self.client.post_ok("/pause_generation", {"mode": mode}, self.control_timeout)
        self.paused = True

    def continue_generation(self) -> None:
        self.client.post_ok("/continue_generation", {}, self.control_timeout)
        self.paused = False

    def flush_cache(self) -> int:
        """Flush the radix/KV cache, retrying while SGLang answers 400 (requests still
        running or waiting). Returns the number of attempts."""
        for attempt in range(1, self.flush_retries + 1):
            reply = self.client.post("/flush_cache", {}, self.control_timeout)
            if reply.status == 200:
                return attempt
            if reply.status != 400:
                check_reply(self.url, "/flush_cache", reply)
            time.sleep(self.flush_interval)
        raise SGLangHTTPError(
            self.url, "/flush_cache", 400,
            f"still refused after {self.flush_retries} attempts (requests running or waiting); "
            "pause generation or abort requests first",
        )  # fmt: skip

    def release_memory(self, tags: Sequence[str] = ALL_TAGS) -> None:
        """Free GPU memory (needs ``--enable-memory-saver``); the engine must be idle.

        SGLang asserts idleness inside its scheduler, and a release while a request runs
        kills the server (seen on 0.5.23). So: refuse while this client has requests in
        flight, then flush the cache, which SGLang refuses (400, retried by
        :meth:`flush_cache`) while any client's request is running or waiting (as slime does).
        """
        with self._lock:
            if self._inflight:
                raise EngineBusy(
                    f"{self}: {self._inflight} requests in flight; release_memory needs an idle engine"
                )
        todo = [t for t in tags if t not in self.released]
        if todo:
            self.flush_cache()
            self.client.post_ok("/release_memory_occupation", {"tags": todo}, self.control_timeout)
            self.released.update(todo)

    def resume_memory(self, tags: Sequence[str] = ALL_TAGS) -> None:
        """Resume the released tags among ``tags``; never a tag that is not released (SGLang's
        scheduler raises on it and the server dies, seen on 0.5.23)."""
        todo = [t for t in tags if t in self.released]
        if todo:
            self.client.post_ok("/resume_memory_occupation", {"tags": todo}, self.control_timeout)
            self.released.difference_update(todo)

    # ---- weight updates ---------------------------------------------------------------

    def server_version(self) -> str:
        """SGLang's release (``version`` of ``/server_info``, or ``/get_server_info`` on servers
        without it), read once per launch."""
        if self._server_version is None:
            reply = self.client.get("/server_info", self.control_timeout)
            if reply.status == 404:
                reply = self.client.get("/get_server_info", self.control_timeout)
            check_reply(self.url, "/server_info", reply)
            version = reply.body.get("version") if isinstance(reply.body, dict) else None
            if version is None:
                raise SGLangHTTPError(
                    self.url, "/server_info", reply.status, "the answer has no 'version' field"
                )
            self._server_version = str(version)
        return self._server_version

    def _release_at_least(self, since: tuple[int, int, int], what: str) -> bool:
        """Whether this server's release is ``since`` or later (``what`` it decides, for the
        error when the release cannot be read)."""
        try:
            return parse_version(self.server_version()) >= since
        except ValueError as err:
            raise SGLangHTTPError(
                self.url, "/server_info", 200,
                f"{err}; megarl reads it to know {what} (SGLang >= {'.'.join(map(str, since))}): run a released SGLang",
            ) from None  # fmt: skip

    @property
    def needs_update_session(self) -> bool:
        """Whether this server applies tensor and distributed updates only inside
        begin_weight_update / end_weight_update (SGLang >= 0.5.21)."""
        return self._release_at_least(UPDATE_SESSION_SINCE, "whether weight updates need begin_weight_update")

    @property
    def takes_flattened_distributed(self) -> bool:
        """Whether ``/update_weights_from_distributed`` takes ``load_format: "flattened_bucket"``
        (one broadcast per bucket; SGLang >= 0.5.6); older servers receive tensor by tensor."""
        return self._release_at_least(FLATTENED_DISTRIBUTED_SINCE, "whether distributed updates take flattened buckets")

    def begin_weight_update(self) -> None:
        """``POST /begin_weight_update`` where the server needs it (>= 0.5.21; a no-op before).
        Call it after pause / flush and before the first tensor or distributed bucket; a
        session this client already opened is kept (a push retried after a failure)."""
        if self.update_session or not self.needs_update_session:
            self.update_session = True
            return
        self.client.post_ok("/begin_weight_update", {}, self.control_timeout)
        self.update_session = True

    def end_weight_update(self) -> None:
        """``POST /end_weight_update`` after the last bucket (a no-op where begin was one)."""
        if self.update_session and self.needs_update_session:
            self.client.post_ok("/end_weight_update", {}, self.control_timeout)
        self.update_session = False

    def _check_update_session(self, endpoint: str) -> None:
        # Refused here rather than by the server: a refused distributed update returns at
        # once, and the trainer's broadcast would then wait for a receiver that never comes.
        if not self.update_session and self.needs_update_session:
            raise RuntimeError(
                f"{self}: SGLang {self.server_version()} applies {endpoint} only between "
                "begin_weight_update and end_weight_update; call engine.begin_weight_update() "
                "before the first bucket and engine.end_weight_update() after the last"
            )

    def update_from_tensor(
        self, payloads: Sequence[str], load_format: str | None, version: int | None
    ) -> None:
        """``/update_weights_from_tensor`` with one base64 payload per engine TP rank (inside
        begin_weight_update / end_weight_update on SGLang >= 0.5.21)."""
        self._check_update_session("/update_weights_from_tensor")
        if len(payloads) != self.tp:
            raise ValueError(
                f"{self}: {len(payloads)} payloads for tp={self.tp}; give one per TP rank"
            )
        body: dict[str, Any] = {
            "serialized_named_tensors": list(payloads),
            "load_format": load_format,
            "flush_cache": False,  # one flush per push, not per bucket
        }
        if version is not None:
            body["weight_version"] = str(version)
        self.client.post_ok("/update_weights_from_tensor", body, self.control_timeout)

    def load_weights(self, bucket: WeightBucket) -> None:
        """One bucket over CUDA IPC (colocated), in its own update session unless the caller
        opened one. Callers normally use the tensor transport (megarl/weight_sync/cuda_ipc.py)."""
        from megarl.rollout_sglang.tensor_payload import build_tensor_requests

        own_session = not self.update_session
        self.begin_weight_update()
        for request in build_tensor_requests(bucket.tensors, self.tp):
            version = bucket.version if bucket.last and request.last else None
            self.update_from_tensor(request.payloads, request.load_format, version)
        if own_session:
            self.end_weight_update()

    def update_from_distributed_async(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
        version: int | None, load_format: str | None = None,
    ) -> Future[Any]:  # fmt: skip
        """Post ``/update_weights_from_distributed`` without waiting: the engine answers only
        after it received every tensor, which the caller broadcasts meanwhile (inside
        begin_weight_update / end_weight_update on SGLang >= 0.5.21, checked before posting).
        ``load_format`` :data:`FLATTENED_BUCKET`: the tensors come as one broadcast of their bytes
        in ``names`` order (:attr:`takes_flattened_distributed` servers only); None: one broadcast
        per tensor."""
        self._check_update_session("/update_weights_from_distributed")
        if load_format == FLATTENED_BUCKET and not self.takes_flattened_distributed:
            # Refused here: an older server ignores the field, waits for one broadcast per tensor,
            # and the sender's single broadcast would never match them.
            raise RuntimeError(
                f"{self}: SGLang {self.server_version()} receives distributed updates tensor by tensor; "
                f"send load_format {FLATTENED_BUCKET!r} only to SGLang >= 0.5.6"
            )
        body: dict[str, Any] = {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": False,
        }  # fmt: skip
        if version is not None:
            body["weight_version"] = str(version)
        if load_format is not None:
            body["load_format"] = load_format
        # No retry: a re-sent request would wait for a second broadcast that never comes.
        return self._background().submit(
            self.client.post_ok, "/update_weights_from_distributed", body, self.control_timeout, 0
        )

    def init_update_group_async(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str, backend: str,
    ) -> Future[Any]:  # fmt: skip
        """Post ``/init_weights_update_group``; it returns only after the rendezvous, so the
        trainer joins the group while this is pending."""
        body = {
            "master_address": master_address, "master_port": master_port,
            "rank_offset": rank_offset, "world_size": world_size,
            "group_name": group_name, "backend": backend,
        }  # fmt: skip
        return self._background().submit(
            self.client.post_ok, "/init_weights_update_group", body, self.control_timeout, 0
        )

    def destroy_update_group(self, group_name: str) -> None:
        self.client.post_ok(
            "/destroy_weights_update_group", {"group_name": group_name}, self.control_timeout
        )

    def update_from_disk(self, model_path: str, version: int, load_format: str = "auto") -> None:
        """``/update_weights_from_disk``. ``load_format`` is always sent: left out, SGLang
        loads with the server's current one, and a server launched with ``--load-format
        dummy`` answers 400 "Failed to get model loader: DummyModelLoader" (0.5.23)."""
        # One request per push, so it may flush the cache itself (the default).
        body = {
            "model_path": model_path,
            "weight_version": str(version),
            "load_format": load_format,
        }
        self.client.post_ok("/update_weights_from_disk", body, self.control_timeout)

    def load_weights_from_disk(self, directory: str | os.PathLike[str], version: int) -> None:
        """What the disk transport (megarl/weight_sync/transports.py) calls: the update, then the
        version check (no pause: SGLang's disk update waits for running requests itself; the
        memory hand-over resumed the weights' memory before the push)."""
        self.update_from_disk(str(directory), version)
        self.check_weight_version(version)

    def set_weight_version(self, version: int) -> None:
        """``/update_weight_version`` (a label only: no weights move)."""
        body = {"new_version": str(version), "abort_all_requests": False}
        self.client.post_ok("/update_weight_version", body, self.control_timeout)

    # ---- state ------------------------------------------------------------------------

    def model_info(self) -> dict[str, Any]:
        """``/model_info`` (0.5.15+), falling back to ``/get_model_info`` on older servers."""
        reply = self.client.get("/model_info", self.control_timeout)
        if reply.status == 404:
            reply = self.client.get("/get_model_info", self.control_timeout)
        check_reply(self.url, "/model_info", reply)
        if not isinstance(reply.body, dict):
            raise SGLangHTTPError(
                self.url, "/model_info", reply.status, f"not a JSON object: {reply.body!r}"
            )
        return reply.body

    def server_weight_version(self) -> int:
        return parse_weight_version(self.model_info().get("weight_version"))

    def check_weight_version(self, expected: int) -> None:
        """Raise :class:`WeightVersionMismatch` unless the server reports ``expected``."""
        got = self.server_weight_version()
        if got != expected:
            raise WeightVersionMismatch(
                f"{self}: weight_version is {got} after pushing version {expected}; the update "
                "did not reach this engine (restarted mid-push? an update request failed?)"
            )
        self._version = expected

    def health(self) -> EngineHealth:
        """Alive = ``/health_generate`` answers 200 (it runs a 1-token generation). While
        generation is paused (a push failed half-way) that request waits and SGLang answers
        503 after its 20 s health timeout (seen on 0.5.23); while memory is released on a GPU
        the 1-token forward would read unmapped weights / KV cache and fault (read in SGLang's
        memory-saver code; the CPU server has nothing to release and answers 200). In both
        cases ``/model_info`` answering is enough."""
        endpoint = "/model_info" if self.released or self.paused else "/health_generate"
        try:
            reply = self.client.get(endpoint, timeout=30.0, retries=0)
        except SGLangHTTPError as err:
            return EngineHealth(False, self._version, str(err))
        if reply.status != 200:
            return EngineHealth(False, self._version, f"{endpoint} answered {reply.status}")
        return EngineHealth(True, self._version)

    def restart(self, timeout: float = 600.0) -> None:
        """Relaunch the server process; its weights are the initial ones until re-pushed."""
        if self.server is None:
            raise RuntimeError(
                f"{self} was built from a URL; only an engine built from a server handle can restart"
            )
        self.server.restart(timeout)
        self.client.url = self.server.url.rstrip("/")
        self.released.clear()
        self.paused = False
        self.update_session = False
        self._server_version = None  # the relaunched process may be another install
        self._version = 0
        # active_adapter is kept: the hand-over re-pushes the same version (and so loads the same
        # name) before anything generates on a restarted server (megarl/memory/handover.py).

    def _background(self) -> ThreadPoolExecutor:
        """The thread for HTTP calls that must not block the caller (made when first needed)."""
        if self._background_pool is None:
            self._background_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-ctl")
        return self._background_pool

    def close(self) -> None:
        """Drop this client's background thread (a later call makes a new one); the server keeps
        running."""
        if self._background_pool is not None:
            self._background_pool.shutdown(wait=False, cancel_futures=True)
            self._background_pool = None

    def shutdown(self) -> None:
        """:meth:`close`, and stop the server process when this engine holds its handle."""
        self.close()
        if self.server is not None:
            self.server.shutdown()


def generate_across(
    engines: Sequence[SGLangEngine], prompts: Sequence[Sequence[int]], params: SamplingParams
) -> list[GenerationResult]:
    """Spread prompts over engines in contiguous slices, all engines at once.

    All n samples of a prompt go to the same engine (they share its prefix cache); results
    come back in prompt order with global ``prompt_index`` and the same per-sample seeds an
    unsplit request would use, so the split never changes what is sampled.
    """
    if not engines:
        raise ValueError("no SGLang engines to generate with; start at least one")
    size = -(-len(prompts) // len(engines))  # ceil: the first engines take one more
    slices = [(i, prompts[i : i + size]) for i in range(0, len(prompts), size)]
    with ThreadPoolExecutor(max_workers=len(slices) or 1) as pool:
        futures = [
            pool.submit(engine.generate, chunk, params.for_prompts(start, start + len(chunk)), start * params.n)
            for engine, (start, chunk) in zip(engines, slices, strict=False)
        ]
        out: list[GenerationResult] = []
        for (start, _), fut in zip(slices, futures, strict=True):
            out += [replace(r, prompt_index=r.prompt_index + start) for r in fut.result()]
    return out
