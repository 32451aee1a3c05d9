"""Adapter-mode pushes (``rollout.weight_sync.lora: adapter``, docs/lora.md): after the base model
reached the SGLang servers once, each push moves only the LoRA adapters.

A push gathers the adapters of the whole model (over TP, EP and PP, megarl/models/lora.py), and
the writer (policy rank 0) has every server load them under the name :func:`adapter_name` and label
its weights with the version. How a server gets them depends on where it runs
(:func:`on_this_host`): a server on the writer's host reads an HF PEFT directory
``<disk_dir>/lora_v<version>`` (``/load_lora_adapter``); a server on another host gets the
tensors and adapter_config.json in the request itself (``/load_lora_adapter_from_tensors``,
SGLang >= 0.5.23), so no filesystem needs to be shared. Why not the request always: it carries
one base64 copy of the adapters per engine TP rank (4/3 of their bytes each: about 8 GiB per
server and push for the 72B config at rank 32 and TP 8), while a server on the same host reads
the same filesystem for certain. Why not the directory always: a server on another node reads it
only from a shared filesystem, which a cluster need not have. The controller's engines then send
that name with every request (the trainer sets it after the push).

The base model goes through the run's own transport with the adapters switched off, on the
first push of a connection (a launched or restarted server holds no weights of the trainer's)
and on a re-push of the same version (the hand-over re-pushes when an engine's weights were
lost: released without a copy, or restarted); a re-push unloads the version's name first where
a server still holds it. The previous version stays loaded (SGLang's unload waits for the last
requests that use it); older ones are unloaded and their directories removed: each push removes
the ``lora_v<N>`` directories of versions the servers do not hold,
what a resumed run's earlier launch left included (``transport_base.remove_versions``).

Adapters on mixture-of-experts experts cannot go this way: transformers 5 holds a Qwen3-MoE
layer's experts as fused parameters (``gate_up_proj [E, 2f, h]``, ``down_proj [E, h, f]``), not
per-expert Linear modules, so a PEFT adapter naming ``mlp.experts.{e}.gate_proj`` does not load;
peft's ``target_parameters`` form adapts a fused parameter with one adapter for gate and up
together, not megarl's separate ones. Such runs push merged weights (the planner refuses adapter
mode with expert adapters; :func:`write_peft_adapter` refuses expert tensors).
"""

from __future__ import annotations

import contextlib
import ipaddress
import shutil
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from megarl.models.lora import peft_config_dict, write_peft_adapter
from megarl.rollout_sglang.client import SGLangHTTPError
from megarl.rollout_sglang.tensor_payload import serialize_for_http
from megarl.weight_sync.transport_base import WeightTransport, remove_versions

EXPERTS_REFUSED = ("rollout.weight_sync.lora (adapter) cannot carry adapters on mixture-of-experts experts (an HF "
                   "PEFT adapter cannot hold them for transformers' fused experts); use rollout.weight_sync.lora=merged")


def on_this_host(url: str) -> bool:
    """Whether the server at ``url`` runs on this host: a loopback address, this host's name, or
    an address of one of this host's interfaces or of its name. The interfaces count because a
    host's name often resolves to a loopback address only (/etc/hosts: Ubuntu's 127.0.1.1), while
    servers listen on its node IP. An unresolvable name counts as another host (the request, which
    needs no shared filesystem, is the safe side)."""
    host = urlsplit(url).hostname or ""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    address = _address(host)
    if address is None:
        return False
    return address.is_loopback or address in _host_addresses()


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as an address: a literal (IPv6 too, without a zone), or what its name resolves to."""
    literal = _literal(host)
    if literal is not None:
        return literal
    try:
        return ipaddress.ip_address(socket.gethostbyname(host))
    except OSError:
        return None


def _host_addresses() -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """This host's addresses: every interface's (psutil), and what its name resolves to."""
    import psutil

    found = {a.address for addresses in psutil.net_if_addrs().values() for a in addresses}
    with contextlib.suppress(OSError):
        found |= {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    return {a for a in map(_literal, found) if a is not None}


def _literal(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``text`` as an address (a link-local one without its zone), or None (a MAC address)."""
    try:
        return ipaddress.ip_address(text.split("%")[0])
    except ValueError:
        return None


@dataclass(frozen=True)
class AdapterRequest:
    """An adapter as ``/load_lora_adapter_from_tensors`` takes it: its adapter_config.json as a
    dict, and its PEFT-named tensors as one base64 payload (sent once per engine TP rank)."""

    config: dict[str, Any]
    payload: str


def adapter_request(tensors: dict[str, Any], cfg: Any, base_model: str) -> AdapterRequest:
    """The request of ``tensors`` (:meth:`LoRAAdapters.peft_tensors`, on the CPU) under ``cfg`` (the
    run's LoRAConfig) on ``base_model``: the same config :func:`write_peft_adapter` writes."""
    # CPU tensors: pickled with their bytes (no shared memory handle a remote server could not open)
    return AdapterRequest(peft_config_dict(tensors, cfg, base_model), serialize_for_http(dict(tensors)))


def load_adapter(engine: Any, name: str, source: Path | AdapterRequest) -> None:
    """``engine`` loads the adapter ``name`` from ``source``: an HF PEFT directory it reads, or the
    adapter in the request."""
    if isinstance(source, AdapterRequest):
        engine.client.load_lora_adapter_from_tensors(name, source.config, [source.payload] * engine.tp)
    else:
        engine.client.load_lora_adapter(name, source)



def adapter_name(version: int) -> str:
    """The name the engines serve the adapters of ``version`` under (SGLang's ``lora_path``)."""
    return f"policy_v{version}"


class AdapterTransport:
    """Adapters through a PEFT directory, the base model through ``base`` (see module docstring)."""

    def __init__(self, base: WeightTransport, adapters: Any, directory: str | Path, *, writer: bool, base_model: str,
                 engines_of: Callable[[Any], Sequence[Any]], barrier: Callable[[], None]) -> None:  # fmt: skip
        """``adapters``: the policy's LoRAAdapters; ``base_model``: the HF base's path (in the PEFT config)."""
        if adapters.has_experts():
            raise ValueError(EXPERTS_REFUSED)
        self.base, self.adapters = base, adapters
        self.directory = Path(directory)
        self.writer, self.base_model, self.engines_of, self.barrier = writer, base_model, engines_of, barrier
        self.engines: list[Any] = []
        self.loaded: list[int] = []  # versions the engines hold, oldest first
        self.last: int | None = None  # the version pushed on this connection

    def connect(self, endpoints: Any) -> None:
        self.base.connect(endpoints)
        self.engines = list(self.engines_of(endpoints))
        self.last = None  # new or restarted servers: the base goes again (self.loaded: what the others may hold)

    def push(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        metrics: dict[str, float] = {}
        repush = self.last is None or version == self.last  # the engines' base weights are not the trainer's
        if repush:
            with self.adapters.disabled():
                metrics = self.base.push(version)
        tensors = self.adapters.peft_tensors()  # collective: every rank
        target = self.directory / f"lora_v{version}"
        local = [on_this_host(engine.url) for engine in self.engines]  # the writer's engines; none elsewhere
        failure = self._write(target, tensors) if any(local) else None
        self.barrier()  # the directory is complete (or failed) before a server reads it
        try:
            if self.writer and failure is None:
                request = adapter_request(tensors, self.adapters.cfg, self.base_model) if not all(local) else None
                self._load(version, [target if here else request for here in local], repush)
        finally:  # every rank meets here, a failed write or load included
            self.barrier()
        if failure is not None:
            raise failure
        self.last = version
        size = metrics.get("weight_sync/bytes", 0.0) + sum(t.numel() * t.element_size() for t in tensors.values())
        seconds = time.perf_counter() - start
        return metrics | {"weight_sync/seconds": seconds, "weight_sync/bytes": size, "weight_sync/gbps": size / max(seconds, 1e-9) / 1e9}

    def _write(self, target: Path, tensors: dict[str, Any]) -> Exception | None:
        """The PEFT directory, written beside and renamed into place whole (a server never reads half
        a version); the error, if writing failed, for the caller to raise once every rank met."""
        try:
            tmp = target.with_name(target.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            write_peft_adapter(tmp, tensors, self.adapters.cfg, self.base_model)
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
        except Exception as exc:  # noqa: BLE001 (raised after the barriers)
            return exc
        return None

    def _load(self, version: int, sources: list[Any], repush: bool) -> None:
        """Every server loads ``version`` from its entry of ``sources`` (:func:`load_adapter`) and
        is labelled with it; the versions before the previous one are unloaded. A re-push first
        unloads the name on the servers that still hold it (SGLang refuses to load a name it holds;
        a restarted server holds none)."""
        for engine, source in zip(self.engines, sources, strict=True):
            if repush or version in self.loaded:
                unload_if_held(engine, version)
            load_adapter(engine, adapter_name(version), source)
            engine.set_weight_version(version)
            engine.check_weight_version(version)  # the server's own label, as the other transports check
        self.loaded = [v for v in self.loaded if v != version] + [version]
        while len(self.loaded) > 2:
            old = self.loaded.pop(0)
            for engine in self.engines:
                unload_if_held(engine, old)
        # every directory but the held versions': older ones, and what an earlier launch of the run wrote
        remove_versions(self.directory, "lora_v", keep=self.loaded)

    def close(self) -> None:
        self.base.close()
        self.engines = []


def unload_if_held(engine: Any, version: int) -> None:
    """Unload ``version``'s adapter from ``engine``; one it does not hold (a restarted server) is no error."""
    try:
        engine.client.unload_lora_adapter(adapter_name(version))
    except SGLangHTTPError as exc:
        if exc.status != 400 or "does not exist" not in exc.detail:  # 0.5.23: 400 "LoRA with name X does not exist"
            raise
