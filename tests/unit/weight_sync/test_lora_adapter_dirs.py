"""Adapter-mode pushes (megarl/weight_sync/lora_adapter.py) keep only the adapter directories the
servers hold: a resumed run's first push removes what the earlier launch left."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

import torch

from megarl.weight_sync import lora_adapter
from megarl.weight_sync.lora_adapter import AdapterTransport


class _Adapters:
    cfg = None

    def has_experts(self) -> bool:
        return False

    def peft_tensors(self) -> dict[str, torch.Tensor]:
        return {"a": torch.zeros(2)}

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

    def load_lora_adapter(self, name: str, path: Path) -> None:
        assert path.is_dir()
        self.held.add(name)

    def unload_lora_adapter(self, name: str) -> None:
        self.held.discard(name)


def _engine():
    return SimpleNamespace(client=_Client(), set_weight_version=lambda v: None, check_weight_version=lambda v: None)


def _transport(directory: Path) -> AdapterTransport:
    engines = [_engine()]
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
