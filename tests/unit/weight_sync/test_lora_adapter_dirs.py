"""Adapter-mode pushes (megarl/weight_sync/lora_adapter.py) keep only the adapter directories the
servers hold: a resumed run's first push removes what the earlier launch left. A server on
another host gets the adapters in the request, and no directory is written for it alone."""

from __future__ import annotations

import contextlib
import inspect
import json
from pathlib import Path
from types import SimpleNamespace

import torch

from megarl.config.train_sections import LoRAConfig
from megarl.weight_sync import lora_adapter
from megarl.weight_sync.lora_adapter import AdapterTransport, on_this_host

KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
OTHER_HOST = "http://192.0.2.1:30000"  # TEST-NET-1 (RFC 5737): no host's address


class _Adapters:
    cfg = LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj"])

    def has_experts(self) -> bool:
        return False

    def peft_tensors(self) -> dict[str, torch.Tensor]:
        return {KEY: torch.arange(8.0).reshape(4, 2)}

    @contextlib.contextmanager
    def disabled(self):
        yield


class _Base:
    def connect(self, endpoints) -> None:
        pass

    def push(self, version: int) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class _Client:
    def __init__(self) -> None:
        self.held: set[str] = set()
        self.sent: dict[str, tuple[dict, list[str]]] = {}  # name -> (config, payloads) of the tensor loads

    def load_lora_adapter(self, name: str, path: Path, timeout: float | None = None) -> None:
        assert Path(path).is_dir()
        self.held.add(name)

    def load_lora_adapter_from_tensors(self, name: str, config: dict, payloads: list[str], timeout: float | None = None) -> None:
        self.held.add(name)
        self.sent[name] = (config, payloads)

    def unload_lora_adapter(self, name: str, timeout: float | None = None) -> None:
        self.held.discard(name)


def _engine(url: str = "http://127.0.0.1:30000", tp: int = 1):
    return SimpleNamespace(client=_Client(), url=url, tp=tp, set_weight_version=lambda v: None,
                           check_weight_version=lambda v: None)  # fmt: skip


def _transport(directory: Path, engines: list | None = None) -> AdapterTransport:
    engines = engines or [_engine()]
    t = AdapterTransport(_Base(), _Adapters(), directory, writer=True, base_model="base",
                         engines_of=lambda endpoints: engines, barrier=lambda: None)  # fmt: skip
    t.connect(None)
    return t


def test_a_resumed_runs_first_push_removes_the_earlier_launchs_adapter_directories(tmp_path, monkeypatch):
    def write(directory, tensors, cfg, base):
        Path(directory).mkdir(parents=True)
        (Path(directory) / "adapter_model.safetensors").write_bytes(b"x")

    monkeypatch.setattr(lora_adapter, "write_peft_adapter", write)
    # what the launch before the resume left (it pushed up to version 2), and what is not the transport's
    for name in ("lora_v1", "lora_v2", "lora_v3.tmp", "v2", "lora_vx", "notes"):
        (tmp_path / name).mkdir()
    t = _transport(tmp_path)
    t.push(3)  # the resumed run's first push
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora_v3", "lora_vx", "notes", "v2"]
    t.push(4)
    t.push(5)  # the previous version stays, older ones go
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora_v4", "lora_v5", "lora_vx", "notes", "v2"]
    # a reconnection (restarted servers) keeps the versions the transport knows are loaded
    t.connect(None)
    t.push(6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora_v5", "lora_v6", "lora_vx", "notes", "v2"]


def test_a_server_on_another_host_gets_the_adapters_in_the_request(tmp_path):
    import base64
    import pickle

    local, remote = _engine(), _engine(OTHER_HOST, tp=2)
    t = _transport(tmp_path, [local, remote])
    t.push(1)
    assert local.client.held == {"policy_v1"} and not local.client.sent  # from the directory
    assert (tmp_path / "lora_v1" / "adapter_model.safetensors").is_file()
    config, payloads = remote.client.sent["policy_v1"]
    assert len(payloads) == 2 and payloads[0] == payloads[1]  # one per engine TP rank
    sent = pickle.loads(base64.b64decode(payloads[0]))  # what SGLang's deserializer reads
    assert sent.keys() == {KEY} and torch.equal(sent[KEY], _Adapters().peft_tensors()[KEY])
    written = json.loads((tmp_path / "lora_v1" / "adapter_config.json").read_text())
    assert config == written and config["r"] == 4 and config["target_modules"] == ["q_proj"]


def test_servers_on_other_hosts_alone_need_no_directory(tmp_path):
    remote = _engine(OTHER_HOST)
    t = _transport(tmp_path / "weights", [remote])  # as the demo's: <root>/run-*/weights, never made
    for version in (1, 2, 3):  # the third push unloads version 1 and tidies the directory that is not there
        t.push(version)
    assert remote.client.held == {"policy_v2", "policy_v3"} and list(tmp_path.iterdir()) == []


def test_which_servers_are_on_this_host():
    import socket

    for url in ("http://127.0.0.1:1", "http://localhost:1", f"http://{socket.gethostname()}:1", "http://[::1]:1"):
        assert on_this_host(url), url
    assert not on_this_host(OTHER_HOST)
    # the node IP Ray gives this host, where its SGLang servers listen, though the hostname may
    # resolve to a loopback address only (/etc/hosts)
    import ray.util

    assert on_this_host(f"http://{ray.util.get_node_ip_address()}:1")
    assert not on_this_host("http://no-such-host.invalid:1")  # unresolvable: the request, the safe side


def test_the_stand_in_client_takes_what_megarl_s_client_takes():
    """The stand-in servers above answer the calls megarl's SGLang client answers, with its
    parameters (names and defaults), so a push that passes one passes the other."""
    from megarl.rollout_sglang.client import SGLangClient

    for method in ("load_lora_adapter", "load_lora_adapter_from_tensors", "unload_lora_adapter"):
        ours, real = inspect.signature(getattr(_Client, method)), inspect.signature(getattr(SGLangClient, method))
        assert [(p.name, p.default) for p in ours.parameters.values()] == [(p.name, p.default) for p in real.parameters.values()], method
