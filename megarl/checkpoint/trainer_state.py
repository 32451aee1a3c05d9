"""The controller's own state in a checkpoint: trainer_state.pt.

Holds what the controller (Ray driver) needs to continue exactly where it stopped: the step,
the data sampler's state, the KL controller's state, the dynamic-sampling carry-over (samples
kept for the next step) and the controller process's RNG states (python `random`, numpy,
torch CPU, and CUDA when available). Everything is stored as plain data (dicts, lists,
tuples, numbers, strings, tensors), so `torch.load(weights_only=True)` reads it back: no
pickled code runs at resume. Dataclasses (e.g. a Batch in the carry-over) are stored as
{"__dataclass__": "module:QualName", "fields": {...}} and rebuilt on load, only for classes
defined in megarl itself.

Left out: the model, optimizer and LR scheduler states (the workers' Megatron
dist-checkpoint holds them) and the workers' own RNG states (same place).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
STATE_FORMAT = 1
_DATACLASS_KEY = "__dataclass__"
_PLAIN_SCALARS = (bool, int, float, str, type(None))


@dataclass
class TrainerState:
    """The controller state saved with every checkpoint.

    step: the last completed RL step (resume continues at step + 1).
    sampler: the data sampler's state_dict (opaque to this module, plain data).
    kl_controller: the adaptive KL controller's state (e.g. {"coef": 0.05}).
    dynamic_sampling_carry: samples carried to the next step by dynamic sampling (plain
      data or megarl dataclasses such as Batch), None when there are none.
    rng: capture_rng() of the controller process.
    logprob_check: the post-push log-prob check's baseline and the means it is measured from
      ({"first": [...], "baseline": float | None, "version": the last push version counted});
      {} when the run has no check, or in a
      checkpoint written before it was kept (the baseline is then measured again).
    rollouts: an asynchronous run's prompts drawn but not yet trained (re-issued first at
      resume), its draw count and the prompts already re-issued once (megarl/rollout/producer.py);
      {} for a synchronous run.
    """

    step: int = 0
    sampler: dict[str, Any] = field(default_factory=dict)
    kl_controller: dict[str, Any] = field(default_factory=dict)
    dynamic_sampling_carry: Any = None
    rng: dict[str, Any] = field(default_factory=dict)
    logprob_check: dict[str, Any] = field(default_factory=dict)
    rollouts: dict[str, Any] = field(default_factory=dict)

    def save(self, directory: str | Path) -> Path:
        """Write `directory/trainer_state.pt` (fsynced); returns its path."""
        path = Path(directory) / STATE_FILE
        payload = {
            "format": STATE_FORMAT,
            "step": int(self.step),
            "sampler": to_plain(self.sampler, "sampler"),
            "kl_controller": to_plain(self.kl_controller, "kl_controller"),
            "dynamic_sampling_carry": to_plain(self.dynamic_sampling_carry, "dynamic_sampling_carry"),
            "rng": to_plain(self.rng, "rng"),
            "logprob_check": to_plain(self.logprob_check, "logprob_check"),
            "rollouts": to_plain(self.rollouts, "rollouts"),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        return path

    @classmethod
    def load(cls, path: str | Path) -> TrainerState:
        """Read a trainer_state.pt (or the directory holding it) with weights_only=True."""
        path = Path(path)
        if path.is_dir():
            path = path / STATE_FILE
        if not path.is_file():
            raise FileNotFoundError(f"trainer state {path} is missing; was the checkpoint saved by megarl?")
        payload = torch.load(path, map_location="cpu", weights_only=True)
        if payload.get("format") != STATE_FORMAT:
            raise ValueError(
                f"{path}: trainer state format {payload.get('format')!r}, this megarl reads {STATE_FORMAT}"
            )
        return cls(
            step=payload["step"],
            sampler=from_plain(payload["sampler"]),
            kl_controller=from_plain(payload["kl_controller"]),
            dynamic_sampling_carry=from_plain(payload["dynamic_sampling_carry"]),
            rng=from_plain(payload["rng"]),
            logprob_check=from_plain(payload.get("logprob_check", {})),  # (absent from older checkpoints)
            rollouts=from_plain(payload.get("rollouts", {})),
        )


# ---- RNG ------------------------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    """RNG states of this process: python random, numpy (if importable), torch CPU, CUDA."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss_next},
        "torch_cpu": torch.get_rng_state(),
    }
    try:
        import numpy as np
    except ImportError:  # numpy is optional for the controller
        pass
    else:
        legacy = np.random.get_state(legacy=True)
        assert isinstance(legacy, tuple)  # the global RandomState is an MT19937: its state is the legacy tuple
        name, keys, pos, has_gauss, cached = legacy
        state["numpy"] = {"name": name, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    if torch.cuda.is_available():
        state["torch_cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set this process's RNGs back to `state` (from capture_rng)."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["internal"].tolist()), py["gauss_next"]))
    torch.set_rng_state(state["torch_cpu"])
    if "numpy" in state:
        import numpy as np

        npst = state["numpy"]
        np.random.set_state((npst["name"], npst["keys"].numpy().astype(np.uint32), npst["pos"],
                             npst["has_gauss"], npst["cached_gaussian"]))
    if "torch_cuda" in state:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["torch_cuda"])
        else:
            log.warning("trainer state holds CUDA RNG states but CUDA is not available; not restored")


# ---- plain-data conversion --------------------------------------------------------------


def to_plain(obj: Any, where: str = "value") -> Any:
    """Convert to data that torch.load(weights_only=True) reads; TypeError names the path of
    anything else."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, _PLAIN_SCALARS):
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        cls = type(obj)
        fields = {f.name: to_plain(getattr(obj, f.name), f"{where}.{f.name}") for f in dataclasses.fields(obj)}
        return {_DATACLASS_KEY: f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{where}: dict key {k!r} ({type(k).__name__}) is not a str or int")
            out[k] = to_plain(v, f"{where}[{k!r}]")
        return out
    if isinstance(obj, (list, tuple)):
        items = [to_plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    raise TypeError(
        f"{where}: {type(obj).__name__} cannot go into trainer_state.pt; use dicts, lists, numbers, "
        "strings, tensors or megarl dataclasses"
    )


def from_plain(obj: Any) -> Any:
    """Inverse of to_plain: rebuilds megarl dataclasses."""
    if isinstance(obj, dict):
        if _DATACLASS_KEY in obj:
            return _rebuild_dataclass(obj[_DATACLASS_KEY], obj["fields"])
        return {k: from_plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(from_plain(v) for v in obj)
    return obj


def _rebuild_dataclass(name: str, fields: dict[str, Any]) -> Any:
    module_name, _, qualname = name.partition(":")
    if module_name != "megarl" and not module_name.startswith("megarl."):
        raise ValueError(f"trainer state names class {name}; only megarl dataclasses are rebuilt")
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    values = {k: from_plain(v) for k, v in fields.items()}
    init = {f.name for f in dataclasses.fields(target) if f.init}
    obj = target(**{k: v for k, v in values.items() if k in init})
    for k, v in values.items():
        if k not in init:
            object.__setattr__(obj, k, v)
    return obj
