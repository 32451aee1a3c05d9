"""Metric slices and their reduction as tensor operations (pure torch: no torch.distributed).

An emitter (a loss function on one micro-batch, the advantage step on the whole batch) reports
a *slice*: ``{public name: tensor [2]}``, names from the catalogue (megarl/metrics.py). What the
pair holds follows the name's reduction:

- ``mean`` / ``sum``: ``(sum of the values, count)``, count = the tokens, sequences or steps
  the sum covers; the mean is reported as sum(sums) / sum(counts), the sum as sum(sums);
- ``max`` / ``min``: ``(extreme, count)``; a slice with count 0 (nothing to count) is ignored,
  whatever its value;
- ``last``: ``(value, 1)``; a later slice replaces it.

:class:`MetricAccumulator` keeps every accumulable catalogue name in a fixed row of one
``[n, 2]`` float64 table on the slices' device and combines slices there, with no host sync.
The rows are grouped by how ranks combine them: the summed block (mean, sum) all-reduces with
SUM; the extreme block (max, and min stored negated so that it is a max too) and the ``last``
block (values identical on every rank) with MAX. So a data-parallel reduction is two
all-reduces, a pipeline hand-over one broadcast, and reading the values one host transfer; the
collectives themselves are the caller's (megarl/megatron_runtime/model.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache

import torch

from megarl.metrics import ACCUMULATED, CATALOGUE, accumulated

_BLOCKS = (("mean", "sum"), ("max", "min"), ("last",))  # summed | extreme | last


@dataclass(frozen=True)
class _Layout:
    """Row of each accumulable name (the same in every process: it derives from the catalogue)."""

    names: tuple[str, ...]
    reductions: tuple[str, ...]
    n_summed: int  # rows [0, n_summed): mean, sum
    n_extreme: int  # rows [n_summed, n_summed + n_extreme): max, min (negated)

    @property
    def row(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.names)}


@cache
def _layout() -> _Layout:
    metrics = [m for m in CATALOGUE if not m.is_pattern and m.reduction in ACCUMULATED]
    ordered = [m for block in _BLOCKS for m in metrics if m.reduction in block]
    sizes = [sum(m.reduction in block for m in metrics) for block in _BLOCKS]
    return _Layout(
        names=tuple(m.name for m in ordered),
        reductions=tuple(m.reduction for m in ordered),
        n_summed=sizes[0],
        n_extreme=sizes[1],
    )


@dataclass(frozen=True)
class _SliceRows:
    """Where one slice's names go: ``order`` sorts them by block (summed, extreme, last)."""

    order: tuple[str, ...]
    index: torch.Tensor  # [k] long, table row of order[i]
    n_summed: int
    n_extreme: int
    sign: torch.Tensor  # [n_extreme] +1 for max, -1 for min


def pair(value: float | torch.Tensor, count: float | torch.Tensor = 1.0) -> torch.Tensor:
    """A slice value ``[2] = (value, count)`` in float64 on ``value``'s device."""
    v = torch.as_tensor(value, dtype=torch.float64)
    return torch.stack([v.reshape(()), torch.as_tensor(count, dtype=torch.float64, device=v.device).reshape(())])


class MetricAccumulator:
    """Slices of catalogued metrics combined on a device (see the module docstring)."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        layout = _layout()
        self.device = torch.device(device if device is not None else "cpu")
        n = len(layout.names)
        self.table = torch.zeros(n, 2, dtype=torch.float64, device=self.device)  # [n, (value, count)]
        self.table[layout.n_summed :, 0] = -math.inf  # extremes start empty; max(-inf, x) = x
        self.seen = torch.zeros(n, dtype=torch.float64, device=self.device)  # [n] 1: a slice named it
        self.names: set[str] = set()  # names added in this process (host side: no sync to read)
        self._rows: dict[tuple[str, ...], _SliceRows] = {}

    def add(self, metrics: Mapping[str, torch.Tensor]) -> None:
        """Combine one slice ``{name: [2]}``; an uncatalogued name raises ``UnknownMetricError``."""
        if not metrics:
            return
        rows = self._slice_rows(tuple(metrics))
        pairs = torch.stack([metrics[n].detach().reshape(2) for n in rows.order]).to(self.table)  # [k, 2]
        s, e = rows.n_summed, rows.n_summed + rows.n_extreme
        if s:
            self.table.index_add_(0, rows.index[:s], pairs[:s])
        if e > s:
            count = pairs[s:e, 1]
            value = torch.where(count > 0, pairs[s:e, 0] * rows.sign, -math.inf)  # empty: never wins
            index = rows.index[s:e]
            self.table[index] = torch.maximum(self.table[index], torch.stack([value, count], 1))
        if len(rows.order) > e:
            self.table[rows.index[e:]] = pairs[e:]
        self.seen[rows.index] = 1.0
        self.names.update(rows.order)

    def all_reduce(self, reduce: Callable[[torch.Tensor, str], None]) -> None:
        """Combine with the other ranks' accumulators. ``reduce(t, op)`` must all-reduce the
        contiguous ``t`` in place, ``op`` "sum" or "max" (one call each)."""
        n_summed = _layout().n_summed
        summed = self.table[:n_summed].contiguous()  # [a, 2]
        reduce(summed, "sum")
        rest = torch.cat([self.table[n_summed:].reshape(-1), self.seen])  # extreme, last, seen
        reduce(rest, "max")
        self._load(torch.cat([summed.reshape(-1), rest]))

    def broadcast(self, send: Callable[[torch.Tensor], None]) -> None:
        """Take another rank's state: ``send(t)`` must broadcast ``t`` in place (one call)."""
        flat = self._flat()
        send(flat)
        self._load(flat)

    def values(self) -> dict[str, float]:
        """``{name: reported value}`` of every name a slice carried (NaN: nothing counted).
        The one device -> host transfer."""
        layout = _layout()
        n = len(layout.names)
        host = self._flat().cpu().tolist()
        table, seen = host[: 2 * n], host[2 * n :]
        out: dict[str, float] = {}
        for i, (name, reduction) in enumerate(zip(layout.names, layout.reductions)):
            if seen[i]:
                out[name] = _final(reduction, table[2 * i], table[2 * i + 1])
        return out

    # ---- internals --------------------------------------------------------------------------
    def _flat(self) -> torch.Tensor:
        return torch.cat([self.table.reshape(-1), self.seen])  # [3n]: the whole state

    def _load(self, flat: torch.Tensor) -> None:
        n = self.seen.numel()
        self.table.copy_(flat[: 2 * n].view(n, 2))
        self.seen.copy_(flat[2 * n :])

    def _slice_rows(self, names: tuple[str, ...]) -> _SliceRows:
        cached = self._rows.get(names)
        if cached is not None:
            return cached
        layout = _layout()
        row = layout.row
        order = tuple(sorted(names, key=lambda n: row[accumulated(n).name]))  # validates each name
        extreme = [n for n in order if accumulated(n).reduction in _BLOCKS[1]]
        rows = _SliceRows(
            order=order,
            index=torch.tensor([row[n] for n in order], dtype=torch.long, device=self.device),
            n_summed=sum(accumulated(n).reduction in _BLOCKS[0] for n in order),
            n_extreme=len(extreme),
            sign=torch.tensor(
                [-1.0 if accumulated(n).reduction == "min" else 1.0 for n in extreme],
                dtype=torch.float64,
                device=self.device,
            ),
        )
        self._rows[names] = rows
        return rows


def _final(reduction: str, value: float, count: float) -> float:
    if count <= 0:
        return math.nan
    if reduction == "mean":
        return value / count
    return -value if reduction == "min" else value


def reduce_metrics(slices: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, float]:
    """Combine metric slices (e.g. the LossFn outputs of several micro-batches) and return
    ``{name: value}`` by each name's catalogued reduction (NaN when nothing counted)."""
    acc = MetricAccumulator()
    for metrics in slices:
        acc.add(metrics)
    return acc.values()
