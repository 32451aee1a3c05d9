"""HTTP client for one SGLang server: JSON requests, bounded retries, clear errors.

Also the pure functions that build ``/generate`` requests and parse their answers, so that
request shape and response parsing are testable without a server. Field names follow SGLang's
``GenerateReqInput`` and ``SamplingParams`` (managers/io_struct.py, sampling/sampling_params.py,
0.5.15 and later); see docs/sglang.md.

Standard library (urllib) and torch only: the SGLang path must not add dependencies to the trainer.
Every request to a server goes through :func:`open_url`, which never uses a proxy.
Deliberately left out: streaming, text prompts (megarl sends token ids), routers.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megarl.data.routing_ids import pack_expert_ids, unrouted_id
from megarl.engines.base import GenerationResult, SamplingParams
from megarl.engines.routing import RoutingLayout

# SGLang refuses a sampling_seed outside [-2**63, 2**63 - 1] (sampling_params.py) and builds
# its per-request seed tensor as int64 (sampling_batch_info.py; 0.5.15 to 0.5.23 at least).
# megarl's seeds are 63-bit already (megarl.engines.seeds), so the mask only guards the range.
_SEED_MASK = (1 << 63) - 1
FINISH_TYPES = ("stop", "length", "abort")

# The engines are reached directly, never through a proxy: clusters export http_proxy /
# HTTP_PROXY into jobs, and urllib's default opener would send http://<node-ip>:<port>/... to
# that proxy, which answers 403 / 502 or never reaches the node (a health wait that times out).
# An empty ProxyHandler replaces the one that reads those variables.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def open_url(request: urllib.request.Request | str, timeout: float) -> Any:
    """``urlopen`` without any proxy: what every request to an SGLang server goes through."""
    return _DIRECT.open(request, timeout=timeout)


class SGLangHTTPError(RuntimeError):
    """A request to an SGLang server failed (HTTP error status, bad body or unreachable)."""

    def __init__(self, url: str, endpoint: str, status: int | None, detail: str) -> None:
        self.url, self.endpoint, self.status, self.detail = url, endpoint, status, detail
        code = f"HTTP {status}" if status is not None else "no answer"
        super().__init__(f"SGLang {url}{endpoint}: {code}: {detail}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Raised in the policy ranks (the weight push) and re-raised on the driver by Ray, which
        # pickles it: the default rebuilds it from the message alone, and that fails
        return type(self), (self.url, self.endpoint, self.status, self.detail)


class SGLangUnreachable(SGLangHTTPError):
    """The server did not answer at all (connection refused/reset after every retry)."""


@dataclass(frozen=True)
class HTTPReply:
    status: int
    body: Any  # parsed JSON (None for an empty or ``null`` body)


class SGLangClient:
    """JSON over HTTP to one server, retrying connection failures a bounded number of times.

    Only failures to connect or a dropped connection are retried (the request did not reach
    the server or was cut); HTTP error statuses are returned to the caller, which knows what
    they mean per endpoint (e.g. ``/flush_cache`` answers 400 while requests run).
    """

    def __init__(
        self, url: str, timeout: float = 3600.0, retries: int = 3, backoff: float = 0.5
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff

    def request(
        self,
        method: str,
        endpoint: str,
        payload: Any = None,
        timeout: float | None = None,
        retries: int | None = None,
    ) -> HTTPReply:
        data = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        last: Exception | None = None
        retries = self.retries if retries is None else retries
        for attempt in range(retries + 1):
            req = urllib.request.Request(
                self.url + endpoint, data=data, method=method, headers=headers
            )
            try:
                with open_url(req, timeout or self.timeout) as resp:
                    return HTTPReply(resp.status, _parse_json(resp.read()))
            except urllib.error.HTTPError as err:  # an answer with an error status
                return HTTPReply(err.code, _parse_json(err.read()))
            # A server that died mid-answer: no connection, a closed one, or a body cut short.
            except (urllib.error.URLError, ConnectionError, http.client.RemoteDisconnected,
                    http.client.IncompleteRead) as err:  # fmt: skip
                reason = getattr(err, "reason", err)
                if isinstance(reason, socket.timeout | TimeoutError):
                    raise SGLangHTTPError(
                        self.url, endpoint, None, f"timed out after {timeout or self.timeout} s"
                    ) from err
                last = err
                if attempt < retries:
                    time.sleep(self.backoff * (2**attempt))
            except TimeoutError as err:
                raise SGLangHTTPError(
                    self.url, endpoint, None, f"timed out after {timeout or self.timeout} s"
                ) from err
        raise SGLangUnreachable(
            self.url, endpoint, None, f"unreachable after {retries + 1} attempts: {last}"
        )

    def get(
        self, endpoint: str, timeout: float | None = None, retries: int | None = None
    ) -> HTTPReply:
        return self.request("GET", endpoint, timeout=timeout, retries=retries)

    def post(
        self,
        endpoint: str,
        payload: Any = None,
        timeout: float | None = None,
        retries: int | None = None,
    ) -> HTTPReply:
        # SGLang's POST handlers parse a JSON body; an empty object stands for "no fields".
        body = {} if payload is None else payload
        return self.request("POST", endpoint, body, timeout, retries)

    def post_ok(
        self,
        endpoint: str,
        payload: Any = None,
        timeout: float | None = None,
        retries: int | None = None,
    ) -> Any:
        """POST and raise :class:`SGLangHTTPError` unless the status is 200 and, for the weight
        endpoints that answer ``{"success": bool, "message": str}``, success is true."""
        reply = self.post(endpoint, payload, timeout, retries)
        check_reply(self.url, endpoint, reply)
        return reply.body

    def load_lora_adapter(
        self, name: str, path: str | os.PathLike[str], timeout: float | None = None
    ) -> None:
        """``/load_lora_adapter``: the server reads the PEFT directory ``path``
        (adapter_config.json + adapter_model.safetensors, on a filesystem it sees) and serves it
        to requests whose ``lora_path`` is ``name``. SGLang refuses a name already loaded, so
        each version needs a name of its own. Not retried: a second attempt after a cut
        connection could only answer "already loaded"."""
        body = {"lora_name": name, "lora_path": str(path)}
        what = f"loading LoRA adapter {name!r} from {path}"
        self._lora_call("/load_lora_adapter", body, what, timeout)

    def load_lora_adapter_from_tensors(
        self, name: str, config: dict[str, Any], payloads: list[str], timeout: float | None = None
    ) -> None:
        """``/load_lora_adapter_from_tensors`` (SGLang >= 0.5.23): the adapter's PEFT-named tensors
        in the request itself, no filesystem shared with the server. ``config``: its
        adapter_config.json as a dict; ``payloads``: one base64 payload of the tensors per engine
        TP rank (megarl/rollout_sglang/tensor_payload.py). Not retried, as :meth:`load_lora_adapter`."""
        body = {"lora_name": name, "config_dict": config, "serialized_named_tensors": payloads}
        self._lora_call("/load_lora_adapter_from_tensors", body, f"loading LoRA adapter {name!r} from tensors", timeout)

    def unload_lora_adapter(self, name: str, timeout: float | None = None) -> None:
        """``/unload_lora_adapter``: SGLang stops giving ``name`` to new requests and answers
        once the requests already using it have finished. A later request naming it would make
        SGLang load it again from its path (0.5.23 remembers every name it loaded)."""
        what = f"unloading LoRA adapter {name!r}"
        self._lora_call("/unload_lora_adapter", {"lora_name": name}, what, timeout)

    def _lora_call(
        self, endpoint: str, body: dict[str, Any], what: str, timeout: float | None
    ) -> None:
        """POST a LoRA endpoint; on failure raise with what was asked and SGLang's reason (its
        ``error_message``: e.g. "LoRA is not enabled" from a server without --enable-lora)."""
        reply = self.post(endpoint, body, timeout, retries=0)
        if reply.status == 404:
            raise SGLangHTTPError(self.url, endpoint, 404, f"{what}: this SGLang has no {endpoint}")
        try:
            check_reply(self.url, endpoint, reply)
        except SGLangHTTPError as err:
            answer = reply.body if isinstance(reply.body, dict) else {}
            detail = answer.get("error_message") or err.detail
            raise SGLangHTTPError(self.url, endpoint, reply.status, f"{what}: {detail}") from None


def check_reply(url: str, endpoint: str, reply: HTTPReply) -> None:
    body = reply.body
    failed = isinstance(body, dict) and body.get("success") is False
    if reply.status != 200 or failed:
        detail = body.get("message", body) if isinstance(body, dict) else body
        raise SGLangHTTPError(url, endpoint, reply.status, str(detail))


def _parse_json(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", errors="replace")


def sampling_params_dict(params: SamplingParams, seed: int | None = None) -> dict[str, Any]:
    """SGLang ``sampling_params`` for one sample.

    Output text is never used by megarl (token ids are), but the flags keep SGLang from
    trimming stop sequences or rewriting special tokens, so ids and text agree.
    """
    out: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "max_new_tokens": params.max_new_tokens,
        "no_stop_trim": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    }
    if params.stop:
        out["stop"] = list(params.stop)
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.ignore_eos:  # SGLang then ignores stop_token_ids too, as the torch engine does
        out["ignore_eos"] = True
    if seed is not None:
        out["sampling_seed"] = seed & _SEED_MASK
    return out


def build_generate_payload(
    prompt_ids: Sequence[int],
    params: SamplingParams,
    first_sample_index: int,
    adapter: str | None = None,
) -> dict[str, Any]:
    """One ``/generate`` request for all ``n`` samples of one prompt.

    The n samples are sent as a batch of n copies of the prompt (not ``sampling_params.n``)
    so that each copy carries its own ``sampling_seed``: SGLang gives every copy of an
    ``n > 1`` request the same seed, and seeded sampling would then return n identical
    samples. Sample ``i`` of the step (``first_sample_index + j``) gets
    ``sample_seed(params.seed, i)``. The batch still goes to one server as one request, so
    the copies share the prompt's prefix cache, and the reply list is in sample order.
    ``adapter``: the name of a loaded LoRA adapter every copy is generated with (None = the
    base model).
    """
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError(
            "an empty prompt (0 token ids) cannot be generated from; drop it or add a template"
        )
    sp = []
    for j in range(params.n):
        seed = None if params.seed is None else _sample_seed(params.seed, first_sample_index + j)
        sp.append(sampling_params_dict(params, seed))
    payload: dict[str, Any] = {
        "input_ids": [prompt] * params.n,
        "sampling_params": sp,
        "return_logprob": True,
        "logprob_start_len": -1,  # log-probs of the output tokens only
    }
    if adapter is not None:
        payload["lora_path"] = [adapter] * params.n  # SGLang's field: an adapter's name, not a path
    if params.return_routing:  # prompt and response (routed_experts_start_len 0, SGLang's default)
        payload["return_routed_experts"] = True
    return payload


def _sample_seed(base: int, index: int) -> int:
    from megarl.engines.seeds import sample_seed  # the torch engine's derivation: same streams

    return sample_seed(base, index)


def parse_finish_reason(meta: dict[str, Any]) -> str:
    """``meta_info.finish_reason`` -> "stop" | "length" | "abort"."""
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind not in FINISH_TYPES:
        raise SGLangHTTPError("", "/generate", 200, f"unexpected finish_reason {reason!r}")
    return str(kind)


def parse_weight_version(value: Any) -> int:
    """SGLang keeps the weight version as a string ("default" before any update)."""
    if value is None or value == "default":
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise SGLangHTTPError(
            "", "", None, f"weight_version {value!r} is not an integer set by megarl"
        ) from None


def parse_routed_experts(meta: dict[str, Any], tokens: int, layout: RoutingLayout) -> torch.Tensor:
    """``meta_info.routed_experts`` of a sample of ``tokens`` prompt + response tokens -> [tokens, L, k]
    packed (megarl/data/routing_ids.py) over the MoE layers of ``layout``, "not routed" in the last row.

    SGLang 0.5.23 sends base64 of int32 [tokens - 1, num_hidden_layers, k]
    (state_capturer/routed_experts.py; the last token never went through the model); a dense
    layer's rows hold nothing it routed and are dropped.
    """
    encoded = meta.get("routed_experts")
    if encoded is None:
        raise SGLangHTTPError("", "/generate", 200, "reply has no meta_info.routed_experts: the server was launched "
                              "without --enable-return-routed-experts (ServerSpec.return_routed_experts)")  # fmt: skip
    flat = torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.int32)
    rows = tokens - 1
    if flat.numel() != rows * layout.num_layers * layout.top_k:
        raise SGLangHTTPError("", "/generate", 200, f"meta_info.routed_experts holds {flat.numel()} ids, expected "
                              f"{rows} tokens x {layout.num_layers} layers x top-{layout.top_k}")  # fmt: skip
    ids = pack_expert_ids(flat.view(rows, layout.num_layers, layout.top_k)[:, list(layout.moe_layers)], layout.num_experts)
    return torch.cat([ids, ids.new_full((1, *ids.shape[1:]), unrouted_id(ids.dtype))])  # [tokens, L, k]


def parse_sample(
    item: dict[str, Any], prompt_index: int, routing: tuple[int, RoutingLayout] | None = None
) -> GenerationResult:
    """One element of a ``/generate`` reply -> :class:`GenerationResult`.

    Token ids and log-probs come from ``meta_info.output_token_logprobs`` items
    ``[logprob, token_id, text|None]``; ``output_ids`` must agree with them. ``routing``
    (prompt length, the model's layout): parse the experts it routed to as well.
    """
    meta = item.get("meta_info") or {}
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        raise SGLangHTTPError(
            "",
            "/generate",
            200,
            "reply has no meta_info.output_token_logprobs (return_logprob ignored?)",
        )
    ids = [int(p[1]) for p in pairs]
    logprobs = [float(p[0]) if p[0] is not None else float("nan") for p in pairs]
    output_ids = item.get("output_ids")
    if output_ids is not None and [int(t) for t in output_ids] != ids:
        raise SGLangHTTPError(
            "", "/generate", 200,
            f"output_ids ({len(output_ids)} tokens) disagree with output_token_logprobs ({len(ids)} tokens)",
        )  # fmt: skip
    return GenerationResult(
        prompt_index=prompt_index,
        response_ids=ids,
        logprobs=logprobs,
        finish_reason=parse_finish_reason(meta),
        weight_version=parse_weight_version(meta.get("weight_version")),
        routed_experts=None if routing is None else parse_routed_experts(meta, routing[0] + len(ids), routing[1]),
    )


def parse_generate_reply(
    body: Any, prompt_index: int, n: int, routing: tuple[int, RoutingLayout] | None = None
) -> list[GenerationResult]:
    """The reply to :func:`build_generate_payload` -> its n results, in sample order."""
    items = body if isinstance(body, list) else [body]
    if len(items) != n or not all(isinstance(i, dict) for i in items):
        raise SGLangHTTPError(
            "", "/generate", 200, f"expected a list of {n} samples, got {str(body)[:200]}"
        )
    return [parse_sample(item, prompt_index, routing) for item in items]
