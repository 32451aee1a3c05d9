"""How one Megatron parameter's TP shard relates to its HF tensor(s): import slices, export gathers.

A :class:`ParamRule` names a Megatron parameter (local name in a GPTModel), the HF tensor(s)
it holds and a layout:

- ``replicated``: same tensor on every TP rank (norm weights, the value head);
- ``column`` / ``row``: split along dim 0 / dim 1 (ColumnParallel / RowParallel linears);
- ``vocab``: rows split after padding the vocabulary to the padded size (embedding, lm_head);
- ``qkv``: Megatron's fused QKV, per query group ``[q heads of the group, k, v]``, split by
  groups; HF keeps separate q/k/v (weights or biases);
- ``fc1``: Megatron's fused ``[gate; up]``, each half split along dim 0 per TP rank.

A parameter of a local expert (MoE) carries ``hf_per_ep_rank``: the HF tensors the same
parameter holds on each rank of the expert-parallel group (local expert j of EP rank r is global
expert ``r * experts_per_rank + j``, as Megatron places them). Its layout applies over the
expert-tensor-parallel group instead of the TP group (each expert whole while etp is 1; at etp > 1
fc1's gate and up halves split along dim 0 and fc2 along dim 1, as Megatron's expert linears
expect), import reads only this rank's experts and their ETP slices, and export all-gathers the
parameter over the ETP group (the expert whole again), then over the EP group, and yields each
rank's under its HF names. An expert-parallel group may span
data-parallel replicas: then export is a collective over them too.

Import builds a rank's shard from row/column slices of the HF tensors (never the full tensor
for split layouts); export turns the rank's shard back into HF shards and all-gathers them over
the TP group, many tensors per collective, so every TP rank ends with the full HF tensors. The
layout conversion (QKV split, gate/up split, vocabulary padding) is on this side of the gather:
each rank converts its own shard, and the gathered pieces join into HF tensors by a plain
concatenation. Communication lives in
megarl.parallel.sharding; this module only knows layouts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Literal

import torch

from megarl.models.safetensors_reader import SafetensorsReader
from megarl.parallel.sharding import ep_group, etp_group, gather_shards

# The critic's value head in HF form: the name transformers' *ForTokenClassification heads use.
VALUE_HEAD_HF_NAME = "score.weight"

Layout = Literal["replicated", "column", "row", "vocab", "qkv", "fc1"]


@dataclass(frozen=True)
class ParamRule:
    megatron: str  # local parameter name in the GPTModel
    hf: tuple[str, ...]  # qkv: (q, k, v); fc1: (gate, up); others: one name
    layout: Layout
    export: bool = True  # False for the last stage's copy of a tied embedding
    # A local expert's parameter: ``hf`` of the same parameter on each EP rank (``hf`` is this
    # rank's entry); None for every other parameter.
    hf_per_ep_rank: tuple[tuple[str, ...], ...] | None = None

    @property
    def expert(self) -> bool:
        return self.hf_per_ep_rank is not None

    def exported_names(self) -> list[str]:
        """The HF names an export yields for this parameter, in order: an expert's for every EP
        rank (each of its tensors in turn, EP ranks in order), else ``hf``."""
        if self.hf_per_ep_rank is None:
            return list(self.hf)
        return [names[k] for k in range(len(self.hf)) for names in self.hf_per_ep_rank]


@dataclass(frozen=True)
class ShardInfo:
    """What a layout needs to know about the model and this rank."""

    tp_rank: int
    tp_size: int
    num_heads: int
    num_groups: int
    head_dim: int
    vocab_size: int  # true HF vocabulary
    padded_vocab_size: int
    ep_rank: int = 0  # expert parallelism (MoE): this rank's place in the EP group
    ep_size: int = 1
    etp_rank: int = 0  # expert tensor parallelism: how each expert is split (1: whole)
    etp_size: int = 1

    def for_experts(self) -> ShardInfo:
        """This info for the experts' layouts: they split over the expert-tensor-parallel group."""
        return replace(self, tp_rank=self.etp_rank, tp_size=self.etp_size)

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_groups

    @property
    def groups_per_rank(self) -> int:
        return self.num_groups // self.tp_size


def _rank_range(size: int, info: ShardInfo) -> tuple[int, int]:
    part = size // info.tp_size
    return info.tp_rank * part, (info.tp_rank + 1) * part


def read_shard(rule: ParamRule, reader: SafetensorsReader, info: ShardInfo) -> torch.Tensor:
    """This TP rank's shard of ``rule``'s parameter, built from slices of the HF tensors (an
    expert's: this EP rank's expert, its ETP shard)."""
    if rule.expert:
        info = info.for_experts()
    name = rule.hf[0]
    if rule.layout == "replicated":
        return reader.read(name)
    if rule.layout == "column":
        return reader.read_rows(name, *_rank_range(reader.shape(name)[0], info))
    if rule.layout == "row":
        return reader.read_cols(name, *_rank_range(reader.shape(name)[1], info))
    if rule.layout == "vocab":
        start, end = _rank_range(info.padded_vocab_size, info)
        rows = reader.read_rows(name, min(start, info.vocab_size), min(end, info.vocab_size))
        pad = (end - start) - rows.shape[0]
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])])
        return rows
    if rule.layout == "fc1":
        gate, up = rule.hf
        rng = _rank_range(reader.shape(gate)[0], info)
        return torch.cat([reader.read_rows(gate, *rng), reader.read_rows(up, *rng)])
    if rule.layout == "qkv":
        return _read_qkv(rule, reader, info)
    raise AssertionError(f"unknown layout {rule.layout}")


def _read_qkv(rule: ParamRule, reader: SafetensorsReader, info: ShardInfo) -> torch.Tensor:
    """Interleave this rank's query groups: per group ``[q (heads_per_group * d), k (d), v (d)]``."""
    q_name, k_name, v_name = rule.hf
    g0, g1 = info.tp_rank * info.groups_per_rank, (info.tp_rank + 1) * info.groups_per_rank
    qd = info.heads_per_group * info.head_dim
    d = info.head_dim
    q = reader.read_rows(q_name, g0 * qd, g1 * qd)  # [groups * qd, (h)]
    k = reader.read_rows(k_name, g0 * d, g1 * d)  # [groups * d, (h)]
    v = reader.read_rows(v_name, g0 * d, g1 * d)
    rest = q.shape[1:]
    per_group = [t.reshape(info.groups_per_rank, -1, *rest) for t in (q, k, v)]
    return torch.cat(per_group, dim=1).reshape(-1, *rest)


@dataclass(frozen=True)
class ExportPart:
    """One HF tensor of a rule as this TP rank holds it: ``shard`` joined with the other ranks'
    along ``dim`` (None: the same on every rank), then cut to its first ``rows`` rows (the
    vocabulary's padding dropped)."""

    name: str
    shard: torch.Tensor
    dim: int | None
    rows: int | None = None
    # An expert's: gathered over EP, one name per EP rank (``dim``: its split over the ETP group).
    ep_names: tuple[str, ...] | None = None

    def full_bytes(self, info: ShardInfo) -> int:
        """What this part becomes after its gather (every EP rank's experts, for an expert's)."""
        split = info.etp_size if self.ep_names is not None else info.tp_size
        copies = (1 if self.dim is None else split) * (info.ep_size if self.ep_names is not None else 1)
        return self.shard.numel() * self.shard.element_size() * copies


def export_parts(rule: ParamRule, shard: torch.Tensor, info: ShardInfo) -> list[ExportPart]:
    """``rule``'s HF tensors as this rank's pieces of them (no communication)."""
    if rule.hf_per_ep_rank is None:
        return _layout_parts(rule, shard, info)
    parts = _layout_parts(rule, shard, info.for_experts())  # at etp 1 whole: the layout only splits fused tensors
    per_rank = rule.hf_per_ep_rank
    return [ExportPart(p.name, p.shard, p.dim if info.etp_size > 1 else None, ep_names=tuple(names[k] for names in per_rank))
            for k, p in enumerate(parts)]  # fmt: skip


def _layout_parts(rule: ParamRule, shard: torch.Tensor, info: ShardInfo) -> list[ExportPart]:
    shard, name = shard.detach(), rule.hf[0]
    if rule.layout == "replicated":
        return [ExportPart(name, shard, None)]
    if rule.layout in ("column", "row"):
        return [ExportPart(name, shard, 0 if rule.layout == "column" else 1)]
    if rule.layout == "vocab":
        return [ExportPart(name, shard, 0, rows=info.vocab_size)]
    if rule.layout == "fc1":
        gate, up = shard.chunk(2, dim=0)
        return [ExportPart(rule.hf[0], gate, 0), ExportPart(rule.hf[1], up, 0)]
    if rule.layout == "qkv":
        rest = shard.shape[1:]
        grouped = shard.reshape(info.groups_per_rank, -1, *rest)  # [groups, q heads + k + v, (h)]
        qd, d = info.heads_per_group * info.head_dim, info.head_dim
        parts = grouped.split([qd, d, d], dim=1)
        return [ExportPart(n, p.reshape(-1, *rest), 0) for n, p in zip(rule.hf, parts, strict=True)]
    raise AssertionError(f"unknown layout {rule.layout}")


def export_full(rules: Iterable[tuple[ParamRule, torch.Tensor]], info: ShardInfo,
                gather_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """The full HF tensors of ``rules`` (this rank's shards) in order. They are TP-gathered in
    groups of at most ``gather_bytes`` full bytes (a larger tensor alone), one collective per
    group and dtype: every TP rank must consume this over the same rules at the same time."""
    group: list[ExportPart] = []
    size = 0
    for rule, shard in rules:
        for part in export_parts(rule, shard, info):
            nbytes = part.full_bytes(info)
            if group and size + nbytes > gather_bytes:
                yield from _gathered(group)
                group, size = [], 0
            group.append(part)
            size += nbytes
    if group:
        yield from _gathered(group)


def _gathered(parts: list[ExportPart]) -> Iterator[tuple[str, torch.Tensor]]:
    """One group's full tensors, each let go by the group once yielded: TP-split parts gathered
    over the TP group, then experts over the ETP group (whole again) and the EP group (every rank
    of these groups calls each gather, in order)."""
    full = deque(gather_shards([(p.shard, p.dim) for p in parts if p.dim is not None and p.ep_names is None]))
    experts = [p for p in parts if p.ep_names is not None]
    split = [p for p in experts if p.dim is not None]
    joined = deque(gather_shards([(p.shard, p.dim) for p in split], group=etp_group()) if split else [])  # type: ignore[misc]
    whole = [joined.popleft() if p.dim is not None else p.shard for p in experts]
    # [ep, ...] per part: every EP rank's tensor, stacked in EP rank order
    stacked = deque(gather_shards([(t.unsqueeze(0), 0) for t in whole], group=ep_group()) if experts else [])
    for part in parts:
        if part.ep_names is not None:
            yield from zip(part.ep_names, stacked.popleft(), strict=True)
            continue
        tensor = part.shard if part.dim is None else full.popleft()
        yield part.name, tensor if part.rows is None else tensor[: part.rows]
