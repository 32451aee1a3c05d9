"""The resumable sampler: which (file, row) each step's prompts come from.

Mixing: file i gets weight w_i (normalised). The k-th prompt of the run comes from the file
whose drawn count lags its share the most, ``argmax_i(w_i * k - drawn_i)`` (ties go to the
lowest index). This is deterministic and keeps every step's composition within one prompt of
the weights (3:1 over 32 prompts gives exactly 24 + 8) instead of the binomial noise a random
choice would add; randomness comes from the shuffles.

Order within a file: file i is read as an endless stream of epochs; epoch e is the permutation
drawn from ``(seed, i, e)`` (the identity when shuffle is off). A step may straddle an epoch
boundary: no prompt is skipped and no batch is short.

State: the number of prompts drawn from each file so far (plus the step). Everything else is
a pure function of (seed, counts), so :meth:`MixtureSampler.load_state_dict` resumes exactly,
mid-epoch included. This module knows nothing about tokenizers or parquet (megarl/data/stream.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from megarl.data.datasets import DataError

STATE_VERSION = 1


def epoch_steps(rows: int, batch_size: int) -> int:
    """Steps of one epoch over ``rows`` prompts, ``batch_size`` a step (rounded up: a step may
    straddle the epoch boundary); the pre-launch check counts a run's length with it too."""
    return -(-rows // batch_size)


class MixtureSampler:
    """Draws ``batch_size`` (file, row) pairs per step from files of ``sizes`` rows."""

    def __init__(
        self,
        sizes: Sequence[int],
        weights: Sequence[float] | None = None,
        *,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        weights = list(weights) if weights is not None else [1.0] * len(sizes)
        if not sizes:
            raise DataError("data.train_files is empty; give at least one parquet file")
        if len(weights) != len(sizes):
            raise ValueError(f"{len(weights)} weights for {len(sizes)} files")
        if any(s < 1 for s in sizes):
            raise ValueError(f"every file needs at least one row, sizes are {list(sizes)}")
        if any(w <= 0 for w in weights):
            raise DataError(f"data.train_files weights must be > 0, got {weights}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        total = float(sum(weights))
        self.sizes = [int(s) for s in sizes]
        self.weights = [float(w) for w in weights]
        self._shares = [w / total for w in weights]
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.step = 0  # steps drawn so far
        self.counts = [0] * len(sizes)  # prompts drawn from each file so far
        self._orders: dict[int, tuple[int, np.ndarray]] = {}  # file -> (epoch, its row order)

    # ---- drawing ----------------------------------------------------------------------
    def next_indices(self) -> list[tuple[int, int]]:
        """The next step's ``batch_size`` (file index, row index) pairs; advances the state."""
        out = []
        for _ in range(self.batch_size):
            f = self._next_file()
            epoch, pos = divmod(self.counts[f], self.sizes[f])
            out.append((f, int(self._order(f, epoch)[pos])))
            self.counts[f] += 1
        self.step += 1
        return out

    def _next_file(self) -> int:
        k = sum(self.counts) + 1
        lags = [share * k - c for share, c in zip(self._shares, self.counts, strict=True)]
        return max(range(len(lags)), key=lambda i: (lags[i], -i))

    def _order(self, file: int, epoch: int) -> np.ndarray:
        cached = self._orders.get(file)
        if cached is None or cached[0] != epoch:
            size = self.sizes[file]
            if self.shuffle:
                rng = np.random.default_rng([self.seed % (1 << 63), file, epoch])
                order = rng.permutation(size)
            else:
                order = np.arange(size)
            cached = (epoch, order)
            self._orders[file] = cached
        return cached[1]

    # ---- progress ---------------------------------------------------------------------
    @property
    def epoch(self) -> float:
        """Prompts drawn so far divided by the rows of all files together."""
        return sum(self.counts) / sum(self.sizes)

    def steps_per_epoch(self) -> int:
        """Steps to draw as many prompts as all files hold together (rounded up)."""
        return epoch_steps(sum(self.sizes), self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        """Plain-python state (JSON-able) saved with checkpoints."""
        return {
            "version": STATE_VERSION,
            "step": self.step,
            "counts": list(self.counts),
            "sizes": list(self.sizes),
            "weights": list(self.weights),
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; refuses a state saved for different data or settings.

        ``prompts_per_step`` may change between runs (the stream of prompts continues where it
        stopped); files, weights, seed and shuffle may not.
        """
        if state.get("version") != STATE_VERSION:
            raise DataError(f"sampler state version {state.get('version')} is not {STATE_VERSION}; cannot resume it")
        conflicts = resume_conflicts(state, self.state_dict())
        if conflicts:
            raise DataError(f"cannot resume the data sampler: {conflicts[0][1]}")
        self.step = int(state["step"])
        self.counts = [int(c) for c in state["counts"]]
        self._orders.clear()


# What a resumed sampler must find as it was saved (a state_dict key, the config field that sets
# it, what it is): the stream of prompts is a function of these.
RESUME_FIXED = (
    ("sizes", "data.train_files", "rows per train file (after filtering)"),
    ("weights", "data.train_files", "data.train_files weights"),
    ("seed", "data.seed", "data.seed"),
    ("shuffle", "data.shuffle", "data.shuffle"),
)


def resume_conflicts(saved: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, str]]:
    """Why a sampler with settings ``now`` cannot resume the state ``saved``: (config field, one
    line) each; empty: it can. Keys missing from either side are not compared: the pre-launch
    check knows the settings of both configs but not the rows a file keeps after filtering.
    What leaves the stream as it was passes: weights of the same shares (one file's, or all
    doubled), another seed with shuffle off in both."""
    unshuffled = saved.get("shuffle") is False and now.get("shuffle") is False
    return [
        (field, f"the checkpoint was saved with {what} = {saved[key]}, the config now gives {now[key]}; resume with "
                f"{what} = {saved[key]}, or start a fresh run in a new trainer.output_dir")
        for key, field, what in RESUME_FIXED
        if key in saved and key in now and _stream_value(key, saved[key]) != _stream_value(key, now[key])
        and not (key == "seed" and unshuffled)
    ]


def _stream_value(key: str, value: Any) -> Any:
    """What of a RESUME_FIXED setting the stream depends on: the weights' shares, as the sampler
    computes them (equal floats draw the same files; weights scaled by a power of two, or whose
    sums are exact, give equal ones; a rounding difference is refused, the safe side), else the value."""
    return [float(w) / float(sum(value)) for w in value] if key == "weights" else value


def resume_settings(data: Any) -> dict[str, Any]:
    """The settings of ``resume_conflicts`` that a DataConfig gives (all but the rows)."""
    return {"weights": [float(f.weight) for f in data.train_files], "seed": data.seed, "shuffle": data.shuffle}
