"""What the policy and critic processes share: checkpoints, memory states and profiling of
their trained model (``self.worker``, a TrainedWorker). Memory states are named as in the
residency table (megarl/memory/residency.py) and moved only when the hand-over asks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megarl.megatron_runtime.offload import ModelStates


class TrainedRank:
    """Base of PolicyRank and CriticRank (collective methods; see megarl/actors/clients.py)."""

    worker: Any  # PolicyWorker | CriticWorker
    info: Any  # megarl.parallel.groups.ParallelInfo
    _profiler: Any = None

    def save(self, path: str) -> None:
        self.worker.save(Path(path))

    def load(self, path: str) -> None:
        self.worker.load(Path(path))

    def close(self) -> None:
        """Let the model be freed once this rank is dropped (TrainedWorker.close)."""
        self.worker.close()

    # ---- memory: what the hand-over moves (megarl/memory/handover.py) ----------------------
    def model_states(self) -> dict[str, ModelStates]:
        """This process's movable models by owner name of the residency table (policy,
        reference, critic)."""
        raise NotImplementedError

    def offload_states(self, states: list[str]) -> int:
        """Move table states (``policy/optimizer``, ``reference/weights``, ...; see
        megarl/memory/residency.py) off the device; returns this rank's bytes freed."""
        owners = self.model_states()
        return sum(owners[o].offload(whats) for o, whats in _by_owner(states, owners).items())

    def onload_states(self, states: list[str]) -> None:
        owners = self.model_states()
        for owner, whats in _by_owner(states, owners).items():
            owners[owner].onload(whats)

    def device_bytes(self) -> dict[str, int]:
        """Bytes each table state of this process keeps allocated on the device (0: off it)."""
        return {f"{o}/{w}": n for o, ms in self.model_states().items() for w, n in ms.device_bytes().items()}

    def host_bytes(self) -> dict[str, int]:
        """Bytes of each table state's host copy in this process (0: none)."""
        return {f"{o}/{w}": n for o, ms in self.model_states().items() for w, n in ms.host_bytes().items()}

    def profile_name(self) -> str:
        raise NotImplementedError

    def start_profile(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._profiler = profile(activities=activities, record_shapes=False)
        self._profiler.__enter__()

    def stop_profile(self, folder: str) -> None:
        if self._profiler is None:
            return
        self._profiler.__exit__(None, None, None)
        target = Path(folder) / f"{self.profile_name()}.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        self._profiler.export_chrome_trace(str(target))
        self._profiler = None


def _by_owner(states: list[str], owners: dict[str, ModelStates]) -> dict[str, list[str]]:
    """``["policy/weights", "reference/weights"]`` -> ``{"policy": ["weights"], "reference": ["weights"]}``."""
    out: dict[str, list[str]] = {}
    for state in states:
        owner, _, what = state.partition("/")
        if owner not in owners:
            raise ValueError(f"state {state!r}: this process holds {', '.join(owners)}, not {owner}")
        out.setdefault(owner, []).append(what)
    return out
