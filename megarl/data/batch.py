"""The Batch: the one record type that flows through the RL loop.

One row per sample (a response). Every per-token tensor is ``[B, R]`` and position ``t``
belongs to response token ``t`` (for log-probs: the log-prob of token ``t`` given everything
before it). Prompts are left-padded to ``P`` so that prompt and response meet in the middle:
``tokens = cat(prompt_ids, response_ids)`` is a contiguous sequence for every row once the
padding (``prompt_mask == 0`` on the left, ``t >= response_lengths`` on the right) is masked.

Fields that stages fill in later (``old_logprobs``, ``values``, ...) are ``None`` until then.
Every operation (select / split / concat / replace) keeps every field aligned by row; there is
deliberately no free-form dict of extra tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.data.routing_ids import unrouted_id

# Per-token float tensors filled in as the step progresses, all [B, R].
TOKEN_FIELDS = (
    "rollout_logprobs",
    "turn_rewards",
    "old_logprobs",
    "ref_logprobs",
    "values",
    "token_rewards",
    "advantages",
    "returns",
)
# Per-sample python lists, length B.
LIST_FIELDS = ("data_source", "ground_truth", "extra_info", "finish_reason", "prompt_text", "raw_prompt")

# Per-token routing of mixture-of-experts models, [B, P+R, L, k]: aligned with the full token rows
# of :meth:`Batch.sequences` (prompt and response), L the model's MoE layers in order, k the experts
# each token goes to (actor.moe.routing_replay).
ROUTING_FIELDS = ("routed_experts", "routing_weights")

# Why a sample ended: the engine stopped it (stop / length / abort), or its agent loop did
# (megarl/rollout/agents/loops.py: max_turns, max_tool_calls, tool_error, timeout).
FINISH_REASONS = ("stop", "length", "abort", "max_turns", "max_tool_calls", "tool_error", "timeout")


@dataclass(frozen=True)
class Batch:
    """A batch of samples; see the module docstring for the alignment rule."""

    prompt_ids: torch.Tensor  # [B, P] long, left-padded
    prompt_mask: torch.Tensor  # [B, P] long, 1 = real prompt token
    response_ids: torch.Tensor  # [B, R] long, right-padded
    response_lengths: torch.Tensor  # [B] long, real response tokens (incl. non-loss ones)
    response_mask: torch.Tensor  # [B, R] float, 1 = model-generated token that counts in the loss
    group_id: torch.Tensor  # [B] long, the prompt the sample came from (unique per step)
    data_source: list[str] = field(default_factory=list)
    ground_truth: list[Any] = field(default_factory=list)
    extra_info: list[dict] = field(default_factory=list)
    finish_reason: list[str] = field(default_factory=list)  # one of FINISH_REASONS
    prompt_text: list[str] = field(default_factory=list)
    raw_prompt: list[Any] = field(default_factory=list)  # the prompt as the data holds it (text or chat messages)
    scores: torch.Tensor | None = None  # [B] float, outcome reward of each sample
    rollout_logprobs: torch.Tensor | None = None  # [B, R] engine log-probs at the rollout T
    turn_rewards: torch.Tensor | None = None  # [B, R] per-turn rewards of agent loops, on each turn's last generated token
    old_logprobs: torch.Tensor | None = None  # [B, R] trainer log-probs before the update
    ref_logprobs: torch.Tensor | None = None  # [B, R] reference-policy log-probs
    values: torch.Tensor | None = None  # [B, R] critic values
    token_rewards: torch.Tensor | None = None  # [B, R] outcome on the last token, minus KL
    advantages: torch.Tensor | None = None  # [B, R]
    returns: torch.Tensor | None = None  # [B, R]
    # The engine's experts of token t of cat(prompt_ids, response_ids) in each MoE layer, -1 where
    # it routed none (padding; the last response token, which no forward pass of the engine saw).
    routed_experts: torch.Tensor | None = None  # [B, P+R, L, k] uint8 / int16 (megarl/data/routing_ids.py)
    routing_weights: torch.Tensor | None = None  # [B, P+R, L, k] the engine's weights of those experts, its dtype
    # A policy rank's share of the routing (:meth:`with_routing_share`): row b's routing is row
    # routing_rows[b] of the two fields above, then [n, P+R, L, k] with n the rows it was sent;
    # -1 = a row of another data-parallel replica, whose routing this rank was not sent.
    routing_rows: torch.Tensor | None = None  # [B] long
    # Asynchronous training (rollout.max_staleness >= 1): the engine's weight version that sampled
    # each response token (a partial rollout continues under newer weights; 0 on padding), and
    # how many policy versions older than the trained one each sample's oldest token is (set when
    # the trainer takes the sample).
    token_versions: torch.Tensor | None = None  # [B, R] long
    staleness: torch.Tensor | None = None  # [B] long

    def __post_init__(self) -> None:
        self.validate()

    # ---- shape contract -------------------------------------------------------------
    def validate(self) -> None:
        """Check every field against the shape contract (internal invariant)."""
        b, r = self.response_ids.shape
        assert self.prompt_ids.dim() == 2 and self.prompt_ids.shape[0] == b, self.prompt_ids.shape
        assert self.prompt_mask.shape == self.prompt_ids.shape
        assert self.response_mask.shape == (b, r), (self.response_mask.shape, (b, r))
        assert self.response_lengths.shape == (b,)
        assert self.group_id.shape == (b,)
        for name in ("scores", "staleness"):
            value = getattr(self, name)
            assert value is None or value.shape == (b,), (name, value.shape)
        assert self.token_versions is None or self.token_versions.shape == (b, r), self.token_versions.shape
        for name in TOKEN_FIELDS:
            value = getattr(self, name)
            assert value is None or value.shape == (b, r), (name, value.shape, (b, r))
        for name in LIST_FIELDS:
            value = getattr(self, name)
            assert len(value) in (0, b), (name, len(value), b)
        rows = b if self.routing_rows is None else None  # a share holds any number of rows
        assert self.routing_rows is None or (self.routing_rows.shape == (b,) and self.routed_experts is not None)
        for name in ROUTING_FIELDS:
            value = getattr(self, name)
            assert value is None or (value.dim() == 4 and value.shape[1] == self.prompt_len + r
                                     and value.shape[0] == (rows if rows is not None else value.shape[0])), (name, value.shape)  # fmt: skip
        if self.routing_weights is not None:
            assert self.routed_experts is not None and self.routing_weights.shape == self.routed_experts.shape

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    @property
    def prompt_len(self) -> int:
        return self.prompt_ids.shape[1]

    @property
    def response_len(self) -> int:
        return self.response_ids.shape[1]

    @property
    def prompt_lengths(self) -> torch.Tensor:
        """[B] number of real prompt tokens."""
        return self.prompt_mask.sum(-1)

    @property
    def response_valid(self) -> torch.Tensor:
        """[B, R] long, 1 where a real (non-padding) response token sits."""
        positions = torch.arange(self.response_len, device=self.response_ids.device)
        return (positions[None, :] < self.response_lengths[:, None]).long()

    def sequences(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The full token rows the models see.

        Returns ``tokens [B, P+R]``, ``attention_mask [B, P+R]`` (1 = real token) and
        ``position_ids [B, P+R]`` (0 at each row's first real token). The log-prob of
        response token t comes from the logits at column ``P + t - 1``.
        """
        tokens = torch.cat([self.prompt_ids, self.response_ids], dim=1)
        mask = torch.cat([self.prompt_mask.long(), self.response_valid], dim=1)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        return tokens, mask, position_ids

    # ---- row operations ---------------------------------------------------------------
    def replace(self, **fields: Any) -> Batch:
        """A copy with some fields replaced (validated)."""
        return dataclasses.replace(self, **fields)

    def select(self, index: torch.Tensor | Sequence[int]) -> Batch:
        """Rows ``index`` (a long tensor, a list of ints or a bool mask [B]), all fields aligned."""
        idx = torch.as_tensor(index, dtype=torch.long) if not isinstance(index, torch.Tensor) else index
        if idx.dtype == torch.bool:
            idx = idx.nonzero(as_tuple=True)[0]
        idx = idx.cpu()
        rows = idx.tolist()
        updates: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in (*ROUTING_FIELDS, "routing_rows") and self.routing_rows is not None:
                continue  # a share's: below
            if isinstance(value, torch.Tensor):
                updates[f.name] = value[idx.to(value.device)]
            elif isinstance(value, list):
                updates[f.name] = [value[i] for i in rows] if value else []
        if self.routing_rows is not None:
            updates |= self._select_share(idx)
        return dataclasses.replace(self, **updates)

    def _select_share(self, idx: torch.Tensor) -> dict[str, Any]:
        """A share's routing of rows ``idx``: the held ones' rows only; a plain [b, P+R, L, k]
        batch when all are held (a micro-batch of this rank's replica)."""
        assert self.routing_rows is not None and self.routed_experts is not None
        where = self.routing_rows[idx]
        held = where >= 0
        weights = self.routing_weights
        out: dict[str, Any] = {"routed_experts": self.routed_experts[where[held]],
                               "routing_weights": None if weights is None else weights[where[held]]}  # fmt: skip
        if bool(held.all()):
            return out | {"routing_rows": None}
        rows = torch.full_like(where, -1)
        rows[held] = torch.arange(int(held.sum()))
        return out | {"routing_rows": rows}

    def split(self, size: int) -> list[Batch]:
        """Consecutive chunks of ``size`` rows (the last may be smaller)."""
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        return [self.select(range(i, min(i + size, len(self)))) for i in range(0, len(self), size)]

    def chunk(self, parts: int) -> list[Batch]:
        """``parts`` consecutive chunks of equal size; ``parts`` must divide the batch."""
        if parts <= 0 or len(self) % parts:
            raise ValueError(f"cannot cut a batch of {len(self)} rows into {parts} equal parts")
        return self.split(len(self) // parts)

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all ``batches`` in order; prompts and responses re-padded to the widest."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        if any(b.routing_rows is not None for b in batches):
            raise ValueError("concat: a policy rank's share of the routing (routing_rows) cannot be concatenated")
        p = max(b.prompt_len for b in batches)
        r = max(b.response_len for b in batches)
        updates: dict[str, Any] = {}
        for f in dataclasses.fields(Batch):
            values = [getattr(b, f.name) for b in batches]
            if all(v is None for v in values):
                updates[f.name] = None
            elif any(v is None for v in values):
                raise ValueError(f"concat: field {f.name} is set in some batches but not all")
            elif isinstance(values[0], list):
                updates[f.name] = [x for v in values for x in v]
            elif f.name in ("prompt_ids", "prompt_mask"):
                updates[f.name] = torch.cat([_pad_left(v, p) for v in values])
            elif f.name in ROUTING_FIELDS:
                fill = unrouted_id(values[0].dtype) if f.name == "routed_experts" else 0
                updates[f.name] = torch.cat([_pad_routing(v, b.prompt_len, p, r, fill) for v, b in zip(values, batches)])
            elif values[0].dim() == 2:
                updates[f.name] = torch.cat([_pad_right(v, r) for v in values])
            else:
                updates[f.name] = torch.cat(values)
        return Batch(**updates)

    # ---- routing shares: each policy rank is sent its data-parallel replica's rows only ----
    def routing_share(self, rows: Sequence[int]) -> RoutingShare:
        """The routing of ``rows`` (indices into this batch), to send to the ranks that run them."""
        assert self.routed_experts is not None and self.routing_rows is None
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        weights = None if self.routing_weights is None else self.routing_weights[idx]
        return RoutingShare(idx, self.routed_experts[idx], weights)

    def with_routing_share(self, share: RoutingShare | None) -> Batch:
        """This batch (sent without routing) holding ``share``: what a policy rank trains on."""
        if share is None:
            return self
        where = torch.full((len(self),), -1, dtype=torch.long)
        where[share.rows] = torch.arange(len(share.rows))
        return self.replace(routed_experts=share.routed_experts, routing_weights=share.routing_weights, routing_rows=where)

    def dense_routing(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(routed_experts, routing_weights)`` [B, P+R, L, k] of these rows; a share's rows must
        all be held (the micro-batches of this rank's replica are)."""
        if self.routing_rows is None or self.routed_experts is None:
            return self.routed_experts, self.routing_weights
        where = self.routing_rows.to(self.routed_experts.device)
        if (where < 0).any():
            raise RuntimeError(f"rows {(where < 0).nonzero().flatten().tolist()} of this micro-batch belong to another "
                               "data-parallel replica: the controller's split (replica_rows) and the rank's disagree")  # fmt: skip
        weights = None if self.routing_weights is None else self.routing_weights[where]
        return self.routed_experts[where], weights

    def to(self, device: torch.device | str) -> Batch:
        updates = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **updates)

    def num_groups(self) -> int:
        return int(torch.unique(self.group_id).numel())


@dataclass(frozen=True)
class RoutingShare:
    """The routing of some rows of a batch (:meth:`Batch.routing_share`): ``rows`` [n] long,
    ``routed_experts`` / ``routing_weights`` [n, P+R, L, k]."""

    rows: torch.Tensor
    routed_experts: torch.Tensor
    routing_weights: torch.Tensor | None


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=0)


def _pad_right(t: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=0)


def _pad_routing(t: torch.Tensor, prompt: int, p: int, r: int, fill: float) -> torch.Tensor:
    """``t`` [B, prompt + R0, L, k] re-padded to [B, p + r, L, k]: prompt columns on the left,
    response columns on the right, as the token rows."""
    head, tail = t[:, :prompt], t[:, prompt:]
    width = (0, 0, 0, 0)
    head = torch.nn.functional.pad(head, (*width, p - prompt, 0), value=fill)
    tail = torch.nn.functional.pad(tail, (*width, 0, r - tail.shape[1]), value=fill)
    return torch.cat([head, tail], dim=1)


@dataclass(frozen=True)
class TokenRows:
    """Per-token results for some rows of a Batch, as one worker process computed them.

    A forward pass over a Batch is spread over data-parallel replicas; each replica's output
    rank (last pipeline stage, TP rank 0) returns the rows it computed, the other ranks return
    None. :meth:`assemble` puts the pieces back into ``[B, R]`` tensors on the controller, so
    no ``[B, R]`` tensor is ever all-reduced over the workers.
    """

    rows: torch.Tensor  # [n] long, row indices into the batch
    values: dict[str, torch.Tensor]  # name -> [n, R] float32, 0 past each row's response length

    @staticmethod
    def assemble(parts: Sequence[TokenRows | None], batch_size: int, width: int) -> dict[str, torch.Tensor]:
        """``name -> [batch_size, width]`` from the parts of every rank; every row exactly once."""
        present = [p for p in parts if p is not None]
        if not present:
            raise ValueError("no worker returned any rows (was the batch empty?)")
        seen = torch.zeros(batch_size, dtype=torch.long)
        out = {name: torch.zeros(batch_size, width, dtype=torch.float32) for name in present[0].values}
        for part in present:
            seen.index_add_(0, part.rows, torch.ones_like(part.rows))  # counts a row listed twice, too
            for name, value in part.values.items():
                out[name][part.rows, : value.shape[1]] = value.float().cpu()
        if not bool((seen == 1).all()):
            bad = (seen != 1).nonzero().flatten().tolist()[:8]
            raise RuntimeError(f"rows {bad} were computed {seen[bad].tolist()} times; expected exactly once each")
        return out
