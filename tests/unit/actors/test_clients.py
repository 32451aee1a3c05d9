"""The controller's clients call the rank classes' own methods: importing them (and so the rank
classes) must cost the controller neither Megatron nor Ray, and a call runs the rank's method
of that name (an override of the method named, as a Ray group's actor runs it)."""

from __future__ import annotations

import subprocess
import sys

from megarl.actors.clients import InProcessGroup


def test_importing_the_clients_imports_no_megatron_and_no_ray():
    code = ("import sys\nimport megarl.actors.clients\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'ray')))\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "[]", out


class _Base:
    def answer(self, x: int) -> str:
        return f"base {x}"


class _Rank(_Base):
    def answer(self, x: int) -> str:
        return f"rank {x}"


def test_a_call_runs_the_ranks_method_of_that_name(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    group = InProcessGroup(_Rank)
    assert group.call(_Base.answer, 1) == ["rank 1"] and group.call_each(_Base.answer, [(2,)]) == ["rank 2"]
    group.shutdown()
